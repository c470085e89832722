"""The golden self-test's tolerances (runtime/selftest.py), without a bundle: a difference of a few int8
steps in an activation's input, carried through LiteRT-style int8 LOGISTIC, TANH and SOFTMAX, stays
within the bound `through` gives, element by element, and that bound stays a few steps where the
activation saturates; a bundle from before tolerances were recorded is judged as it always was."""

from __future__ import annotations

import numpy as np
import pytest

from edgesdk.runtime.manifest import QuantParams, TensorSpec
from edgesdk.runtime.selftest import compare, through

STEPS = 4


def _int8(op: str, z: np.ndarray, out_step: float) -> np.ndarray:
    """The activation of `z` as an int8 kernel gives it, dequantized: LiteRT's output quantization
    (logistic and softmax 1/256 from 0, tanh 1/128 around 0), rounded to the nearest step."""
    if op == "LOGISTIC":
        y = 1 / (1 + np.exp(-z))
    elif op == "TANH":
        y = np.tanh(z)
    else:
        e = np.exp(z - z.max(-1, keepdims=True))
        y = e / e.sum(-1, keepdims=True)
    low = 0.0 if op != "TANH" else -1.0
    return np.clip(np.round((y - low) / out_step), 0, 255) * out_step + low


# a softmax's bound is taken from its output alone
@pytest.mark.parametrize("op, out_step, input_known", [
    ("LOGISTIC", 1 / 256, True), ("LOGISTIC", 1 / 256, False), ("TANH", 1 / 128, True), ("TANH", 1 / 128, False),
    ("SOFTMAX", 1 / 256, False)])
@pytest.mark.parametrize("in_step", [0.05, 0.88])
def test_steps_of_an_activations_input_stay_within_the_bound_carried_through_it(op, out_step, input_known, in_step):
    """The detector's logistic reads logits quantized at 0.88 per step: 2 steps of difference there move
    its output by up to 0.22 where the logit is near 0. Every input moved by up to STEPS steps (each
    element its own way) moves every output by at most `through`'s bound, computed from the golden
    output, and from the golden input where the segment gives it out too."""
    rng = np.random.default_rng(0)
    z = rng.integers(-128, 128, (64, 10)) * in_step
    golden = _int8(op, z, out_step)
    bound = through(op, golden, out_step, STEPS * in_step, z if input_known else None)
    for _ in range(50):
        moved = _int8(op, z + rng.integers(-STEPS, STEPS + 1, z.shape) * in_step, out_step)
        assert np.all(np.abs(moved - golden) <= bound + 1e-12)
    if input_known and in_step > 0.5:  # where the activation saturates, steps of its input move nothing
        far = np.abs(z) > 12 + STEPS * in_step
        assert far.any() and np.max(bound[far]) <= 2 * out_step


def test_the_bound_tells_a_text_pixel_from_an_empty_one():
    """A text map's logistic over logits at 0.88 per step: a pixel whose golden logit is 20 stays at 1,
    one at 0 may move by ~0.45 either way; from the output alone, a pixel the golden calls text (0.996)
    may fall to 0.78 at the least, so a map of zeros fails there."""
    step, delta = 1 / 256, STEPS * 0.88
    logits = np.array([20.0, 0.0])
    known = through("LOGISTIC", _int8("LOGISTIC", logits, step), step, delta, logits)
    assert known[0] <= 2 * step and 0.4 < known[1] < 0.5
    alone = through("LOGISTIC", np.array([255 * step, 128 * step]), step, delta)
    assert 0.15 < alone[0] < 0.3 and 0.4 < alone[1] < 0.5


def test_a_bundle_without_recorded_tolerances_is_judged_as_before():
    int8 = TensorSpec("y", (4,), "float32", quant=QuantParams(0.5, 0))
    golden = np.array([0.0, 0.5, 1.0, 1.5], np.float32)
    assert compare(int8, golden + 0.5, golden, None)["passed"]  # 1 LSB
    result = compare(int8, golden + 1.0, golden, None)
    assert not result["passed"] and result["rule"] == "1 LSB"
    float_ = TensorSpec("y", (4,), "float32")
    assert compare(float_, golden * (1 + 5e-5), golden, None)["passed"]
    assert not compare(float_, golden + 1e-3, golden, None)["passed"]


def test_a_recorded_tolerance_bounds_each_element_and_the_mean():
    spec = TensorSpec("y", (4,), "float32")
    golden = np.zeros(4, np.float32)
    tolerance = {"abs": 1.0, "mean_abs": 0.3, "rule": "r", "reason": "why"}
    assert compare(spec, np.array([0.9, 0, 0, 0]), golden, tolerance)["passed"]
    assert not compare(spec, np.array([1.1, 0, 0, 0]), golden, tolerance)["passed"]  # one element beyond
    result = compare(spec, np.array([0.9, 0.9, 0, 0]), golden, tolerance)  # each within, the mean not
    assert not result["passed"] and result["mean_abs_error"] == pytest.approx(0.45)
    assert not compare(spec, np.array([np.nan, 0, 0, 0]), golden, tolerance)["passed"]
    assert not compare(spec, np.zeros(3), golden, tolerance)["passed"]  # another shape
