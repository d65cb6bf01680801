"""``FetchOptions`` and ``CacheOptions``: the fetch side's and the cache side's settings, each
checked once, where it is made.

An invalid value raises what the builder's loose keyword raises (the builder makes the object
from its keywords); the objects are frozen, hashable and normalised to plain Python; the builder
takes an object or the keywords and builds the same pipeline from either, and refuses an object
beside a keyword off its default.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from insitubatch_nodes import RetryPolicy, insitu_pipeline, open_geometries, split_by_chunk
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.options import CacheOptions, FetchOptions
from insitubatch_nodes.plan import SplitManifest
from insitubatch_nodes.slots import RamBacking
from insitubatch_nodes.synthetic import make_era5_like


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("options") / "era5.zarr"
    make_era5_like(root, n_time=64, n_lat=8, n_lon=16, samples_per_chunk=8, variables=["t2m"])
    return root


@pytest.fixture(scope="module")
def views(store_path: Path) -> dict[str, ArrayGeometry]:
    t2m = open_geometries(store_path, ["t2m"])["t2m"]
    return {"x": t2m, "y": t2m.shift(1)}


@pytest.fixture(scope="module")
def manifest(views: dict[str, ArrayGeometry]) -> SplitManifest:
    return split_by_chunk(views["x"].base, (0.75, 0.125, 0.125))


class _NotABacking:
    def __repr__(self) -> str:  # a stable test id (xdist workers must collect the same ids)
        return "_NotABacking()"


# (builder keyword, object, field, value, error, match)
BAD: list[tuple[str, type, str, Any, type[Exception], str]] = [
    ("max_inflight", FetchOptions, "max_inflight", 0, ValueError, "max_inflight must be a pos"),
    ("max_inflight", FetchOptions, "max_inflight", True, TypeError, "max_inflight must be an in"),
    ("decode_threads", FetchOptions, "decode_threads", 2.0, TypeError, "decode_threads must be"),
    ("retry", FetchOptions, "retry", 30, TypeError, "retry must be a RetryPolicy"),
    ("on_bad_chunk", FetchOptions, "on_bad_chunk", "skip", ValueError, "on_bad_chunk must be"),
    ("report", FetchOptions, "report", 1, TypeError, "report must be True or False"),
    ("prefetch_depth", FetchOptions, "prefetch_depth", 0, ValueError, "prefetch_depth must be"),
    ("cache_budget_bytes", CacheOptions, "budget_bytes", 0, ValueError, "cache_budget_bytes mu"),
    ("cache_budget_bytes", CacheOptions, "budget_bytes", 1.0, TypeError, "cache_budget_bytes mu"),
    ("backing", CacheOptions, "backing", _NotABacking(), TypeError, "backing must be a SlotBa"),
    ("persist", CacheOptions, "persist", True, ValueError, "persist need a cache_dir"),
    ("readonly_cache", CacheOptions, "readonly", True, ValueError, "readonly_cache need a cac"),
    ("reset_stale_cache", CacheOptions, "reset_stale", "y", TypeError, "reset_stale_cache must"),
    ("verify_cache", CacheOptions, "verify", False, ValueError, "verify_cache=False needs a"),
    ("check_store", CacheOptions, "check_store", False, ValueError, "check_store=False needs"),
    ("cache_dir", CacheOptions, "cache_dir", 3, TypeError, "cache_dir must be a path"),
]


@pytest.mark.parametrize(
    ("keyword", "kind", "field", "value", "error", "match"),
    BAD,
    ids=[f"{k}={v!r}" for k, _, _, v, _, _ in BAD],
)
def test_an_invalid_option_raises_what_the_builder_keyword_raises(
    store_path: Path,
    manifest: SplitManifest,
    views: dict[str, ArrayGeometry],
    keyword: str,
    kind: type,
    field: str,
    value: Any,
    error: type[Exception],
    match: str,
) -> None:
    with pytest.raises(error, match=match):
        kind(**{field: value})
    with pytest.raises(error, match=match):
        insitu_pipeline(store_path, manifest, views, **{keyword: value})
    with pytest.raises(error, match=match):
        kind().replace(**{field: value})


def test_cache_options_refuse_combinations_that_cannot_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="writes nothing"):
        CacheOptions(cache_dir=tmp_path, readonly=True, reset_stale=True)
    with pytest.raises(ValueError, match="pass cache_dir or backing"):
        CacheOptions(cache_dir=tmp_path, backing=RamBacking())
    with pytest.raises(ValueError, match="persist and readonly_cache need a cache_dir"):
        CacheOptions(persist=True, readonly=True)


def test_options_are_frozen_hashable_and_plain_python(tmp_path: Path) -> None:
    fetch = FetchOptions(max_inflight=np.int64(8), report=np.bool_(False))  # type: ignore[arg-type]
    assert type(fetch.max_inflight) is int and fetch.report is False
    assert fetch == FetchOptions(max_inflight=8, report=False)
    assert hash(fetch) == hash(FetchOptions(max_inflight=8, report=False))
    cache = CacheOptions(budget_bytes=np.int32(2**20), cache_dir=tmp_path, verify=np.bool_(True))  # type: ignore[arg-type]
    assert type(cache.budget_bytes) is int and cache.verify is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        fetch.max_inflight = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cache.persist = True  # type: ignore[misc]
    assert fetch.replace(max_inflight=4).max_inflight == 4 and fetch.max_inflight == 8


def test_a_persistent_cache_is_asked_for_by_persist_or_readonly(tmp_path: Path) -> None:
    assert not CacheOptions().persistent
    assert not CacheOptions(cache_dir=tmp_path).persistent  # slots on disk, spilled
    assert CacheOptions(cache_dir=tmp_path, persist=True).persistent
    assert CacheOptions(cache_dir=tmp_path, readonly=True).persistent


def test_the_builder_takes_the_options_objects_or_the_same_keywords(
    store_path: Path, manifest: SplitManifest, views: dict[str, ArrayGeometry], tmp_path: Path
) -> None:
    retry = RetryPolicy(timeout_s=20.0)
    loose = insitu_pipeline(
        store_path, manifest, views, batch_size=4, max_inflight=3, decode_threads=1,
        retry=retry, on_bad_chunk="nan", report=False, prefetch_depth=3,
        cache_budget_bytes=2**22, cache_dir=tmp_path / "a", persist=True,
    )  # fmt: skip
    boxed = insitu_pipeline(
        store_path, manifest, views, batch_size=4,
        fetch=FetchOptions(max_inflight=3, decode_threads=1, retry=retry, on_bad_chunk="nan",
                           report=False, prefetch_depth=3),
        cache=CacheOptions(budget_bytes=2**22, cache_dir=tmp_path / "b", persist=True),
    )  # fmt: skip
    with loose, boxed:
        for pipe in (loose, boxed):
            fetch, pool = pipe.stages.fetch, pipe.stages.pool
            assert (fetch.max_inflight, fetch.on_bad_chunk) == (3, "nan")
            assert (pool.budget_bytes, pool.auto) == (2**22, False)
            assert pool.cache is not None and pool.cache.persistent
        got = [b.sample_indices["x"].tolist() for b in boxed]
        want = [b.sample_indices["x"].tolist() for b in loose]
        assert got == want and len(got) > 1


def test_fetch_options_carry_direct_which_has_no_keyword(
    store_path: Path, manifest: SplitManifest, views: dict[str, ArrayGeometry]
) -> None:
    for direct in (None, False, True):
        pipe = insitu_pipeline(
            store_path, manifest, views, batch_size=4, fetch=FetchOptions(direct=direct)
        )
        with pipe:
            assert pipe.stages.fetch.context.options.direct is direct


def test_an_options_object_beside_one_of_its_keywords_is_refused(
    store_path: Path, manifest: SplitManifest, views: dict[str, ArrayGeometry], tmp_path: Path
) -> None:
    fetch, cache = FetchOptions(max_inflight=4), CacheOptions(budget_bytes=2**22)
    with pytest.raises(TypeError, match=r"insitu_pipeline: pass fetch=.*\(max_inflight\)"):
        insitu_pipeline(store_path, manifest, views, fetch=fetch, max_inflight=8)
    with pytest.raises(TypeError, match=r"pass cache=.*\(cache_budget_bytes, readonly_cache\)"):
        insitu_pipeline(
            store_path, manifest, views, cache=cache, cache_budget_bytes=2**20, readonly_cache=True
        )
    with pytest.raises(TypeError, match="insitu_pipeline: fetch must be a FetchOptions"):
        insitu_pipeline(store_path, manifest, views, fetch={"max_inflight": 4})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="insitu_pipeline: cache must be a CacheOptions"):
        insitu_pipeline(store_path, manifest, views, cache=FetchOptions())  # type: ignore[arg-type]
    # keywords left at their defaults are no conflict
    pipe = insitu_pipeline(
        store_path, manifest, views, fetch=fetch, cache=cache, max_inflight=32, persist=False
    )
    with pipe:
        assert pipe.stages.fetch.max_inflight == 4 and pipe.stages.pool.budget_bytes == 2**22
