"""Every array zarr-python opens, open_geometries finds, on stores written by real writers.

Root arrays (``zarr.save_array``, tensorstore), arrays below folders with no group metadata
(tensorstore writes arrays, never groups), variables written after the consolidated metadata
(xarray's ``to_zarr(mode="a", consolidated=False)``), and arrays appended to after
consolidation. zarr's own read is the oracle for every delivered row. Naming an array reads it
by name: a store that cannot list (HTTP) works for named arrays.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
import zarr.storage
from zarr.abc.store import Store

from insitubatch_nodes import (
    DecodedChunk,
    applies,
    insitu_pipeline,
    open_geometries,
    open_store,
    split_by_chunk,
    to_torch,
)
from insitubatch_nodes.plan import PlanConfig
from insitubatch_nodes.stages import ReadPlanNode

# zarr says so of every v3 consolidation; the claims here are about what we read back
pytestmark = pytest.mark.filterwarnings("ignore:Consolidated metadata is currently not part")


def _values(shape: tuple[int, ...], dtype: str = "f4", seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 10 + 100).astype(dtype)  # never the fill value


def _epoch_equals_zarr(store: Any, path: str, want: zarr.Array, **kwargs: Any) -> int:
    """Run one epoch over array ``path`` of ``store``; every row equals ``want``'s read."""
    geom = open_geometries(store, [path])[path]
    pipe = insitu_pipeline(
        store, split_by_chunk(geom, (1.0, 0.0, 0.0)), {"x": geom}, batch_size=4, **kwargs
    )
    rows = 0
    try:
        for batch in pipe:
            idx = batch.sample_indices["x"]
            np.testing.assert_array_equal(
                batch["x"], want[idx.min() : idx.max() + 1][idx - idx.min()]
            )
            np.testing.assert_array_equal(to_torch(batch)["x"].numpy(), want.oindex[idx])
            rows += len(batch)
    finally:
        pipe.close()
    assert rows == want.shape[0]
    return rows


class NoListStore(zarr.storage.WrapperStore[Store]):
    """A zarr store that cannot list, as a store served over plain HTTP cannot."""

    def _with_store(self, store: Store) -> NoListStore:
        return type(self)(store)

    @property
    def supports_listing(self) -> bool:
        return False

    def list(self) -> AsyncIterator[str]:
        raise NotImplementedError("this store cannot list (like HTTP)")

    def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        raise NotImplementedError("this store cannot list (like HTTP)")

    def list_dir(self, prefix: str) -> AsyncIterator[str]:
        raise NotImplementedError("this store cannot list (like HTTP)")


# ---------------------------------------------------------------------------------------------
# An array at the store root
# ---------------------------------------------------------------------------------------------


def test_an_array_saved_at_the_store_root_by_zarr_save_array_is_found_under_the_path_empty(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root.zarr"
    data = _values((23, 3, 5))
    zarr.save_array(str(root), data)
    geoms = open_geometries(root)
    assert list(geoms) == [""]
    want = zarr.open_array(root, mode="r")
    assert geoms[""].shape == want.shape and geoms[""].chunks == want.chunks
    assert geoms[""].store_key(0) in {"c/0/0/0", "0.0.0"}
    # named as "" or "/", by name
    assert open_geometries(root, [""])[""] == geoms[""]
    assert open_geometries(root, "/")[""] == geoms[""]
    assert _epoch_equals_zarr(root, "", want) == 23


def _plus_one(chunk: DecodedChunk) -> DecodedChunk:
    chunk.data += 1
    return chunk


def test_a_chunk_transform_is_scoped_to_a_root_array_by_its_path(tmp_path: Path) -> None:
    root = tmp_path / "root.zarr"
    zarr.save_array(str(root), _values((12, 3)))
    geom = open_geometries(root)[""]
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    want = zarr.open_array(root, mode="r")
    for name in ("", "/"):
        pipe = insitu_pipeline(
            root, manifest, {"x": geom}, batch_size=4, chunk_transforms=[applies(name, _plus_one)]
        )
        with pipe:
            for batch in pipe:
                np.testing.assert_array_equal(
                    batch["x"], want.oindex[batch.sample_indices["x"]] + 1
                )
    other = tmp_path / "group.zarr"
    zarr.open_group(other, mode="w").create_array("t2m", shape=(8, 3), chunks=(4, 3), dtype="f4")
    g = open_geometries(other, ["t2m"])["t2m"]
    with pytest.raises(ValueError, match="''"):  # no root array there: named at build
        insitu_pipeline(
            other,
            split_by_chunk(g, (1.0, 0.0, 0.0)),
            {"x": g},
            chunk_transforms=[applies("/", _plus_one)],
        )


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_root_array_created_by_zarr_create_array_trains_like_zarr_reads_it(
    tmp_path: Path, zarr_format: int
) -> None:
    root = tmp_path / "root.zarr"
    arr = zarr.create_array(
        store=zarr.storage.LocalStore(root),
        shape=(18, 6),
        chunks=(5, 4),
        dtype="i4",
        fill_value=0,
        zarr_format=zarr_format,  # type: ignore[arg-type]
    )
    arr[...] = _values((18, 6), "i4")
    assert set(open_geometries(root)) == {""}
    _epoch_equals_zarr(root, "", zarr.open_array(root, mode="r"))


# ---------------------------------------------------------------------------------------------
# Arrays below folders without group metadata
# ---------------------------------------------------------------------------------------------


def _groupless(root: Path, zarr_format: int) -> dict[str, np.ndarray]:
    """Arrays written at nested paths with no group metadata anywhere above them."""
    data = {"a/b/t2m": _values((17, 4, 3), seed=1), "c/z": _values((9, 2), "f8", seed=2)}
    for path, values in data.items():
        arr = zarr.create_array(
            store=zarr.storage.LocalStore(root / path),
            shape=values.shape,
            chunks=(4, *values.shape[1:]),
            dtype=values.dtype,
            zarr_format=zarr_format,  # type: ignore[arg-type]
        )
        arr[...] = values
    return data


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_arrays_below_folders_without_group_metadata_are_found_by_their_path(
    tmp_path: Path, zarr_format: int
) -> None:
    root = tmp_path / "store"
    data = _groupless(root, zarr_format)
    for meta in ("zarr.json", ".zgroup", ".zattrs"):  # really no group metadata
        assert not (root / meta).exists() and not (root / "a" / meta).exists()
    geoms = open_geometries(root)
    assert set(geoms) == set(data)
    for path in data:
        want = zarr.open_array(root, path=path, mode="r")
        assert geoms[path].shape == want.shape
        assert geoms[path].store_key(0).startswith(f"{path}/")
    _epoch_equals_zarr(root, "a/b/t2m", zarr.open_array(root, path="a/b/t2m", mode="r"))


def test_a_group_with_a_folder_holding_arrays_but_no_group_metadata_yields_both(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=2)
    group.create_array("t2m", shape=(8, 3), chunks=(4, 3), dtype="f4")[...] = _values((8, 3))
    zarr.consolidate_metadata(root)
    _groupless(root, 2)
    assert set(open_geometries(root)) == {"t2m", "a/b/t2m", "c/z"}


class ListingRecorder(zarr.storage.WrapperStore[Store]):
    """A zarr store that records the prefixes it is asked to list."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.listed: list[str] = []

    def _with_store(self, store: Store) -> ListingRecorder:
        return type(self)(store)

    def list_dir(self, prefix: str) -> AsyncIterator[str]:
        self.listed.append(prefix)
        return self._store.list_dir(prefix)


def test_finding_arrays_below_folders_without_group_metadata_lists_folders_never_arrays(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    _groupless(root, 2)  # a v2 array's folder holds every chunk key: listing it is costly
    store = ListingRecorder(zarr.storage.LocalStore(root, read_only=True))
    assert set(open_geometries(store)) == {"a/b/t2m", "c/z"}
    assert sorted(store.listed) == ["", "a", "a/b", "c"]  # the folders, not the arrays


@pytest.mark.xdist_group("s3")
def test_a_root_array_and_arrays_without_group_metadata_are_found_in_an_s3_bucket(
    tmp_path: Path, s3_upload: Callable[[Path, str], str], s3_options: dict[str, Any]
) -> None:
    root = tmp_path / "store"
    _groupless(root, 2)
    store = open_store(s3_upload(root, "layouts/groupless"), **s3_options)
    assert set(open_geometries(store)) == {"a/b/t2m", "c/z"}
    _epoch_equals_zarr(store, "c/z", zarr.open_array(root, path="c/z", mode="r"))
    single = tmp_path / "root.zarr"
    zarr.save_array(str(single), _values((10, 2)))
    store = open_store(s3_upload(single, "layouts/root.zarr"), **s3_options)
    assert list(open_geometries(store)) == [""]
    _epoch_equals_zarr(store, "", zarr.open_array(single, mode="r"))


def test_naming_arrays_reads_them_by_name_in_a_store_that_cannot_list(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _groupless(root, 3)
    zarr.save_array(str(tmp_path / "root.zarr"), _values((10, 2)))
    store = NoListStore(zarr.storage.LocalStore(root, read_only=True))
    geoms = open_geometries(store, ["a/b/t2m", "c/z"])
    assert geoms["a/b/t2m"].shape == (17, 4, 3)
    _epoch_equals_zarr(store, "a/b/t2m", zarr.open_array(root, path="a/b/t2m", mode="r"))
    root_store = NoListStore(zarr.storage.LocalStore(tmp_path / "root.zarr", read_only=True))
    assert open_geometries(root_store)[""].shape == (10, 2)  # a root array needs no listing
    # finding the arrays unnamed needs a listing (or consolidated metadata): the error says so
    with pytest.raises(FileNotFoundError, match=r"cannot be listed|listing it failed") as info:
        open_geometries(store)
    assert "open_geometries(store, [" in str(info.value)
    with pytest.raises(KeyError, match=r"'a/b/t2'.*could not be found.*listing it failed"):
        open_geometries(store, ["a/b/t2"])  # a typo: what was looked for, and why no list


def test_a_consolidated_group_in_a_store_that_cannot_list_yields_its_consolidated_arrays(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    group.create_array("t2m", shape=(8, 3), chunks=(4, 3), dtype="f4")
    group.create_array("nested/z", shape=(8,), chunks=(4,), dtype="f4")
    zarr.consolidate_metadata(root)
    store = NoListStore(zarr.storage.LocalStore(root, read_only=True))
    assert set(open_geometries(store)) == {"t2m", "nested/z"}


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_an_unknown_name_says_what_was_looked_for_where_and_what_exists(
    tmp_path: Path, zarr_format: int
) -> None:
    root = tmp_path / "store"
    _groupless(root, zarr_format)
    with pytest.raises(KeyError) as info:
        open_geometries(root, ["a/b/t2m", "a/b/t2"])
    message = str(info.value)
    assert "'a/b/t2'" in message and "'a/b/t2/zarr.json'" in message
    assert "'a/b/t2/.zarray'" in message and str(root) in message
    assert "'a/b/t2m'" in message and "'c/z'" in message  # what exists
    with pytest.raises(KeyError, match="'a/b': a group, not an array"):
        group = zarr.open_group(tmp_path / "g.zarr", mode="w", zarr_format=zarr_format)
        group.create_array("a/b/x", shape=(3,), dtype="f4")
        open_geometries(tmp_path / "g.zarr", ["a/b"])


# ---------------------------------------------------------------------------------------------
# Consolidated metadata that is out of date
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_an_array_created_after_consolidation_is_found_unnamed_and_by_name(
    tmp_path: Path, zarr_format: int
) -> None:
    root = tmp_path / "store.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=zarr_format)
    group.create_array("t2m", shape=(8, 3), chunks=(4, 3), dtype="f4")[...] = _values((8, 3))
    zarr.consolidate_metadata(root)
    late = zarr.open_group(root, mode="a", use_consolidated=False)
    late.create_array("late", shape=(11, 2), chunks=(3, 2), dtype="f4")[...] = _values((11, 2))
    assert "late" not in zarr.open_group(root, mode="r")  # zarr's consolidated view lacks it
    assert set(open_geometries(root)) == {"t2m", "late"}
    _epoch_equals_zarr(root, "late", zarr.open_array(root, path="late", mode="r"))


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_an_array_deleted_after_consolidation_is_named_missing_not_listed_as_available(
    tmp_path: Path, zarr_format: int
) -> None:
    import shutil

    root = tmp_path / "store.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=zarr_format)
    for name in ("t2m", "gone"):
        group.create_array(name, shape=(8, 3), chunks=(4, 3), dtype="f4")[...] = _values((8, 3))
    zarr.consolidate_metadata(root)
    before = open_geometries(root)["gone"]
    shutil.rmtree(root / "gone")
    assert set(open_geometries(root)) == {"t2m"}
    manifest = split_by_chunk(before, (1.0, 0.0, 0.0))
    with pytest.raises(FileNotFoundError, match=r"arrays there: \['t2m'\]; .*still names"):
        insitu_pipeline(root, manifest, {"x": before}, batch_size=4)
    with pytest.raises(KeyError) as raised:
        open_geometries(root, ["gone"])
    message = str(raised.value)
    assert "available arrays: ['t2m']" in message
    assert re.search(
        r"consolidated metadata.*still names \['gone'\].*consolidate_metadata", message
    )


def test_a_variable_xarray_appends_without_consolidating_is_found(tmp_path: Path) -> None:
    xr = pytest.importorskip("xarray")
    root = tmp_path / "ds.zarr"
    n = 12
    base = xr.Dataset(
        {"t2m": (("time", "lat"), _values((n, 3)))},
        coords={"time": np.arange(n), "lat": np.arange(3.0)},
    )
    base.to_zarr(root, consolidated=True, zarr_format=2)
    extra = xr.Dataset({"sst": (("time", "lat"), _values((n, 3), seed=5))})
    extra.to_zarr(root, mode="a", consolidated=False)
    assert set(open_geometries(root)) == {"t2m", "sst"}
    _epoch_equals_zarr(root, "sst", zarr.open_array(root, path="sst", mode="r"))


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_an_array_appended_after_consolidation_is_read_with_its_own_metadata_and_a_warning(
    tmp_path: Path, zarr_format: int
) -> None:
    root = tmp_path / "store.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=zarr_format)
    group.create_array("t2m", shape=(8, 3), chunks=(4, 3), dtype="f4")[...] = _values((8, 3))
    zarr.consolidate_metadata(root)
    arr = zarr.open_array(root, path="t2m", mode="a")
    arr.append(_values((6, 3), seed=9))  # now 14 samples; the consolidated copy says 8
    assert zarr.open_group(root, mode="r")["t2m"].shape == (8, 3)  # zarr's consolidated view
    for variables in (None, ["t2m"]):
        with pytest.warns(UserWarning, match=r"stale.*'t2m'.*shape \(14, 3\).*\(8, 3\)"):
            geoms = open_geometries(root, variables)
        assert geoms["t2m"].shape == (14, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        # the store check reads the array's own metadata: it agrees now ("Were the geometries
        # read from another store?" before), and the appended rows are delivered
        assert _epoch_equals_zarr(root, "t2m", zarr.open_array(root, path="t2m", mode="r")) == 14
        geom = open_geometries(root, ["t2m"])["t2m"]
        views = {"x": geom, "y": geom.shift(1)}
        pipe = insitu_pipeline(root, split_by_chunk(geom, (1.0, 0.0, 0.0)), views, batch_size=4)
        assert max(int(b.sample_indices["y"].max()) for b in pipe) == 13
        pipe.close()


def test_a_time_series_xarray_appends_to_without_consolidating_is_read_whole(
    tmp_path: Path,
) -> None:
    xr = pytest.importorskip("xarray")
    root = tmp_path / "ds.zarr"

    def part(start: int, n: int) -> Any:
        return xr.Dataset(
            {"t2m": (("time", "lat"), _values((n, 3), seed=start))},
            coords={"time": np.arange(start, start + n), "lat": np.arange(3.0)},
        )

    part(0, 8).to_zarr(root, consolidated=True, zarr_format=2, encoding={"t2m": {"chunks": (4, 3)}})
    part(8, 5).to_zarr(root, mode="a", append_dim="time", consolidated=False)
    with pytest.warns(UserWarning, match="stale"):
        geom = open_geometries(root)["t2m"]
    assert geom.shape == (13, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _epoch_equals_zarr(root, "t2m", zarr.open_array(root, path="t2m", mode="r"))


@pytest.mark.parametrize(
    "zarr_format, shards", [(2, None), (3, None), (3, (6, 4, 6))], ids=["v2", "v3", "v3-sharded"]
)
def test_a_zarr_zipstore_handed_in_unopened_reads_like_zarr_reads_it(
    tmp_path: Path, zarr_format: int, shards: tuple[int, ...] | None
) -> None:
    path = tmp_path / "store.zip"
    values = _values((12, 4, 6))
    with zarr.storage.ZipStore(path, mode="w") as writer:
        kwargs: dict[str, Any] = {"shards": shards} if shards else {}
        array = zarr.create_array(
            writer,
            name="t2m",
            shape=values.shape,
            chunks=(2, 2, 3),
            dtype="f4",
            zarr_format=zarr_format,  # type: ignore[arg-type]
            **kwargs,
        )
        array[:] = values
    # a store as a user makes it: not opened (zarr's own open_array opens it first)
    store = zarr.storage.ZipStore(path, mode="r", read_only=True)
    geoms = open_geometries(store)
    assert list(geoms) == ["t2m"] and geoms["t2m"].shape == values.shape
    want = zarr.open_array(zarr.storage.ZipStore(path, mode="r", read_only=True), path="t2m")
    np.testing.assert_array_equal(want[:], values)
    assert _epoch_equals_zarr(zarr.storage.ZipStore(path, mode="r", read_only=True), "t2m", want)


# ---------------------------------------------------------------------------------------------
# What a new user passes by mistake: each refused with a message that names the fix
# ---------------------------------------------------------------------------------------------


def test_a_root_array_named_in_the_list_form_of_views_says_to_pass_a_dict(tmp_path: Path) -> None:
    root = tmp_path / "root.zarr"
    zarr.save_array(str(root), _values((16, 3)))
    geoms = open_geometries(root)
    manifest = split_by_chunk(geoms[""], (1.0, 0.0, 0.0))
    for names in ([""], ["/"]):
        with pytest.raises(ValueError, match=r"path ''.*pass the views as a dict.*\{'x'"):
            insitu_pipeline(root, manifest, names, batch_size=4)
    pipe = insitu_pipeline(root, manifest, {"x": geoms[""]}, batch_size=4)  # as it says
    assert sum(len(b) for b in pipe) == 16
    pipe.close()


def test_a_dict_of_sample_axes_passed_as_variables_says_to_pass_sample_axis(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store.zarr"
    group = zarr.open_group(root, mode="w")
    group.create_array("a", shape=(4, 6), chunks=(2, 3), dtype="f4")
    with pytest.raises(TypeError, match=r"sample_axis=\{'a': 1\}"):
        open_geometries(root, {"a": 1})  # type: ignore[arg-type]
    assert open_geometries(root, sample_axis={"a": 1})["a"].sample_axis == 1  # as it says


def test_an_xarray_dataset_opened_from_zarr_stands_for_its_store_or_says_what_to_pass(
    tmp_path: Path,
) -> None:
    xr = pytest.importorskip("xarray")
    root = tmp_path / "era5.zarr"
    values = _values((16, 4, 6))
    xr.Dataset({"t2m": (("time", "lat", "lon"), values)}).to_zarr(root, zarr_format=3)
    want = zarr.open_array(root / "t2m", mode="r")
    for ds in (
        xr.open_zarr(root),  # from a path: ds.encoding["source"]
        xr.open_zarr(zarr.storage.LocalStore(root, read_only=True)),  # from a zarr store
    ):
        assert list(open_geometries(ds)) == ["t2m"]
        assert _epoch_equals_zarr(ds, "t2m", want) == 16
    in_memory = xr.Dataset({"t2m": (("time",), np.zeros(4, "f4"))})
    with pytest.raises(TypeError, match=r"not a zarr store.*pass the store itself, its path"):
        open_geometries(in_memory)
    xr.Dataset({"t2m": (("time",), np.zeros(4, "f4"))}).to_zarr(root.parent / "g.zarr", group="g")
    with pytest.raises(TypeError, match=r"group 'g'.*\['g/t2m'\]"):
        open_geometries(xr.open_zarr(root.parent / "g.zarr", group="g"))


def test_an_xarray_dataset_selected_after_opening_is_refused_and_one_of_fewer_variables_is_those(
    tmp_path: Path,
) -> None:
    # The store stood for the Dataset whatever was selected: ds.isel(time=slice(0, 4)) trained
    # on all 16 steps, ds[["t2m"]] gave every array of the store
    xr = pytest.importorskip("xarray")
    root = tmp_path / "era5.zarr"
    dims = ("time", "lat", "lon")
    xr.Dataset({"t2m": (dims, _values((16, 4, 6))), "u": (dims, _values((16, 4, 6)))}).to_zarr(
        root, zarr_format=3
    )
    ds = xr.open_zarr(root)
    for selected, shown in (
        (ds.isel(time=slice(0, 4)), r"'time': 4, 'lat': 4, 'lon': 6\} here but \(16, 4, 6\)"),
        (ds.sel(lat=[0, 2]), r"'lat': 2"),
        (ds.transpose("lon", "lat", "time"), r"'lon': 6, 'lat': 4, 'time': 16"),
        (ds.isel(time=slice(0, 4))[["t2m"]], r"'t2m'"),
    ):
        with pytest.raises(ValueError, match=r"a selection of its store: .*" + shown):
            open_geometries(selected)
        with pytest.raises(ValueError, match=r"isel/sel for field axes .*sample_range"):
            insitu_pipeline(selected, split_by_chunk(open_geometries(root)["t2m"]), {})
    assert list(open_geometries(ds[["t2m"]])) == ["t2m"]  # the variables it kept
    assert list(open_geometries(ds)) == ["t2m", "u"]
    assert open_geometries(root, []) == {} == open_geometries(ds, [])  # none named, none given
    assert _epoch_equals_zarr(ds[["t2m"]], "t2m", zarr.open_array(root / "t2m", mode="r")) == 16


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_an_array_of_variable_length_strings_is_refused_at_construction_naming_the_fix(
    tmp_path: Path, zarr_format: int
) -> None:
    root = tmp_path / "names.zarr"
    names = zarr.create_array(root, shape=(6,), chunks=(2,), dtype=str, zarr_format=zarr_format)
    names[...] = np.array(["a", "bb", "ccc", "d", "e", "f"])
    geom = open_geometries(root, [""])[""]  # found, like any array
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match=r"'' holds variable-length.*fixed-width.*'<U8'"):
        insitu_pipeline(root, manifest, {"x": geom}, batch_size=2)


@pytest.mark.parametrize("dtype", ["<U3", "S3", [("a", "<i4"), ("b", "<f8")]])
def test_fixed_width_strings_and_structured_records_train_like_zarr_reads_them(
    tmp_path: Path, dtype: Any
) -> None:
    root = tmp_path / "records.zarr"
    fill = None if isinstance(dtype, list) else ""
    array = zarr.create_array(
        root, shape=(11, 2), chunks=(3, 2), dtype=dtype, zarr_format=2, fill_value=fill
    )
    values = np.zeros((11, 2), dtype=np.dtype(dtype))
    if isinstance(dtype, list):
        values["a"] = np.arange(22).reshape(11, 2)
        values["b"] = values["a"] * 0.5
    else:
        values[...] = np.array([["ab", "c"], ["", "xyz"]] * 5 + [["q", "r"]], dtype=dtype)
    array[:9] = values[:9]  # the last chunk is never written: the fill value
    want = zarr.open_array(root, mode="r")[...]
    geom = open_geometries(root, [""])[""]
    pipe = insitu_pipeline(root, split_by_chunk(geom, (1.0, 0.0, 0.0)), {"x": geom}, batch_size=4)
    with pipe:
        batches = list(pipe)
    assert sum(len(b) for b in batches) == 11
    for batch in batches:
        assert batch["x"].dtype == want.dtype
        np.testing.assert_array_equal(batch["x"], want[batch.sample_indices["x"]])
    with pytest.raises(TypeError, match=r"no tensor type.*convert it to numbers"):
        to_torch(batches[0])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("shape", [(5, 0), (5, 3, 0)])
def test_an_array_with_a_zero_length_field_axis_is_refused_at_construction_not_waited_on(
    tmp_path: Path, shape: tuple[int, ...]
) -> None:
    root = tmp_path / "empty.zarr"
    zarr.create_array(root, shape=shape, chunks=(2,) * len(shape), dtype="f4", fill_value=0)
    geom = open_geometries(root, [""])[""]
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match=r"'' has shape .*no values.*drop it from the views"):
        insitu_pipeline(root, manifest, {"x": geom}, batch_size=2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", ["strings", "zero-length"])
def test_a_read_plan_composed_by_hand_refuses_an_array_a_batch_cannot_hold_as_the_builder_does(
    tmp_path: Path, case: str
) -> None:
    root = tmp_path / "odd.zarr"
    if case == "strings":
        odd = zarr.create_array(root, shape=(6,), chunks=(2,), dtype=str)
        odd[...] = np.array(["a", "bb", "ccc", "d", "e", "f"])
        message = r"'' holds variable-length"
    else:
        zarr.create_array(root, shape=(5, 0), chunks=(2, 2), dtype="f4", fill_value=0)
        message = r"'' has shape .*no values"
    geom = open_geometries(root, [""])[""]
    manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match=message):  # not a failed or endless first batch
        ReadPlanNode(manifest, {"x": geom}, config=PlanConfig(batch_size=2))


def test_a_zarr_group_or_array_passed_as_the_store_stands_for_it_or_says_what_to_pass(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store.zarr"
    group = zarr.open_group(root, mode="w")
    group.create_array("t2m", shape=(8, 3), chunks=(4, 3), dtype="f4")[...] = _values((8, 3))
    group.require_group("sub").create_array("z", shape=(8, 2), chunks=(4, 2), dtype="f4")
    opened = zarr.open_group(root, mode="r")  # the root group stands for its store
    assert set(open_geometries(opened)) == {"t2m", "sub/z"}
    assert _epoch_equals_zarr(opened, "t2m", zarr.open_array(root, path="t2m", mode="r")) == 8
    with pytest.raises(TypeError, match=r"group 'sub'.*\.store.*\['sub/t2m'\]"):
        open_geometries(zarr.open_group(root, path="sub", mode="r"))
    with pytest.raises(TypeError, match=r"a zarr Array is not a store.*\.store.*\['t2m'\]"):
        open_geometries(zarr.open_array(root, path="t2m", mode="r"))
