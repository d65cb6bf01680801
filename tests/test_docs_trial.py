"""The docs' prose, taken at its word by a new user: found wrong by a trial of README.md, the
pages under docs/ and recipes/README.md.

The code blocks of the docs already run (tests/test_docs.py); this holds the sentences around
them: a behaviour a page promises that the code did not keep, and the defaults and thresholds a
page quotes, read from the page itself and compared with the code's, so that neither can drift
from the other again. The stores are tiny and written with zarr, which is also the oracle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import re
import shutil
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
import zarr.storage
from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype

from insitubatch_nodes import (
    RetryPolicy,
    _process,
    insitu_pipeline,
    open_geometries,
    report,
    split_by_chunk,
)
from insitubatch_nodes.cli import _parser, gil_probe, main
from insitubatch_nodes.io import objects
from insitubatch_nodes.options import FetchOptions
from insitubatch_nodes.plan import PlanConfig, schedule
from insitubatch_nodes.stages import _jobs

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``t2m (time, lat, lon)``, 8 steps in chunks of 4."""
    path = tmp_path_factory.mktemp("docs_trial") / "era5.zarr"
    group = zarr.open_group(path, mode="w")
    t2m = group.create_array("t2m", shape=(8, 4, 6), chunks=(4, 4, 6), dtype="f4")
    t2m[...] = np.arange(8 * 4 * 6, dtype="f4").reshape(8, 4, 6)
    return path


def prose(doc: str) -> str:
    """A page's text with its line breaks folded into spaces, so a sentence reads as one line."""
    return re.sub(r"\s+", " ", (DOCS / doc).read_text())


def check_transform(store: Path, target: str) -> tuple[int, str]:
    """``insitubatch-nodes check-transform`` in this process: its status and its output."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = main(["check-transform", str(store), "--var", "t2m", "--transform", target,
                   "--no-gil-probe"])  # fmt: skip
    return rc, out.getvalue()


def test_check_transform_exits_2_naming_a_module_target_that_cannot_be_imported(
    store: Path,
) -> None:
    # docs/transforms.md: "Exit status: ... 2 for a usage error (an unknown array, a target that
    # cannot be loaded)". A module:attr target whose module is not importable (a typo, or a
    # module in a folder that is not on the path: the console script does not put the working
    # directory there) raised ModuleNotFoundError out of main(): a traceback and status 1, the
    # status of a transform that failed its checks.
    rc, out = check_transform(store, "no_such_module_for_the_docs_trial:scale")
    assert rc == 2, out
    assert "no_such_module_for_the_docs_trial" in out and "path.py:attr" in out
    rc, out = check_transform(store, "insitubatch_nodes.no_such_submodule:scale")
    assert rc == 2 and "insitubatch_nodes.no_such_submodule" in out, out


class ListingStore(zarr.storage.WrapperStore[Store]):
    """A store that counts the GETs and the listings made through it."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.gets = 0
        self.listings = 0

    def _with_store(self, store: Store) -> ListingStore:
        return type(self)(store)

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        self.gets += 1
        return await self._store.get(key, prototype, byte_range)

    def list(self) -> AsyncIterator[str]:
        self.listings += 1
        return self._store.list()

    def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        self.listings += 1
        return self._store.list_prefix(prefix)

    def list_dir(self, prefix: str) -> AsyncIterator[str]:
        self.listings += 1
        return self._store.list_dir(prefix)


def test_finding_arrays_costs_the_gets_and_listings_concepts_md_counts(
    era5_v3_path: Path, era5_v2_path: Path, tmp_path: Path
) -> None:
    # docs/concepts.md, "Finding arrays", counts them on this very store; the counts had drifted
    # (14 and 28 GETs for every array, 9 and 11 with consolidated metadata, on "seven arrays").
    said = re.search(
        r"ERA5-like store .*?(\w+) arrays; .*?naming `t2m` takes (\d+) GETs \(v3[^)]*\) or "
        r"(\d+) \(v2[^)]*\) and no listing; finding every array takes (\d+) listings and (\d+) "
        r"GETs \(v3[^)]*\) or (\d+) \(v2[^)]*\), and with consolidated metadata (\d+) listing "
        r"and (\d+) or (\d+) GETs",
        prose("concepts.md"),
    )
    assert said, "the sentence of concepts.md that counts the GETs has changed: update this test"
    arrays, named_v3, named_v2, lists, every_v3, every_v2, c_lists, c_v3, c_v2 = said.groups()

    def cost(root: Path, names: list[str] | None) -> tuple[int, int]:
        store = ListingStore(zarr.storage.LocalStore(root, read_only=True))
        open_geometries(store, names)
        return store.gets, store.listings

    counted: dict[str, Any] = {}
    for fmt, path in (("v3", era5_v3_path), ("v2", era5_v2_path)):
        root = shutil.copytree(path, tmp_path / fmt)  # consolidated below: a copy
        counted[f"{fmt} arrays"] = sum(1 for _ in zarr.open_group(root, mode="r").arrays())
        counted[f"{fmt} named"] = cost(root, ["t2m"])
        counted[f"{fmt} every"] = cost(root, None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (zarr's note on consolidated metadata in v3)
            zarr.consolidate_metadata(str(root))
        counted[f"{fmt} consolidated"] = cost(root, None)
    words = {"seven": 7, "eight": 8, "nine": 9}
    assert counted == {
        "v3 arrays": words[arrays], "v2 arrays": words[arrays],
        "v3 named": (int(named_v3), 0), "v2 named": (int(named_v2), 0),
        "v3 every": (int(every_v3), int(lists)), "v2 every": (int(every_v2), int(lists)),
        "v3 consolidated": (int(c_v3), int(c_lists)), "v2 consolidated": (int(c_v2), int(c_lists)),
    }  # fmt: skip


def test_recipes_readme_lists_every_recipe_with_options_it_really_takes() -> None:
    # recipes/README.md left recipes/lightning_forecast.py out; each bullet's --options must be
    # options of the recipe the bullet runs (argparse spells them "--name" in its source).
    recipes = ROOT / "recipes"
    bullets = re.split(r"\n- ", (recipes / "README.md").read_text())[1:]
    listed = set()
    for bullet in bullets:
        scripts = set(re.findall(r"recipes/(\w+\.py)", bullet))
        assert len(scripts) == 1, bullet
        script = scripts.pop()
        listed.add(script)
        source = (recipes / script).read_text()
        for option in set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", bullet)) - {"--help"}:
            assert f'"{option}"' in source, f"recipes/README.md: {script} takes no {option}"
    assert listed == {p.name for p in recipes.glob("*.py")}


def said(doc: str, pattern: str) -> tuple[str, ...]:
    """The groups of the one sentence of ``doc`` that ``pattern`` finds (it must find one)."""
    found = re.search(pattern, prose(doc))
    assert found, f"docs/{doc} no longer says {pattern!r}: update the page or this test"
    return found.groups()


def test_the_retry_policy_table_of_concepts_md_quotes_the_policys_defaults() -> None:
    # concepts.md, "Retries and timeouts": | `field`, ... | default, ... | meaning |
    table = re.search(r"\| Field \| Default \| Meaning \|\n\|[- |]+\|\n((?:\|.*\|\n)+)",
                      (DOCS / "concepts.md").read_text()).group(1)  # type: ignore[union-attr]  # fmt: skip
    quoted: dict[str, object] = {}
    for row in table.splitlines():
        names, values = row.split("|")[1:3]
        for name, value in zip(re.findall(r"`(\w+)`", names), values.split(","), strict=True):
            value = value.strip().strip("`")
            quoted[name] = None if value == "None" else float(value)
    defaults = {f.name: f.default for f in dataclasses.fields(RetryPolicy)}
    assert quoted == defaults


def test_the_plan_defaults_concepts_md_quotes_are_plan_configs_and_the_builders() -> None:
    text = prose("concepts.md")
    (holding,) = said("concepts.md", r"`None`: the defaults\) holding `([^`]+)`")
    quoted = eval(f"dict({holding})")  # split="train", batch_size=32, ...
    (stride,) = said("concepts.md", r"a `PlanConfig` field; default `(\d+)`, every sample")
    quoted["stride"] = int(stride)
    assert "stride=" in text and quoted == {
        f.name: f.default for f in dataclasses.fields(PlanConfig)
    }
    builder = inspect.signature(insitu_pipeline).parameters
    assert {k: builder[k].default for k in quoted if k in builder} == {
        k: v for k, v in quoted.items() if k in builder
    }


def test_the_defaults_pipeline_md_quotes_are_the_builders_and_fetch_options() -> None:
    builder = inspect.signature(insitu_pipeline).parameters
    fetch = {f.name: f.default for f in dataclasses.fields(FetchOptions)}
    quoted = dict(re.findall(r"`(\w+)` \(default (\d+)\)", prose("pipeline.md")))
    assert {"max_inflight", "prefetch_depth"} <= set(quoted)
    for name, value in quoted.items():
        assert builder[name].default == fetch[name] == int(value), name


def test_the_thresholds_pipeline_md_and_caching_md_quote_are_the_codes() -> None:
    ram = _process.usable_memory_bytes()  # the machine's, or its container's limit
    fractions = {"a sixteenth": 16, "a quarter": 4, "half": 2}
    (keep,) = said("pipeline.md", r"for the automatic budget, (a \w+) of RAM")
    (cap,) = said("pipeline.md", r"while the read-once bound is under (a \w+) of the machine's RAM")
    assert schedule._auto_keep_bytes() == ram // 4 // 4 and fractions[keep] == 16
    assert schedule._auto_cap_bytes() == ram // 4 and fractions[cap] == 4
    consumer, decode = (
        said("pipeline.md", r"less than (\d+) % of the time \(`CONSUMER_WAIT_FRACTION`\)")
        + said("pipeline.md", r"at least (\d+) % of the time \(`DECODE_BUSY_FRACTION`\)")
    )  # fmt: skip
    assert int(consumer) == report.CONSUMER_WAIT_FRACTION * 100
    assert int(decode) == report.DECODE_BUSY_FRACTION * 100
    sys_share, fault_mib = said(
        "pipeline.md",
        r"the kernel took at least (a \w+) of the wall time and the page faults touched at "
        r"least (\d+) MiB",
    )
    assert 1 / fractions[sys_share] == report.FAULT_SYS_FRACTION
    assert int(fault_mib) * 2**20 == report.FAULT_MIN_BYTES
    (budget_share,) = said("pipeline.md", r"above the budget and under (\w+) the RAM")
    assert 1 / fractions[budget_share] == report._BUDGET_RAM_SHARE
    (small_us,) = said("pipeline.md", r"under (\d+) µs \(`SMALL_OBJECT_S`")
    assert pytest.approx(int(small_us) * 1e-6) == _jobs.SMALL_OBJECT_S
    (heads,) = said("caching.md", r"a HEAD request each, (\d+) in flight")
    assert int(heads) == objects.HEADS_IN_FLIGHT


def test_the_check_transform_defaults_transforms_md_quotes_are_the_clis() -> None:
    args = _parser().parse_args(["check-transform", "store.zarr", "--var", "t2m",
                                 "--transform", "prep.py:f"])  # fmt: skip
    (chunk,) = said("transforms.md", r"runs it on chunk `--chunk` \(default (\d+)\)")
    (threshold,) = said("transforms.md", r"`--gil-threshold` \((\d+) % by default\)")
    (switch_ms,) = said("transforms.md", r"switch interval set to (\d+) ms")
    assert args.chunk == int(chunk) and args.gil_threshold * 100 == int(threshold)
    probe = inspect.signature(gil_probe).parameters
    assert probe["interval"].default * 1000 == int(switch_ms)
    said("transforms.md", r"for at least a second and two calls")
    assert args.probe_seconds == probe["seconds"].default == 1.0
    assert probe["min_calls"].default == 2


def test_stats_are_the_pool_counters_and_the_outside_pool_bytes_pipeline_md_tables(
    store: Path,
) -> None:
    # pipeline.md said pipe.stats() was "the same as pipe.stages.pool.stats.as_dict()"; it adds
    # the memory held outside the pool (the table's last four rows).
    text = (DOCS / "pipeline.md").read_text()
    table = text[text.index("| Counter | Meaning |") :].split("\n\n")[0].splitlines()[2:]
    documented = [re.findall(r"`(\w+)`", row.split("|")[1]) for row in table]
    t2m = open_geometries(store, ["t2m"])["t2m"]
    manifest = split_by_chunk(t2m, (1.0, 0.0, 0.0))
    with insitu_pipeline(store, manifest, {"x": t2m}, batch_size=4, coords=()) as pipe:
        for _ in pipe:
            pass
        stats, pool = pipe.stats(), pipe.stages.pool.stats.as_dict()
    parts = ("batch_buffer_bytes", "decode_scratch_bytes", "batch_transform_bytes")
    outside = {*parts, "outside_pool_bytes"}
    assert {name for row in documented for name in row} == set(stats)
    assert [name for row in documented[-4:] for name in row] == sorted(
        outside, key=list(stats).index
    )
    assert {k: v for k, v in stats.items() if k not in outside} == pool
    assert stats["outside_pool_bytes"] == sum(stats[k] for k in parts)
