"""Activation ranges for int8 from the values a tensor takes on the calibration samples, by four methods,
and the error each range gives those values, by which `auto` chooses a method per tensor.

The int8 scheme is TFLite's (and onnxruntime's QDQ): a range [a, b] is first widened to hold 0, then
held by 256 levels of step s = (b - a) / 255 with an integer zero point z, so 0 is exact; a value x
becomes q = clip(round(x / s) + z, -128, 127) and is read back as (q - z) * s. A narrower range gives a
finer step (less rounding error, about s^2 / 12 per value) and clips more values (error x - b beyond b).

The methods, as onnxruntime's and TensorRT's calibrators offer them (reimplemented on one histogram of
HISTOGRAM_BINS bins over the values' min-max range):

- minmax: [min, max] of the values seen; nothing clipped, the step set by the rarest outlier.
- percentile: the p-th and (100 - p)-th percentiles (onnxruntime's PercentileCalibrater), rounded
  outwards to a bin edge.
- mse: the range minimizing the mean squared error of the values quantized, clipping and rounding
  together: E(a, b) = sum_{x < a} (x - a)^2 + sum_{x > b} (x - b)^2 + n_inside * s^2 / 12, over every
  pair of bin edges holding 0 (prefix sums of the counts, of count * x and of count * x^2 make each
  pair O(1); coarse-to-fine: every MSE_STRIDE-th edge, then every edge near the best).
- entropy: TensorRT's KL calibration (onnxruntime's EntropyCalibrater): for a threshold t, the window
  [max(min, -t), min(max, t)] of the histogram, the values outside it folded into its end bins (P),
  and the same window quantized to the 256 int8 levels, each level's count spread evenly over the
  bins of the level that hold values (Q); the t minimizing KL(P || Q). TensorRT takes |x| and 128
  levels; the window here follows int8's asymmetric grid, so a one-signed tensor (after a ReLU) gets
  all 256 levels. A window spans at least 256 bins, as TensorRT's spans at least its 128 levels.

`auto` measures, for each tensor, the squared error of its values on the calibration samples quantized
with each method's range (`Errors`: exact, value by value, not from the histogram) and keeps the least;
ties go to the earlier method in METHODS. Everything here is numpy over fixed bins and sums in a fixed
order: the same values give the same ranges, bit for bit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

METHODS = ("minmax", "percentile", "mse", "entropy")
HISTOGRAM_BINS = 2048
LEVELS = 256  # int8
MSE_STRIDE = 8  # the coarse search's step in bin edges; then every edge within one step of the best
ENTROPY_STRIDE = 32  # the same for the entropy method's threshold (each KL is O(bins)), then 4, then 1
ENTROPY_EPS = 1e-4  # onnxruntime's smoothing of empty bins before the KL divergence


Range = tuple[float, float]


def with_zero(lo: float, hi: float) -> Range:
    """The range int8 holds for [lo, hi]: widened to hold 0, as the converters widen it."""
    return min(float(lo), 0.0), max(float(hi), 0.0)


def quantized(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """`x` as int8 over [lo, hi] reads it back (TFLite's nudged zero point): the values `auto` compares."""
    lo, hi = with_zero(lo, hi)
    if hi <= lo:
        return np.zeros_like(x)
    scale = (hi - lo) / (LEVELS - 1)
    zero = float(np.clip(np.round(-128 - lo / scale), -128, 127))
    q = np.clip(np.round(x / scale) + zero, -128, 127)
    return ((q - zero) * scale).astype(x.dtype, copy=False)


@dataclass
class Histogram:
    """One tensor's values over [lo, hi] (its min-max range), in HISTOGRAM_BINS bins."""

    lo: float
    hi: float
    counts: np.ndarray = field(default_factory=lambda: np.zeros(HISTOGRAM_BINS, np.int64))

    def add(self, values: np.ndarray) -> None:
        # in float64: numpy makes the bins in the values' own type, and a float32 range some 1e-7 of its
        # magnitude wide (a tensor that barely moves, away from 0) holds fewer than HISTOGRAM_BINS distinct
        # edges there ("Too many bins for data range"); narrower still, even float64's, and such a tensor
        # keeps its min-max range (`ranges`: no values counted)
        if self.hi > self.lo and self.resolved:
            self.counts += np.histogram(np.asarray(values, np.float64), HISTOGRAM_BINS, (self.lo, self.hi))[0]

    @functools.cached_property  # lo and hi never change: not once per sample
    def resolved(self) -> bool:
        """Whether float64 holds HISTOGRAM_BINS distinct bins over [lo, hi]."""
        return bool(np.all(np.diff(self.edges) > 0))

    @property
    def edges(self) -> np.ndarray:
        return np.linspace(self.lo, self.hi, HISTOGRAM_BINS + 1)


def ranges(h: Histogram, percentile: float = 99.99) -> dict[str, Range]:
    """Each method's range for the values `h` holds, widened to hold 0 (what the converter will hold)."""
    if h.hi <= h.lo or not h.counts.sum():
        return {m: with_zero(h.lo, h.hi) for m in METHODS}
    return {"minmax": with_zero(h.lo, h.hi), "percentile": with_zero(*percentile_range(h, percentile)),
            "mse": with_zero(*mse_range(h)), "entropy": with_zero(*entropy_range(h))}


def percentile_range(h: Histogram, percentile: float) -> Range:
    """The `percentile`-th and (100 - `percentile`)-th percentiles, outwards to bin edges: the first bin
    whose cumulative share passes the lower tail, the last bin still holding values inside the upper."""
    tail = (100.0 - percentile) / 100.0
    cdf = np.cumsum(h.counts) / h.counts.sum()
    edges = h.edges
    lo = float(edges[int(np.searchsorted(cdf, tail, side="right"))])
    hi = float(edges[min(int(np.searchsorted(cdf, 1.0 - tail, side="left")) + 1, HISTOGRAM_BINS)])
    lo, hi = max(lo, h.lo), min(hi, h.hi)
    return (lo, hi) if hi > lo else (h.lo, h.hi)


def _zero_edge(h: Histogram) -> int:
    """The index of the bin edge nearest 0 (0 where all values are positive, the last where negative)."""
    return int(np.clip(np.round(-h.lo / (h.hi - h.lo) * HISTOGRAM_BINS), 0, HISTOGRAM_BINS))


def mse_range(h: Histogram) -> Range:
    """The range of least expected squared quantization error (module docstring), over pairs of edges
    (s, e) with s <= the zero edge <= e."""
    edges = h.edges
    centers = (edges[:-1] + edges[1:]) / 2
    counts = h.counts.astype(np.float64)
    # prefix sums: P_k[i] = sum over bins < i of count * center^k
    p0, p1, p2 = (np.concatenate([[0.0], np.cumsum(counts * centers ** k)]) for k in range(3))
    z = _zero_edge(h)

    def error(s: np.ndarray, e: np.ndarray) -> np.ndarray:
        a, b = np.minimum(edges[s], 0.0), np.maximum(edges[e], 0.0)
        left = p2[s] - 2 * a * p1[s] + a * a * p0[s]
        right = (p2[-1] - p2[e]) - 2 * b * (p1[-1] - p1[e]) + b * b * (p0[-1] - p0[e])
        step = (b - a) / (LEVELS - 1)
        return left + right + (p0[e] - p0[s]) * step * step / 12.0

    def best(starts: np.ndarray, ends: np.ndarray) -> tuple[int, int]:
        s, e = np.meshgrid(starts, ends, indexing="ij")
        keep = e > s
        s, e = s[keep], e[keep]
        i = int(np.argmin(error(s, e)))  # the first of equal errors: the order of the grid, fixed
        return int(s[i]), int(e[i])

    def grid(lo: int, hi: int, stride: int) -> np.ndarray:
        return np.unique(np.concatenate([np.arange(lo, hi + 1, stride), [lo, hi]]))

    s, e = best(grid(0, z, MSE_STRIDE), grid(z, HISTOGRAM_BINS, MSE_STRIDE))
    s, e = best(grid(max(s - MSE_STRIDE, 0), min(s + MSE_STRIDE, z), 1),
                grid(max(e - MSE_STRIDE, z), min(e + MSE_STRIDE, HISTOGRAM_BINS), 1))
    return float(edges[s]), float(edges[e])


def entropy_range(h: Histogram) -> Range:
    """TensorRT's KL calibration over thresholds t (module docstring): the window of least KL(P || Q)."""
    edges = h.edges
    width = (h.hi - h.lo) / HISTOGRAM_BINS
    z = _zero_edge(h)
    # threshold k is t = k bin widths from 0; its window's first and last edges. Below the range's nearest
    # end to 0 (a range away from 0) every window is empty: the thresholds start there, else a range 1e-7
    # of its magnitude wide made some 1e9 of them
    near = 0.0 if h.lo <= 0.0 <= h.hi else min(abs(h.lo), abs(h.hi))
    t = np.arange(max(int(np.floor(near / width)), 1), int(np.ceil(max(-h.lo, h.hi) / width)) + 1) * width
    steps = len(t)
    starts = np.clip(np.floor((np.maximum(h.lo, -t) - h.lo) / width + 1e-9), 0, z).astype(int)
    ends = np.clip(np.ceil((np.minimum(h.hi, t) - h.lo) / width - 1e-9), z, HISTOGRAM_BINS).astype(int)
    wide = np.flatnonzero(ends - starts >= LEVELS)  # a window spans at least LEVELS bins
    if not wide.size:
        return h.lo, h.hi
    first = int(wide[0])

    def least(ks) -> int:
        best, best_k = np.inf, None
        for k in ks:
            d = _kl(h.counts, int(starts[k]), int(ends[k]))
            if d < best:  # strictly: the first (narrowest) of equal divergences
                best, best_k = d, k
        return best_k if best_k is not None else steps - 1

    k = least(sorted({*range(first, steps, ENTROPY_STRIDE), steps - 1}))
    for stride in (ENTROPY_STRIDE // 8, 1):  # then finer, about the best so far
        k = least(range(max(first, k - 8 * stride), min(steps - 1, k + 8 * stride) + 1, stride))
    return float(edges[starts[k]]), float(edges[ends[k]])


def _kl(counts: np.ndarray, s: int, e: int) -> float:
    """KL(P || Q) for the window of bins [s, e): P its counts with what lies outside folded into its end
    bins, Q the window's counts merged into LEVELS levels and spread evenly over each level's bins that
    hold values."""
    p = counts[s:e].astype(np.float64)
    p[0] += counts[:s].sum()
    p[-1] += counts[e:].sum()
    n = e - s
    level = np.minimum((np.arange(n) * LEVELS) // n, LEVELS - 1)
    held = counts[s:e] > 0
    total = np.bincount(level, counts[s:e].astype(np.float64), LEVELS)
    bins = np.bincount(level, held.astype(np.float64), LEVELS)
    q = np.where(held, total[level] / np.maximum(bins[level], 1.0), 0.0)
    p, q = _smooth(p), _smooth(q)
    if p is None or q is None:
        return np.inf
    p, q = p / p.sum(), q / q.sum()
    return float(np.sum(p * np.log(p / q)))


def _smooth(p: np.ndarray) -> np.ndarray | None:
    """Empty bins given ENTROPY_EPS, taken evenly off the others (onnxruntime's smooth_distribution)."""
    zeros = p == 0
    if zeros.all():
        return None
    eps1 = ENTROPY_EPS * zeros.sum() / (~zeros).sum()
    out = p + np.where(zeros, ENTROPY_EPS, -eps1)
    return out if (out > 0).all() else np.where(out > 0, out, ENTROPY_EPS)


@dataclass
class Errors:
    """Per method, the sum of squared errors of one tensor's values read back through int8 over that
    method's range, and how many values: accumulated sample by sample (`add`)."""

    ranges: dict[str, Range]
    squared: dict[str, float] = field(default_factory=dict)
    values: int = 0

    def add(self, x: np.ndarray) -> None:
        x = np.asarray(x, np.float32).ravel()
        done: dict[Range, float] = {}
        for m, (lo, hi) in self.ranges.items():
            if (lo, hi) not in done:
                # numpy's own pairwise sum, not BLAS's dot: the same order every run, and no BLAS threads
                done[(lo, hi)] = float(np.sum(np.square(quantized(x, lo, hi) - x, dtype=np.float64)))
            self.squared[m] = self.squared.get(m, 0.0) + done[(lo, hi)]
        self.values += x.size

    def rms(self, method: str) -> float:
        return float(np.sqrt(self.squared.get(method, 0.0) / max(self.values, 1)))

    def least(self) -> str:
        """The method of least error; of equal ones, the first in METHODS."""
        return min((m for m in METHODS if m in self.ranges), key=lambda m: (self.squared.get(m, 0.0), METHODS.index(m)))


OUTPUT_ERROR = "per output: squared error / squared deviation of the float values from their mean, averaged over the outputs"


def output_error(got: list[dict[str, np.ndarray]], want: list[dict[str, np.ndarray]]) -> float:
    """How far quantized outputs `got` are from the float ones `want` (per sample, by name): OUTPUT_ERROR,
    1 - R^2 of each output, so that outputs of every scale count alike."""
    errors = []
    for name in want[0]:
        w = np.stack([v[name] for v in want]).astype(np.float64)
        g = np.stack([v[name] for v in got]).astype(np.float64)
        spread = float(np.sum((w - w.mean()) ** 2)) or 1.0
        errors.append(float(np.sum((g - w) ** 2)) / spread)
    return float(np.mean(errors))
