"""Helpers for the checkpoint/resume tests (plain loaders, StatefulDataLoader, Lightning, DDP).

Two halves:

* in-process helpers: write a small ERA5-like store, build a pipeline from a JSON-able config,
  turn batches into comparable records (epoch, index, sample indices, a hash of every array's
  bytes), run a reference, take a state after ``k`` delivered batches;
* a command line (``python tests/resume_helpers.py MODE REQUEST.json RESPONSE.json``) that
  builds a pipeline *afresh in a new process*, restores a state read from JSON and records what
  follows, or trains a tiny Lightning model (also under ``strategy="ddp"``, whose launcher
  re-runs this same command line for rank 1).

Nothing here decides what the right answer is from the package's plan: expected batches come
from an uninterrupted run, and the reference's arrays are checked against zarr's own read.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import forkserver
import numpy as np
import zarr
from torchdata.nodes import Loader

from insitubatch_nodes import (
    ArrayGeometry,
    Batch,
    InSituPipeline,
    insitu_pipeline,
    open_geometries,
    split_by_chunk,
)
from insitubatch_nodes.io.stores import as_store
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.synthetic import make_era5_like

HERE = Path(__file__).resolve()
SUBPROCESS_TIMEOUT_S = 180

STORE_DEFAULTS: dict[str, Any] = {
    "n_time": 128,
    "n_lat": 8,
    "n_lon": 16,
    "n_level": 2,
    "samples_per_chunk": 8,
    "variables": ("t2m", "z"),
}

# 128 time steps in chunks of 8: 16 chunks, (0.75, 0.125, 0.125) -> 12 train chunks = 96
# samples; batch_size 10 -> 10 batches per epoch (the last one holds 6); block_chunks 3 -> 24
# samples per block, which 10 does not divide, so batches straddle blocks and chunks first read
# by one batch are read again by later ones.
PIPE_DEFAULTS: dict[str, Any] = {
    "array": "t2m",
    "windowed": True,
    "fractions": [0.75, 0.125, 0.125],
    "split": "train",
    "batch_size": 10,
    "block_chunks": 3,
    "shuffle": True,
    "seed": 0,
    "rank": None,
    "world_size": None,
    "prefetch_depth": 2,
    "max_inflight": 32,
    "decode_threads": None,
    "cache_budget_bytes": None,
    "store_options": None,  # open_store options when "store" is a URL (e.g. s3://...)
    # patched views: {"extent": [lat, lon], "origins": "grid" | "random", "order": ...} or None
    "patches": None,
    "stride": 1,  # the anchor stride: an int or a time step such as "6h"
}


def write_store(root: Path, **overrides: Any) -> Path:
    """A small ERA5-like store (``t2m`` and ``z``) at ``root``."""
    make_era5_like(root, **{**STORE_DEFAULTS, **overrides})
    return root


def pipe_config(store: Path | str, **overrides: Any) -> dict[str, Any]:
    """A JSON-able pipeline description (see :data:`PIPE_DEFAULTS`)."""
    unknown = set(overrides) - set(PIPE_DEFAULTS)
    if unknown:
        raise KeyError(f"unknown pipeline options {sorted(unknown)}")
    return {"store": str(store), **PIPE_DEFAULTS, **overrides}


def labels_of(
    store: Any, array: str, windowed: bool, patches: Mapping[str, Any] | None = None
) -> dict[str, ArrayGeometry]:
    g = open_geometries(store, [array])[array]
    views = {"x": g, "y": g.shift(1)} if windowed else {"x": g}
    if patches is not None:
        extent = dict(zip(g.field_axes[-2:], patches["extent"], strict=True))
        options = {k: v for k, v in patches.items() if k != "extent"}
        views = {label: v.patches(extent, **options) for label, v in views.items()}
    return views


def build_pipeline(cfg: Mapping[str, Any]) -> InSituPipeline:
    """Build the pipeline ``cfg`` (from :func:`pipe_config`) describes, from scratch."""
    store = as_store(cfg["store"], **(cfg["store_options"] or {}))
    labels = labels_of(store, cfg["array"], cfg["windowed"], cfg.get("patches"))
    manifest = split_by_chunk(labels["x"].base, tuple(cfg["fractions"]))
    return insitu_pipeline(
        store,
        manifest,
        labels,
        split=cfg["split"],
        batch_size=cfg["batch_size"],
        block_chunks=cfg["block_chunks"],
        shuffle=cfg["shuffle"],
        seed=cfg["seed"],
        rank=cfg["rank"],
        world_size=cfg["world_size"],
        prefetch_depth=cfg["prefetch_depth"],
        max_inflight=cfg["max_inflight"],
        decode_threads=cfg["decode_threads"],
        cache_budget_bytes=cfg["cache_budget_bytes"],
        stride=cfg.get("stride", 1),
    )


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------


def digest(arr: Any) -> str:
    """A hash of an array's dtype, shape and bytes (numpy arrays or CPU tensors)."""
    a = np.ascontiguousarray(arr.numpy() if hasattr(arr, "numpy") else arr)
    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.tobytes())
    return h.hexdigest()[:24]


def record(batch: Batch) -> dict[str, Any]:
    """What identifies a delivered batch: position, sample indices, hash of every array."""
    return {
        "epoch": int(batch.epoch),
        "index": int(batch.index),
        "idx": {k: [int(i) for i in v] for k, v in sorted(batch.sample_indices.items())},
        "hash": {k: digest(v) for k, v in sorted(batch.arrays.items())},
        **(
            {"origins": {k: v.tolist() for k, v in sorted(batch.patch_origins.items())}}
            if batch.patch_origins
            else {}
        ),
    }


def record_item(item: Mapping[str, Any]) -> dict[str, Any]:
    """A record of an item made by :func:`indexed_transform` (tensors + positions)."""
    return {
        "epoch": int(item["epoch"]),
        "index": int(item["index"]),
        "idx": {"x": [int(i) for i in item["idx"].tolist()]},
        "hash": {k: digest(item[k]) for k in ("x", "y") if k in item},
    }


def indexed_transform(batch: Batch) -> dict[str, Any]:
    """``to_torch`` plus the sample indices of ``x`` and the batch position (for recording)."""
    import torch

    from insitubatch_nodes import to_torch

    return {
        **to_torch(batch),
        "idx": torch.from_numpy(np.array(batch.sample_indices["x"], dtype=np.int64)),
        "epoch": int(batch.epoch),
        "index": int(batch.index),
        **(
            {"origins": torch.from_numpy(np.asarray(batch.patch_origins["x"], dtype=np.int64))}
            if batch.patch_origins
            else {}
        ),
    }


def epochs_of(loader: Any) -> Iterator[Any]:
    """Items of ``loader`` epoch after epoch (each pass is one ``iter()``)."""
    while True:
        yield from loader


def assert_resumes_exactly(
    build: Callable[[], InSituPipeline],
    records: Callable[[list[Any]], list[Any]],
    ref: Sequence[Any],
    ks: Iterable[int],
    *,
    epochs: int = 2,
) -> None:
    """The mid-epoch resume claim, for each ``k`` in ``ks``: a fresh ``build()`` delivers ``k``
    batches through ``Loader`` (across epochs, as :func:`epochs_of`), and its
    ``loader.state_dict()`` — plain Python — is saved; another fresh ``build()``, restored from
    it, delivers the rest of the ``epochs`` epochs. The first ``k`` records equal ``ref[:k]``, and
    with the rest exactly ``ref``: the records (``records(batches)``, taken while their pipeline is
    open) of an uninterrupted run of ``epochs`` whole epochs."""
    per_epoch, extra = divmod(len(ref), epochs)
    assert per_epoch and not extra, f"{len(ref)} reference records are not {epochs} epochs"
    for k in ks:
        pipe = build()
        try:
            loader = Loader(pipe)
            it = epochs_of(loader)
            head = records([next(it) for _ in range(k)])
            state = loader.state_dict()
        finally:
            pipe.close()
        assert is_plain(state), f"the state after {k} batches is not plain Python"
        assert head == list(ref[:k]), f"the first {k} batches are not the reference's"
        pipe = build()
        try:
            loader = Loader(pipe)
            loader.load_state_dict(state)
            rest = records([b for _ in range(epochs - k // per_epoch) for b in loader])
        finally:
            pipe.close()
        assert head + rest == list(ref), f"resumed after {k} batches"


def reference_run(cfg: Mapping[str, Any], epochs: int, check_zarr: bool = True) -> list[dict]:
    """``epochs`` uninterrupted epochs through ``Loader(pipe)``, each batch checked against
    zarr's own read of its sample indices (when ``check_zarr``). Each record also holds
    ``"state"``: the pipeline's (root) state right after that batch was delivered."""
    pipe = build_pipeline(cfg)
    views = {"x": 0, "y": 1} if cfg["windowed"] else {"x": 0}
    full = np.asarray(zarr.open_group(cfg["store"], mode="r")[cfg["array"]][...])
    out: list[dict] = []
    try:
        loader = Loader(pipe)
        for _ in range(epochs):
            for batch in loader:
                if check_zarr:
                    for label, offset in views.items():
                        idx = np.asarray(batch.sample_indices[label])
                        np.testing.assert_array_equal(idx - offset, batch.sample_indices["x"])
                        if batch.patch_origins:  # each row: its window of the field
                            h, w = batch.arrays[label].shape[-2:]
                            for i, (y0, x0) in enumerate(batch.patch_origins[label].tolist()):
                                want = full[idx[i], ..., y0 : y0 + h, x0 : x0 + w]
                                np.testing.assert_array_equal(batch.arrays[label][i], want)
                        else:
                            np.testing.assert_array_equal(batch.arrays[label], full[idx])
                out.append({**record(batch), "state": loader.state_dict()["root"]})
    finally:
        pipe.close()
    return out


def carried_chunks(records: Sequence[dict], k: int, spc: int) -> set[int]:
    """Chunks of the epoch of ``records[k]`` read both before and at/after batch ``k``
    (from the sample indices alone)."""
    epoch = records[k]["epoch"]
    same = [r for r in records if r["epoch"] == epoch]
    pos = records[k]["index"]

    def chunks(rs: Sequence[dict]) -> set[int]:
        return {i // spc for r in rs for idx in r["idx"].values() for i in idx}

    return chunks(same[:pos]) & chunks(same[pos:])


def is_plain(obj: Any) -> bool:
    """Only dict (str keys), list, str, int, float, bool and None, all the way down."""
    if obj is None or type(obj) in (str, int, float, bool):
        return True
    if type(obj) is dict:
        return all(type(k) is str and is_plain(v) for k, v in obj.items())
    if type(obj) is list:
        return all(is_plain(v) for v in obj)
    return False


def take_state(
    cfg: Mapping[str, Any],
    k: int,
    *,
    sleep_s: float = 0.0,
    exhaust_epoch: bool = False,
    probe: Callable[[InSituPipeline], None] | None = None,
) -> tuple[list[dict], dict[str, Any]]:
    """Deliver ``k`` batches through ``Loader(pipe)`` (across epochs), optionally wait
    ``sleep_s`` so the look-ahead fills (then call ``probe(pipe)``), and return the delivered
    records and ``loader.state_dict()``. With ``exhaust_epoch`` the state is taken after the
    ``for`` loop over the epoch that batch ``k`` ends has finished (StopIteration seen)."""
    pipe = build_pipeline(cfg)
    try:
        loader = Loader(pipe)
        got: list[dict] = []
        if exhaust_epoch:
            while len(got) < k:
                got.extend(record(b) for b in loader)
            assert len(got) == k, f"k={k} is not at an epoch boundary ({len(got)} batches)"
        else:
            it = epochs_of(loader)
            got = [record(next(it)) for _ in range(k)]
        if sleep_s:
            time.sleep(sleep_s)
        if probe is not None:
            probe(pipe)
        state = loader.state_dict()
    finally:
        pipe.close()
    return got, state


# ---------------------------------------------------------------------------------------------
# Running this file in a fresh process
# ---------------------------------------------------------------------------------------------


def run_fresh(
    mode: str, request: Mapping[str, Any], workdir: Path, timeout: float = SUBPROCESS_TIMEOUT_S
) -> dict[str, Any]:
    """Run ``python resume_helpers.py MODE`` in a new process; the request and the response
    travel as JSON files (so everything exchanged is plain Python). The process is forked from
    the tests' fork server (``tests/forkserver.py``: new, with nothing of this one's state),
    except for ``timing``, whose claim counts an interpreter's start: a fresh interpreter."""
    workdir.mkdir(parents=True, exist_ok=True)
    n = len(list(workdir.glob(f"{mode}-*.request.json")))
    req = workdir / f"{mode}-{n}.request.json"
    resp = workdir / f"{mode}-{n}.response.json"
    req.write_text(json.dumps(request))
    runner = subprocess.run if mode == "timing" else forkserver.run
    proc = runner(
        [sys.executable, str(HERE), mode, str(req), str(resp)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0 or not resp.exists():
        raise AssertionError(
            f"{mode} subprocess failed with exit code {proc.returncode}\n--- stdout\n"
            f"{proc.stdout}\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return json.loads(resp.read_text())


def _restore_loader(req: Mapping[str, Any]) -> dict[str, Any]:
    pipe = build_pipeline(req["config"])
    try:
        loader = Loader(pipe)
        loader.load_state_dict(req["state"])
        records: list[dict] = []
        for _ in range(req["passes"]):
            records.extend({**record(b), "state": loader.state_dict()["root"]} for b in loader)
    finally:
        pipe.close()
    return {"records": records}


def _restore_sdl(req: Mapping[str, Any]) -> dict[str, Any]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    from insitubatch_nodes.torch_data import as_dataset

    pipe = build_pipeline(req["config"])
    try:
        dl = StatefulDataLoader(
            as_dataset(pipe, transform=indexed_transform), batch_size=None, num_workers=0
        )
        dl.load_state_dict(req["state"])
        records: list[dict] = []
        len_restored = None  # len(dl) once the state is applied (the first item is out)
        for _ in range(req["passes"]):
            for item in dl:
                records.append(record_item(item))
                len_restored = len(dl) if len_restored is None else len_restored
    finally:
        pipe.close()
    return {"records": records, "len": len(dl), "len_restored": len_restored}


def _timing(req: Mapping[str, Any]) -> dict[str, Any]:
    """Seconds from process start (``req['t0']``, wall clock) to imports done, pipeline built
    and first batch delivered, cold or restored from ``req['state']``."""
    t_imported = time.time()
    pipe = build_pipeline(req["config"])
    t_built = time.time()
    try:
        loader = Loader(pipe)
        if req.get("state") is not None:
            loader.load_state_dict(req["state"])
        batch = next(iter(loader))
        t_first = time.time()
        gets = pipe.stats()["gets"]
        rec = record(batch)
    finally:
        pipe.close()
    t0 = req["t0"]
    return {
        "imports_s": t_imported - t0,
        "built_s": t_built - t0,
        "first_batch_s": t_first - t0,
        "first": [rec["epoch"], rec["index"]],
        "gets": gets,
    }


# ---------------------------------------------------------------------------------------------
# Lightning (single device and DDP)
# ---------------------------------------------------------------------------------------------

LIGHTNING_DEFAULTS: dict[str, Any] = {
    "max_epochs": 2,
    "devices": 1,
    "strategy": "auto",
    "batch_size": 10,
    "eval_batch_size": 10,
    "block_chunks": 3,
    "seed": 0,
    "every_n_train_steps": None,
    "kill_at_step": None,
    "ckpt_path": None,
    "estimated_stepping_batches": False,
    "limit_val_batches": 0,
    "val_check_interval": None,
    "num_sanity_val_steps": 0,
    "patches": None,  # as PIPE_DEFAULTS["patches"]: both views patched alike
}


def lightning_request(store: Path, out: Path, ckpt_dir: Path, **overrides: Any) -> dict:
    unknown = set(overrides) - set(LIGHTNING_DEFAULTS)
    if unknown:
        raise KeyError(f"unknown Lightning options {sorted(unknown)}")
    return {
        "store": str(store),
        "out": str(out),
        "ckpt_dir": str(ckpt_dir),
        **LIGHTNING_DEFAULTS,
        **overrides,
    }


def read_records(out: Path | str, rank: int = 0, kind: str = "train") -> list[dict]:
    """The records a Lightning run wrote for ``rank`` (``kind`` train or val)."""
    path = Path(f"{out}.rank{rank}.jsonl")
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["kind"] == kind]


def comparable(rows: Sequence[dict]) -> list[tuple]:
    """(trainer epoch, batch_idx, batch epoch, batch index, hash, sample indices) per row."""
    return [
        (r["epoch"], r["batch_idx"], r["b_epoch"], r["b_index"], r["hash"], tuple(r["idx"]))
        for r in rows
    ]


def run_lightning(
    request: Mapping[str, Any], workdir: Path, timeout: float = SUBPROCESS_TIMEOUT_S
) -> tuple[int, str]:
    """Run a Lightning training in a new process (forked from the tests' fork server; under
    ``strategy="ddp"`` Lightning's launcher re-runs the script for rank 1, forked from the same
    server: ``forkserver._fork_lightnings_ranks``); returns (exit code, its log). stdout/stderr
    go to a file so a DDP child that inherits them can never keep a pipe open."""
    workdir.mkdir(parents=True, exist_ok=True)
    n = len(list(workdir.glob("lightning-*.request.json")))
    req = workdir / f"lightning-{n}.request.json"
    log = workdir / f"lightning-{n}.log"
    req.write_text(json.dumps(dict(request)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "NODE_RANK"))}
    env.pop("MASTER_PORT", None)
    env.pop("WORLD_SIZE", None)
    env["PYTHONUNBUFFERED"] = "1"
    with open(log, "w") as fh:
        proc = forkserver.run(
            [sys.executable, str(HERE), "lightning", str(req), str(workdir / f"lightning-{n}.out")],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=workdir,
            timeout=timeout,
            check=False,
        )
    return proc.returncode, log.read_text()


def run_lightnings_side_by_side(
    runs: Sequence[tuple[Mapping[str, Any], Path]],
) -> list[tuple[int, str]]:
    """Run independent Lightning trainings (``(request, workdir)`` pairs, each workdir its own)
    at the same time, each as :func:`run_lightning` runs it; returns their (exit code, log) in
    the order of ``runs``. For runs that share nothing but read-only inputs (a store, a
    checkpoint), such as a reference run beside a run to be killed."""
    from concurrent.futures import ThreadPoolExecutor

    if len({workdir for _, workdir in runs}) != len(runs):
        raise ValueError("each run needs a workdir of its own")
    with ThreadPoolExecutor(max_workers=max(1, len(runs))) as pool:
        return list(pool.map(lambda run: run_lightning(*run), runs))


def _lightning(req: Mapping[str, Any]) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from insitubatch_nodes.lightning import InSituDataModule

    out_prefix = req["out"]

    class Recorder(pl.LightningModule):
        def __init__(self, n_in: int) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(n_in, n_in)

        def _write(self, kind: str, batch: Mapping[str, Any], batch_idx: int) -> None:
            row = {
                "kind": kind,
                "epoch": int(self.current_epoch),
                "batch_idx": int(batch_idx),
                "step": int(self.global_step),
                "b_epoch": int(batch["epoch"]),
                "b_index": int(batch["index"]),
                "hash": digest(batch["x"]) + digest(batch["y"]),
                "idx": [int(i) for i in batch["idx"].tolist()],
            }
            if "origins" in batch:
                row["idx"] = [
                    [i, *o] for i, o in zip(row["idx"], batch["origins"].tolist(), strict=True)
                ]
            with open(f"{out_prefix}.rank{self.global_rank}.jsonl", "a") as fh:
                fh.write(json.dumps(row) + "\n")

        def _loss(self, batch: Mapping[str, Any]) -> torch.Tensor:
            x = (batch["x"].flatten(1) - 270.0) / 30.0
            y = (batch["y"].flatten(1) - 270.0) / 30.0
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor:
            self._write("train", batch, batch_idx)
            return self._loss(batch)

        def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
            self._write("val", batch, batch_idx)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if req["estimated_stepping_batches"]:  # Lightning issue #20550
                total = self.trainer.estimated_stepping_batches
                assert total > 0
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class KillAtStep(pl.Callback):
        """SIGKILL this process when the batch after the checkpoint of ``step`` starts."""

        def __init__(self, step: int) -> None:
            self.step = step

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == self.step:
                os.kill(os.getpid(), signal.SIGKILL)

    store = req["store"]
    patches = req["patches"]

    def views(geoms: Mapping[str, Any]) -> dict[str, Any]:
        out = {"x": geoms["t2m"], "y": geoms["t2m"].shift(1)}
        if patches is None:
            return out
        g = geoms["t2m"]
        extent = dict(zip(g.field_axes[-2:], patches["extent"], strict=True))
        options = {k: v for k, v in patches.items() if k != "extent"}
        return {label: v.patches(extent, **options) for label, v in out.items()}

    dm = InSituDataModule(
        store,
        views,
        (0.75, 0.125, 0.125),
        config=PlanConfig(
            batch_size=req["batch_size"], block_chunks=req["block_chunks"], seed=req["seed"]
        ),
        eval_batch_size=req["eval_batch_size"],
        transform=indexed_transform,
    )
    g = open_geometries(store, ["t2m"])["t2m"]
    n_in = int(np.prod(g.inner_shape if patches is None else patches["extent"]))
    torch.manual_seed(0)
    model = Recorder(n_in)
    callbacks: list[Any] = []
    if req["every_n_train_steps"]:
        callbacks.append(
            ModelCheckpoint(
                dirpath=req["ckpt_dir"],
                filename="{step}",
                every_n_train_steps=req["every_n_train_steps"],
                save_top_k=-1,
            )
        )
    if req["kill_at_step"] is not None:
        callbacks.append(KillAtStep(req["kill_at_step"]))
    extra: dict[str, Any] = {}
    if req["val_check_interval"] is not None:
        extra["val_check_interval"] = req["val_check_interval"]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=req["devices"],
        strategy=req["strategy"],
        max_epochs=req["max_epochs"],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(req["every_n_train_steps"]),
        limit_val_batches=req["limit_val_batches"],
        num_sanity_val_steps=req["num_sanity_val_steps"],
        callbacks=callbacks,
        **extra,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=req["ckpt_path"])
    return {"global_step": int(trainer.global_step), "current_epoch": int(trainer.current_epoch)}


# ---------------------------------------------------------------------------------------------
# torch.multiprocessing.spawn worker (gloo)
# ---------------------------------------------------------------------------------------------


def ddp_worker(rank: int, world: int, init_file: str, cfg: dict, epochs: int, out: str) -> None:
    """One rank: build the pipeline with rank/world from torch.distributed, read ``epochs``
    epochs, all_reduce once per batch, and write per-epoch sample indices and chunk GETs to
    ``out.format(rank)``."""
    import torch
    import torch.distributed as dist
    from helpers import counting_store

    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        store = counting_store(Path(cfg["store"]))
        labels = labels_of(store, cfg["array"], cfg["windowed"], cfg.get("patches"))
        manifest = split_by_chunk(labels["x"].base, tuple(cfg["fractions"]))
        pipe = insitu_pipeline(
            store,
            manifest,
            labels,
            split=cfg["split"],
            batch_size=cfg["batch_size"],
            block_chunks=cfg["block_chunks"],
            shuffle=cfg["shuffle"],
            seed=cfg["seed"],
            rank=None,
            world_size=None,
        )
        plan = pipe.stages.plan
        result: dict[str, Any] = {"rank": plan.rank, "world_size": plan.world_size, "epochs": []}
        loader = Loader(pipe)
        for _ in range(epochs):
            store.reset_counts()
            samples: list[Any] = []
            n_batches = 0
            for batch in loader:
                t = torch.ones(1)
                dist.all_reduce(t)  # every rank must reach this once per batch
                assert int(t.item()) == world
                if batch.patch_origins:  # a sample is (anchor, window origin)
                    origins = batch.patch_origins["x"].tolist()
                    idx = batch.sample_indices["x"].tolist()
                    samples.extend([int(i), *o] for i, o in zip(idx, origins, strict=True))
                else:
                    samples.extend(int(i) for i in batch.sample_indices["x"])
                n_batches += 1
            counts = torch.tensor([n_batches, -n_batches])
            dist.all_reduce(counts, op=dist.ReduceOp.MAX)
            result["epochs"].append(
                {
                    "samples": samples,
                    "n_batches": n_batches,
                    "max_batches": int(counts[0]),
                    "min_batches": -int(counts[1]),
                    "gets": sorted(store.chunk_counts()),
                }
            )
        pipe.close()
        Path(out.format(rank)).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _collection_ddp(req: Mapping[str, Any]) -> dict[str, Any]:
    """One rank (``req["rank"]`` of ``req["world"]``, gloo through ``req["init_file"]``) reading
    ``req["epochs"]`` epochs of a collection of the ``t2m`` arrays of the stores at
    ``req["roots"]`` (one member each, each store wrapped in a counting store), rank and world
    size from ``torch.distributed``, an ``all_reduce`` per batch; every row checked against
    zarr's read of its member. Per epoch: the ``[member, index]`` samples, the batch count
    (and the least and most over the ranks), and ``{"<member>:<key>": GETs}`` of stored
    objects."""
    import torch
    import torch.distributed as dist
    from helpers import counting_store

    from insitubatch_nodes import Collection, split_by_member

    world = int(req["world"])
    dist.init_process_group(
        "gloo",
        init_method=f"file://{req['init_file']}",
        rank=int(req["rank"]),
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        roots = [Path(r) for r in req["roots"]]
        stores = [counting_store(r) for r in roots]
        oracles = [np.asarray(zarr.open_array(r / "t2m", mode="r")[...]) for r in roots]
        coll = Collection.from_arrays([(s, "t2m") for s in stores])
        pipe = insitu_pipeline(
            coll,
            split_by_member(coll, {"train": 1.0}),
            {"x": coll["data"]},
            batch_size=req["batch_size"],
            block_chunks=2,
            seed=req["seed"],
            rank=None,
            world_size=None,
        )
        plan = pipe.stages.plan
        result: dict[str, Any] = {"rank": plan.rank, "world_size": plan.world_size, "epochs": []}
        try:
            loader = Loader(pipe)
            for _ in range(req["epochs"]):
                for store in stores:
                    store.reset_counts()
                samples: list[list[int]] = []
                n_batches = 0
                for batch in loader:
                    t = torch.ones(1)
                    dist.all_reduce(t)  # every rank must reach this once per batch
                    assert int(t.item()) == world
                    rows = zip(batch.members["x"].tolist(), batch.sample_indices["x"].tolist(),
                               strict=True)  # fmt: skip
                    for r, (m, i) in enumerate(rows):
                        np.testing.assert_array_equal(batch["x"][r], oracles[m][i])
                        samples.append([int(m), int(i)])
                    n_batches += 1
                counts = torch.tensor([n_batches, -n_batches])
                dist.all_reduce(counts, op=dist.ReduceOp.MAX)
                gets = {
                    f"{m}:{k}": n for m, s in enumerate(stores) for k, n in s.chunk_counts().items()
                }
                result["epochs"].append(
                    {
                        "samples": samples,
                        "n_batches": n_batches,
                        "max_batches": int(counts[0]),
                        "min_batches": -int(counts[1]),
                        "gets": gets,
                    }
                )
        finally:
            pipe.close()
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


def run_ranks(mode: str, requests: Sequence[Mapping[str, Any]], workdir: Path) -> list[dict]:
    """Run ``python resume_helpers.py MODE`` once per request, all at once (forked from the
    tests' fork server: the ranks of one job), and return their responses in order."""
    workdir.mkdir(parents=True, exist_ok=True)
    procs, paths = [], []
    for r, request in enumerate(requests):
        req, resp = workdir / f"{mode}-{r}.request.json", workdir / f"{mode}-{r}.response.json"
        req.write_text(json.dumps(dict(request)))
        log = open(workdir / f"{mode}-{r}.log", "w")  # noqa: SIM115 (closed below)
        procs.append((forkserver.popen([sys.executable, str(HERE), mode, str(req), str(resp)],
                                       stdout=log, stderr=subprocess.STDOUT), log))  # fmt: skip
        paths.append(resp)
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=SUBPROCESS_TIMEOUT_S))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
        finally:
            log.close()
    logs = [(workdir / f"{mode}-{r}.log").read_text()[-4000:] for r in range(len(requests))]
    if any(codes) or not all(p.exists() for p in paths):
        raise AssertionError(f"{mode} ranks exited with {codes}\n" + "\n---\n".join(logs))
    return [json.loads(p.read_text()) for p in paths]


def spawn_ranks(fn: Callable[..., None], args: Sequence[Any], nprocs: int, workdir: Path) -> None:
    """Like ``torch.multiprocessing.spawn(fn, args=args, nprocs=nprocs, join=True)``: call
    ``fn(rank, *args)`` in ``nprocs`` processes at once and raise when one fails, but each
    rank is forked from the tests' fork server (new, with nothing of this process's state; its
    modules already imported) instead of a fresh interpreter importing torch again. ``fn`` is a
    module-level function and ``args`` are JSON values; logs and requests go to ``workdir``."""
    requests = [
        {"module": fn.__module__, "function": fn.__qualname__, "rank": r, "args": list(args)}
        for r in range(nprocs)
    ]
    run_ranks("call", requests, workdir)


def _call(req: Mapping[str, Any]) -> dict[str, Any]:
    import importlib

    fn = getattr(importlib.import_module(req["module"]), req["function"])
    fn(int(req["rank"]), *req["args"])
    return {}


# ---------------------------------------------------------------------------------------------

MODES: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "call": _call,
    "collection-ddp": _collection_ddp,
    "loader-restore": _restore_loader,
    "sdl-restore": _restore_sdl,
    "timing": _timing,
    "lightning": _lightning,
}


def main(argv: Sequence[str]) -> int:
    mode, req_path, resp_path = argv
    req = json.loads(Path(req_path).read_text())
    resp = MODES[mode](req)
    rank = os.environ.get("LOCAL_RANK", "0")
    if rank == "0":
        Path(resp_path).write_text(json.dumps(resp))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
