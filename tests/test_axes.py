"""One resolution of an axis named by index or by dimension name (``io/axes.axis_of``), used by
``open_geometries``' ``sample_axis``, product sample axes, patches and ``isel``/``sel``: each
keeps the exact words of its refusals."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import zarr

from insitubatch_nodes import open_geometries
from insitubatch_nodes.io.axes import AxisNames, axis_of
from insitubatch_nodes.io.product import product_view


@pytest.fixture
def img(tmp_path: Path) -> Path:
    root = tmp_path / "s.zarr"
    g = zarr.open_group(root, mode="w", zarr_format=3)
    a = g.create_array("img", shape=(2, 3, 8, 6), chunks=(1, 3, 4, 6), dtype="f4",
                       dimension_names=("t", "z", "y", "x"))  # fmt: skip
    a[...] = np.arange(2 * 3 * 8 * 6, dtype="f4").reshape(a.shape)
    return root


def _exactly(message: str) -> str:
    return "^" + re.escape(message) + "$"


def test_an_axis_is_an_index_from_either_end_or_a_dimension_name() -> None:
    arr = AxisNames("a", ("t", "z", "y"), 3)
    assert [axis_of(arr, k) for k in (0, 2, -1, -3, "t", "y", np.int64(1))] == [0, 2, 2, 0, 0, 2, 1]
    assert axis_of(arr, "z", allowed=(1, 2)) == 1
    with pytest.raises(KeyError, match=r"no dimension named 'w'"):
        axis_of(arr, "w")
    with pytest.raises(KeyError, match=r"dimension names: None"):
        axis_of(AxisNames("a", None, 3), "t")
    with pytest.raises(TypeError, match="an axis is an int or a dimension name, got True"):
        axis_of(arr, True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=_exactly("a: axis 3 is out of range for 3 axes")):
        axis_of(arr, 3)
    with pytest.raises(ValueError, match=_exactly("a: axis -4 is out of range for 3 axes")):
        axis_of(arr, -4)
    with pytest.raises(ValueError, match=_exactly("a: axis 't' is not one of (1, 2)")):
        axis_of(arr, "t", allowed=(1, 2))


def test_product_axes_keep_their_refusals(img: Path) -> None:
    g = open_geometries(img, ["img"])["img"]
    assert product_view(g, ("t", -3)).product.axes == (0, 1)
    with pytest.raises(KeyError) as e:
        product_view(g, ("t", "w"))
    assert e.value.args[0] == (
        "img: no dimension named 'w' (the array's dimension names: ('t', 'z', 'y', 'x')); "
        "name the product axes by index instead"
    )
    refused = "a product axis is an int or a dimension name, got 1.0"
    with pytest.raises(TypeError, match=_exactly(refused)):
        product_view(g, ("t", 1.0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=_exactly("img: axis 4 is out of range for 4 axes")):
        product_view(g, ("t", 4))


def test_patched_axes_keep_their_refusals(img: Path) -> None:
    g = open_geometries(img, ["img"])["img"]
    assert g.patches({"y": 4, -1: 3}) == g.patches({2: 4, 3: 3})
    with pytest.raises(KeyError) as e:
        g.patches({"w": 4})
    assert e.value.args[0] == (
        "img: no dimension named 'w' (the array's dimension names: ('t', 'z', 'y', 'x')); "
        "name axes by index instead"
    )
    refused = "a patched axis is an int or a dimension name, got 2.0"
    with pytest.raises(TypeError, match=_exactly(refused)):
        g.patches({2.0: 4})  # type: ignore[dict-item]
    not_field = "img: axis {!r} is not a field axis (the sample axis is 0; field axes (1, 2, 3))"
    for key in ("t", 0, 4, -5):
        with pytest.raises(ValueError, match=_exactly(not_field.format(key))):
            g.patches({key: 1})


def test_selected_dimensions_keep_their_refusals(img: Path) -> None:
    g = open_geometries(img, ["img"])["img"]
    assert g.isel(z=[0, 2]).inner_shape == (2, 8, 6)
    with pytest.raises(KeyError) as e:
        g.isel(w=1)
    assert e.value.args[0] == (
        "img: no dimension named 'w' (the array's dimension names: ('t', 'z', 'y', 'x'))"
    )
    # (and what to do to keep some t of every sample: make t a field axis)
    advice = r"keep some t in every sample, open it with another sample_axis and isel\(t=...\)"
    with pytest.raises(ValueError, match=r"'t' is the sample axis \(the split chooses .*" + advice):
        g.isel(t=0)


def test_a_sample_axis_keeps_its_refusals(img: Path) -> None:
    g = open_geometries(img, ["img"], sample_axis="z")["img"]
    assert g.sample_axis == 1
    assert open_geometries(img, ["img"], sample_axis=-4)["img"].sample_axis == 0
    with pytest.raises(ValueError) as e:
        open_geometries(img, ["img"], sample_axis=4)
    assert e.value.args[0] == (
        "sample_axis=4 is out of range for array 'img' of shape (2, 3, 8, 6) (4 axes); pick an "
        "axis in [0, 4)"
    )
