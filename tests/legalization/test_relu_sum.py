"""ReLU-sum approximations (`legalization.relu_sum`): the error bound on grids of our own, knot
counts against uniform knots and against the asymptotic optimum, the ONNX form against numpy in
onnxruntime, the error paths, and the real int8 TFLite error.

About 5 s on the 2-core build machine (6.5 s with pytest's start-up), 2.3 s of it TensorFlow's
import and the conversion in the int8 test, 1.1 s the hypothesis test.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper
from scipy.optimize import linprog
from scipy.special import erf

from edgesdk.legalization.relu_sum import (
    VERIFY_POINTS,
    Approximation,
    ApproximationError,
    evaluate,
    fit,
    int8_errors,
    to_onnx,
    to_onnx_conv,
)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    return np.logaddexp(0.0, x)


def gelu(x):
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def silu(x):
    return x * sigmoid(x)


def mish(x):
    return x * np.tanh(softplus(x))


def elu(x):
    return np.where(x > 0, x, np.expm1(np.minimum(x, 0.0)))


# name: (f, lo, hi, max_knots, knots at 1e-2, knots at 1e-3), counts as measured (adaptive vs
# uniform knots with the best vertex values, by LP: softplus 7/24 vs 19/62, gelu 6/22 vs 35/111,
# silu 7/27 vs 27/88, mish 8/26 vs 31/100, elu 5/16 vs 32/120, tanh 8/26 vs 34/109,
# sigmoid 6/18 vs 12/38, exp 100/322 vs 583/1569, log 11/37 vs 200/697).
FUNCTIONS = {
    "softplus": (softplus, -8.0, 8.0, 64, 7, 24),
    "gelu": (gelu, -8.0, 8.0, 64, 6, 22),
    "silu": (silu, -8.0, 8.0, 64, 7, 27),
    "mish": (mish, -8.0, 8.0, 64, 8, 26),
    "elu": (elu, -8.0, 8.0, 64, 5, 16),
    "tanh": (np.tanh, -8.0, 8.0, 64, 8, 26),
    "sigmoid": (sigmoid, -8.0, 8.0, 64, 6, 18),
    # the bound is absolute and exp reaches 403: ~100 knots at 1e-2 (see test_exp_needs_...)
    "exp": (np.exp, -6.0, 6.0, 400, 100, 322),
    "log": (np.log, 0.1, 10.0, 64, 11, 37),
}


def dense_error(a: Approximation, f, seed: int = 0) -> float:
    """max |f - g| on points of our own: 199,999 uniform ones (not the module's grid) and 20,000
    random ones."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([np.linspace(a.lo, a.hi, 199_999), rng.uniform(a.lo, a.hi, 20_000)])
    return float(np.abs(evaluate(a, x) - f(x)).max())


def documented_bound(f, lo: float, hi: float, eps: float) -> float:
    """eps + M*h^2/8, the module's guarantee between its verification points (h at most
    (hi - lo)/(VERIFY_POINTS - 1)), with M = max |f''| from second differences."""
    x, dx = np.linspace(lo, hi, 200_001, retstep=True)
    curvature = float(np.abs(np.diff(f(x), 2)).max()) / dx**2
    h = (hi - lo) / (VERIFY_POINTS - 1)
    return eps + 1.01 * curvature * h**2 / 8


def uniform_minimax_error(f, lo: float, hi: float, n_knots: int, points: int = 2001) -> float:
    """The smallest max |f - g| on `points` uniform points over continuous piecewise-linear g with
    n_knots uniform interior knots (vertex values free): an LP, min t s.t. |B v - f| <= t."""
    x = np.linspace(lo, hi, points)
    vertices = np.linspace(lo, hi, n_knots + 2)
    basis = np.stack([np.interp(x, vertices, row) for row in np.eye(n_knots + 2)], axis=1)
    ones = np.ones((points, 1))
    y = f(x)
    cost = np.zeros(n_knots + 3)
    cost[-1] = 1.0
    result = linprog(cost, A_ub=np.vstack([np.hstack([basis, -ones]), np.hstack([-basis, -ones])]),
                     b_ub=np.concatenate([y, -y]), bounds=[(None, None)] * (n_knots + 2) + [(0, None)],
                     method="highs")
    assert result.success, result.message
    return float(result.fun)


def run_onnx(nodes, inits, inputs: dict[str, np.ndarray], outputs: list[str]) -> list[np.ndarray]:
    graph = helper.make_graph(
        nodes, "relu_sum",
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, v.shape) for n, v in inputs.items()],
        # elementwise: every output has the shape of the (one) input
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, next(iter(inputs.values())).shape)
         for n in outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(outputs, inputs)


# ---------------------------------------------------------------------------------------------
# The bound and the knot counts


@pytest.mark.parametrize("eps", [1e-2, 1e-3])
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_bound_holds_on_an_independent_grid_with_the_measured_knots(name, eps):
    f, lo, hi, max_knots, knots_1e2, knots_1e3 = FUNCTIONS[name]
    a = fit(f, lo, hi, eps, max_knots=max_knots)
    assert a.grid_error <= eps
    assert dense_error(a, f) <= documented_bound(f, lo, hi, eps)
    assert len(a.knots) <= (knots_1e2 if eps == 1e-2 else knots_1e3), a.knots
    assert len(a.knots) == len(a.weights) and list(a.knots) == sorted(a.knots)
    assert all(lo < k < hi for k in a.knots)


@pytest.mark.parametrize("name, second_derivative", [
    ("softplus", lambda x: sigmoid(x) * (1 - sigmoid(x))),
    ("exp", np.exp),
    ("log", lambda x: 1 / x**2),
])
@pytest.mark.parametrize("eps", [1e-2, 1e-3])
def test_knot_count_is_near_the_asymptotic_optimum_for_convex_functions(name, second_derivative, eps):
    # For a convex (or concave) f the fewest pieces of a continuous piecewise-linear g with
    # |f - g| <= eps tend to integral sqrt(|f''| / (16 eps)) dx as eps -> 0 (each piece of
    # length h equioscillates with error h^2 |f''| / 16).
    f, lo, hi, max_knots, *_ = FUNCTIONS[name]
    x = np.linspace(lo, hi, 100_001)
    optimum = float(np.trapezoid(np.sqrt(np.abs(second_derivative(x)) / (16 * eps)), x))
    pieces = len(fit(f, lo, hi, eps, max_knots=max_knots).knots) + 1
    assert optimum - 1 <= pieces <= 1.05 * optimum + 1, (pieces, optimum)


@pytest.mark.parametrize("name, eps", [("softplus", 1e-3), ("gelu", 1e-2), ("log", 1e-3)])
def test_uniform_knots_with_as_many_knots_miss_the_bound(name, eps):
    f, lo, hi, max_knots, *_ = FUNCTIONS[name]
    a = fit(f, lo, hi, eps, max_knots=max_knots)
    assert uniform_minimax_error(f, lo, hi, len(a.knots)) > 1.5 * eps


def test_outside_the_range_g_continues_its_first_and_last_pieces():
    a = fit(softplus, -4.0, 4.0, 1e-2)
    below = np.linspace(-20.0, -4.0, 50)
    above = np.linspace(4.0, 20.0, 50)
    assert np.allclose(evaluate(a, below), a.c0 + a.c1 * below, rtol=0, atol=1e-12)
    last_slope = a.c1 + sum(a.weights)
    assert np.allclose(evaluate(a, above), evaluate(a, np.array(4.0)) + last_slope * (above - 4.0), rtol=0, atol=1e-12)
    assert abs(last_slope - 1.0) < 0.05 and abs(a.c1) < 0.05  # softplus' own slopes at -4 and 4


def test_to_json_is_plain_and_counts_pieces():
    a = fit(silu, -8.0, 8.0, 1e-2)
    report = json.loads(json.dumps(a.to_json()))
    assert set(report) == {"lo", "hi", "pieces", "knots", "weights", "c0", "c1", "grid_error"}
    assert report["pieces"] == len(a.knots) + 1 == len(report["weights"]) + 1
    assert report["grid_error"] == a.grid_error <= 1e-2


@st.composite
def smooth_functions(draw):
    """a*sin(b*x + c) + d*tanh(e*x) + a cubic in t = (x - mid)/half, on a random [lo, hi]."""
    a, d = draw(st.floats(-2, 2)), draw(st.floats(-2, 2))
    b, e = draw(st.floats(-3, 3)), draw(st.floats(-3, 3))
    c = draw(st.floats(-math.pi, math.pi))
    cubic = draw(st.lists(st.floats(-2, 2), min_size=4, max_size=4))
    lo = draw(st.floats(-10, 5))
    hi = lo + draw(st.floats(0.5, 20))
    mid, half = (lo + hi) / 2, (hi - lo) / 2

    def f(x):
        return a * np.sin(b * x + c) + d * np.tanh(e * x) + np.polyval(cubic, (x - mid) / half)

    return f, lo, hi


@settings(max_examples=50, deadline=None)
@given(smooth_functions(), st.floats(-3, -1), st.integers(1, 24))
def test_random_smooth_functions_meet_the_bound_or_need_more_knots(case, log_eps, max_knots):
    f, lo, hi = case
    eps = 10.0**log_eps
    try:
        a = fit(f, lo, hi, eps, max_knots=max_knots)
    except ApproximationError as e:
        # Genuinely too few knots: uniform knots with the best vertex values miss the bound too,
        # the reported best error is above it, and that error is reachable with max_knots.
        assert f"at most {max_knots} knots" in str(e)
        assert e.best_error > eps
        assert e.knots_needed is None or e.knots_needed > max_knots
        assert uniform_minimax_error(f, lo, hi, max_knots) > eps
        assert len(fit(f, lo, hi, e.best_error, max_knots=max_knots).knots) <= max_knots
    else:
        assert len(a.knots) <= max_knots
        assert dense_error(a, f) <= documented_bound(f, lo, hi, eps)


# ---------------------------------------------------------------------------------------------
# ONNX


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_onnx_nodes_compute_g_in_float32(name):
    f, lo, hi, max_knots, *_ = FUNCTIONS[name]
    a = fit(f, lo, hi, 1e-3 if name != "exp" else 1e-2, max_knots=max_knots)
    nodes, inits = to_onnx(a, "x", "y", "act_")
    width = hi - lo
    # half the inputs outside [lo, hi]: the continued pieces are part of the graph's function
    x = np.random.default_rng(1).uniform(lo - width / 2, hi + width / 2, (1, 3, 8, 8)).astype(np.float32)
    x.flat[:4] = [lo, hi, a.knots[0], a.knots[-1]]
    (got,) = run_onnx(nodes, inits, {"x": x}, ["y"])
    x64 = x.astype(np.float64)
    want = evaluate(a, x64)
    assert got.shape == (1, 3, 8, 8) and got.dtype == np.float32
    # float32 rounding, as to_onnx states it: u*(log2(#terms) + 3) * the sum of |terms|;
    # measured 0.17-0.5 of that. It is large where big slopes cancel (log near 0.1, the
    # continuation of exp), so the 1e-5 absolute check is for the functions whose terms stay small.
    magnitude = abs(a.c0) + np.abs(a.c1 * x64)
    magnitude += sum(abs(w) * np.maximum(x64 - k, 0) for k, w in zip(a.knots, a.weights))
    rounding = 2.0**-24 * (math.ceil(math.log2(len(a.knots) + 1)) + 3) * magnitude
    assert (np.abs(got - want) <= rounding).all(), (np.abs(got - want) / rounding).max()
    if name not in ("exp", "log"):
        assert np.abs(got - want).max() <= 1e-5  # measured 0.5e-6..3.2e-6
    assert {n.op_type for n in nodes} <= {"Add", "Mul", "Relu"}
    # affine part (Mul, Add); per knot Add (none for k = 0, silu has one), Relu, Mul; one Add
    # per term summed
    assert len(nodes) == 2 + sum((k != 0) + 2 for k in a.knots) + len(a.knots)
    assert all(w not in (0.0, 1.0) for w in a.weights)
    assert all(i.name.startswith("act_") and i.dims == [] and i.data_type == onnx.TensorProto.FLOAT for i in inits)
    assert all(n.name.startswith("act_") for n in nodes)
    assert [o for n in nodes for o in n.output if not o.startswith("act_")] == ["y"]


def test_onnx_for_many_approximations_in_one_graph():
    a = fit(softplus, -8.0, 8.0, 1e-2)
    b = fit(np.tanh, -4.0, 4.0, 1e-2)
    nodes_a, inits_a = to_onnx(a, "x", "ya", "a_")
    nodes_b, inits_b = to_onnx(b, "x", "yb", "b_")
    x = np.linspace(-10, 10, 2 * 3 * 5, dtype=np.float32).reshape(2, 3, 5)
    ya, yb = run_onnx(nodes_a + nodes_b, inits_a + inits_b, {"x": x}, ["ya", "yb"])
    assert np.abs(ya - evaluate(a, x)).max() <= 1e-5
    assert np.abs(yb - evaluate(b, x)).max() <= 1e-5


@pytest.mark.parametrize("a, ops", [
    # relu(x): k = 0 needs no shift, w = 1 no product, c0 = c1 = 0 no affine part
    (Approximation(-1, 1, (0.0,), 0.0, 0.0, (1.0,), 0.0), ["Relu"]),
    # x + relu(x) + 0*relu(x - 0.5): c1 = 1 is x itself, the zero weight gives nothing
    (Approximation(-1, 1, (0.0, 0.5), 0.0, 1.0, (1.0, 0.0), 0.0), ["Relu", "Add"]),
    # the constant 2: x*0 keeps x's shape
    (Approximation(-1, 1, (), 2.0, 0.0, (), 0.0), ["Mul", "Add"]),
    # the identity: one node names the output
    (Approximation(-1, 1, (), 0.0, 1.0, (), 0.0), ["Mul"]),
    # 1.5 + 2 relu(x + 1) - 2 relu(x - 1): c1 = 0, c0 added last
    (Approximation(-2, 2, (-1.0, 1.0), 1.5, 0.0, (2.0, -2.0), 0.0),
     ["Add", "Relu", "Mul", "Add", "Relu", "Mul", "Add", "Add"]),
])
def test_onnx_emits_no_node_that_does_nothing(a, ops):
    nodes, inits = to_onnx(a, "x", "y", "p_")
    assert [n.op_type for n in nodes] == ops
    x = np.linspace(-3, 3, 61, dtype=np.float32).reshape(1, 61)
    (got,) = run_onnx(nodes, inits, {"x": x}, ["y"])
    assert np.abs(got - evaluate(a, x)).max() <= 1e-6


@pytest.mark.parametrize("name", ["softplus", "tanh", "silu"])
def test_conv_form_computes_g_in_float32_with_five_nodes_whatever_the_knots(name):
    """The Edge TPU form: Reshape, Conv, Relu, Conv, Reshape for 8 or 27 knots alike, g continued on
    both sides of [lo, hi] as `evaluate` continues it."""
    f, lo, hi, max_knots, *_ = FUNCTIONS[name]
    a = fit(f, lo, hi, 1e-3, max_knots=max_knots)
    nodes, inits = to_onnx_conv(a, "x", "y", "act_", (1, 3, 8, 8))
    assert [n.op_type for n in nodes] == ["Reshape", "Conv", "Relu", "Conv", "Reshape"]
    terms = len(a.knots) + 2 * (a.c1 != 0)
    slopes = next(i for i in inits if i.name == "act_slopes")
    assert list(slopes.dims) == [terms, 1, 1, 1]
    width = hi - lo
    x = np.random.default_rng(1).uniform(lo - width / 2, hi + width / 2, (1, 3, 8, 8)).astype(np.float32)
    x.flat[:4] = [lo, hi, a.knots[0], a.knots[-1]]
    (got,) = run_onnx(nodes, inits, {"x": x}, ["y"])
    x64 = x.astype(np.float64)
    magnitude = abs(a.c0) + np.abs(a.c1 * x64) + abs(a.c1 * a.lo)
    magnitude += sum(abs(w) * np.maximum(x64 - k, 0) for k, w in zip(a.knots, a.weights))
    rounding = 2.0**-24 * (terms + 2) * magnitude  # the docstring's bound
    assert got.shape == x.shape and (np.abs(got - evaluate(a, x64)) <= rounding).all()
    assert all(n.name.startswith("act_") for n in nodes)
    assert [o for n in nodes for o in n.output if not o.startswith("act_")] == ["y"]


def test_conv_form_of_a_constant_keeps_the_shape():
    nodes, inits = to_onnx_conv(Approximation(-1, 1, (), 2.0, 0.0, (), 0.0), "x", "y", "p_", (2, 5))
    (got,) = run_onnx(nodes, inits, {"x": np.linspace(-3, 3, 10, dtype=np.float32).reshape(2, 5)}, ["y"])
    assert got.shape == (2, 5) and np.all(got == 2.0)


def test_conv_form_converts_to_four_tflite_ops_in_int8(tmp_path):
    """RESHAPE, CONV_2D (the Relu fused), CONV_2D, RESHAPE, int8 throughout, for 24 knots; the tree
    form of the same approximation is 3 ops per knot."""
    from edgesdk.backends.tflite import convert_int8

    a = fit(softplus, -8, 8, 1e-3)
    points = (1, 4, 256)
    calibration = [{"x": np.random.default_rng(s).uniform(-8, 8, points).astype(np.float32)} for s in range(4)]
    counts = {}
    for form, (nodes, inits) in {"conv": to_onnx_conv(a, "x", "y", "s_", points),
                                 "tree": to_onnx(a, "x", "y", "s_")}.items():
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, points)],
                                  [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, points)], inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 10
        counts[form] = convert_int8(m, calibration, tmp_path / f"{form}.tflite").op_counts
    assert counts["conv"] == {"RESHAPE": 2, "CONV_2D": 2}, counts["conv"]
    assert sum(counts["tree"].values()) > 3 * len(a.knots), counts["tree"]


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("lo, hi", [(1.0, 1.0), (2.0, 1.0), (0.0, math.inf)])
def test_an_empty_range_is_refused(lo, hi):
    with pytest.raises(ValueError, match=r"lo must be below hi"):
        fit(np.tanh, lo, hi, 1e-3)


@pytest.mark.parametrize("eps", [0.0, -1e-3, math.nan])
def test_a_bound_that_is_not_positive_is_refused(eps):
    with pytest.raises(ValueError, match=r"the error bound must be a positive number"):
        fit(np.tanh, -1, 1, eps)


def test_f_not_finite_is_refused_saying_where():
    with pytest.raises(ValueError, match=r"f is not finite at \d+ of \d+ points in \[-1, 1\], "
                                         r"first at x = 0\.50\d* \(f = nan\), last at x = 1$"):
        fit(lambda x: np.where(x > 0.5, np.nan, x), -1, 1, 1e-3)


def test_f_that_is_not_vectorized_is_refused():
    with pytest.raises(ValueError, match=r"f must map an array to one of the same shape"):
        fit(lambda x: 1.0, -1, 1, 1e-3)


def test_too_few_knots_is_an_approximation_error_with_the_best_error_reached():
    with pytest.raises(ApproximationError) as err:
        fit(softplus, -8, 8, 1e-3, max_knots=4)
    e = err.value
    assert isinstance(e, ValueError)
    assert e.knots_needed == len(fit(softplus, -8, 8, 1e-3).knots) == 24
    assert 1e-3 < e.best_error < 0.05  # measured 0.0255
    assert str(e) == (f"cannot keep |f - g| <= 0.001 on [-8, 8] with at most 4 knots: the best error "
                      f"reached with 4 knots is {e.best_error:.3g}, and the bound needs 24 knots")
    # the best error is real: asked for, it is met with 4 knots
    a = fit(softplus, -8, 8, e.best_error, max_knots=4)
    assert len(a.knots) <= 4 and dense_error(a, softplus) <= documented_bound(softplus, -8, 8, e.best_error)


def test_exp_needs_about_a_hundred_knots_within_1e_2_on_minus_6_6():
    with pytest.raises(ApproximationError, match=r"with at most 64 knots: .* the bound needs 10\d knots"):
        fit(np.exp, -6, 6, 1e-2)


def test_a_discontinuous_f_cannot_be_verified():
    with pytest.raises(ApproximationError, match=r"cannot verify \|f - g\| <= 0.001 on \[-1, 1\].*discontinuous"):
        fit(np.sign, -1, 1, 1e-3)


# ---------------------------------------------------------------------------------------------
# int8


def test_int8_error_through_the_real_tflite_path():
    # Measured (TF 2.21, LiteRT 2.3), the conv form legalize emits: softplus 0.053, silu 0.058
    # for fits within 1e-3 of 24 and 27 knots (0.086 and 0.090 in the Add/Relu/Mul tree form).
    # Input and output quantization alone (steps 16/255 and ~8/255) give ~0.05; the rest is the
    # int8 rounding of the terms and of the weights.
    a = fit(softplus, -8, 8, 1e-3)
    b = fit(silu, -8, 8, 1e-3)
    errors = int8_errors([(a, softplus), (b, silu)])
    assert len(errors) == 2 and all(math.isfinite(e) for e in errors)
    assert errors[0] > 10 * a.grid_error and errors[1] > 10 * b.grid_error  # int8 really ran
    assert max(errors) < 0.12, errors
