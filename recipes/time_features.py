"""Pick a training window by date and feed the model hour-of-day and day-of-year inputs.

1. **A window by date.** ``open_coordinates`` reads the store's CF-encoded ``time`` (int64 hours
   since 2000-01-01) and decodes it without xarray — to ``numpy.datetime64``, or with
   ``--calendar noleap`` / ``360_day`` / ``julian`` / ... (the store's ``calendar`` attribute,
   as a climate model writes it) to cftime dates, as xarray decodes them;
   ``split_by_chunk(..., sample_range=(START, STOP), coord=time)`` keeps the samples with
   ``START <= time < STOP`` (half-open, dates read in the calendar): it reads whole chunks
   and trains on the window's samples only.
2. **Times per row.** Every batch carries ``batch.coords[label]["time"]``: the time of each row
   of that label (the target ``y = t2m.shift(1)`` has its own, 6 h later).
3. **Time features.** A batch transform turns the input's times into
   ``sin/cos(2π·hour/24)`` and ``sin/cos(2π·day_of_year/year_length)`` (in the times' own
   calendar: 360 days in ``360_day``) — four float32 columns, a label of their own that
   ``to_torch`` converts like any other — and a tiny linear model trains on ``t2m`` plus those
   features.

    .venv/bin/python recipes/time_features.py
    .venv/bin/python recipes/time_features.py --start 2000-03-01 --stop 2000-09-01
    .venv/bin/python recipes/time_features.py --calendar 360_day --stop 2000-02-30
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import zarr

from insitubatch_nodes import Batch, insitu_pipeline, open_geometries, split_by_chunk, to_torch
from insitubatch_nodes.io.coords import open_coordinates, time_offsets
from insitubatch_nodes.synthetic import make_era5_like

YEAR_DAYS = {"360_day": 360.0, "noleap": 365.0, "all_leap": 366.0}  # others: 365.25 on average


def hour_and_day_of_year(t: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Hour of day (0.0 .. 23.x), day of year (1 ..) and the year's length in days, of each time
    in its own calendar: ``datetime64`` values or cftime dates (``object``)."""
    hour = (time_offsets(t, "1s") % 86_400) / 3600.0  # every calendar's day has 24 hours
    if t.dtype.kind == "M":
        day = t.astype("datetime64[D]")
        doy = (day - t.astype("datetime64[Y]")).astype(np.int64) + 1  # 1 .. 366
        return hour, doy, 365.25
    doy = np.array([d.dayofyr for d in t])  # cftime dates know their calendar's day of year
    return hour, doy, YEAR_DAYS.get(t[0].calendar, 365.25)


def time_features(batch: Batch) -> Batch:
    """Add ``batch["time_features"]``: (rows, 4) float32 from the times of ``batch["x"]``."""
    t = batch.coords["x"]["time"]  # datetime64[ns] or cftime dates, one per row
    hour, doy, year_days = hour_and_day_of_year(t)
    angles = np.stack([2 * np.pi * hour / 24, 2 * np.pi * (doy - 1) / year_days], axis=1)
    batch.arrays["time_features"] = np.concatenate([np.sin(angles), np.cos(angles)], 1).astype(
        np.float32
    )
    return batch


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", type=Path, default=None, help="store (default: a temp folder)")
    parser.add_argument("--n-time", type=int, default=1460, help="6-hourly steps (1460: a year)")
    parser.add_argument("--start", default="2000-02-01", help="first date of the window")
    parser.add_argument("--stop", default="2000-11-01", help="end of the window (excluded)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--calendar", default="standard", help="CF calendar of the new store's time (noleap, ...)"
    )
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        path = args.path or Path(tmp) / "era5.zarr"
        if not path.exists():
            make_era5_like(path, n_time=args.n_time, n_lat=8, n_lon=16, n_level=2,
                           samples_per_chunk=24, variables=("t2m",))  # fmt: skip
            # the same stored hours, read in another calendar (as a climate model writes them)
            zarr.open_array(path / "time", mode="r+").attrs["calendar"] = args.calendar
        t2m = open_geometries(path, ["t2m"])["t2m"]
        time = open_coordinates(path, t2m)["time"]
        manifest = split_by_chunk(
            t2m, (0.8, 0.2, 0.0), sample_range=(args.start, args.stop), coord=time
        )
        i0, i1 = manifest.sample_range or (0, t2m.n_samples)
        first, last = manifest.chunks("train")[0], manifest.chunks("val")[-1]
        lo, hi = t2m.chunk_range(first)[0], t2m.chunk_range(last)[1]
        kind = "cftime dates" if time.values.dtype == object else str(time.values.dtype)
        print(f"time: {kind} in the {time.attrs.get('calendar', 'standard')} calendar")
        print(
            f"[{args.start}, {args.stop}) is samples [{i0}, {i1}) ({time.values[i0]} .. "
            f"{time.values[i1 - 1]}); read in whole chunks {first}..{last} (samples [{lo}, "
            f"{hi}))"
        )

        n_in = 8 * 16
        torch.manual_seed(0)
        model = torch.nn.Linear(n_in + 4, n_in)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        views = {"x": t2m, "y": t2m.shift(1)}
        pipe = insitu_pipeline(
            path, manifest, views, batch_size=args.batch_size, batch_transforms=[time_features]
        )
        try:
            for epoch in range(args.epochs):
                losses = []
                for batch in pipe:
                    tx, ty = batch.coords["x"]["time"], batch.coords["y"]["time"]
                    step = time_offsets(ty, "1h") - time_offsets(tx, "1h")  # in any calendar
                    assert np.all(step == 6), "y is one step after x"
                    assert np.all(tx >= time.values[i0]) and np.all(ty <= time.values[i1 - 1])
                    t = to_torch(batch)  # coords stay numpy; time_features is a tensor now
                    x = (t["x"].reshape(len(batch), -1) - 280.0) / 15.0
                    y = (t["y"].reshape(len(batch), -1) - 280.0) / 15.0
                    pred = model(torch.cat([x, t["time_features"]], dim=1))
                    loss = torch.nn.functional.mse_loss(pred, y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    losses.append(loss.item())
                pipe.reset()  # the next epoch
                print(f"epoch {epoch}: {len(losses)} batches, mean loss {np.mean(losses):.4f}")
        finally:
            pipe.close()
        print(
            f"last batch: x times {tx[0]} .., y times {ty[0]} ..; time_features[0] = "
            f"{[round(float(v), 3) for v in batch['time_features'][0]]}"
        )
        print("every row carried its own time (y 6 h after x), inside the window's chunks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
