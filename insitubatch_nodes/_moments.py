"""Per-channel running moments in float64: what :func:`~insitubatch_nodes.statistics.fit_statistics`
accumulates batch by batch.

:class:`_Moments` keeps, per channel, the count of finite values, their mean, the sum of squared
deviations from it, the minimum, the maximum and the NaNs skipped; batches are merged as Chan et
al.'s pairwise update. A batch's sums and sums of squares are taken in float64 straight from the
data (two reads, nothing written); where they would cancel (a channel's mean more than ``CANCEL
** 0.5`` standard deviations from zero, or a constant channel), and in a batch with NaNs, its
deviations from a per-channel reference near the mean (the running mean, else a value of the
channel) are summed and squared instead: a constant channel, missing points or not, has a mean
that is its value and a sum of squares of exactly 0.
"""

from __future__ import annotations

import math

import numpy as np

#: the plain float64 sums serve while sum(x**2) <= CANCEL * sum((x - mean)**2) per channel
#: (a relative error of about CANCEL * 2**-53 per term summed, ~1e-9 at most in practice)
CANCEL = 1e5


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
        s1 = np.einsum("rcv->c", x, dtype=np.float64)  # a NaN anywhere shows here
        if np.isnan(s1).any():
            n, mean, m2, lo, hi, nans = _masked_moments(x)
        else:
            n = np.full(x.shape[1], float(x.shape[0] * x.shape[2]))
            mean = s1 / n
            # the plain sums in float64 (two reads of x, nothing written): exact enough
            # while the squares do not cancel, i.e. the mean is within CANCEL ** 0.5 standard
            # deviations of zero; else the deviations from a reference near the mean
            s2 = np.einsum("rcv,rcv->c", x, x, dtype=np.float64)
            m2 = s2 - s1 * mean
            if np.any(s2 > CANCEL * m2):
                mean, m2 = self._about_reference(x, n)
            m2 = np.maximum(m2, 0.0)
            if extrema:
                lo = x.min(axis=(0, 2)).astype(np.float64)
                hi = x.max(axis=(0, 2)).astype(np.float64)
            else:
                lo = hi = np.full(x.shape[1], np.nan)
            nans = np.zeros_like(n)
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

    def _about_reference(self, x: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(mean, m2)`` of ``x`` (no NaN) from its deviations from a per-channel reference
        near the mean (the running mean, else the batch's first value), taken in the data's
        own dtype and summed and squared in float64: no cancellation of large squares."""
        first = x[0, :, 0].astype(np.float64)
        # a channel with no value yet (all NaN so far) has a running mean of 0: not near it
        ref = (np.where(self.n > 0, self.mean, first) if self.started else first).astype(x.dtype)
        d = x - ref[None, :, None]
        mean_d = np.einsum("rcv->c", d, dtype=np.float64) / n
        m2 = np.einsum("rcv,rcv->c", d, d, dtype=np.float64) - n * mean_d**2
        return ref.astype(np.float64) + mean_d, m2

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
