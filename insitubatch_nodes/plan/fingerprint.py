"""What identifies the dataset a read plan reads, in its saved states: the manifest and the
plan's views, hashed (a state restores only onto the same dataset, or says which views it was
saved with), and what the batch labels hold beyond them (stacks, selections); and the checks
of a saved state's anchors (stride, missing steps), inputs and elastic cuts."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from insitubatch_nodes.errors import StateMismatchError
from insitubatch_nodes.io.geometry import ArrayGeometry
from insitubatch_nodes.io.patching import Patches
from insitubatch_nodes.plan.anchors import SampleSteps, calendar_unit
from insitubatch_nodes.plan.config import PlanConfig
from insitubatch_nodes.plan.ledger import Stage
from insitubatch_nodes.plan.patches import patch_spec
from insitubatch_nodes.plan.ranks import LEGACY_PAD, LEGACY_SIT_OUT
from insitubatch_nodes.plan.splits import SplitManifest
from insitubatch_nodes.plan.valid_anchors import chunk_anchors
from insitubatch_nodes.stack import Stack

__all__ = [
    "ORDER_KEYS",
    "PlanAnchors",
    "anchors_hash",
    "check_cuts",
    "check_inputs",
    "check_legacy",
    "check_same_anchors",
    "config_differs",
    "dataset_hash",
    "dealt",
    "inputs_of",
    "other_order",
    "other_views_error",
    "readable_views",
    "saved_dealing",
    "saved_patches",
    "saved_views",
    "stratifying_tiles",
    "views_list",
    "without_dealing",
]


def dataset_hash(manifest: SplitManifest, views: Sequence[Sequence[Any]]) -> str:
    """The fingerprint's ``dataset``: the manifest and the plan's views (sorted
    ``(label, path, offset, samples_per_chunk[, patch])``)."""
    return hashlib.sha256(json.dumps([manifest.fingerprint(), views]).encode()).hexdigest()[:16]


def anchors_hash(
    manifest: SplitManifest, views: Mapping[str, ArrayGeometry], config: PlanConfig
) -> str:
    """The fingerprint's ``anchors``: the split's chunks, each one's anchors (after the stride
    and the missing steps) and the plan's views (:func:`views_list`) — what a plan's epochs
    are a function of beside its settings. Unlike :func:`dataset_hash` (the whole manifest,
    the length of the array among it) it stays the same when the archive grows outside the
    split: a state saved before an append resumes exactly where these agree."""
    chunks = manifest.chunk_array(config.split)
    counts, anchors = chunk_anchors(manifest, chunks, [g.offset for g in views.values()], config)
    body = [manifest.array, manifest.samples_per_chunk, views_list(views)]
    digest = hashlib.sha256(json.dumps(body).encode())
    for part in (manifest.members, manifest.product):
        digest.update(b"|" + (b"" if part is None else part.fingerprint.encode()))
    for arr in (chunks, counts, anchors):
        digest.update(b"|" + np.ascontiguousarray(arr, dtype="<i8").tobytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True, eq=False)
class PlanAnchors:
    """:func:`anchors_hash` of a plan, made when first asked for — the plan state of the
    first batch, or a state checked — then kept for the pipeline's life (per set of views):
    O(anchors) of numpy and a hash, 0.1-0.25 s once at a million samples beside the 1.1-1.6 s
    of one epoch's plan (a pipeline never iterated does not pay it)."""

    manifest: SplitManifest
    views: Mapping[str, ArrayGeometry]
    config: PlanConfig

    @functools.cached_property
    def value(self) -> str:
        return anchors_hash(self.manifest, self.views, self.config)


def views_list(views: Mapping[str, ArrayGeometry]) -> list[list[Any]]:
    """The plan's views as the fingerprint lists them: sorted ``[label, path, offset,
    samples_per_chunk(, patch)]``."""
    return sorted(
        [k, g.path, g.offset, g.samples_per_chunk]
        + ([] if g.patch is None else [g.patch.describe()])
        for k, g in views.items()
    )


def stratifying_tiles(views: Mapping[str, ArrayGeometry]) -> list[int] | None:
    """The tiles a patched plan stratifies its windows and regions by — the first patched
    view's, in the order ``views`` are given — where patched arrays are tiled differently
    (``None`` otherwise). :func:`views_list` sorts the views, so it cannot say whose."""
    spec = patch_spec(views)
    tiles = {g.patch.tile for g in views.values() if g.patch is not None}
    return None if spec is None or len(tiles) < 2 else list(spec.tile)


def readable_views(views: Sequence[Sequence[Any]]) -> str:
    """A state's ``views`` entry as ``[x[0]: t2m -1, x[1]: t2m +0, y: t2m +1]``."""
    return "[" + ", ".join(f"{v[0]}: {v[1] or '/'} {int(v[2]):+d}" for v in views) + "]"


#: the plan settings that batch an epoch's samples (which batch, in which order) and read
#: nothing else: a state taken where an epoch begins or ends restores under other values, the
#: next epoch batched by them (in the middle of one, the rest would be other batches)
ORDER_KEYS = ("batch_size", "block_chunks", "shuffle", "ramp", "seed")


def other_order(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> dict[str, Any]:
    """``{key: saved value}`` of the :data:`ORDER_KEYS` a saved read-plan config (``saved``)
    has otherwise than this plan's (``mine``)."""
    return {k: saved[k] for k in ORDER_KEYS if k in saved and saved[k] != mine.get(k)}


def config_differs(key: str, saved: Any, mine: Any, state: Mapping[str, Any]) -> StateMismatchError:
    """The error for a read-plan ``state`` whose config entry ``key`` is ``saved`` where this
    plan's is ``mine``: what differs, how to resume the state (build the pipeline as the run
    that saved it) and how to go on without it (the epoch it was taken in, for ``set_epoch``)."""
    epoch, emitted = int(state["epoch"]), int(state["batches_emitted"])
    what, build = key, f"with {key}={saved!r}"
    if key == "dataset":
        what = "dataset (arrays, views or split chunks)"
        build = (
            "over the arrays, views and split manifest of the run that saved it (over an "
            "archive appended to since, a manifest whose split holds the same samples: drawn "
            "by dates, split_by_chunk(..., sample_range=(start, stop), coord=time))"
        )
    boundary = (  # (refused mid-epoch only)
        f". A state taken where an epoch begins or ends restores here, with {key}={mine!r}"
        if key in ORDER_KEYS
        else ""
    )
    return StateMismatchError(
        f"cannot restore this read-plan state: its {what} differs (saved {saved!r}, this "
        f"pipeline {mine!r})",
        f"To resume it, build the pipeline {build}",
        _go_on(epoch, emitted),
        epoch=epoch,
        batches=emitted,
        also=boundary,
    )


def _go_on(epoch: int, emitted: int) -> str:
    """How a pipeline's user goes on without a refused state taken ``emitted`` batches into
    ``epoch`` (a data module says its own way: ``StateMismatchError.told``)."""
    return (
        "To go on with this pipeline instead, do not load the state: its data order starts "
        f"afresh, and pipe.stages.plan.set_epoch({epoch}) before the first iter() starts it at "
        f"the epoch the state was taken in (epoch {epoch}, after {emitted} of its batches; "
        f"set_epoch({epoch + 1}): the next one)"
    )


def check_legacy(saved: Mapping[str, Any], rule_matters: Callable[[], bool]) -> None:
    """Raise ``ValueError`` for a read-plan config saved before a rule that changes its plan:
    without ``cross_split_windows`` where the rule matters (``rule_matters()``: its windows read
    across the split's edge), or without ``remainder`` on several ranks (they dealt and dropped
    the tail otherwise)."""
    if "cross_split_windows" not in saved and rule_matters():
        raise ValueError(
            "cannot restore this read-plan state: it predates cross_split_windows and its "
            "windows read across the split's edge; pass cross_split_windows=True to resume it"
        )
    if "remainder" not in saved and int(saved.get("world_size", 1)) > 1:
        raise ValueError(
            "cannot restore this read-plan state: it was saved with several ranks before "
            "samples of the remainder chunks were dealt (its remainder policy differs); start "
            "this run's data order afresh"
        )


def dealt(shuffle: bool, dealing: str, remainder: str = "drop", world: int = 1) -> dict[str, str]:
    """The config keys that say how a plan's epochs are dealt between ranks (``dealing``, its
    views' :func:`~insitubatch_nodes.plan.epoch.dealing_for`): ``"deal": "runs"`` for windows,
    and ``"run_order": "store"`` for unshuffled ones (each rank's run in store order, since
    2026-12-07); ``"sit_out": "drawn"`` for a shuffled ``remainder="drop"`` on ``world > 1``
    ranks (the samples that sit out drawn from the whole epoch,
    :func:`~insitubatch_nodes.plan.ranks.sit_out`, since 2026-12-07; one rank deals nothing, so
    a default config's keys stay as they were); ``"pad": "drawn"`` for ``remainder="pad"`` (on
    any world size: one rank's epoch may go on after a cut of several; each padded sample
    drawn from the other ranks' samples,
    :func:`~insitubatch_nodes.plan.ranks.deal` and
    :func:`~insitubatch_nodes.plan.ranks.deal_runs`, since 2026-12-07); none else (see
    :func:`saved_dealing`)."""
    keys = {"sit_out": "drawn"} if shuffle and remainder == "drop" and world > 1 else {}
    if remainder == "pad":
        keys["pad"] = "drawn"
    if dealing != "runs":
        return keys
    return {"deal": "runs", **keys} if shuffle else {"deal": "runs", "run_order": "store", **keys}


def saved_dealing(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> str | None:
    """The dealing (:data:`~insitubatch_nodes.plan.ranks.DEALINGS`) an epoch of a state saved
    with config ``saved`` began under, where a plan with config ``mine`` would deal it by
    another rule (``None`` otherwise): ``"chunks"`` for windows saved before they were dealt
    in runs (no ``"deal"``), ``"runs-partial-last"`` for unshuffled windows saved before each
    rank's run went in store order (no ``"run_order"``: its first partial piece came last);
    either dealing's :data:`~insitubatch_nodes.plan.ranks.LEGACY_SIT_OUT` rule for a shuffled
    ``"drop"`` plan saved on several ranks before their sit-out samples were drawn (no
    ``"sit_out"``: it began by that rule, whatever world size resumes it), or saved again in
    such an epoch (``"sit_out": "dealt"``, :func:`without_dealing`); the dealing's
    :data:`~insitubatch_nodes.plan.ranks.LEGACY_PAD` rule for a ``"pad"`` plan saved on
    several ranks before their padded samples were drawn from other ranks' (no ``"pad"``;
    saved again in such an epoch, still none)."""
    legacy = None
    if "deal" in mine and "deal" not in saved:
        legacy = "chunks"
    elif "run_order" in mine and "run_order" not in saved:
        legacy = "runs-partial-last"
    shuffled, remainder = bool(saved.get("shuffle")), str(saved.get("remainder"))
    if (
        remainder == "pad" and "pad" not in saved
    ):  # (the old ranks' pads: whatever world size resumes it)
        own = legacy or ("runs" if "deal" in mine else "chunks")
        return next(old for old, new in LEGACY_PAD.items() if new == own)
    drew = dealt(shuffled, "", remainder, int(saved.get("world_size", 1)))
    if saved.get("sit_out") == "dealt" or (drew and "sit_out" not in saved):
        own = legacy or ("runs" if "deal" in mine else "chunks")
        return next((old for old, new in LEGACY_SIT_OUT.items() if new == own), own)
    return legacy


def without_dealing(config: Mapping[str, Any], dealing: str | None) -> dict[str, Any]:
    """``config`` as a state of an epoch dealt by the legacy ``dealing`` (from
    :func:`saved_dealing`) records it, so that it is restored by that rule again (a legacy
    sit-out says ``"sit_out": "dealt"``: on any world size, even one that draws none)."""
    drop = {"chunks": ("deal", "run_order"), "runs-partial-last": ("run_order",),
            "chunks-tail-out": ("deal", "run_order"), "runs-pad-edge": ("pad",),
            "runs-partial-last-pad-edge": ("run_order", "pad"),
            "chunks-pad-any": ("deal", "run_order", "pad")}  # fmt: skip
    out = {k: v for k, v in config.items() if k not in drop.get(dealing or "", ())}
    return {**out, "sit_out": "dealt"} if dealing in LEGACY_SIT_OUT else out


def check_same_anchors(
    saved: Mapping[str, Any], mine: Mapping[str, Any], same: bool, steps: SampleSteps | None = None
) -> None:
    """Raise ``ValueError`` unless a saved read-plan config (``saved``) draws its anchors as
    this plan's (``mine``) does: the same ``stride`` and the same missing steps (a hash of the
    steps dropped by ``missing=``, ``missing_objects="drop"`` and the time checks; absent when
    nothing was checked), or, where ``same`` (the state's :func:`anchors_hash` is this plan's:
    an archive grown outside the split), the very same anchors. With ``steps`` (the plan's)
    counted in calendar months, the message also names the rule that changed on 2026-12-07;
    where the store lists missing dates (``steps.recorded``), it says that they are dropped
    since 2026-12-07 and what to do."""
    if saved.get("stride", 1) != mine.get("stride", 1):  # absent = the default
        raise ValueError(
            f"cannot restore this read-plan state: its stride differs (saved "
            f"{saved.get('stride', 1)!r}, this pipeline {mine.get('stride', 1)!r}); "
            "the anchors a plan draws depend on it: build the pipeline with the saved run's "
            "stride to resume it, or start this run's data order afresh (without this state)"
        )
    theirs, ours = saved.get("missing_steps"), mine.get("missing_steps")
    if theirs == ours or same:
        return
    checked = {True: "steps checked", False: "no steps checked"}
    if (theirs is None) != (ours is None):
        how = f"saved with {checked[theirs is not None]}, built with {checked[ours is not None]}"
    else:
        how = f"fingerprint {theirs} saved, {ours} now"
    raise ValueError(
        f"cannot restore this read-plan state: the steps dropped as missing differ ({how}): "
        "the missing= list, missing_objects='drop' (a stored object absent then and present "
        "now, or the reverse), or the times' gaps and NaTs changed since it was saved (steps "
        "appended to the archive count only where the split's anchors changed with them), and "
        "the anchors a plan draws depend on them; build the pipeline with the saved run's "
        "missing= and missing_objects= over the same store (and split), or start this run's "
        "data order afresh (without this state)"
        + (
            f". Or it was saved before 2026-12-07, when the steps of dates calendar "
            f"{months} apart (monthly, seasonal, yearly means) were counted in seconds (a 30-day "
            "month after a 31-day one was a gap): it cannot resume; start afresh"
            if steps is not None and (months := calendar_unit(steps))
            else ""
        )
        + (
            f". The store lists {steps.recorded} date(s) it holds no data for (anemoi-datasets' "
            "missing_dates), dropped as missing since 2026-12-07 (an independent member's own, "
            "of a collection, since later that day): a state saved before then, or before the "
            "attribute was written, was drawn with their samples in it (delivered as NaN rows) "
            "and cannot go on: start this run's data order afresh (load the model's weights, "
            "not this loader state)"
            if steps is not None and steps.recorded
            else ""
        )
    )


def check_cuts(cuts: Any, emitted: int) -> tuple[Stage, ...]:
    """The ``resumed`` entry of a read-plan state as ``((world_size, batches), ...)``."""
    out: list[Stage] = []
    try:
        for w, k in cuts:
            out.append((int(w), int(k)))
    except (TypeError, ValueError):
        raise ValueError(f"not a read-plan state: resumed={cuts!r}") from None
    batches = [k for _, k in out]
    if (
        any(w < 1 for w, _ in out)
        or batches != sorted(set(batches))
        or any(k < 1 or k > emitted for k in batches)
    ):
        raise ValueError(
            f"not a read-plan state: resumed={cuts!r} must list (world_size >= 1, batches) "
            f"cuts with batches rising from 1 to at most batches_emitted={emitted}"
        )
    return tuple(out)


def saved_patches(entry: Sequence[Any], view: ArrayGeometry) -> Patches | None:
    """The patches of a saved state's ``views`` entry (``[label, path, offset, spc(, patch)]``,
    :func:`views_list`) for the array of ``view``: rebuilt from its description, ``None``
    for an entry without (an unpatched view), or ``view``'s own where the description is not
    one this version writes."""
    if len(entry) < 5:
        return None
    try:
        axes, extent, field, tile, origins, stride, per_tile, order, within = entry[4]
    except (TypeError, ValueError):
        return view.patch
    return Patches(
        axes=tuple(axes),
        dims=None if view.dims is None else tuple(view.dims[a] for a in axes),
        extent=tuple(extent),
        field=tuple(field),
        tile=tuple(tile),
        origins=origins,
        stride=None if stride is None else tuple(stride),
        per_tile=per_tile,
        order=order,
        within=None if within is None else tuple(tuple(b) for b in within),
    )


def saved_views(
    saved: Mapping[str, Any],
    dataset: str,
    known: Mapping[str, dict[str, ArrayGeometry]],
    manifest: SplitManifest,
    views: Mapping[str, ArrayGeometry],
) -> dict[str, ArrayGeometry] | None:
    """The plan's views a state's ``config`` (``saved``) was saved with, when its dataset
    fingerprint differs from ``dataset`` (the plan's, over ``views``) only by them: ``known``
    (fingerprint -> views the plan had or was given), else rebuilt from the saved views of the
    same arrays; ``None`` otherwise (the same views, or the manifest or arrays differ too)."""
    theirs_hash = str(saved.get("dataset"))
    if theirs_hash == dataset:
        return None
    if theirs_hash in known:
        return known[theirs_hash]
    theirs = saved.get("views")
    if not isinstance(theirs, list) or theirs_hash != dataset_hash(manifest, theirs):
        return None  # the manifest or the arrays differ too: not a change of views
    by_path = {g.path: g for g in views.values()}
    out: dict[str, ArrayGeometry] = {}
    for entry in theirs:
        try:
            label, path, offset = str(entry[0]), str(entry[1]), int(entry[2])
        except (TypeError, ValueError, IndexError):
            return None
        if path not in by_path:
            return None
        out[label] = by_path[path].base.shift(offset)
        if patch := saved_patches(entry, by_path[path]):
            out[label] = replace(out[label], patch=patch)
    return out


def other_views_error(
    saved: Mapping[str, ArrayGeometry],
    mine: Mapping[str, ArrayGeometry],
    state: Mapping[str, Any],
    where: str,
) -> StateMismatchError:
    """The refusal of a read-plan ``state`` saved mid-epoch (``where``) with the views
    ``saved`` by a plan reading ``mine``: naming the arrays patched otherwise (which
    ``set_views`` cannot change), else both sets of views; then how to resume it and how to go
    on without it."""
    epoch, emitted = int(state["epoch"]), int(state["batches_emitted"])
    end = ", or restore a state taken where an epoch begins or ends"
    if patched := _patch_changes(saved, mine):
        what = (
            f"cannot restore this read-plan state: it was saved mid-epoch ({where}) with "
            f"arrays patched otherwise ({'; '.join(patched)}: saved vs this pipeline's)"
        )
        resume = f"To resume it, build the pipeline with the saved run's patches{end}"
    else:
        what = (
            f"cannot restore this read-plan state: its dataset's views differ, and it was "
            f"saved mid-epoch ({where}) with views {readable_views(views_list(saved))}, and "
            f"this pipeline reads {readable_views(views_list(mine))}"
        )
        resume = f"To resume it, give the pipeline the state's views (set_views){end}"
    return StateMismatchError(what, resume, _go_on(epoch, emitted), epoch=epoch, batches=emitted)


def _patch_changes(
    saved: Mapping[str, ArrayGeometry], mine: Mapping[str, ArrayGeometry]
) -> list[str]:
    """Per array patched otherwise in ``saved`` than in ``mine``: ``"z: extent (2, 4) vs
    (4, 4)"`` (saved first)."""
    theirs = {g.path: g.patch for g in saved.values()}
    ours = {g.path: g.patch for g in mine.values()}
    out = []
    for path in sorted(theirs.keys() & ours.keys()):
        a, b = theirs[path], ours[path]
        if a == b:
            continue
        if a is None or b is None:
            out.append(f"{path}: {'not patched' if a is None else 'patched'} vs the other")
        else:
            out.append(f"{path}: {a.differences(b) or 'patched otherwise'}")
    return out


def inputs_of(
    views: Mapping[str, Any], statics: Mapping[str, ArrayGeometry] | None = None
) -> dict[str, dict[str, Any]]:
    """What the batch labels hold beyond the plan's views (which only say what is read, and
    when): per label that is a stack, its layout, channel names (members, their levels and
    order), its members' selections, its constant members (``"constants"``: a static
    member's array path, a forcing member's settings: neither is read by the plan, so the
    dataset's fingerprint does not see them) and a hash of the statistics it is normalised with
    (``normalize=``); per selected view, its selection; per static label of ``statics`` (the
    plan never reads them: a ``StaticFields`` puts them in), its array's path and selection.
    Other labels are left out (an empty mapping for a plan of plain views)."""
    out: dict[str, dict[str, Any]] = {
        label: {"static": view.path}
        | ({} if view.select is None else {"select": view.select.describe()})
        for label, view in (statics or {}).items()
    }
    for label, view in sorted(views.items()):
        if isinstance(view, Stack):
            chosen = {
                m.name: m.view.select.describe()
                for m in view.members
                if m.view is not None and m.view.select is not None
            }
            out[label] = {"layout": view.layout, "channels": list(view.channels)}
            if view.ensemble is not None:  # (absent otherwise: states saved before are alike)
                out[label]["ensemble"] = [view.ensemble_dim, [str(v) for v in view.ensemble]]
            out[label] |= {"select": chosen} if chosen else {}
            constants: dict[str, Any] = {m.name: m.geometry.path for m in view.static}
            constants |= {m.name: _forcing_settings(m.forcing) for m in view.forcings if m.forcing}
            out[label] |= {"constants": constants} if constants else {}
            norms = [m.norm for m in view.members if m.norm is not None]
            if norms:  # what the rows are standardised with
                digest = hashlib.sha256()
                for mean, std in norms:
                    digest.update(np.ascontiguousarray(mean, np.float64).tobytes())
                    digest.update(np.ascontiguousarray(std, np.float64).tobytes())
                out[label]["normalize"] = digest.hexdigest()[:16]
        elif isinstance(view, ArrayGeometry) and view.select is not None:
            out[label] = {"select": view.select.describe()}
    return out


def _forcing_settings(forcing: Any) -> list[Any]:
    """What a forcing member's values depend on besides the rows' times and its grid (which
    :func:`~insitubatch_nodes.stack.stack` ties to the sampled members' points): the time
    coordinate it reads, for the radiation its period, bins and irradiance, and its
    convention where it is not the default (states saved before conventions stay alike)."""
    settings: list[Any] = [forcing.time_name]
    solar = {"toa_incident_solar_radiation", "cos_solar_zenith"}  # (not by a convention)
    if forcing.convention != "calendar" and set(forcing.names) - solar:
        settings.append(forcing.convention)
    if "toa_incident_solar_radiation" in forcing.names:
        seconds = float(forcing.period / np.timedelta64(1, "s"))
        settings += [seconds, forcing.bins, float(forcing.irradiance)]
    return settings


def check_inputs(state: Mapping[str, Any], mine: Mapping[str, Any], where: str) -> None:
    """Raise :class:`StateMismatchError` when a saved read-plan ``state``'s config's ``inputs``
    (:func:`inputs_of`) differ from this plan's config's (``mine``) for a state saved
    mid-epoch (``where`` says where).
    A state without the entry was saved by a plan of plain views (``{}``). A static label
    the state does not name is let be (the rows are the same; states saved before static
    labels were recorded name none); one it names must come alike."""
    if not where:
        return
    theirs, ours = state["config"].get("inputs", {}), mine.get("inputs", {})
    if not isinstance(theirs, Mapping):
        raise ValueError(f"not a read-plan state: inputs={theirs!r}")
    changes = []
    for label in sorted(theirs.keys() | ours.keys()):
        a, b = theirs.get(label, {}), ours.get(label, {})
        if "static" in b and not a:
            continue
        changes += [
            f"{label!r} {key} {a.get(key)!r} saved, {b.get(key)!r} now"
            for key in ("static", "channels", "layout", "select")
            if a.get(key) != b.get(key)
        ]
        if "constants" in a and a["constants"] != b.get("constants"):  # (recorded since 12-06)
            changes.append(
                f"{label!r} static members' arrays or forcings' settings {a['constants']!r} "
                f"saved, {b.get('constants')!r} now"
            )
        if a.get("normalize") != b.get("normalize"):
            changes.append(f"{label!r} is normalised with other statistics")
    if changes:
        epoch, emitted = int(state["epoch"]), int(state["batches_emitted"])
        raise StateMismatchError(
            "cannot restore this read-plan state: the batches' inputs differ ("
            + "; ".join(changes)
            + f") and it was saved mid-epoch ({where}), whose rest would come with other "
            "channels or static labels",
            "To resume it, build the pipeline with the saved run's views to finish that "
            "epoch, or restore a state taken where an epoch begins or ends",
            _go_on(epoch, emitted),
            epoch=epoch,
            batches=emitted,
        )
