"""A trial of the metadata documents one run reads (metadata2, 2026-12-07): the GETs per key of
``open_geometries``, of builds over the geometries and of one Lightning ``fit``, counted by a
store wrapper (tests/helpers.CountingStore); zarr's own read the oracle of the values.

Found (fixed):

* ``open_geometries`` read the root ``zarr.json`` and ``.zgroup`` twice each, and a named
  array's ``zarr.json`` (v2: ``.zarray``) twice: once to find what the node is, once more in
  zarr's open. zarr's open now takes the documents read to find the kind
  (``io/_preread.py``): naming ``t2m`` is 6 GETs (v3, before 11) or 9 (v2, before 12).
* every pipeline build read each array's metadata again for its store check: one ``fit`` read
  ``t2m/zarr.json`` 4 times (geometries: 2; the training and the validation builds: 1 each).
  The coordinate reader the data module keeps per store (anemoi2) now keeps the arrays'
  metadata too: ``open_geometries(..., coords_reader=)`` and ``insitu_pipeline(...,
  coords_reader=)`` share it, and one ``fit`` reads each metadata document once
  (test_anemoi2_trial's fit counts them).
* the demo read the time coordinate twice (its time-ordered split, then its pipeline's build)
  and ``t2m/zarr.json`` 4 times (the geometries' open twice, the build's store check, its
  normaliser's own zarr open): one coordinate reader now serves all of them.
* ``stack()`` named channels by the index after any error looking their names up: a 403 or
  a deadline spent on the group's ``variables`` attribute (or on the coordinate array's
  metadata) gave ``data@0``... silently, other names than a rank that could read them. Only
  an absent coordinate and absent names fall back to the index now; a store that cannot be
  read fails the stack with an ``OSError`` of the cause's kind saying what to do.

Left as it is: ``insitu_pipeline`` without ``coords_reader`` checks the arrays' metadata
against the store at every build (one GET per array), its documented contract (a document
changed since the geometries were read fails the build: test_store_contents); pass one
reader to the builds of one run to read it once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from helpers import counting_store, is_metadata_key, write_era5

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.errors import ArrayNotFoundError
from insitubatch_nodes.io.coords import coordinate_reader


def _metadata_counts(store: Any) -> dict[str, int]:
    return {k: n for k, n in store.counts.items() if is_metadata_key(k)}


# one worker runs the module: each parametrized module fixture is built once, not once per
# worker and again at every switch between its parameters
pytestmark = pytest.mark.xdist_group("metadata2_trial")


@pytest.fixture(scope="module", params=[2, 3])
def era5(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp(f"metadata2_v{request.param}") / "era5.zarr"
    return write_era5(root, n_time=32, variables=("t2m",), zarr_format=request.param)


def test_open_geometries_reads_each_metadata_document_once_naming_arrays_or_listing_them(
    era5: Path,
) -> None:
    """Before: the root's ``zarr.json`` and ``.zgroup`` twice each, a named array's first
    document (``t2m/zarr.json``, v2 ``t2m/.zarray``) twice."""
    want = zarr.open_array(era5, path="t2m", mode="r")
    for variables in (["t2m"], None):
        store = counting_store(era5)
        geom = open_geometries(store, variables)["t2m"]
        twice = {k: n for k, n in _metadata_counts(store).items() if n > 1}
        assert twice == {}, f"{variables}: documents read more than once: {twice}"
        assert (geom.shape, geom.chunks, geom.dtype) == (want.shape, want.chunks, want.dtype)


def test_builds_that_share_a_coordinate_reader_read_each_metadata_document_once(
    era5: Path,
) -> None:
    """The training and validation builds over geometries opened with one reader: each
    document (the arrays', the time coordinate's) and the time chunk read once in all; each
    batch equals zarr's rows. Without a reader each build checks the store again (one GET of
    the array's first document per build)."""
    store = counting_store(era5)
    reader = coordinate_reader(store)
    geom = open_geometries(store, ["t2m"], coords_reader=reader)["t2m"]
    manifest = split_by_chunk(geom, (0.75, 0.25, 0.0))
    oracle = zarr.open_array(era5, path="t2m", mode="r")[...]
    for split in ("train", "val"):
        pipe = insitu_pipeline(store, manifest, {"x": geom}, split=split, batch_size=8,
                               coords_reader=reader)  # fmt: skip
        batch = next(pipe)
        np.testing.assert_array_equal(batch.arrays["x"], oracle[batch.sample_indices["x"]])
        pipe.close()
    counts = {k: n for k, n in store.counts.items() if is_metadata_key(k) or "time/" in k}
    assert {k: n for k, n in counts.items() if n > 1} == {}
    first = "t2m/zarr.json" if geom.zarr_format == 3 else "t2m/.zarray"
    store.reset_counts()
    for split in ("train", "val"):  # no reader: the documented check, once per build
        insitu_pipeline(store, manifest, {"x": geom}, split=split, batch_size=8).close()
    assert store.counts[first] == 2


def test_a_store_check_through_a_reader_still_refuses_geometries_of_another_store(
    era5: Path, tmp_path: Path
) -> None:
    """The reader's memo answers "no array there" as a fresh read does: the array named and
    its store in the error; and a reader of another store is refused by open_geometries."""
    other = counting_store(write_era5(tmp_path / "other.zarr", n_time=16, variables=("z",)))
    geom = open_geometries(era5, ["t2m"])["t2m"]
    with pytest.raises(ArrayNotFoundError, match=r"'t2m' is not in store .*other\.zarr"):
        insitu_pipeline(other, split_by_chunk(geom), {"x": geom}, batch_size=8,
                        coords_reader=coordinate_reader(other))  # fmt: skip
    with pytest.raises(ValueError, match=r"coords_reader reads store .*era5\.zarr.*not the one"):
        open_geometries(other, ["z"], coords_reader=coordinate_reader(counting_store(era5)))


def test_the_demo_reads_the_time_coordinate_and_each_metadata_document_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One epoch of the demo (its split in time order, its training pipeline, its
    normalisation): before, the time coordinate's ``zarr.json`` and chunk were read twice (the
    split, the build) and ``t2m/zarr.json`` 4 times (the geometries' open twice, the build's
    store check, the normaliser's zarr open)."""
    from insitubatch_nodes import demo

    store = counting_store(write_era5(tmp_path / "era5.zarr", n_time=32, variables=("t2m",)))
    monkeypatch.setattr(demo, "_prepare_store", lambda args: store)
    assert demo.main(["--epochs", "1", "--batch-size", "8", "--no-progress"]) in (0, 1)
    assert "epoch 0:" in capsys.readouterr().out
    counts = {k: n for k, n in store.counts.items() if is_metadata_key(k) or "time/" in k}
    assert {k: n for k, n in counts.items() if n > 1} == {}, counts
    assert {"t2m/zarr.json", "time/zarr.json", "time/c/0"} <= set(counts)


# ---------------------------------------------------------------------------------------------
# A stack's channel names: absent names fall back to the index, unreadable ones fail
# ---------------------------------------------------------------------------------------------

NAMES = ["2t", "t_850", "10u"]


@pytest.fixture(scope="module")
def anemoi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """anemoi-datasets' layout in zarr v2: ``data (time, variable, ensemble, cell)``, the
    channel names in the root group's ``variables`` attribute."""
    root = tmp_path_factory.mktemp("metadata2_anemoi") / "anemoi.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=2)
    data = group.create_array("data", shape=(4, 3, 1, 5), chunks=(1, 3, 1, 5), dtype="f4")
    data.attrs["_ARRAY_DIMENSIONS"] = ["time", "variable", "ensemble", "cell"]
    data[...] = np.arange(60, dtype="f4").reshape(4, 3, 1, 5)
    for name in ("latitudes", "longitudes"):  # (the grid of points along ``cell``)
        arr = group.create_array(name, shape=(5,), chunks=(5,), dtype="f8")
        arr.attrs["_ARRAY_DIMENSIONS"] = ["cell"]
        arr[...] = np.arange(5) * 10.0 + 5
    group.attrs["variables"] = NAMES
    return root


@pytest.mark.parametrize(
    ("refused", "error"),
    [(".zattrs", PermissionError("403 Forbidden")), (".zattrs", TimeoutError("deadline")),
     ("variable/.zarray", PermissionError("403 Forbidden"))],
    ids=["403-attributes", "timeout-attributes", "403-coordinate-lookup"],
)  # fmt: skip
def test_a_stack_whose_channel_names_cannot_be_read_fails_saying_what_to_do(
    anemoi: Path, refused: str, error: Exception
) -> None:
    """Before, any error naming the channels fell back to the index: a 403 or a deadline
    spent on the group's attributes named them ``data@0``... (other names than a rank that
    read them), silently. Now the error, of its kind, names the key and what to do."""
    from insitubatch_nodes import stack

    store = counting_store(anemoi)
    g = open_geometries(store)["data"].isel(ensemble=0)
    store.fail[refused] = error
    with pytest.raises(type(error)) as caught:
        stack({"data": g})
    message = str(caught.value)
    assert "'data'" in message and str(anemoi) in message, message
    assert "grant read access" in message.lower() and repr(refused.split("/")[0]) in message
    assert caught.value.__cause__ is error
    store.fail.clear()
    assert stack({"data": g}).channels == tuple(f"data@{n}" for n in NAMES)


def test_a_stack_whose_store_has_no_channel_names_names_them_by_index(tmp_path: Path) -> None:
    """No ``variables`` attribute, no coordinate array: the index names the channels."""
    from insitubatch_nodes import stack

    group = zarr.open_group(tmp_path / "plain.zarr", mode="w", zarr_format=3)
    group.create_array("data", shape=(4, 3, 2, 5), chunks=(1, 3, 2, 5), dtype="f4",
                       dimension_names=["time", "variable", "lat", "lon"])  # fmt: skip
    g = open_geometries(counting_store(tmp_path / "plain.zarr"))["data"]
    assert stack({"data": g}).channels == ("data@0", "data@1", "data@2")
