"""A continuous unary function as a sum of ReLUs, within a stated error: as two 1x1 convolutions
around a Relu (`to_onnx_conv`, what legalize emits), or as Add, Mul and Relu only (`to_onnx`).

The Edge TPU lacks most smooth activations (Softplus, GELU, SiLU, Mish, ELU, Erf, Exp, Log, ...).
On an input range [lo, hi] we replace f by the continuous piecewise-linear

    g(x) = c0 + c1*x + sum_i w_i * relu(x - k_i)        (lo < k_1 < ... < k_m < hi)

whose slope is c1 left of k_1 and grows by w_i at each knot k_i.

Method. g is a chain of segments through vertices (t_j, v_j), t_0 = lo, t_last = hi, that stays in
the tube |g - f| <= tol at the points of a uniform fit grid (`FIT_POINTS`, more for a large
max_knots). From a vertex (a, v) the lines that stay in the tube up to a point b have slopes in

    [ max_{a<x<=b} (f(x) - tol - v) / (x - a),  min_{a<x<=b} (f(x) + tol - v) / (x - a) ],

an interval that only shrinks as b grows, so one running max/min pass over the grid finds the
furthest b (the next knot) and the slopes that reach it; we take the middle one. Free vertex
values, not f's own, let a segment sit on both sides of f (on a convex stretch it touches the
upper edge of the tube in its middle and the lower edge at its ends): sqrt(2) times the length of
a chord of f, so a convex stretch with curvature f'' needs about integral sqrt(f''/(16 tol))
segments where chords of f need sqrt(f''/(8 tol)). Knots crowd where |f''| is large. The first
vertex value is free within the tube; a few are tried, the fewest knots win. The greedy count is
not monotone in tol, so when the bound needs more than max_knots knots, the smallest tol whose
chain fits in max_knots is searched for; if even that misses the bound, `ApproximationError`
says the best error it reached.

Guarantee. The result is verified on n = `VERIFY_POINTS` (or more) uniform points, not those of
the fit grid, plus every knot and the points just beside it; `grid_error` is the largest |f - g|
there, and `fit` returns only when grid_error <= max_abs_error (otherwise it tightens tol and fits
again). Every knot is a verification point, so g is linear between neighbouring ones and, for f
with |f''| <= M on [lo, hi], sup |f - g| <= grid_error + M*h^2/8 with h = (hi - lo)/(n - 1)
(a linear function minus f's linear interpolant is bounded by its values at the ends).

The bound is absolute: a function that grows fast needs many knots where it is large (exp on
[-6, 6] within 1e-2 needs ~100, integral sqrt(e^x / 0.16) dx = 100).

Outside [lo, hi] g continues its first and last linear pieces: g(x) = c0 + c1*x below lo, and
the last piece's line above hi. Nothing is promised about |f - g| there; the input range must
come from calibration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

UnaryFunction = Callable[[np.ndarray], np.ndarray]

FIT_POINTS = 8193  # where the tube is imposed while placing knots (at least; see _grid_sizes)
VERIFY_POINTS = 20001  # where the bound is checked (at least), shares few points with the fit grid
_BESIDE = 1e-7  # points at knot +- _BESIDE*(hi - lo) are verified too
_START_OFFSETS = (0.0, -0.5, 0.5, -1.0, 1.0)  # first vertex value: f(lo) + offset*tol
_MAX_REFITS = 30
_MAX_PIECES_COUNTED = 1024  # when reporting the knots a bound needs, "more than" beyond this


class ApproximationError(ValueError):
    """`max_knots` knots cannot keep |f - g| within the bound; says the best error reached."""

    def __init__(self, message: str, best_error: float, knots_needed: int | None):
        super().__init__(message)
        self.best_error = best_error
        self.knots_needed = knots_needed  # None: more than _MAX_PIECES_COUNTED - 1


@dataclass(frozen=True)
class Approximation:
    """g(x) = c0 + c1*x + sum_i weights[i] * relu(x - knots[i]), fitted on [lo, hi]."""

    lo: float
    hi: float
    knots: tuple[float, ...]  # interior breakpoints, increasing
    c0: float
    c1: float
    weights: tuple[float, ...]  # slope change at each knot
    grid_error: float  # max |f - g| on the verification grid

    def to_json(self) -> dict:
        """A plain dict for reports (`pieces` = linear pieces = knots + 1)."""
        return {"lo": self.lo, "hi": self.hi, "pieces": len(self.knots) + 1, "knots": list(self.knots),
                "weights": list(self.weights), "c0": self.c0, "c1": self.c1, "grid_error": self.grid_error}


def fit(f: UnaryFunction, lo: float, hi: float, max_abs_error: float, *, max_knots: int = 64) -> Approximation:
    """The ReLU sum with the fewest knots we find such that |f - g| <= max_abs_error on the
    verification grid of [lo, hi] (see the module docstring for what that guarantees between
    grid points). `f` maps a float64 array to a float64 array of the same shape.

    Raises ValueError for lo >= hi, a bound <= 0, or f not finite somewhere on the grid (it says
    where); ApproximationError (a ValueError) when `max_knots` knots do not meet the bound, or when
    the bound cannot be verified between fit points (a discontinuous f)."""
    lo, hi, eps = float(lo), float(hi), float(max_abs_error)
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo >= hi:
        raise ValueError(f"the input range [{lo:g}, {hi:g}] is empty or not finite: lo must be below hi")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"the error bound must be a positive number, got {eps:g}")
    if max_knots < 0:
        raise ValueError(f"max_knots must be >= 0, got {max_knots}")

    n_fit, n_check = _grid_sizes(max_knots)
    x_fit = np.linspace(lo, hi, n_fit)
    x_check = np.linspace(lo, hi, n_check)
    y_fit, y_check = _values(f, x_fit), _values(f, x_check)

    def verified(a: Approximation) -> Approximation:
        d = _BESIDE * (hi - lo)
        k = np.asarray(a.knots)
        beside = np.clip(np.concatenate([k, k - d, k + d]), lo, hi)
        err = max(_max_abs(evaluate(a, x_check) - y_check), _max_abs(evaluate(a, beside) - _values(f, beside)))
        return Approximation(a.lo, a.hi, a.knots, a.c0, a.c1, a.weights, err)

    tol = eps
    for attempt in range(_MAX_REFITS):
        a = _best_chain(x_fit, y_fit, tol, max_knots + 1)
        if a is None:
            break
        a = verified(a)
        if a.grid_error <= eps:
            return a
        # The tube held at the fit points but not between them, by an overshoot that barely
        # changes with tol: take twice the overshoot off tol, doubling each time it is not enough.
        tol = max(tol - 2 ** (attempt + 1) * (a.grid_error - eps), tol / 2)
    else:
        raise ApproximationError(
            f"cannot verify |f - g| <= {eps:g} on [{lo:g}, {hi:g}]: after {_MAX_REFITS} refits the error "
            f"between fit points is still {a.grid_error:.3g} (is f discontinuous, or does it vary faster "
            f"than the fit grid's step {(hi - lo) / (n_fit - 1):.3g}?)", a.grid_error, None)

    # The greedy count is not monotone in tol (a slightly wider tube can end a segment in a worse
    # place), so a smaller tol may still fit in max_knots: search for the smallest one that does.
    best = verified(_smallest_tol_chain(x_fit, y_fit, max_knots + 1))
    if best.grid_error <= eps:
        return best
    needed = _best_chain(x_fit, y_fit, tol, _MAX_PIECES_COUNTED)
    count = f"{len(needed.knots)} knots" if needed is not None else f"more than {_MAX_PIECES_COUNTED - 1} knots"
    raise ApproximationError(
        f"cannot keep |f - g| <= {eps:g} on [{lo:g}, {hi:g}] with at most {max_knots} knots: the best error "
        f"reached with {max_knots} knots is {best.grid_error:.3g}, and the bound needs {count}",
        best.grid_error, None if needed is None else len(needed.knots))


def evaluate(a: Approximation, x: np.ndarray) -> np.ndarray:
    """g at x (float64, any shape), the pieces continued outside [lo, hi]."""
    x = np.asarray(x, np.float64)
    g = a.c0 + a.c1 * x
    for k, w in zip(a.knots, a.weights):
        g = g + w * np.maximum(x - k, 0.0)
    return g


def to_onnx(a: Approximation, x_name: str, out_name: str,
            prefix: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Nodes (Add, Mul, Relu only) computing out = g(x) elementwise in float32 for x of any shape,
    and their scalar initializers; every node, tensor and initializer name but x_name and
    out_name starts with `prefix`.

    Terms are summed as a balanced tree in knot order: float32 rounding then grows with
    log2(#terms) rather than #terms, and neighbouring knots, whose terms cancel where big slope
    changes follow each other, meet early. The result is within about
    2^-24 * (log2(#terms) + 3) * (|c0| + |c1*x| + sum_i |w_i| relu(x - k_i)) of g(x): a few ulp
    of g where the terms are small, more where big slopes cancel (log on [0.1, 10] continued to
    15: 1.8e-5 for |g| < 3). A tree also beats a chain after int8 conversion (softplus within
    1e-3, 24 knots on [-8, 8]: 0.086 against 0.14 summed left to right). Zero weights give no term; c0 == 0, c1 == 0 or 1,
    w == 1 and k == 0 give no node."""
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []

    def const(name: str, value: float) -> str:
        inits.append(numpy_helper.from_array(np.array(value, np.float32), prefix + name))
        return prefix + name

    def node(op: str, inputs: list[str], name: str) -> str:
        nodes.append(helper.make_node(op, inputs, [prefix + name], name=prefix + name))
        return prefix + name

    def f32(v: float) -> float:
        return float(np.float32(v))

    terms: list[str] = []
    c0_pending = f32(a.c0) != 0.0
    if f32(a.c1) != 0.0:
        line = x_name if f32(a.c1) == 1.0 else node("Mul", [x_name, const("c1", a.c1)], "line_slope")
        if c0_pending:
            line, c0_pending = node("Add", [line, const("c0", a.c0)], "line"), False
        terms.append(line)
    for i, (k, w) in enumerate(zip(a.knots, a.weights)):
        if f32(w) == 0.0:
            continue
        shifted = x_name if f32(k) == 0.0 else node("Add", [x_name, const(f"k{i}", -k)], f"shift{i}")
        ramp = node("Relu", [shifted], f"ramp{i}")
        terms.append(ramp if f32(w) == 1.0 else node("Mul", [ramp, const(f"w{i}", w)], f"term{i}"))
    if not terms:  # g is the constant c0: a product with x keeps x's shape
        terms.append(node("Mul", [x_name, const("zero_scale", 0.0)], "zero"))

    level = 0
    while len(terms) > 1:
        paired = [node("Add", [terms[j], terms[j + 1]], f"sum{level}_{j // 2}") for j in range(0, len(terms) - 1, 2)]
        terms = paired + terms[len(terms) - len(terms) % 2:]
        level += 1
    out = terms[0]
    if c0_pending:
        out = node("Add", [out, const("c0", a.c0)], "plus_c0")
    if out == x_name:  # g(x) = x: one node is needed to name the output
        out = node("Mul", [x_name, const("one_scale", 1.0)], "same")
    nodes[-1].output[0] = out_name
    return nodes, inits


def to_onnx_conv(a: Approximation, x_name: str, out_name: str, prefix: str,
                 shape: tuple[int, ...]) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """g(x) for x of static `shape` as a fixed number of nodes whatever the knot count: x reshaped to
    NCHW [1, 1, P, Q] (Q its last dimension), a 1x1 convolution to one channel per term with the knots
    as biases, Relu, a 1x1 convolution back to one channel with the weights and c0 as its bias,
    reshaped back. On the Edge TPU that is RESHAPE, CONV_2D (with the ReLU fused), CONV_2D, RESHAPE:
    4 ops where `to_onnx`'s Add, Relu and Mul per knot are about 3 per knot plus the sums.

    The line c0 + c1*x is two terms that continue it on both sides of lo exactly:
    c1*relu(x - lo) - c1*relu(lo - x) = c1*(x - lo), c1*lo going into the bias. The terms are summed
    by one convolution, in the kernel's order: within about 2^-24 * (#terms + 2) * (|c0| + |c1*x| +
    sum_i |w_i| relu(x - k_i)) of g(x) in float32. After full-int8 conversion the sum is one int32
    accumulation, not a requantized Add per term (measured in int8_errors: GELU with 6 knots 0.039
    against the tree's 0.034, softplus with 24 knots 0.053 against 0.086, tanh with 8 knots 0.031
    against 0.047). Every name but x_name and out_name starts with `prefix`."""
    slopes_in, biases_in, weights_out = [], [], []
    if a.c1 != 0.0:
        slopes_in += [1.0, -1.0]
        biases_in += [-a.lo, a.lo]
        weights_out += [a.c1, -a.c1]
    for k, w in zip(a.knots, a.weights):
        if np.float32(w) != 0.0:
            slopes_in.append(1.0)
            biases_in.append(-k)
            weights_out.append(w)
    c0 = a.c0 + a.c1 * a.lo
    if not weights_out:  # g is the constant c0: the same shape, through one zero term
        slopes_in, biases_in, weights_out = [0.0], [0.0], [0.0]
    terms = len(weights_out)
    q = shape[-1] if shape else 1
    p = math.prod(shape) // q
    inits = [numpy_helper.from_array(np.array([1, 1, p, q], np.int64), prefix + "rows"),
             numpy_helper.from_array(np.array(slopes_in, np.float32).reshape(terms, 1, 1, 1), prefix + "slopes"),
             numpy_helper.from_array(np.array(biases_in, np.float32), prefix + "knots"),
             numpy_helper.from_array(np.array(weights_out, np.float32).reshape(1, terms, 1, 1), prefix + "weights"),
             numpy_helper.from_array(np.array([c0], np.float32), prefix + "c0"),
             numpy_helper.from_array(np.array(shape, np.int64), prefix + "shape")]
    nodes = [helper.make_node("Reshape", [x_name, prefix + "rows"], [prefix + "x4"], name=prefix + "rows"),
             helper.make_node("Conv", [prefix + "x4", prefix + "slopes", prefix + "knots"], [prefix + "shifted"],
                              name=prefix + "shift"),
             helper.make_node("Relu", [prefix + "shifted"], [prefix + "ramps"], name=prefix + "ramps"),
             helper.make_node("Conv", [prefix + "ramps", prefix + "weights", prefix + "c0"], [prefix + "g4"],
                              name=prefix + "sum"),
             helper.make_node("Reshape", [prefix + "g4", prefix + "shape"], [out_name], name=prefix + "shape")]
    return nodes, inits


def int8_errors(items: list[tuple[Approximation, UnaryFunction]], *, points: int = VERIFY_POINTS) -> list[float]:
    """max |f - g_int8| over `points` uniform points of each approximation's [lo, hi], where g_int8
    is g in the form legalize emits (`to_onnx_conv`) run by LiteRT after full-int8 conversion
    (`backends.tflite.convert_int8`: int8 inputs,
    activations and outputs). All approximations go into one model, converted once, each its own
    input and output of shape (1, points); calibration is the grid itself and three feeds of
    random points in range (seed 0). The error includes the input's own quantization."""
    import tempfile
    from pathlib import Path

    from ai_edge_litert.interpreter import Interpreter

    from ..backends.tflite import convert_int8

    if not items:
        return []
    grids = [np.linspace(a.lo, a.hi, points) for a, _ in items]
    nodes, inits, inputs, outputs = [], [], [], []
    for i, (a, _) in enumerate(items):
        n, t = to_onnx_conv(a, f"x{i}", f"y{i}", f"a{i}_", (1, points))
        nodes += n
        inits += t
        inputs.append(helper.make_tensor_value_info(f"x{i}", onnx.TensorProto.FLOAT, (1, points)))
        outputs.append(helper.make_tensor_value_info(f"y{i}", onnx.TensorProto.FLOAT, (1, points)))
    graph = helper.make_graph(nodes, "relu_sums", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10

    rng = np.random.default_rng(0)
    calibration = [{f"x{i}": g[None].astype(np.float32) for i, g in enumerate(grids)}]
    for _ in range(3):
        calibration.append({f"x{i}": rng.uniform(a.lo, a.hi, (1, points)).astype(np.float32)
                            for i, (a, _) in enumerate(items)})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "relu_sums.tflite"
        result = convert_int8(model, calibration, path)
        runner = Interpreter(model_path=str(path)).get_signature_runner()
        feeds = {}
        for spec in result.inputs:
            x = calibration[0][spec.name]
            if spec.quant is not None:
                x = np.clip(np.round(x / spec.quant.scale) + spec.quant.zero_point, -128, 127).astype(np.int8)
            feeds[spec.key] = x
        got = runner(**feeds)
    errors = []
    for i, (_, f) in enumerate(items):
        spec = next(s for s in result.outputs if s.name == f"y{i}")
        y = got[spec.key].astype(np.float64)
        if spec.quant is not None:
            y = (y - spec.quant.zero_point) * spec.quant.scale
        errors.append(_max_abs(y.reshape(-1) - _values(f, grids[i])))
    return errors


# ---------------------------------------------------------------------------------------------
# Knot placement


def _grid_sizes(max_knots: int) -> tuple[int, int]:
    """Fit and verification grid sizes. Knots sit on fit points, so the shortest segment must
    span several of them: where the curvature varies strongly (exp over [-8, 8]) the shortest is
    ~8x shorter than the average (hi - lo)/(max_knots + 1). The verification grid stays at
    least twice as fine and shares few points with the fit grid (33 at the defaults)."""
    n_fit = max(FIT_POINTS, 96 * (max_knots + 1) + 1)
    return n_fit, max(VERIFY_POINTS, 2 * n_fit + 1)


def _values(f: UnaryFunction, x: np.ndarray) -> np.ndarray:
    y = np.asarray(f(x), np.float64)
    if y.shape != x.shape:
        raise ValueError(f"f must map an array to one of the same shape: shape {x.shape} gave {y.shape}")
    bad = ~np.isfinite(y)
    if bad.any():
        where = x[bad]
        raise ValueError(f"f is not finite at {bad.sum()} of {x.size} points in [{x.min():g}, {x.max():g}], "
                         f"first at x = {where[0]:g} (f = {y[bad][0]}), last at x = {where[-1]:g}")
    return y


def _max_abs(v: np.ndarray) -> float:
    return float(np.abs(v).max()) if v.size else 0.0


def _chain(x: np.ndarray, y: np.ndarray, tol: float, v0: float,
           max_pieces: int) -> tuple[list[float], list[float]] | None:
    """Greedy segments from (x[0], v0), each as long as the tube |g - y| <= tol allows at the
    points x: (interior knots, slope of each segment); None beyond max_pieces segments."""
    knots: list[float] = []
    slopes: list[float] = []
    start, v = 0, v0
    last = len(x) - 1
    window = 64
    while start < last:
        if len(slopes) == max_pieces:
            return None
        # Scan a window that doubles until the tube closes in it: O(segment length), not O(len(x)).
        while True:
            stop = min(start + 1 + window, last + 1)
            dx = x[start + 1:stop] - x[start]
            low = np.maximum.accumulate((y[start + 1:stop] - tol - v) / dx)
            high = np.minimum.accumulate((y[start + 1:stop] + tol - v) / dx)
            # the first point is always reachable (|v - y[start]| <= tol); reach is monotone in b
            blocked = low > high
            if blocked.any() or stop == last + 1:
                break
            window *= 2
        reach = int(np.argmax(blocked)) if blocked.any() else len(dx)
        window = max(64, 2 * reach)
        end = start + reach
        slope = 0.5 * (low[reach - 1] + high[reach - 1])
        slopes.append(float(slope))
        v = v + slope * (x[end] - x[start])
        start = end
        if start < last:
            knots.append(float(x[start]))
    return knots, slopes


def _best_chain(x: np.ndarray, y: np.ndarray, tol: float, max_pieces: int) -> Approximation | None:
    """The chain with the fewest segments over the tried first-vertex values, as an
    Approximation (grid_error not yet measured); None if every one needs more than max_pieces."""
    best = None
    for offset in _START_OFFSETS:
        v0 = y[0] + offset * tol
        found = _chain(x, y, tol, v0, max_pieces if best is None else len(best[2]) - 1)
        if found is not None:
            best = (v0, *found)
    if best is None:
        return None
    v0, knots, slopes = best
    lo = float(x[0])
    return Approximation(lo, float(x[-1]), tuple(knots), float(v0 - slopes[0] * lo), slopes[0],
                         tuple(float(b - a) for a, b in zip(slopes, slopes[1:])), math.nan)


def _smallest_tol_chain(x: np.ndarray, y: np.ndarray, max_pieces: int) -> Approximation:
    """The chain of the smallest tol (within 0.1%, by bisection in log space) that needs at most
    max_pieces segments. The search interval depends on y alone, so the answer does not depend on
    the bound asked for: a bound of at least the error this chain reaches is then met."""
    # one flat segment meets tol = ptp(y); 2^-40 of that needs more pieces than any grid has
    tol_high = max(float(np.ptp(y)), np.finfo(np.float64).tiny)
    tol_low = tol_high * 2.0 ** -40
    while tol_high / tol_low > 1.001:
        mid = math.sqrt(tol_low * tol_high)
        if _best_chain(x, y, mid, max_pieces) is None:
            tol_low = mid
        else:
            tol_high = mid
    chain = _best_chain(x, y, tol_high, max_pieces)
    assert chain is not None  # tol_high only ever moves to a tol whose chain fits
    return chain
