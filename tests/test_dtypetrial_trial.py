"""The model-input features over the dtypes real archives hold: a dtype trial of 2026-12-06.

Tried: float32, float64, float16, int8/int16/int32/int64, uint8/uint16/uint32/uint64, bool,
big-endian ``>f4``/``>i2``/``>u2`` (zarr v2), complex64/complex128, CF-packed int16 with
``scale_factor``/``add_offset``/``_FillValue`` and float32 with ``_FillValue = -9999`` (v2 and
v3, ``cf_dtype`` default and ``"float32"``), datetime64, timedelta64, int32, uint8 and
descending float32 coordinates; zarr v2, v3 and v3 sharded; plain views, windows, ``isel``
selections, stacks in both layouts, a persistent cache read cold then warm; numpy, zarr and
xarray as the oracles.

Found (now fixed):

- a **static stack member of a dtype the stack cannot hold** was cast without a word: a float32
  flat-field in an int16 microscopy stack arrived truncated to integers (1.29 -> 1), a complex
  beam in a float32 stack lost its imaginary part, a float64 field of 8e4 in a float16 stack
  became inf; a complex beam in a complex64 stack lost its imaginary part too (the static
  fields were cast through float64). Now a static member of a kind the stack's dtype cannot
  hold (a float in an integer stack, complex in a real one) is refused when the stack is made,
  one whose values overflow it (8e4 in float16, a uint16 60000 in int16) when the pipeline is
  built, or by ``set_views`` before it takes the new views (the first fix raised after the plan
  had taken them, leaving a stack without its constants); bool, uint8 and other members the
  stack's dtype holds are taken, and cast as numpy casts them. Standardised (``normalize=``) a
  static member is the stack's dtype of the exact result, as a sampled one is.
- **forcings in a stack that cannot hold them**: in an int16 stack ``cos_solar_zenith`` became
  0 and ``toa_incident_solar_radiation`` wrapped around (-11079 J m⁻²); in a float16 stack the
  radiation (up to 4.9e6 J m⁻² an hour) became inf. Both are refused when the stack is made
  (the forcings in [-1, 1] stack into float16 as they are).
- ``fit_statistics`` of **complex values** (radio visibilities) failed deep inside numpy
  ("Cannot cast ufunc 'subtract' input 0 from dtype('<c8') ...") and of a complex static field
  fitted its real part with only a ``ComplexWarning``; ``stats.normalizer`` dropped the
  imaginary part the same way. Both refuse complex views now, saying to take real channels
  with a batch transform.
- ``sel`` on a **datetime64 field axis** (an ensemble archive sampled along ``member``, each
  sample a run of times) took no date strings: ``sel(time="2020-06-01T06")`` was a ``KeyError``
  listing the dates as nanosecond integers, a slice of strings a ``TypeError`` ("'<' not
  supported between instances of 'int' and 'str'"). Now strings select as xarray's
  (pandas') ``sel`` does: a string as precise as the coordinate is one date (the axis dropped),
  a coarser one (``"2020-06-01"`` on 6-hourly times) every date in it (the axis kept), a slice
  of strings from its start's first instant to its stop's last. ``method="nearest"`` on dates
  and on lead times (``sel(step="7h", method="nearest")``) was a ``TypeError`` ("needs a
  numeric coordinate"); it takes the nearest, as xarray.
- a stack member with a **datetime64 channel axis** named its channels by nanosecond integers
  (``g@1590969600000000000``); now by the date, to the precision the dates need
  (``g@2020-06-01T06``).
- a stack of members of other dtypes said "a chunk transform can cast one", and
  ``normalize=`` on integer members "cast them with a chunk transform": a pipeline refuses a
  chunk transform that casts a stack member, so the advice led to a second refusal. Both now
  say what works (labels of their own, cast in a batch transform; ``cf_dtype``).
- ``open_geometries(store, cf_dtype="float16")`` decoded ERA5's packed mean sea-level
  pressure (about 1e5 Pa) to inf at every point; a packed field whose stored integers unpack
  past the largest value of ``cf_dtype`` is refused now, naming it.

Tried and found right (no claim needed): every dtype above through the plain pipeline, windows,
uneven ``isel`` lists, stacks (``np.concatenate`` of the members in both layouts) and a
persistent cache read twice, on v2, v3 and sharded v3 (batches native, equal to zarr's read);
members of different dtypes (int16 + float32, uint8 + float16, float64 + float32) are refused
naming both, as documented; ``fit_statistics`` of every integer and float dtype above against
numpy in float64 (uint16 squares, uint8 differences without wrap-around, float16 accumulated in
float64, int64/uint64 up to 2**62), CF-packed and ``_FillValue`` fields (statistics of the
unpacked values, fills counted in ``nan_count``), ``Statistics`` JSON round trip (finite values,
NaN, ±inf); ``isel``/``sel`` with numpy scalars, 0-d arrays, uint8 index arrays, bool lists and
masks, DataArray masks, negative indices, descending float32 latitudes, int32 levels with
float values (``500.0`` selects, ``500.5`` is a ``KeyError``), each against xarray;
``stack(..., normalize=stats)`` of float64 members and a uint8 static member (both layouts,
statistics as fitted and as loaded from JSON) and ``stats.normalizer`` of uint8 and int16
labels (float32) equal ``(x - mean) / std`` exactly; big-endian v2 ``>i2`` packed and ``>f4``
fields with a ``>i8`` time coordinate, through fit, windows, a normalised stack, forcings and a
warm persistent cache, equal xarray's values.

Left as they are: a channel holding ``±inf`` (not NaN) has a NaN mean where numpy's
``nanmean`` gives ``±inf`` when a NaN shares its batch (its ``std`` is NaN either way, as
numpy's); a float field narrowed to ``float16`` by ``cf_dtype`` is inf past 65504, as numpy
casts it (only a packed field's range is known before reading).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr

from insitubatch_nodes import insitu_pipeline, open_geometries, split_by_chunk, stack
from insitubatch_nodes.forcings import Forcings
from insitubatch_nodes.io.selection import view_keys
from insitubatch_nodes.statistics import fit_statistics

xr = pytest.importorskip("xarray")
pd = pytest.importorskip("pandas")

pytestmark = pytest.mark.timeout(60)

T, Y, X = 8, 3, 4


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6-hourly ``(time, lat, lon)`` fields of several dtypes (``i16`` int16, ``h`` float16,
    ``f`` float32, ``vis`` complex64) and static ``(lat, lon)`` fields: ``flat`` float32
    (1.29, 0.69, ...), ``big`` float64 (up to 9e4), ``beam`` complex64, ``lsm`` uint8,
    ``mask`` bool and ``counts`` uint16 (up to 6e4)."""
    rng = np.random.default_rng(0)
    field = (T, Y, X)
    dims = ("time", "lat", "lon")
    ds = xr.Dataset(
        {
            "i16": (dims, rng.integers(-3000, 3000, field).astype(np.int16)),
            "h": (dims, rng.standard_normal(field).astype(np.float16)),
            "f": (dims, rng.standard_normal(field).astype(np.float32)),
            "vis": (dims, (rng.standard_normal(field) + 1j * rng.standard_normal(field))
                    .astype(np.complex64)),
            "flat": (dims[1:], (rng.random((Y, X)) + 0.5).astype(np.float32)),
            "big": (dims[1:], 1e4 + rng.random((Y, X)) * 8e4),
            "beam": (dims[1:], (rng.random((Y, X)) + 1j).astype(np.complex64)),
            "lsm": (dims[1:], (rng.random((Y, X)) > 0.5).astype(np.uint8)),
            "mask": (dims[1:], rng.random((Y, X)) > 0.5),
            "counts": (dims[1:], rng.integers(0, 60000, (Y, X)).astype(np.uint16)),
        },
        coords={"time": pd.date_range("2020-06-01", periods=T, freq="6h"),
                "lat": [30.0, 20.0, 10.0], "lon": [0.0, 90.0, 180.0, 270.0]},
    )  # fmt: skip
    root = tmp_path_factory.mktemp("dtypes") / "s.zarr"
    enc = {v: {"chunks": (2, Y, X)} for v in ("i16", "h", "f", "vis")}
    ds.to_zarr(root, encoding=enc, consolidated=False, zarr_format=3)
    return root


def _first_batch(store: Path, views: dict) -> object:
    g = open_geometries(store)
    manifest = split_by_chunk(g["f"], (1.0, 0.0, 0.0))
    with insitu_pipeline(store, manifest, views, batch_size=4, shuffle=False) as pipe:
        return next(iter(pipe))


# -- static members the stack's dtype cannot hold ----------------------------------------------
@pytest.mark.parametrize(
    ("data", "static"), [("i16", "flat"), ("f", "beam"), ("i16", "big"), ("h", "beam")]
)
def test_a_static_member_whose_values_the_stacks_dtype_cannot_hold_is_refused_naming_it(
    store: Path, data: str, static: str
) -> None:
    g = open_geometries(store)
    with pytest.raises(ValueError, match=rf"stack member '{static}'.*{g[static].dtype}"):
        stack({data: g[data], static: g[static]})


@pytest.mark.parametrize(("data", "static"), [("h", "big"), ("i16", "counts")])
def test_a_static_member_whose_values_overflow_the_stacks_dtype_is_refused_when_built(
    store: Path, data: str, static: str
) -> None:
    g = open_geometries(store)
    x = stack({data: g[data], static: g[static]})
    dtype = g[data].dtype
    with pytest.raises(ValueError, match=rf"stack member '{static}'.*{dtype}.*normalize"):
        _first_batch(store, {"x": x})


@pytest.mark.parametrize(
    ("data", "statics"),
    [
        ("f", ("lsm", "mask", "big", "counts")),
        ("i16", ("lsm", "mask")),
        ("h", ("lsm", "mask", "flat")),
        ("vis", ("beam", "flat", "mask")),
    ],
)
def test_static_members_the_stacks_dtype_holds_stack_as_numpy_concatenates_them(
    store: Path, data: str, statics: tuple[str, ...]
) -> None:
    g = open_geometries(store)
    members = {data: g[data], **{name: g[name] for name in statics}}
    for layout in ("channels_first", "channels_last"):
        batch = _first_batch(store, {"x": stack(members, layout=layout)})
        got = batch.arrays["x"]  # type: ignore[attr-defined]
        rows = batch.sample_indices["x"]  # type: ignore[attr-defined]
        dtype = g[data].dtype
        parts = [zarr.open_array(store / data)[...][rows][:, None]]
        for name in statics:  # each static field cast to the stack's dtype, as numpy casts
            whole = zarr.open_array(store / name)[...].astype(dtype)
            parts.append(np.broadcast_to(whole, (len(rows), 1, Y, X)))
        want = np.concatenate(parts, axis=1)
        if layout == "channels_last":
            want = np.moveaxis(want, 1, -1)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, want)


# -- forcings in a stack that cannot hold them -------------------------------------------------
@pytest.mark.parametrize(
    ("data", "names"),
    [("i16", ["cos_solar_zenith"]), ("h", ["cos_solar_zenith", "toa_incident_solar_radiation"])],
)
def test_forcings_in_a_stack_whose_dtype_cannot_hold_them_are_refused(
    store: Path, data: str, names: list[str]
) -> None:
    g = open_geometries(store)
    sun = Forcings("x", view=g[data], names=names)
    with pytest.raises(ValueError, match=rf"{names[-1]}.*{g[data].dtype}"):
        stack({data: g[data], "sun": sun})


def test_bounded_forcings_stack_into_float16_as_float16_rounds_them(store: Path) -> None:
    g = open_geometries(store)
    names = ["cos_solar_zenith", "local_time_sin", "year_progress_cos"]
    x = stack({"h": g["h"], "sun": Forcings("x", view=g["h"], names=names)})
    batch = _first_batch(store, {"x": x})
    times = batch.coords["x"]["time"]  # type: ignore[attr-defined]
    want = Forcings("x", view=g["h"], names=names).compute(times)
    for c, name in enumerate(names, start=1):
        got = batch.arrays["x"][:, c]  # type: ignore[attr-defined]
        assert got.dtype == np.float16 and np.isfinite(got).all()
        np.testing.assert_array_equal(got, want[name].astype(np.float16))


# -- complex values in statistics --------------------------------------------------------------
@pytest.mark.parametrize("label", ["vis", "beam"])
def test_fit_statistics_of_complex_values_is_refused_saying_how(store: Path, label: str) -> None:
    g = open_geometries(store)
    manifest = split_by_chunk(g["f"], (1.0, 0.0, 0.0))
    views = {"f": g["f"], label: g[label]}
    with pytest.raises(ValueError, match=rf"'{label}'.*complex64.*batch transform"):
        fit_statistics(store, manifest, views)


def test_a_normalizer_refuses_a_complex_label_instead_of_dropping_its_imaginary_part(
    store: Path,
) -> None:
    g = open_geometries(store)
    manifest = split_by_chunk(g["f"], (1.0, 0.0, 0.0))
    stats = fit_statistics(store, manifest, {"f": g["f"]})
    stats.paths["f"] = "vis"  # statistics given over, as for another store's quantity
    with pytest.raises(ValueError, match=r"'f'.*complex64"):
        stats.normalizer({"f": g["vis"]})


# -- sel on a datetime64 field axis ------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """``g (member, time, lat, lon)``: each member a run of 6-hourly times over two days."""
    times = pd.date_range("2020-06-01", periods=8, freq="6h")
    ds = xr.Dataset(
        {"g": (("member", "time", "lat", "lon"), np.zeros((2, 8, 3, 4), np.float32))},
        coords={"member": [0, 1], "time": times, "lat": [30.0, 20.0, 10.0],
                "lon": [0.0, 90.0, 180.0, 270.0]},
    )  # fmt: skip
    root = tmp_path_factory.mktemp("runs") / "r.zarr"
    ds.to_zarr(root, encoding={"g": {"chunks": (1, 8, 3, 4)}}, consolidated=False, zarr_format=3)
    return root, ds.g.isel(member=0)


@pytest.mark.parametrize(
    "key",
    [
        "2020-06-01T06",
        "2020-06-01T06:00:00",
        "2020-06-01",
        "2020-06",
        ["2020-06-01T06", "2020-06-02"],
        slice("2020-06-01T06", "2020-06-01T18"),
        slice("2020-06-01", "2020-06-01"),
        slice("2020-06-01T12", None),
        slice(None, "2020-06-01", 2),
        pd.Timestamp("2020-06-02T06"),
        np.datetime64("2020-06-01T18"),
    ],
    ids=repr,
)
def test_sel_on_a_datetime_axis_takes_dates_and_strings_as_xarray(
    runs: tuple[Path, object], key: object
) -> None:
    root, da = runs
    g = open_geometries(root, sample_axis="member")["g"]
    want = da.sel(time=key)  # type: ignore[attr-defined]
    got = g.sel(time=key)
    assert got.inner_shape == want.shape
    picked = view_keys(got)[0]  # (None: the whole axis)
    times = da.time.values  # type: ignore[attr-defined]
    chosen = times if picked is None else times[picked if isinstance(picked, int) else list(picked)]
    np.testing.assert_array_equal(np.atleast_1d(chosen), np.atleast_1d(want.time.values))


def test_a_date_not_in_a_datetime_axis_is_a_key_error_showing_the_dates(
    runs: tuple[Path, object],
) -> None:
    root, _ = runs
    g = open_geometries(root, sample_axis="member")["g"]
    with pytest.raises(KeyError, match=r"2020-06-01T07.*'2020-06-01T00"):
        g.sel(time="2020-06-01T07")
    with pytest.raises(KeyError, match=r"2020-07"):
        g.sel(time="2020-07")


def test_a_datetime_channel_axis_names_its_channels_by_date(runs: tuple[Path, object]) -> None:
    root, _ = runs
    g = open_geometries(root, sample_axis="member")["g"]
    x = stack({"g": g.isel(time=[0, 1, 4])})
    assert x.channels == ("g@2020-06-01T00", "g@2020-06-01T06", "g@2020-06-02T00")


@pytest.mark.parametrize(
    ("key", "options"),
    [
        ("2020-06-01T07", {"method": "nearest"}),
        (np.datetime64("2020-06-01T10"), {"method": "nearest", "tolerance": "2h"}),
        (["2020-06-01T04", "2020-06-02T20"], {"method": "nearest"}),
    ],
    ids=repr,
)
def test_sel_nearest_on_a_datetime_axis_takes_the_nearest_date_as_xarray(
    runs: tuple[Path, object], key: object, options: dict
) -> None:
    root, da = runs
    g = open_geometries(root, sample_axis="member")["g"]
    want = da.sel(time=key, **options)  # type: ignore[attr-defined]
    got = g.sel(time=key, **options)
    picked = view_keys(got)[0]
    times = da.time.values  # type: ignore[attr-defined]
    chosen = times[picked if isinstance(picked, int) else list(picked)]  # type: ignore[arg-type]
    np.testing.assert_array_equal(chosen, want.time.values)
    with pytest.raises(KeyError):
        da.sel(time="2020-06-01T07", method="nearest", tolerance="30min")  # type: ignore[attr-defined]
    with pytest.raises(KeyError):
        g.sel(time="2020-06-01T07", method="nearest", tolerance="30min")


@pytest.mark.parametrize(
    "key",
    [slice("2020-06-02", "2020-06-01"), slice("2020-06-02T06", "2020-06-01T12"), "2020-06-01"],
    ids=repr,
)
def test_a_date_slice_on_dates_stored_latest_first_follows_their_order(
    runs: tuple[Path, object], key: object
) -> None:
    """As a latitude stored north to south takes ``slice(north, south)``. (pandas refuses a
    slice of strings on dates that decrease: the oracle is xarray's slice of the ascending
    dates, reversed.)"""
    root, da = runs
    g = open_geometries(root, sample_axis="member")["g"].isel(time=slice(None, None, -1))
    if isinstance(key, slice):
        up = da.sel(time=slice(key.stop, key.start))  # type: ignore[attr-defined]
        want = up.isel(time=slice(None, None, -1))
    else:
        want = da.isel(time=slice(None, None, -1)).sel(time=key)  # type: ignore[attr-defined]
    got = g.sel(time=key)
    assert got.inner_shape == want.shape
    # the view selects within its reversed times: its keys index the stored (ascending) axis
    times = da.time.values  # type: ignore[attr-defined]
    np.testing.assert_array_equal(times[list(view_keys(got)[0])], want.time.values)  # type: ignore[arg-type]


def test_sel_nearest_on_a_lead_time_axis_takes_the_nearest_duration_as_xarray(
    tmp_path: Path,
) -> None:
    """A forecast archive ``(init, step, lat, lon)``: ``sel(step="7h", method="nearest")``
    (before, a ``TypeError``: "needs a numeric coordinate"); ties to the longer step."""
    ds = xr.Dataset(
        {"f": (("init", "step", "lat", "lon"), np.zeros((3, 4, 3, 4), np.float32))},
        coords={"init": pd.date_range("2020-06-01", periods=3, freq="12h"),
                "step": pd.to_timedelta([0, 6, 12, 24], unit="h"), "lat": [30.0, 20.0, 10.0],
                "lon": [0.0, 90.0, 180.0, 270.0]},
    )  # fmt: skip
    ds.to_zarr(tmp_path / "f.zarr", consolidated=False, zarr_format=3)
    g = open_geometries(tmp_path / "f.zarr")["f"]
    da = ds.f.isel(init=0)
    steps = ds.step.values
    for key in ("7h", "9h", ["5h", "20h"], np.timedelta64(17, "h")):
        want = da.sel(step=key, method="nearest").step.values
        picked = view_keys(g.sel(step=key, method="nearest"))[0]
        got = steps[picked if isinstance(picked, int) else list(picked)]  # type: ignore[arg-type]
        np.testing.assert_array_equal(got, want)
    with pytest.raises(KeyError):
        da.sel(step="7h", method="nearest", tolerance="30min")
    with pytest.raises(KeyError, match=r"'7h'.*6:00:00"):
        g.sel(step="7h", method="nearest", tolerance="30min")


def test_set_views_refuses_an_overflowing_static_member_before_taking_the_views(
    store: Path,
) -> None:
    """The refusal comes before the plan takes the new views: the pipeline goes on with the
    views it had (before the check, set_views would have left a stack without its constants)."""
    g = open_geometries(store)
    manifest = split_by_chunk(g["i16"], (1.0, 0.0, 0.0))
    first = stack({"i16": g["i16"], "lsm": g["lsm"]})
    with insitu_pipeline(store, manifest, {"x": first}, batch_size=4, shuffle=False) as pipe:
        with pytest.raises(ValueError, match=r"stack member 'counts'.*int16"):
            pipe.set_views({"x": stack({"i16": g["i16"], "counts": g["counts"]})})
        for _ in range(2):  # this epoch and the next: the stack it was built with
            batches = list(pipe)
            assert [b.channels["x"] for b in batches] == [["i16", "lsm"]] * len(batches)
            lsm = zarr.open_array(store / "lsm")[...]
            for b in batches:
                np.testing.assert_array_equal(b.arrays["x"][:, 1], np.broadcast_to(lsm, (4, Y, X)))


def test_cf_dtype_float16_refuses_a_packed_field_it_would_decode_to_inf(tmp_path: Path) -> None:
    """ERA5's mean sea-level pressure packed as int16 (about 1e5 Pa) decoded in float16 was inf
    at every point, without a word; a packed 2 m temperature decodes in float16 as xarray's
    values rounded to it."""
    rng = np.random.default_rng(3)
    msl = rng.normal(101000, 1500, (4, 3, 4))
    t2m = rng.normal(280, 10, (4, 3, 4))
    ds = xr.Dataset(
        {"msl": (("time", "lat", "lon"), msl), "t2m": (("time", "lat", "lon"), t2m)},
        coords={"time": pd.date_range("2020-01-01", periods=4, freq="6h"),
                "lat": [30.0, 20.0, 10.0], "lon": [0.0, 90.0, 180.0, 270.0]},
    )  # fmt: skip
    packed = {"dtype": "int16", "_FillValue": -32767, "chunks": (2, 3, 4)}
    enc = {"msl": {**packed, "scale_factor": 0.2, "add_offset": 100000.0},
           "t2m": {**packed, "scale_factor": 0.002, "add_offset": 270.0}}  # fmt: skip
    root = tmp_path / "era5.zarr"
    ds.to_zarr(root, encoding=enc, consolidated=False, zarr_format=3)
    with pytest.raises(ValueError, match=r"'msl'.*float16.*inf.*cf_dtype='float32'"):
        open_geometries(root, cf_dtype="float16")
    g = open_geometries(root, ["t2m"], cf_dtype="float16")
    manifest = split_by_chunk(g["t2m"], (1.0, 0.0, 0.0))
    want = xr.open_zarr(root, consolidated=False).t2m.values
    with insitu_pipeline(root, manifest, g, batch_size=4, coords=(), shuffle=False) as pipe:
        got = next(iter(pipe)).arrays["t2m"]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2**-10)


def test_a_stack_of_other_dtypes_points_at_what_works_not_at_a_refused_chunk_cast(
    store: Path,
) -> None:
    """``stack`` said "a chunk transform can cast one" (and, for ``normalize=`` on integers,
    "cast them with a chunk transform"), but a pipeline refuses a chunk transform that casts a
    stack member: the advice led to a second refusal."""
    from insitubatch_nodes.statistics import Statistics

    g = open_geometries(store)
    manifest = split_by_chunk(g["i16"], (1.0, 0.0, 0.0))
    stats = fit_statistics(store, manifest, {"i16": g["i16"]})
    for make in (
        lambda: stack({"i16": g["i16"], "f": g["f"]}),
        lambda: stack({"i16": g["i16"]}, normalize=stats),
    ):
        with pytest.raises(ValueError, match=r"int16") as info:
            make()
        said = str(info.value)
        assert "can cast one" not in said and "cast them with a chunk" not in said
        assert "labels of their own" in said
    # the advice's route is refused, as documented
    scaler = Statistics.scaler(stats)  # int16 chunks -> float32: a cast
    with pytest.raises(ValueError, match=r"chunk transforms change member 'i16'"):
        insitu_pipeline(store, manifest, {"x": stack({"i16": g["i16"]})},
                        chunk_transforms=[scaler])  # fmt: skip
