"""A trial of ensemble stacks on anemoi-datasets' converted layout (2026-12-07): one array
``data (time, variable, ensemble, cell)``, the names in the root group's ``variables``, the
times in ``dates``, the points in ``latitudes``/``longitudes``; numpy transposes of the zarr
array are the oracle.

Found (fixed):

* ``stack([...], ensemble="ensemble")`` on that layout was refused (the ensemble axis comes
  after the variable axis, and a member had to keep it first after the sample axis): the
  documented workaround was a label of rows ``(C, E, cell)`` permuted on the device. A member
  may now keep the ensemble axis second, after its channel axis: its destination in the
  batch is its ``(E, c0:c1)`` slice with the two axes swapped, so its data is still copied
  once from the pool (and standardised in that copy, by statistics in its own axis order),
  rows ``([T,] E, C, cell)`` / ``([T,] E, cell, C)``;
* anemoi's ``missing_dates`` group attribute (dates whose slot in ``data`` holds no data:
  anemoi raises ``MissingDateError`` reading one) was ignored: samples at those dates were
  delivered (NaN rows, or whatever the slot holds) without a word. The dates it lists are now
  missing dates, as if given in ``missing=``: every anchor a step of which is at one is dropped
  (each store's, of stores joined by ``concat``).

Tried and found right: variables selected by name in any order beside a member that keeps
the ensemble first (each part its own destination), windows, channels last, statistics
pooled over ``"ensemble"`` or per member, a static field and forcings on anemoi's points
broadcast along the members; a time stride (``stride="12h"``) against anemoi's ``frequency``
attribute (the ``dates`` decide, the attribute is not read); a state saved mid-epoch resuming
bit-exact (missing dates, standardised). Tried outside this file: members patched along
``cell`` (each row's window of every member, as numpy's), ``fit_statistics`` skipping the
missing dates (numpy's mean without them), per-member statistics of all members refused, by a
message, for a view of a subset of the members (``isel(ensemble=[2, 0])``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr

from insitubatch_nodes import (
    Loader,
    concat,
    fit_statistics,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
    stack,
)
from insitubatch_nodes.forcings import Forcings, cos_solar_zenith

pytestmark = pytest.mark.timeout(60)

NAMES = ["10u", "2t", "lsm", "t_500", "t_850"]
NE, NC, NT = 3, 7, 12


def _write(
    root: Path, missing: list[str] | None = None, start: str = "2020-01-01T00"
) -> tuple[np.ndarray, np.ndarray]:
    """A store as ``anemoi-datasets create`` writes it (zarr v2): ``data (time, variable,
    ensemble, cell)`` one date a chunk, ``dates`` 6-hourly from ``start``, the points, the
    names in ``variables``; a companion ``spread (time, ensemble, cell)`` (ensemble first) and
    a static ``orog (cell)``. ``missing``: dates listed in ``missing_dates``, their slots left
    unwritten (NaN). Returns ``(data, dates)``."""
    nv = len(NAMES)
    dates = np.datetime64(start, "s") + np.arange(NT) * np.timedelta64(6, "h")
    rng = np.random.default_rng(0)
    data = rng.normal(size=(NT, nv, NE, NC)) + 10 * np.arange(nv)[:, None, None]
    data = (data + 100 * np.arange(NE)[:, None]).astype("f4")  # members far apart
    group = zarr.open_group(root, mode="w", zarr_format=2)
    arr = group.create_array("data", shape=data.shape, chunks=(1, nv, NE, NC), dtype="f4",
                             fill_value=np.nan)  # fmt: skip
    for i, d in enumerate(dates):
        if missing is None or str(d.astype("datetime64[h]")) not in missing:
            arr[i] = data[i]
        else:
            data[i] = np.nan
    arr.attrs["_ARRAY_DIMENSIONS"] = ["time", "variable", "ensemble", "cell"]
    spread = group.create_array("spread", shape=(NT, NE, NC), chunks=(2, NE, NC), dtype="f4")
    spread[:] = data[:, 1] * 2
    spread.attrs["_ARRAY_DIMENSIONS"] = ["time", "ensemble", "cell"]
    orog = group.create_array("orog", shape=(NC,), chunks=(NC,), dtype="f4")
    orog[:] = np.arange(NC, dtype="f4") * 10 + 5  # (no 0: zarr v2 fill value)
    orog.attrs["_ARRAY_DIMENSIONS"] = ["cell"]
    times = group.create_array("dates", shape=(NT,), chunks=(NT,), dtype="<M8[s]")
    times[:] = dates
    times.attrs["_ARRAY_DIMENSIONS"] = ["time"]
    for name, values in (("latitudes", [-60, -40, -20, 0, 20, 40, 60]),
                         ("longitudes", [0, 50, 100, 150, 200, 250, 300])):  # fmt: skip
        place = group.create_array(name, shape=(NC,), chunks=(NC,), dtype="f8", fill_value=0.0)
        place[:] = values
        place.attrs["_ARRAY_DIMENSIONS"] = ["cell"]
    attrs = {"variables": NAMES, "frequency": "6h", "ensemble_dimension": NE}
    if missing is not None:
        attrs["missing_dates"] = [f"{d}:00:00" for d in missing]
    group.attrs.update(attrs)
    return data, dates


@pytest.fixture(scope="module")
def anemoi(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray, np.ndarray]:
    root = tmp_path_factory.mktemp("anemoiens") / "anemoi.zarr"
    return (root, *_write(root))


def _batches(root: Path, views: dict, **options: object) -> list:
    g = open_geometries(root)["data"]
    options.setdefault("batch_size", 4)
    with insitu_pipeline(root, split_by_chunk(g, (1.0, 0.0, 0.0)), views, **options) as pipe:
        return list(Loader(pipe))


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_an_ensemble_stack_of_anemoi_s_array_holds_every_member_s_variables_by_name(
    anemoi: tuple[Path, np.ndarray, np.ndarray], layout: str
) -> None:
    # refused before ("'ensemble' after 'variable' ... give it as a label of its own")
    root, data, _ = anemoi
    g = open_geometries(root)
    picked = ["t_850", "2t", "10u"]
    index = [NAMES.index(n) for n in picked]
    members = {"data": g["data"].sel(variable=picked), "spread": g["spread"]}
    members = {k: v.window([-1, 0]) for k, v in members.items()}
    x = stack(members, ensemble="ensemble", layout=layout)
    assert x.channels == ("data@t_850", "data@2t", "data@10u", "spread")
    assert x.ensemble == (0, 1, 2)
    rows = 0
    for batch in _batches(root, {"x": x}):
        idx = batch.sample_indices["x"]
        want = np.concatenate([data[idx][:, :, index], data[idx][:, :, None, 1] * 2], axis=2)
        want = want.transpose(0, 1, 3, 2, 4)  # (n, T, C, E, cell) -> (n, T, E, C, cell)
        if layout == "channels_last":
            want = want.transpose(0, 1, 2, 4, 3)
        np.testing.assert_array_equal(batch["x"], want)
        rows += len(idx)
    assert rows == NT - 1


@pytest.mark.parametrize("pool", [(), ("ensemble",)])
def test_an_anemoi_ensemble_stack_is_standardised_by_its_statistics_beside_constants(
    anemoi: tuple[Path, np.ndarray, np.ndarray], pool: tuple[str, ...]
) -> None:
    root, data, dates = anemoi
    g = open_geometries(root)
    view = g["data"].sel(variable=["2t", "t_500"])
    manifest = split_by_chunk(g["data"], (1.0, 0.0, 0.0))
    stats = fit_statistics(root, manifest, {"data": view, "orog": g["orog"]}, pool=pool)
    sun = Forcings("x", view=g["data"], time_name="dates", names=["cos_solar_zenith"])
    x = stack({"data": view, "orog": g["orog"], "sun": sun}, ensemble="ensemble",
              normalize=stats, layout="channels_last")  # fmt: skip
    assert x.row_shape == (NE, NC, 4)
    sel = data[:, [1, 3]].astype(np.float64)  # (time, C, E, cell)
    axes = (0, 2, 3) if pool else (0, 3)
    mean, std = sel.mean(axis=axes, keepdims=True)[0], sel.std(axis=axes, keepdims=True)[0]
    orog = np.arange(NC) * 10.0 + 5
    lat = zarr.open_array(root, path="latitudes", mode="r")[...]
    lon = zarr.open_array(root, path="longitudes", mode="r")[...]
    for batch in _batches(root, {"x": x}):
        idx = batch.sample_indices["x"]
        got = batch["x"]
        want = ((sel[idx] - mean) / std).transpose(0, 2, 3, 1)  # (n, E, cell, C)
        np.testing.assert_allclose(got[..., :2], want, rtol=1e-5, atol=1e-5)
        for e in range(NE):  # the same for every member
            z = (orog - orog.mean()) / orog.std()
            np.testing.assert_allclose(got[:, e, :, 2], np.broadcast_to(z, (len(idx), NC)),
                                       rtol=1e-5, atol=1e-6)  # fmt: skip
            for r, i in enumerate(idx):
                want_sun = np.diag(cos_solar_zenith(dates[i], lat, lon))
                np.testing.assert_allclose(got[r, e, :, 3], want_sun, atol=1e-6)


def test_an_ensemble_among_the_field_s_axes_is_still_refused_saying_how(tmp_path: Path) -> None:
    group = zarr.open_group(tmp_path / "x.zarr", mode="w", zarr_format=3)
    group.create_array("x", shape=(4, 3, 2, 5), chunks=(1, 3, 2, 5), dtype="f4",
                       dimension_names=("time", "lat", "member", "lon"))  # fmt: skip
    g = open_geometries(tmp_path / "x.zarr")["x"]
    with pytest.raises(ValueError, match=r"'member' among its field's axes.*label of its own"):
        stack({"x": g}, ensemble="member")


def test_anemoi_s_missing_dates_drop_the_samples_that_touch_them(tmp_path: Path) -> None:
    """anemoi lists dates it has no data for in ``missing_dates`` (reading one raises
    ``MissingDateError``); they were delivered, NaN rows, as any other sample."""
    root = tmp_path / "gaps.zarr"
    gone = ["2020-01-02T00", "2020-01-03T06"]
    data, dates = _write(root, missing=gone)
    g = open_geometries(root)
    x = stack({"data": g["data"].sel(variable=["2t"]).window([-1, 0])}, ensemble="ensemble")
    seen = []
    for batch in _batches(root, {"x": x}, batch_size=3):
        idx = batch.sample_indices["x"]
        assert not np.isnan(batch["x"]).any()
        np.testing.assert_array_equal(batch["x"], data[idx][:, :, [1]].transpose(0, 1, 3, 2, 4))
        seen += [int(i) for i in idx[:, 1]]
    bad = {int(np.flatnonzero(dates == np.datetime64(d))[0]) for d in gone}
    assert sorted(seen) == [i for i in range(1, NT) if i not in bad and i - 1 not in bad]


def test_the_missing_dates_of_each_of_two_concatenated_anemoi_stores_are_dropped(
    tmp_path: Path,
) -> None:
    parts = [_write(tmp_path / "y0.zarr", ["2020-01-01T12"]),
             _write(tmp_path / "y1.zarr", ["2020-01-05T00"], start="2020-01-04T00")]  # fmt: skip
    data = np.concatenate([p[0] for p in parts])
    archive = concat([str(tmp_path / "y0.zarr"), str(tmp_path / "y1.zarr")], ["data"])
    views = {"x": archive["data"].sel(variable=["2t"])}
    seen = []
    with insitu_pipeline(archive, split_by_chunk(archive["data"], (1.0, 0.0, 0.0)), views,
                         batch_size=5) as pipe:  # fmt: skip
        for batch in pipe:
            idx = batch.sample_indices["x"]
            np.testing.assert_array_equal(batch["x"], data[idx][:, [1]])
            seen += [int(i) for i in idx]
    assert sorted(seen) == [i for i in range(2 * NT) if i not in (2, NT + 4)]


def test_a_time_stride_on_anemoi_s_dates_keeps_every_twelfth_hour(
    anemoi: tuple[Path, np.ndarray, np.ndarray],
) -> None:
    root, data, dates = anemoi
    g = open_geometries(root)
    x = stack({"data": g["data"].sel(variable=["2t"])}, ensemble="ensemble")
    seen = []
    for batch in _batches(root, {"x": x}, stride="12h"):
        idx = batch.sample_indices["x"]
        np.testing.assert_array_equal(batch["x"], data[idx][:, [1]].transpose(0, 2, 1, 3))
        seen += [int(i) for i in idx]
    assert sorted(seen) == [i for i in range(NT) if dates[i].astype(int) % 43200 == 0]


def test_an_anemoi_ensemble_stack_resumes_bit_exact_mid_epoch(tmp_path: Path) -> None:
    root = tmp_path / "r.zarr"
    _write(root, missing=["2020-01-02T00"])
    g = open_geometries(root)
    manifest = split_by_chunk(g["data"], (1.0, 0.0, 0.0))
    view = g["data"].sel(variable=["2t", "t_850"])
    stats = fit_statistics(root, manifest, {"data": view, "orog": g["orog"]})
    x = stack({"data": view.window([-1, 0]), "orog": g["orog"]}, ensemble="ensemble",
              normalize=stats)  # fmt: skip

    def records(state: object = None, stop: int | None = None) -> tuple[list, object]:
        out: list = []
        with insitu_pipeline(root, manifest, {"x": x}, batch_size=3, seed=4) as pipe:
            loader = Loader(pipe)
            if state is not None:
                loader.load_state_dict(state)
            for _ in range(2 if state is None else 1):
                for batch in loader:
                    out.append((batch.epoch, batch["x"].tobytes()))
                    if len(out) == stop:
                        return out, loader.state_dict()
        return out, None

    ref, _ = records()
    head, state = records(stop=2)
    rest, _ = records(state)
    assert head + rest == ref[: len(ref) // 2]
