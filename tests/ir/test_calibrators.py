"""The calibration methods (ir/calibrators.py) on distributions whose best int8 ranges are known, and the
per-tensor choice `auto` makes by measured error."""

from __future__ import annotations

import numpy as np
import pytest

from edgesdk.ir import calibrators as c


def _histogram(x: np.ndarray) -> c.Histogram:
    h = c.Histogram(float(x.min()), float(x.max()))
    h.add(x)
    return h


def _errors(x: np.ndarray, ranges: dict) -> c.Errors:
    e = c.Errors(ranges)
    e.add(x)
    return e


def test_gaussian_with_rare_outliers_mse_and_entropy_clip_them_minmax_does_not():
    """N(0, 1), 2 million values, and 4 outliers at +-38..40 (2 in a million). Min-max spans the outliers,
    so its int8 step is 80 / 255 and every ordinary value is held to within 0.16; MSE, entropy (KL) and
    percentile clip them and keep the Gaussian's bulk (MSE weighs the clipped outliers' squared error
    against the finer step: about +-11 here), and `auto` (the least measured error) is not min-max."""
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, 2_000_000).astype(np.float32)
    x[:4] = [-40, 40, -38, 39]
    r = c.ranges(_histogram(x))
    assert r["minmax"] == (-40.0, 40.0)
    for m in ("percentile", "mse", "entropy"):
        lo, hi = r[m]
        assert -20 < lo < -3.5 and 3.5 < hi < 20, (m, r[m])  # the outliers clipped, the Gaussian's bulk kept
    e = _errors(x, r)
    assert e.least() == "mse" and e.rms("mse") < 0.6 * e.rms("minmax"), {m: e.rms(m) for m in c.METHODS}
    bulk = x[4:]  # the ordinary values: min-max's coarse step costs them, the clips do not
    rms = {m: float(np.sqrt(np.mean((c.quantized(bulk, *r[m]) - bulk) ** 2))) for m in c.METHODS}
    assert all(rms[m] < rms["minmax"] / 3 for m in ("percentile", "mse", "entropy")), rms


@pytest.mark.parametrize("scale, optimum", [(1.0, 3.92), (2.0, 7.84)])
def test_mse_finds_the_known_best_clip_of_a_gaussian(scale, optimum):
    """The MSE-optimal symmetric clip for 8-bit uniform quantization of N(0, s) is 3.92 s (ACIQ); the
    search over the histogram's edges lands within 5 % of it, and its error is no worse than any
    symmetric clip tried by brute force on the values themselves."""
    rng = np.random.default_rng(1)
    x = rng.normal(0, scale, 1_000_000).astype(np.float32)
    lo, hi = c.mse_range(_histogram(x))
    assert abs(-lo - optimum) < 0.05 * optimum and abs(hi - optimum) < 0.05 * optimum, (lo, hi)
    mse = float(np.mean((c.quantized(x, lo, hi) - x) ** 2))
    brute = min(float(np.mean((c.quantized(x, -t, t) - x) ** 2)) for t in np.linspace(0.5, 1.5, 41) * optimum)
    assert mse <= brute * 1.01, (mse, brute)


def test_nothing_to_clip_keeps_min_max_and_auto_takes_it():
    """Uniform values: clipping only loses. Every method keeps (about) the whole range, and `auto`'s
    choice is min-max (of equal errors, the first method)."""
    rng = np.random.default_rng(2)
    x = rng.uniform(-1, 3, 500_000).astype(np.float32)
    r = c.ranges(_histogram(x))
    for m, (lo, hi) in r.items():
        assert lo <= -0.98 and hi >= 2.98, (m, lo, hi)
    assert _errors(x, r).least() == "minmax"


def test_one_signed_values_keep_zero_and_use_the_whole_grid():
    """After a ReLU: every range starts at 0 (int8 holds 0 exactly), and the long tail is clipped by MSE."""
    rng = np.random.default_rng(3)
    x = np.maximum(rng.normal(0, 1, 1_000_000), 0).astype(np.float32)
    x[:2] = [30, 25]
    r = c.ranges(_histogram(x))
    assert all(lo == 0.0 for lo, _ in r.values()), r
    assert r["minmax"][1] == 30 and 3.5 < r["mse"][1] < 25 and r["entropy"][1] < 25, r


def test_a_range_not_holding_zero_is_widened_to_hold_it():
    x = np.linspace(2, 5, 10_000, dtype=np.float32)
    assert c.ranges(_histogram(x))["minmax"] == (0.0, 5.0)
    q = c.quantized(np.array([0.0, 2.0, 5.0, 7.0], np.float32), 2, 5)
    assert q[0] == 0.0 and abs(q[1] - 2) <= 5 / 255 / 2 + 1e-6 and abs(q[2] - 5) < 5 / 255 and q[3] == q[2]


def test_the_same_values_give_the_same_ranges_bit_for_bit():
    rng = np.random.default_rng(4)
    x = rng.standard_t(3, 300_000).astype(np.float32)
    a, b = c.ranges(_histogram(x)), c.ranges(_histogram(x.copy()))
    assert a == b


def test_auto_takes_the_method_of_least_error_of_the_values_themselves():
    """The errors `auto` compares are measured value by value on the samples (not from the histogram),
    accumulated over samples; `least` is their arg min, ties to the earlier method."""
    rng = np.random.default_rng(5)
    xs = [rng.laplace(0, 1, 100_000).astype(np.float32) for _ in range(3)]
    h = c.Histogram(float(min(x.min() for x in xs)), float(max(x.max() for x in xs)))
    for x in xs:
        h.add(x)
    r = c.ranges(h)
    e = c.Errors(r)
    for x in xs:
        e.add(x)
    whole = np.concatenate(xs)
    for m, (lo, hi) in r.items():
        assert e.squared[m] == pytest.approx(float(np.sum((c.quantized(whole, lo, hi) - whole).astype(np.float64) ** 2)),
                                             rel=1e-9)
    assert e.least() == min(c.METHODS, key=lambda m: e.squared[m])
    tied = c.Errors({"minmax": (0.0, 1.0), "percentile": (0.0, 1.0)})
    tied.add(np.linspace(0, 1, 100, dtype=np.float32))
    assert tied.least() == "minmax"


def test_a_tensor_that_barely_moves_away_from_zero_is_binned_or_kept_at_its_min_max_range():
    """A float32 tensor whose values span some 1e-7 of their magnitude (an activation that barely moves, as in
    transformers' EfficientNet-B0 with random weights) made numpy's histogram fail in float32 ("Too many bins
    for data range": an internal error of the build). In float64 it is binned, and every method's range lies
    within its min-max one; narrower than float64 can split into bins, it keeps its min-max range."""
    rng = np.random.default_rng(0)
    values = (10.0 + rng.uniform(0, 1e-5, 4096)).astype(np.float32)
    h = c.Histogram(float(values.min()), float(values.max()))
    h.add(values)
    assert h.counts.sum() == values.size
    r = c.ranges(h)
    for lo, hi in r.values():
        assert 0.0 <= lo and hi <= float(values.max()) + 1e-12, r
    tight = c.Histogram(10.0, 10.0 + 1e-14)
    tight.add(np.full(16, 10.0, np.float32))
    assert not tight.resolved and tight.counts.sum() == 0
    assert set(c.ranges(tight).values()) == {c.with_zero(10.0, 10.0 + 1e-14)}
