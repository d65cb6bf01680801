"""What CF decoding (mask and scale) costs, and where (a measurement, not a test).

Writes, with xarray, one chunk of 256 x 8192 values twice (zarr v3, zstd): ``p`` packed as
``int16`` with ``scale_factor`` / ``add_offset`` / ``_FillValue`` (as netCDF-converted ERA5
arrives) and ``f`` a ``float32`` field with ``_FillValue = -9999``. Then, side by side in one run:

* decodes each with ``ChunkDecoder.decode_trusted`` into a slot, raw
  (``open_geometries(..., mask_and_scale=False)``) and decoded (the default: what the pipeline
  does, the rule applied as the object is written);
* gathers the 256 rows into a ``float64`` batch from a decoded slot (a plain copy: the route
  taken) and from a raw ``int16`` slot unpacking as it copies (the route not taken, which would
  keep the pool at the stored size but pay the unpacking on every gather of every epoch).

Prints the best time of each and the slot sizes. Run:
``.venv/bin/python benchmarks/cf_decode.py``.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import numpy as np
import xarray as xr

from benchmarks.byte_order import _best
from insitubatch_nodes import open_geometries
from insitubatch_nodes.io.decode import ChunkDecoder

SHAPE = (256, 8192)
REPEATS = 30


def main() -> None:
    root = Path(tempfile.mkdtemp()) / "cf.zarr"
    rng = np.random.default_rng(0)
    a = (273 + 10 * rng.standard_normal(SHAPE)).astype("f4")
    a[:, :64] = np.nan
    f = np.where(np.isnan(a), np.float32(-9999), a).astype("f4")
    ds = xr.Dataset({"p": (("time", "x"), a), "f": (("time", "x"), f)})
    packed = {"dtype": "int16", "scale_factor": 0.01, "add_offset": 273.0, "_FillValue": -32767}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds.to_zarr(root, zarr_format=3, consolidated=False, encoding={
            "p": {**packed, "chunks": SHAPE}, "f": {"_FillValue": -9999.0, "chunks": SHAPE},
        })  # fmt: skip
    for v in ("p", "f"):
        stored = (root / v / "c" / "0" / "0").read_bytes()
        for mask_and_scale in (False, True):
            g = open_geometries(root, [v], mask_and_scale=mask_and_scale)[v]
            decoder = ChunkDecoder(g)
            slot = np.empty(SHAPE, g.dtype)
            t = _best(lambda d=decoder, s=slot, b=stored: d.decode_trusted(b, s, 0, (0,)), REPEATS)
            print(
                f"decode {v} mask_and_scale={mask_and_scale!s:5} -> {g.dtype!s:8} slot "
                f"{slot.nbytes / 2**20:5.1f} MiB: {t * 1e3:6.2f} ms"
            )
    g = open_geometries(root, ["p"])["p"]
    raw = open_geometries(root, ["p"], mask_and_scale=False)["p"]
    decoded_slot, raw_slot = np.empty(SHAPE, g.dtype), np.empty(SHAPE, raw.dtype)
    ChunkDecoder(g).decode_trusted((root / "p/c/0/0").read_bytes(), decoded_slot, 0, (0,))
    ChunkDecoder(raw).decode_trusted((root / "p/c/0/0").read_bytes(), raw_slot, 0, (0,))
    batch = np.empty(SHAPE, g.dtype)
    rows = np.arange(SHAPE[0])
    cf = g.cf
    assert cf is not None

    def unpack() -> None:
        cf.decode_into(raw_slot[rows], batch)

    copy = _best(lambda: np.take(decoded_slot, rows, axis=0, out=batch, mode="clip"), REPEATS)
    print(f"gather 256 rows from the decoded slot (taken):        {copy * 1e3:6.2f} ms")
    unpacking = _best(unpack, REPEATS)
    print(f"gather 256 rows from an int16 slot, unpacking (not):  {unpacking * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
