"""An HCS plate as one stream (``open_plate``) against today's route, and the plate scale.

Two plates, written once per run:

* a plate of ``--rows x --columns`` wells x ``--fields`` fields (default 8 x 12 x 4 = 384
  fields) written with ome-zarr-py (``make_hcs_plate``: NGFF 0.5, zarr v3, zstd), each field
  ``(--t, 2, --z, --yx, --yx)`` uint16 (default ``(3, 2, 8, 256, 256)``, the issue's field)
  with one Z plane per chunk;
* a metadata-only plate of 1,536 wells x 9 fields = 13,824 fields (``make_plate_metadata_only``:
  no chunk at all, every pixel the fill value).

Engines, each in a fresh process (its peak RSS and first epoch its own), two epochs each:

* ``collection``: ``open_plate(plate, sample_axis="z")``, every well in training
  (``split_by_member(..., {"train": 1.0}, by="well")``), one ``insitu_pipeline`` over
  ``coll["image"]``: the issue's route;
* ``collection_mixed``: the same collection, trained on the ``per_field`` route's fields only
  (``split_by_member`` by name): the same data as that route;
* ``collection_mixed_direct``: the same, keeping nothing (``FetchOptions(direct=True)``: every
  plane decoded straight into its batch row every epoch): its memory without the 96 fields'
  planes, which ``collection_mixed``'s pool keeps for the next epoch because they fit;
* ``per_field``: today's route: one pipeline per field (``open_geometries`` of its level-0
  array, ``split_by_chunk``), the first ``--mix-fields`` fields (default 96, the issue's
  comparison point; all 384 would need ~12 MB each) mixed by torchdata's
  ``MultiNodeWeightedSampler`` (equal weights, until all are exhausted);
* ``bare``: two threads reading every stored object of the plate's level-0 images once per
  epoch and zstd-decoding it into a buffer each reuses, nothing else (samples/s counts the Z
  planes those objects hold);
* ``metadata``: the 13,824-field metadata-only plate: ``read_plate`` and ``open_plate`` time,
  the build of one pipeline, the first batch, RSS once built and at peak (no epochs: it has no
  chunks; its fields are ``(1, 2, 16, 2048, 2048)``, so a batch buffer alone is 16 MB a row).

Reported: open, build and first-batch seconds, samples/s per epoch (best of ``--rounds``),
peak RSS; ratios ``collection/bare`` (target >= 0.85) and ``collection_mixed/per_field`` RSS
(target <= 1/10 at 96 fields); the scale targets (open <= 10 s, build <= 2 s, first batch
<= 1 s, RSS <= 1 GB at 13,824 fields). ``python -m benchmarks.plates [--smoke] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._childutil import proc_status_bytes

ROOT = Path(__file__).resolve().parent.parent


def _rss_peak_bytes() -> int:
    return proc_status_bytes("VmHWM") or 0


def _rss_bytes() -> int:
    return proc_status_bytes("VmRSS") or 0


def _epochs(run_epoch: Any, n: int) -> list[dict[str, Any]]:
    """``n`` calls of ``run_epoch()`` (one epoch each, returning its sample count), timed."""
    out = []
    for e in range(n):
        t0 = time.perf_counter()
        samples = run_epoch()
        out.append({"epoch": e, "samples": samples, "seconds": time.perf_counter() - t0})
    return out


def run_collection(cfg: dict[str, Any]) -> dict[str, Any]:
    from insitubatch_nodes import Loader, insitu_pipeline, open_plate, split_by_member

    t0 = time.perf_counter()
    coll = open_plate(cfg["plate"], sample_axis="z")
    t1 = time.perf_counter()
    if cfg.get("only_mixed"):  # the per_field route's fields alone: the same data
        split = split_by_member(coll, {"train": list(coll.members[: cfg["mix_fields"]])})
    else:
        split = split_by_member(coll, {"train": 1.0}, by="well")
    fetch = None
    if cfg.get("direct"):  # every plane decoded straight into its batch row: nothing kept
        from insitubatch_nodes import FetchOptions

        fetch = FetchOptions(direct=True)
    pipe = insitu_pipeline(
        coll, split, {"image": coll["image"]}, batch_size=cfg["batch_size"], fetch=fetch
    )
    loader = Loader(pipe)
    t2 = time.perf_counter()
    next(iter(loader))
    t3 = time.perf_counter()
    epochs = _epochs(lambda: sum(len(batch) for batch in loader), cfg["epochs"])
    pipe.close()
    return {
        "members": len(coll), "open_s": t1 - t0, "build_s": t2 - t1, "first_batch_s": t3 - t2,
        "epochs": epochs, "rss_peak_bytes": _rss_peak_bytes(),
    }  # fmt: skip


def run_per_field(cfg: dict[str, Any]) -> dict[str, Any]:
    from torchdata.nodes import MultiNodeWeightedSampler

    from insitubatch_nodes import Loader, insitu_pipeline, open_geometries, split_by_chunk
    from insitubatch_nodes.io.ngff import read_plate

    t0 = time.perf_counter()
    plate = read_plate(cfg["plate"])
    fields = plate.fields[: cfg["mix_fields"]]
    z = plate.axes.index("z")
    pipes = {}
    for f in fields:
        geom = open_geometries(cfg["plate"], [f.image], sample_axis=z)[f.image]
        manifest = split_by_chunk(geom, (1.0, 0.0, 0.0))
        pipes[f.path] = insitu_pipeline(
            cfg["plate"], manifest, {"image": geom}, batch_size=cfg["batch_size"]
        )
    t1 = time.perf_counter()
    mixed = MultiNodeWeightedSampler(
        pipes, {k: 1.0 for k in pipes}, stop_criteria="ALL_DATASETS_EXHAUSTED"
    )
    loader = Loader(mixed)
    t2 = time.perf_counter()
    next(iter(loader))
    t3 = time.perf_counter()
    epochs = _epochs(lambda: sum(len(batch) for batch in loader), cfg["epochs"])
    for pipe in pipes.values():
        pipe.close()
    return {
        "members": len(fields), "open_s": t1 - t0, "build_s": t2 - t1, "first_batch_s": t3 - t2,
        "epochs": epochs, "rss_peak_bytes": _rss_peak_bytes(),
    }  # fmt: skip


def run_bare(cfg: dict[str, Any]) -> dict[str, Any]:
    """Two threads, each reading every other stored object of the level-0 images and
    zstd-decoding it into a buffer it reuses; the samples are the Z planes those objects make
    up (a plane of a ``(T, C, Z, Y, X)`` field chunked ``(1, C, 1, Y, X)`` is T objects)."""
    from concurrent.futures import ThreadPoolExecutor

    import numcodecs
    import zarr

    from insitubatch_nodes.io.ngff import read_plate

    t0 = time.perf_counter()
    plate = read_plate(cfg["plate"])
    first = zarr.open_array(cfg["plate"], path=plate.fields[0].image, mode="r")
    codecs = [type(c).__name__ for c in first.metadata.codecs]
    if codecs != ["BytesCodec", "ZstdCodec"]:
        raise ValueError(f"the bare loop decodes plain zstd chunks, not {codecs}")
    jobs = [p for f in plate.fields for p in sorted((Path(cfg["plate"]) / f.image / "c").rglob("*"))
            if p.is_file()]  # fmt: skip
    planes = len(plate.fields) * int(first.shape[2])  # a plane spans T (and C) chunks
    threads = 2
    shares = [jobs[i::threads] for i in range(threads)]
    codec = numcodecs.Zstd()
    buffers = [np.ones(first.chunks, first.dtype) for _ in range(threads)]
    pool = ThreadPoolExecutor(threads)
    list(pool.map(lambda _: None, range(threads)))
    setup_s = time.perf_counter() - t0

    def work(i: int) -> int:
        for path in shares[i]:
            with open(path, "rb", buffering=0) as fh:
                codec.decode(fh.read(), out=buffers[i])
        return len(shares[i])

    def epoch() -> int:
        done = sum(pool.map(work, range(threads)))
        assert done == len(jobs)
        return planes

    epochs = _epochs(epoch, cfg["epochs"])
    pool.shutdown()
    return {"setup_s": setup_s, "epochs": epochs, "rss_peak_bytes": _rss_peak_bytes()}


def run_metadata(cfg: dict[str, Any]) -> dict[str, Any]:
    from insitubatch_nodes import Loader, insitu_pipeline, open_plate, split_by_member
    from insitubatch_nodes.io.ngff import read_plate

    t0 = time.perf_counter()
    plate = read_plate(cfg["metadata_plate"])
    t1 = time.perf_counter()
    coll = open_plate(cfg["metadata_plate"], sample_axis="z")
    t2 = time.perf_counter()
    split = split_by_member(coll, {"train": 0.8, "val": 0.2}, by="well")
    pipe = insitu_pipeline(coll, split, {"image": coll["image"]}, batch_size=cfg["batch_size"])
    loader = Loader(pipe)
    t3 = time.perf_counter()
    rss_built = _rss_bytes()
    # the batch buffers made ahead of need (a thread started at build): the batch size's
    # memory, not the collection's (here 16 rows of 16 MiB each)
    buffers_built = pipe.context.buffers.held_bytes
    next(iter(loader))
    t4 = time.perf_counter()
    pipe.close()
    return {
        "members": len(coll), "fields_read": len(plate.fields), "read_plate_s": t1 - t0,
        "open_s": t2 - t1, "build_s": t3 - t2, "first_batch_s": t4 - t3,
        "rss_built_bytes": rss_built, "buffers_built_bytes": buffers_built,
        "rss_peak_bytes": _rss_peak_bytes(),
    }  # fmt: skip


def run_collection_mixed(cfg: dict[str, Any]) -> dict[str, Any]:
    return run_collection({**cfg, "only_mixed": True})


def run_collection_mixed_direct(cfg: dict[str, Any]) -> dict[str, Any]:
    """``collection_mixed`` asked to keep nothing (``FetchOptions(direct=True)``): every plane
    decoded straight into its batch row in every epoch, as a split too large for the budget is
    served; the memory of one stream over the 96 fields without their planes kept."""
    return run_collection({**cfg, "only_mixed": True, "direct": True})


ENGINES = {
    "collection": run_collection,
    "collection_mixed": run_collection_mixed,
    "collection_mixed_direct": run_collection_mixed_direct,
    "per_field": run_per_field,
    "bare": run_bare,
    "metadata": run_metadata,
}


def _child(argv: list[str]) -> None:
    cfg = json.loads(argv[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        result = ENGINES[cfg["engine"]](cfg)
    Path(argv[1]).write_text(json.dumps(result))


def run_engine(engine: str, cfg: dict[str, Any], tmp: Path) -> dict[str, Any]:
    out = tmp / f"{engine}.json"
    child = {**cfg, "engine": engine}
    cmd = [sys.executable, "-m", "benchmarks.plates", "--child", json.dumps(child), str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return json.loads(out.read_text())


def summarise(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Best-of-rounds samples/s per engine and epoch, the ratios and the scale figures."""

    def rate(engine: str, epoch: int) -> float:
        runs = [r for r in results.get(engine, []) if "epochs" in r]
        return max((r["epochs"][epoch]["samples"] / r["epochs"][epoch]["seconds"] for r in runs),
                   default=float("nan"))  # fmt: skip

    def best(engine: str, key: str) -> float:
        return min((r[key] for r in results.get(engine, []) if key in r), default=float("nan"))

    out: dict[str, Any] = {"samples_per_s": {}, "ratios": {}, "seconds": {}}
    for engine in results:
        if engine != "metadata":
            out["samples_per_s"][engine] = [rate(engine, 0), rate(engine, 1)]
        out["seconds"][engine] = {
            k: best(engine, k)
            for k in ("read_plate_s", "open_s", "build_s", "first_batch_s", "setup_s")
            if any(k in r for r in results[engine])
        }
    for e in (0, 1):
        if "collection" in results and "bare" in results:
            out["ratios"][f"collection/bare epoch {e}"] = rate("collection", e) / rate("bare", e)
        for mixed in ("collection_mixed", "collection_mixed_direct"):
            if mixed in results and "per_field" in results:
                out["ratios"][f"{mixed}/per_field epoch {e}"] = rate(mixed, e) / rate(
                    "per_field", e
                )
    out["rss_peak_mib"] = {
        engine: max(r["rss_peak_bytes"] for r in runs) / 2**20 for engine, runs in results.items()
    }
    if "metadata" in results:  # the collection's own memory, before any batch buffer is filled
        out["metadata_rss_built_mib"] = (
            max(r["rss_built_bytes"] for r in results["metadata"]) / 2**20
        )
        out["metadata_rss_built_without_buffers_mib"] = (
            max(r["rss_built_bytes"] - r.get("buffers_built_bytes", 0) for r in results["metadata"])
            / 2**20
        )
    for engine in ("collection", "collection_mixed", "collection_mixed_direct"):
        if engine in results and "per_field" in results:
            out["ratios"][f"rss {engine}/per_field"] = (
                out["rss_peak_mib"][engine] / out["rss_peak_mib"]["per_field"]
            )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--columns", type=int, default=12)
    p.add_argument("--fields", type=int, default=4)
    p.add_argument("--t", type=int, default=3)
    p.add_argument("--z", type=int, default=8)
    p.add_argument("--yx", type=int, default=256)
    p.add_argument("--mix-fields", type=int, default=96, help="pipelines the per_field route mixes")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    p.add_argument("--smoke", action="store_true", help="tiny plates, one round")
    p.add_argument("--out", type=Path, default=None, help="write collections-*.jsonl here")
    args = p.parse_args(argv)
    from insitubatch_nodes.synthetic import make_hcs_plate, make_plate_metadata_only

    meta_shape: dict[str, Any] = {}
    if args.smoke:
        args.rows, args.columns, args.fields, args.t, args.z, args.yx = 2, 3, 2, 1, 4, 32
        args.mix_fields, args.rounds, args.batch_size = 12, 1, 4
        meta_shape = {"rows": 4, "columns": 6, "fields": 3}
    with tempfile.TemporaryDirectory(prefix="collections-") as d:
        tmp = Path(d)
        t0 = time.perf_counter()
        plate = make_hcs_plate(
            tmp / "plate.zarr", rows=args.rows, columns=args.columns, fields=args.fields,
            shape=(args.t, 2, args.z, args.yx, args.yx), levels=1, labels=(), ngff_version="0.5",
        )  # fmt: skip
        meta = make_plate_metadata_only(tmp / "metadata.zarr", **meta_shape)
        print(f"wrote the plates in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        cfg = {
            "plate": plate, "metadata_plate": meta, "batch_size": args.batch_size,
            "mix_fields": args.mix_fields, "epochs": 2,
        }  # fmt: skip
        results: dict[str, list[dict[str, Any]]] = {e: [] for e in args.engines}
        for r in range(args.rounds):
            order = args.engines[r % len(args.engines) :] + args.engines[: r % len(args.engines)]
            for engine in order:
                results[engine].append(run_engine(engine, cfg, tmp))
        summary = summarise(results)
    row = {
        "type": "collections",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": results,
        "summary": summary,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print(json.dumps(summary, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"collections-{'smoke' if args.smoke else 'full'}-{time.strftime('%Y%m%dT%H%M%S')}"
        (args.out / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
    return row


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
    else:
        main()
