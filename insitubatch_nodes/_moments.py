"""Per-channel running moments in float64: what :func:`~insitubatch_nodes.statistics.fit_statistics`
accumulates batch by batch.

:class:`_Moments` keeps, per channel, the count of finite values, their mean, the sum of squared
deviations from it, the minimum, the maximum and the NaNs skipped; batches are merged as Chan et
al.'s pairwise update. A batch's sums and sums of squares are taken in float64 from the data
(one pass, a block at a time: below); where they would cancel (a channel's mean more than
``CANCEL ** 0.5`` standard deviations from zero, or a constant channel) its deviations from a
per-channel reference near the mean (the running mean, else the batch's first value) are summed
and squared instead (a second pass), and a batch with NaNs takes its deviations from each
channel's minimum, then from their mean (``_masked_moments``, on a float64 copy of the batch):
a constant channel, missing points or not, has a mean that is its value and a sum of squares
of exactly 0.

The sums are taken block by block (:data:`BLOCK` values at a time): each block is cast to float64
in a scratch buffer of the thread's (a one-step difference is formed there from its two
operands: no difference array of the batch's size, but in a batch with NaNs), then summed by a
BLAS dot with ones and with itself per row — two native passes over a block that stays in
cache, where numpy's ``einsum(..., dtype=float64)`` of float32 data cast and multiplied element
by element (an (8, 13, 2048) float32 batch, measured side by side: :meth:`_Moments.add` 268 ->
152 µs, its one-step differences 232 -> 134 µs).

:meth:`_Moments.add_steps` takes a batch's values and its one-step differences in that one
pass: per row the sum and sum of squares, per pair of rows their dot product, from the same
widened block (float32 products are exact in float64), and the differences' moments from those
(``sum((b - a)**2) = sum(b**2) + sum(a**2) - 2 sum(a * b)``) where they do not cancel
(:data:`STEP_CANCEL`); the channels where they would have their differences formed as above.
"""

from __future__ import annotations

import math
import threading

import numpy as np

#: the plain float64 sums serve while sum(x**2) <= CANCEL * sum((x - mean)**2) per channel
#: (a relative error of about CANCEL * 2**-53 per term summed, ~1e-9 at most in practice)
CANCEL = 1e5


#: :meth:`_Moments.add_steps` takes a channel's one-step differences from its rows' sums and
#: their dot products while ``sum(a**2) + sum(b**2) <= STEP_CANCEL * m2`` of the differences (a
#: relative error of about STEP_CANCEL * 2**-53 per term summed); else it forms them
STEP_CANCEL = 1e6

#: float64 values per block of the sums (at most 2 MiB of scratch per thread)
BLOCK = 1 << 18


class _Scratch(threading.local):
    """A thread's buffers for the blocks, shared by all its moments: float64 blocks, float32
    differences and a vector of ones as long as a block's rows (each grown on first need)."""

    def __init__(self) -> None:
        self.wide = np.zeros(0)
        self.narrow = np.zeros(0, np.float32)
        self.ones = np.zeros(0)

    def get(self, size: int, row: int, narrow: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.wide.size < size:
            self.wide = np.empty(size)
        if narrow and self.narrow.size < size:
            self.narrow = np.empty(size, np.float32)
        if self.ones.size < row:
            self.ones = np.ones(row)
        return self.wide, self.narrow, self.ones


_SCRATCH = _Scratch()


class _Moments:
    """Per-channel running count, mean, sum of squared deviations, min and max (float64)."""

    def __init__(self) -> None:
        self.started = False
        empty = np.zeros(0)
        self.n, self.mean, self.m2, self.lo, self.hi, self.nans = (empty,) * 6

    def add(self, x: np.ndarray, *, extrema: bool = True) -> None:
        """``x``: ``(rows, channels, values)``, any float or integer dtype. Without
        ``extrema`` the minimum and maximum are not taken (they stay NaN)."""
        if x.size == 0:
            return
        if x.dtype.kind != "f" or x.dtype.itemsize < 4:
            x = x.astype(np.float64)
        self._merge(x, None, extrema)

    def add_difference(self, later: np.ndarray, earlier: np.ndarray) -> None:
        """Add ``later - earlier`` (both ``(rows, channels, values)``, one shape), formed block
        by block: in float32 for float32 data (each within half an ulp of the exact difference),
        in float64 for other dtypes; no minimum or maximum is taken."""
        if later.size == 0:
            return
        self._merge(later, earlier, False)

    def add_steps(self, x: np.ndarray, steps: _Moments, pairs: np.ndarray) -> None:
        """``add(x)``, and to ``steps`` the one-step differences ``x[p + 1] - x[p]`` of each
        row ``p`` in ``pairs`` (row indices below ``len(x) - 1``), in one pass over ``x``:
        float32 data (its common case: no NaN) has each row's sum and sum of squares and each
        pair's dot product taken in float64 as the block is widened (float32 products are
        exact in float64), and a difference's moments follow from them
        (``sum((b - a)**2) = sum(b**2) + sum(a**2) - 2 sum(a * b)``): no difference array,
        no second widening. A channel whose squares would cancel there (its differences
        small beside its values: ``STEP_CANCEL``), and a batch with a NaN or of another
        dtype, take the differences as :meth:`add_difference` does (formed, then summed).
        These moments are of the exact differences; :meth:`add_difference`'s of float32
        differences (each within half an ulp of them)."""
        pairs = np.asarray(pairs, np.intp)
        if x.size == 0:
            return
        formed = x.dtype != np.float32  # (other dtypes: their products are not exact)
        if formed:
            self.add(x)
        else:
            r1, r2, cross = _row_sums(x, cross=len(pairs) > 0)
            s1 = r1.sum(0)  # (a NaN anywhere shows in it: the masked moments, and formed)
            self._combine(*self._moments_of(x, None, True, (s1, r2.sum(0))))
            formed = bool(np.isnan(s1).any())
        if not len(pairs):
            return
        later = pairs + 1
        if formed:
            steps.add_difference(x[later], x[pairs])
            return
        d1 = (r1[later] - r1[pairs]).sum(0)
        squares = (r2[later] + r2[pairs]).sum(0)
        n = np.full(x.shape[1], float(len(pairs) * x.shape[2]))
        mean = d1 / n
        m2 = squares - 2.0 * cross[pairs].sum(0) - d1 * mean
        near = squares > STEP_CANCEL * m2  # (also a constant step: m2 0)
        if near.any():  # those channels' differences formed, then summed
            at = np.flatnonzero(near)
            theirs = _Moments()
            part = x[:, at]
            theirs.add_difference(part[later], part[pairs])
            mean[at], m2[at] = theirs.mean, theirs.m2
        nan = np.full(x.shape[1], np.nan)
        steps._combine(n, mean, np.maximum(m2, 0.0), nan, nan, np.zeros_like(n))

    def _merge(self, x: np.ndarray, minus: np.ndarray | None, extrema: bool) -> None:
        """Merge the moments of ``x`` (less ``minus`` where given) into the running ones."""
        self._combine(*self._moments_of(x, minus, extrema, None))

    def _moments_of(
        self,
        x: np.ndarray,
        minus: np.ndarray | None,
        extrema: bool,
        sums: tuple[np.ndarray, np.ndarray] | None,
    ) -> tuple[np.ndarray, ...]:
        """``(count, mean, m2, min, max, nans)`` per channel of ``x`` (less ``minus``), from
        its float64 ``sums`` (sum, sum of squares per channel) where given."""
        s1, s2 = self._sums(x, minus) if sums is None else sums  # a NaN anywhere shows in s1
        if np.isnan(s1).any():
            whole = x if minus is None else np.subtract(x, minus, dtype=_difference_dtype(x, minus))
            return _masked_moments(whole)
        n = np.full(x.shape[1], float(x.shape[0] * x.shape[2]))
        mean = s1 / n
        # the plain sums in float64: exact enough while the squares do not cancel, i.e.
        # the mean is within CANCEL ** 0.5 standard deviations of zero; else the
        # deviations from a reference near the mean
        m2 = s2 - s1 * mean
        if np.any(s2 > CANCEL * m2):
            mean, m2 = self._about_reference(x, minus, n)
        m2 = np.maximum(m2, 0.0)
        if extrema:
            lo = x.min(axis=(0, 2)).astype(np.float64)
            hi = x.max(axis=(0, 2)).astype(np.float64)
        else:
            lo = hi = np.full(x.shape[1], np.nan)
        return n, mean, m2, lo, hi, np.zeros_like(n)

    def _combine(self, *batch: np.ndarray) -> None:
        """Merge a batch's ``(count, mean, m2, min, max, nans)`` into the running moments
        (Chan et al.'s pairwise update)."""
        n, mean, m2, lo, hi, nans = batch
        if not self.started:
            self.started = True
            self.n, self.mean, self.m2, self.lo, self.hi, self.nans = n, mean, m2, lo, hi, nans
            return
        total = self.n + n
        delta = mean - self.mean
        share = n / np.maximum(total, 1)
        self.mean = self.mean + delta * share
        self.m2 = self.m2 + m2 + delta**2 * self.n * share
        self.n = total
        self.lo = np.minimum(self.lo, lo)
        self.hi = np.maximum(self.hi, hi)
        self.nans = self.nans + nans

    def _about_reference(
        self, x: np.ndarray, minus: np.ndarray | None, n: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(mean, m2)`` of ``x`` (less ``minus``; no NaN) from its deviations from a
        per-channel reference near the mean (the running mean, else the batch's first value),
        formed, summed and squared in float64: no cancellation of large squares."""
        first = x[0, :, 0].astype(np.float64)
        if minus is not None:
            first = first - minus[0, :, 0]
        # a channel with no value yet (all NaN so far) has a running mean of 0: not near it
        ref = np.where(self.n > 0, self.mean, first) if self.started else first
        s1, s2 = self._sums(x, minus, ref)
        mean_d = s1 / n
        return ref + mean_d, s2 - n * mean_d**2

    def _sums(
        self, x: np.ndarray, minus: np.ndarray | None = None, ref: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per channel, the float64 sum and sum of squares of ``x - minus - ref`` (each term
        optional; ``ref`` per channel), over rows and values, block by block."""
        rows, channels, values = x.shape
        s1, s2 = np.zeros(channels), np.zeros(channels)
        rr, cc, vv = _blocking(x.shape)
        narrow = minus is not None and _difference_dtype(x, minus) == np.float32
        wide, narrow_scratch, ones = _SCRATCH.get(min(rows, rr) * cc * vv, vv, narrow)
        for r0 in range(0, rows, rr):
            for c0 in range(0, channels, cc):
                for v0 in range(0, values, vv):
                    at = (slice(r0, r0 + rr), slice(c0, c0 + cc), slice(v0, v0 + vv))
                    part = x[at]
                    block = wide[: part.size].reshape(part.shape)
                    if minus is None:
                        np.copyto(block, part)
                    elif narrow:  # float32: the difference in float32, then widened
                        diff = narrow_scratch[: part.size].reshape(part.shape)
                        np.copyto(block, np.subtract(part, minus[at], out=diff))
                    else:
                        np.subtract(part, minus[at], out=block, dtype=np.float64)
                    if ref is not None:
                        block -= ref[c0 : c0 + cc, None]
                    flat = block.reshape(-1, part.shape[2])
                    got = part.shape[:2]
                    s1[c0 : c0 + got[1]] += (flat @ ones[: part.shape[2]]).reshape(got).sum(0)
                    s2[c0 : c0 + got[1]] += np.vecdot(flat, flat).reshape(got).sum(0)
        return s1, s2

    def result(self, channels: tuple[int, ...]) -> dict[str, np.ndarray]:
        size = math.prod(channels)
        if not self.started:
            nan, zero = np.full(size, np.nan), np.zeros(size)
            out = {"mean": nan, "std": nan, "min": nan, "max": nan, "count": zero, "nan": zero}
        else:
            empty = self.n == 0
            std = np.sqrt(self.m2 / np.maximum(self.n, 1))
            out = {
                "mean": np.where(empty, np.nan, self.mean),
                "std": np.where(empty, np.nan, std),
                "min": np.where(empty, np.nan, self.lo),
                "max": np.where(empty, np.nan, self.hi),
                "count": self.n,
                "nan": self.nans,
            }
        return {k: v.reshape(channels) for k, v in out.items()}


def _blocking(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """``(rows, channels, values)`` per block of the sums of an array of ``shape`` ``(rows,
    channels, values)``: at most :data:`BLOCK` values — a part of one row's values, some of
    its channels, or whole rows."""
    _, channels, values = shape
    vv = min(values, BLOCK)
    cc = min(channels, max(1, BLOCK // vv))
    rr = max(1, BLOCK // (cc * vv)) if cc == channels else 1
    return rr, cc, vv


def _row_sums(x: np.ndarray, cross: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row and channel of ``x`` ``(rows, channels, values)``: the float64 sum, sum of
    squares and (``cross``) dot product with the next row, ``(rows, channels)`` each (the
    last ``(rows - 1, channels)``), block by block as :meth:`_Moments._sums` takes them: a
    block's rows widened once serve all three; the widened last row of a block is kept for
    the dot product with the next block's first."""
    rows, channels, values = x.shape
    r1, r2 = np.zeros((rows, channels)), np.zeros((rows, channels))
    dots = np.zeros((max(rows - 1, 0), channels))
    rr, cc, vv = _blocking(x.shape)
    wide, _, ones = _SCRATCH.get(min(rows, rr) * cc * vv, vv, False)
    carry = np.empty((cc, vv)) if cross and rr < rows else None
    for c0 in range(0, channels, cc):
        for v0 in range(0, values, vv):
            for r0 in range(0, rows, rr):
                part = x[r0 : r0 + rr, c0 : c0 + cc, v0 : v0 + vv]
                pr, pc, pv = part.shape
                block = wide[: part.size].reshape(part.shape)
                np.copyto(block, part)
                flat = block.reshape(-1, pv)
                r1[r0 : r0 + pr, c0 : c0 + pc] += (flat @ ones[:pv]).reshape(pr, pc)
                r2[r0 : r0 + pr, c0 : c0 + pc] += np.vecdot(flat, flat).reshape(pr, pc)
                if not cross:
                    continue
                if pr > 1:
                    dots[r0 : r0 + pr - 1, c0 : c0 + pc] += np.vecdot(block[1:], block[:-1])
                if carry is not None:
                    if r0:
                        dots[r0 - 1, c0 : c0 + pc] += np.vecdot(block[0], carry[:pc, :pv])
                    carry[:pc, :pv] = block[-1]
    return r1, r2, dots


def _difference_dtype(later: np.ndarray, earlier: np.ndarray) -> type[np.floating]:
    """The dtype ``later - earlier`` is formed in: float32 for float32 data (each within half
    an ulp of the exact difference), float64 for other dtypes; with or without NaNs."""
    return np.float32 if later.dtype == earlier.dtype == np.float32 else np.float64


def _masked_moments(x: np.ndarray) -> tuple[np.ndarray, ...]:
    """``(count, mean, m2, min, max, nans)`` per channel of ``x`` with NaNs, skipping them.
    The minimum and maximum are values of ``x`` (taken before the deviations are formed:
    ``x - mean + mean`` is not always ``x`` in floating point); a channel of NaNs only has
    ``inf`` / ``-inf``, which the running extrema pass over. The mean and ``m2`` are taken
    from the deviations from a value of each channel (its minimum), then from their mean: a
    float64 mean of ``n`` equal values is not always that value (``0.1`` summed 1,000 times
    and divided), and its deviations made a constant channel a ``std`` of 1e-17, not 0."""
    x64 = x.astype(np.float64)
    nan = np.isnan(x64)
    n = (~nan).sum(axis=(0, 2)).astype(np.float64)
    x64[nan] = np.inf
    lo = x64.min(axis=(0, 2))
    x64[nan] = -np.inf
    hi = x64.max(axis=(0, 2))
    ref = np.where(n > 0, lo, 0.0)
    x64 -= ref[None, :, None]
    x64[nan] = 0.0
    shift = x64.sum(axis=(0, 2)) / np.maximum(n, 1)
    x64 -= shift[None, :, None]
    x64[nan] = 0.0
    m2 = np.einsum("rcv,rcv->c", x64, x64)
    return n, ref + shift, m2, lo, hi, nan.sum(axis=(0, 2)).astype(np.float64)


def as_channels(
    x: np.ndarray, channels: tuple[int, ...], pooled: tuple[int, ...] = ()
) -> np.ndarray:
    """``(n, *channels, *grid)`` -> ``(n, prod(kept channels), rest)`` (a view when it can):
    the channel axes at the positions ``pooled`` are reduced with the grid (moved behind the
    others: a copy)."""
    if pooled:
        keep = [1 + i for i in range(len(channels)) if i not in pooled]
        rest = range(1 + len(channels), x.ndim)
        x = x.transpose(0, *keep, *(1 + i for i in pooled), *rest)
        channels = tuple(channels[i - 1] for i in keep)
    return x.reshape(x.shape[0], math.prod(channels), -1)
