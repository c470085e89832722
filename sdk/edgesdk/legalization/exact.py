"""Exact rewrites: ops the Edge TPU cannot run, or runs badly, turned into ops it has
(`devices.edgetpu.OPS`), computing the same function.

Each rule carries its exactness:
- "exact": bit-identical float32 results for finite inputs (up to the sign of a zero); where an
  infinity comes out differently, the rule's bound below says so;
- "exact up to float rounding (...)": an identity of real arithmetic whose float results differ
  by the rounding the mark states.

    leaky-relu-to-prelu        LeakyRelu(x, a)              -> PRelu(x, a)   (a == 0: Relu(x))
    hardswish-to-relu6         HardSwish(x)                 -> (x * 1/6) * Clip(x + 3, 0, 6)
    hardsigmoid-to-relu6       HardSigmoid(x, 1/6, 0.5)     -> Clip(x + 3, 0, 6) * 1/6
    hardsigmoid-to-clip        HardSigmoid(x, a, b)         -> Clip(x*a + b, 0, 1)
    sub-constant-to-add        x - c                        -> x + (-c)
    div-constant-to-mul        x / c                        -> x * (1/c)
    clip-to-relu               Clip(x, 0) / Clip(x, 0, inf) -> Relu(x)
    gemm-to-fully-connected    Gemm(A, B, C; any transB, alpha, beta) -> Gemm(A, alpha*B' [N, K], beta*C [N]; transB=1)
    gemm-rows-to-conv          Gemm(A [M, K], B [N, K], C [N]; transB=1), M and N > 1 -> as matmul-rows-to-conv, C the bias
    gemm-computed-bias-to-add  Gemm(A, B, C), B constant, C computed -> Gemm(A, B) + C  (beta != 1: + C*beta)
    matmul-rows-to-conv        MatMul(A [..., K], B [K, N]), more than one row and column out
                               -> Reshape(Transpose(Conv(Transpose(Reshape(A, [1, R, 1, K])), B^T as [N, K, 1, 1])))
    matmul-to-fully-connected  MatMul(A [..., K], B [K, N]) -> Reshape(Gemm(Reshape(A, [-1, K]), B^T; transB=1))
    fold-rank-for-elementwise  op(x [>3 dims > 1], ...)     -> Reshape(op(Reshape(x, rank 3), ...), x's shape)
    reduce-mean-to-average-pool ReduceMean(x, axes=[2, 3])  -> GlobalAveragePool(x) (+ Reshape for keepdims=0)
    float-of-quantized         DequantizeLinear(int8 constant) -> float constant; Q -> DQ pair of one grid -> x
                               (legalization/quantized.py: weights exact, activations within half a step each)
    gather-constant-index-to-slice Gather(x, k, axis=a), k a constant scalar -> Squeeze(Slice(x, [k], [k+1], [a]), [a])
                               (k of shape [1]: the Slice alone; negative k taken modulo x's static dim)
    gather-constant-run-to-reshape Gather(x, constant k..k+n-1 in any shape, axis=a)
                               -> Reshape(Slice(x, [k], [k+n], [a]), x's shape with the indices' at a)

What the TFLite lowering (`backends.tflite`, int8 via the TFLite converter) makes of the results,
checked by converting them (TF 2.21): Clip(0, 6) -> RELU6, Clip(-1, 1) -> RELU_N1_TO_1 (our
lowering writes maximum/minimum; the converter fuses them), Clip(0) and Clip(0, inf) -> RELU,
Clip(0, 1) -> RELU + MINIMUM (no RELU_0_TO_1), other ranges -> MAXIMUM + MINIMUM. So Clip(0, 6)
and Clip(-1, 1) stay Clip here, and clip-to-relu only names what the lowering already does.
PRelu becomes PRELU, an Edge TPU op (LEAKY_RELU is not). Slice and Squeeze become
STRIDED_SLICE and RESHAPE (the Edge TPU table has both; it has no GATHER). A Gemm with C becomes
FULLY_CONNECTED with a constant bias only, so a computed C must leave it: FULLY_CONNECTED + ADD.

The order of the products matters for the hard activations: the converter fuses
x * (relu6(x + 3) * 1/6) and (x * relu6(x + 3)) * 1/6 into HARD_SWISH, which the Edge TPU lacks,
and leaves (x * 1/6) * relu6(x + 3) alone (ADD+RELU6, MUL, MUL). For the same reason
hardsigmoid-to-relu6 refuses a HardSigmoid whose output is multiplied by its own input (that
product is a hard swish); hardsigmoid-to-clip takes it instead (MUL, ADD+RELU, MINIMUM, MUL).

Bounds (u = 2^-24, float32's unit roundoff; ulp as of the result):
- LeakyRelu: PRelu with slope a is the same function, x for x >= 0 and the same float product a*x
  below: exact (at x = -0 the two may give zeros of different signs). Not Max(x, a*x): in full int8
  MAXIMUM gives its inputs its output's range, [a*lo, hi], so the x that a*x is taken of is
  clipped (docs/legalize.md, "int8: ops that share one quantization"). a == 0 becomes Relu, which
  differs from the spec's 0*x only at x = -inf (0 where 0*(-inf) is NaN).
- Clip(x, 0) -> Relu: the spec's absent maximum is FLT_MAX, so +inf comes out as FLT_MAX there and
  as inf from Relu; Clip(x, 0, inf) is Relu for every x.
- Sub: x - c is defined as x + (-c) in IEEE arithmetic: exact.
- Div: 1/c rounded once; x * fl(1/c) is within 1 ulp of fl(x/c) (two roundings of relative
  error u each, and the two results are floats less than 2 ulp apart); exact when c is a power
  of two (1/c is then exact). c with a zero, or whose 1/c overflows or is subnormal, is refused.
- HardSwish: x*clip(x/6 + 1/2, 0, 1) == (x/6)*clip(x + 3, 0, 6) in real arithmetic. The reference
  rounds x/6 + 1/2, which cancels near x = -3, so the error is absolute, not relative: within
  3*u*|x| (measured: 2.5*u*|x| at most, on 400k points in [-100, 100] and around -3).
- HardSigmoid, relu6 form: clip(x + 3, 0, 6)/6 against clip(x/6 + 1/2, 0, 1): within u absolute
  (measured: exactly u at most). The Clip form computes fl(fl(a*x) + b) as the spec writes it,
  as onnxruntime does (bit-identical there); a runtime that fuses the multiply-add into one FMA
  differs by at most 1 ulp of a*x + b before the clip.
- Gemm: with alpha = beta = 1 only B's layout changes (exact in real arithmetic; the kernel may
  order the K-sum differently, a few ulp of sum |a_k b_k|). alpha*B and beta*C are rounded once:
  within ~2u * sum |alpha a_k b_k| + u*|beta c| of the reference; exact scaling for powers of two.
- MatMul: the same dot products, B transposed and A's rows flattened: as Gemm with alpha = 1; as a
  1x1 convolution, each output pixel is one row's dot products with the same weights.
- Gemm with a computed C: the reference kernel (onnxruntime's MLAS) starts from beta*C and adds the
  product in blocks of K; the rewrite rounds the whole product first and adds beta*C last. One sum
  of the same terms in another order: within ~2^-24 * (|alpha| |A| |B| + |beta C|) elementwise
  (|A| |B| the product of absolute values; measured 0.70 of that at most for K up to 2048, and
  bit-identical for K <= 256, one block, on x86). beta*C is rounded once, as the reference rounds
  it; beta = 0 drops C (onnxruntime does not read it; the spec's 0*C differs only where C is
  infinite or NaN).
- Gather of a constant index: the same elements copied: exact. An index out of range (Gather
  fails there, a Slice would clamp) is refused, and so are non-constant or multi-element indices
  (a real gather).
- ReduceMean: GlobalAveragePool sums the same H*W numbers in another order: within
  ~H*W*u * mean |x|.

Needs: opset 13 or newer (the import stage leaves 17), static shapes where a rule reads them
(shapes are inferred again between rounds). Guarantees: the same graph inputs and outputs, the
same function within each rule's mark, IR version <= 10.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, ShapeInferencePass
from onnxscript.rewriter import pattern

from ..ir import model as irm
from ..passes.rule import Rule, fixed_point, from_patterns
from ..passes.values import FLOAT_TYPES, broadcast, constant, static_shape
from . import quantized

EXACT = "exact"
# a pseudo op type among a device's refusals: it refuses a tensor's rank, not an op (edgetpu.rank)
RANK = "<rank>"


@dataclasses.dataclass(frozen=True)
class ExactRule:
    name: str
    rule: Rule
    exactness: str  # EXACT, or "exact up to float rounding (bound)"
    replaces: tuple[str, ...]  # op types it removes (none: it rewrites an op into a form the device takes)
    description: str
    # what makes a rule that removes no op type worth running: the refused op it reshapes, or RANK
    triggers: tuple[str, ...] = ()


# --- what the rewrites share ------------------------------------------------------------------


class _Initializers:
    """The initializers one rewrite adds: names unique in the graph and among themselves. One
    that an earlier firing added with the same content (3.0, a reshape target) is reused, so
    repeated firings do not pile up copies."""

    def __init__(self, graph: ir.Graph | ir.Function):
        self.graph, self.made = graph, {}

    def array(self, op, base: str, array: np.ndarray) -> ir.Value:
        array = np.ascontiguousarray(array)
        key = (base, array.dtype.str, array.shape, array.tobytes())
        if key in self.made:
            return self.made[key]
        existing = self.graph.initializers if isinstance(self.graph, ir.Graph) else {}
        taken = {value.name for value in self.made.values()}
        name, k = f"exact.{base}", 1
        while name in existing or name in taken:
            value = existing.get(name)
            if name not in taken and value is not None and not value.is_graph_input() and value.const_value is not None:
                known = value.const_value.numpy()
                if (known.dtype.str, known.shape, known.tobytes()) == key[1:]:
                    self.made[key] = value
                    return value
            name, k = f"exact.{base}_{k}", k + 1
        self.made[key] = op.initializer(ir.tensor(array), name)
        return self.made[key]

    def scalar(self, op, base: str, value: float, like: ir.Value) -> ir.Value:
        """A rank-0 constant of `like`'s element type."""
        return self.array(op, base, np.asarray(value, like.dtype.numpy()))

    def shape(self, op, base: str, shape: Iterable[int]) -> ir.Value:
        return self.array(op, base, np.asarray(list(shape), np.int64))


def _not_float(x: ir.Value) -> str | None:
    return None if x.dtype in FLOAT_TYPES else f"{x.name} is not a float tensor"


# --- activations ------------------------------------------------------------------------------


class LeakyReluToPRelu(pattern.RewriteRuleClassBase):
    def pattern(self, op, x):
        return op.LeakyRelu(x, _outputs=["y"])

    def check(self, context, x, y):
        result = pattern.MatchResult()
        if reason := _not_float(x):
            return result.fail(reason)
        self._alpha = y.producer().attributes.get_float("alpha", 0.01)
        return result

    def rewrite(self, op, x, y):
        if self._alpha == 0:
            return op.Relu(x)
        return op.PRelu(x, self._new.scalar(op, "leaky_alpha", self._alpha, x))


class HardSwishToRelu6(pattern.RewriteRuleClassBase):
    def pattern(self, op, x):
        return op.HardSwish(x)

    def check(self, context, x):
        result = pattern.MatchResult()
        return result.fail(reason) if (reason := _not_float(x)) else result

    def rewrite(self, op, x):
        # (x * 1/6) * relu6(x + 3): the scale on x, where the TFLite converter does not fuse HARD_SWISH.
        c = self._new
        relu6 = op.Clip(op.Add(x, c.scalar(op, "three", 3.0, x)), c.scalar(op, "zero", 0.0, x),
                        c.scalar(op, "six", 6.0, x))
        return op.Mul(op.Mul(x, c.scalar(op, "sixth", 1.0 / 6.0, x)), relu6)


def _hardsigmoid_attrs(node: ir.Node) -> tuple[float, float]:
    return node.attributes.get_float("alpha", 0.2), node.attributes.get_float("beta", 0.5)


class HardSigmoidToRelu6(pattern.RewriteRuleClassBase):
    """Only alpha = float32(1/6), beta = 0.5: then alpha*x + beta = (x + 3)/6 up to rounding."""

    def pattern(self, op, x):
        return op.HardSigmoid(x, _outputs=["y"])

    def check(self, context, x, y):
        result = pattern.MatchResult()
        if reason := _not_float(x):
            return result.fail(reason)
        alpha, beta = _hardsigmoid_attrs(y.producer())
        if alpha != float(np.float32(1 / 6)) or beta != 0.5:
            return result.fail(f"alpha={alpha}, beta={beta} is not alpha=1/6, beta=0.5")
        for use, _ in y.uses():
            if use.op_type == "Mul" and x in use.inputs:
                return result.fail(f"{use.name} multiplies it by {x.name}: the converter would make HARD_SWISH")
        return result

    def rewrite(self, op, x, y):
        c = self._new
        relu6 = op.Clip(op.Add(x, c.scalar(op, "three", 3.0, x)), c.scalar(op, "zero", 0.0, x),
                        c.scalar(op, "six", 6.0, x))
        return op.Mul(relu6, c.scalar(op, "sixth", 1.0 / 6.0, x))


class HardSigmoidToClip(pattern.RewriteRuleClassBase):
    def pattern(self, op, x):
        return op.HardSigmoid(x, _outputs=["y"])

    def check(self, context, x, y):
        result = pattern.MatchResult()
        return result.fail(reason) if (reason := _not_float(x)) else result

    def rewrite(self, op, x, y):
        c = self._new
        alpha, beta = _hardsigmoid_attrs(y.producer())
        affine = op.Add(op.Mul(x, c.scalar(op, "hardsigmoid_alpha", alpha, x)),
                        c.scalar(op, "hardsigmoid_beta", beta, x))
        return op.Clip(affine, c.scalar(op, "zero", 0.0, x), c.scalar(op, "one", 1.0, x))


class ClipToRelu(pattern.RewriteRuleClassBase):
    def pattern(self, op, x):
        return op.Clip(x, _allow_other_inputs=True, _outputs=["y"])

    def check(self, context, x, y):
        result = pattern.MatchResult()
        if reason := _not_float(x):
            return result.fail(reason)
        inputs = list(y.producer().inputs) + [None, None]
        lo, hi = inputs[1], inputs[2]
        lo_value = constant(lo) if lo is not None else None
        if lo_value is None or lo_value.size != 1 or float(lo_value.reshape(-1)[0]) != 0.0:
            return result.fail("the minimum is not the constant 0")
        if hi is not None:
            hi_value = constant(hi)
            if hi_value is None or hi_value.size != 1 or float(hi_value.reshape(-1)[0]) != math.inf:
                return result.fail("the maximum is neither absent nor +inf")
        return result

    def rewrite(self, op, x, y):
        return op.Relu(x)


# --- constant divisors and subtrahends ----------------------------------------------------------


class SubConstantToAdd(pattern.RewriteRuleClassBase):
    def pattern(self, op, x, c):
        return op.Sub(x, c)

    def check(self, context, x, c):
        result = pattern.MatchResult()
        if reason := _not_float(x):
            return result.fail(reason)
        self._negated = None if (array := constant(c)) is None else -array
        if self._negated is None:
            return result.fail(f"{c.name} is not a constant")
        return result

    def rewrite(self, op, x, c):
        return op.Add(x, self._new.array(op, f"{c.name}_negated", self._negated))


class DivConstantToMul(pattern.RewriteRuleClassBase):
    def pattern(self, op, x, c):
        return op.Div(x, c)

    def check(self, context, x, c):
        result = pattern.MatchResult()
        if reason := _not_float(x):
            return result.fail(reason)
        array = constant(c)
        if array is None:
            return result.fail(f"{c.name} is not a constant")
        if np.any(array == 0):
            return result.fail(f"{c.name} has a zero")
        with np.errstate(all="ignore"):
            reciprocal = (1.0 / array.astype(np.float64)).astype(array.dtype)
        if not np.all(np.isfinite(reciprocal)) or np.any(np.abs(reciprocal) < np.finfo(array.dtype).tiny):
            return result.fail(f"1/{c.name} overflows or is subnormal")
        self._reciprocal = reciprocal
        return result

    def rewrite(self, op, x, c):
        return op.Mul(x, self._new.array(op, f"{c.name}_reciprocal", self._reciprocal))


class PowToMul(pattern.RewriteRuleClassBase):
    """x ** n for a whole n in 2..4 as products (LayerNorm's variance is Pow(x - mean, 2)); the
    Edge TPU has MUL but no POW, and an approximation of x**2 on a wide range needs dozens of ReLUs."""

    def pattern(self, op, x, n):
        return op.Pow(x, n)

    def check(self, context, x, n):
        result = pattern.MatchResult()
        if reason := _not_float(x):
            return result.fail(reason)
        array = constant(n)
        if array is None or array.size != 1:
            return result.fail(f"{n.name} is not a scalar constant")
        value = float(array.reshape(()))
        if value not in (2.0, 3.0, 4.0):
            return result.fail(f"exponent {value:g} is not 2, 3 or 4")
        self._n = int(value)
        return result

    def rewrite(self, op, x, n):
        if self._n == 4:
            square = op.Mul(x, x)
            return op.Mul(square, square)
        return op.Mul(x, x) if self._n == 2 else op.Mul(op.Mul(x, x), x)


# --- matrix products --------------------------------------------------------------------------


def _constant_matrix(a, b):
    """A Gemm's B as a constant 2-D array where A is float, else why not (a sentence)."""
    if reason := _not_float(a):
        return reason
    weights = constant(b)
    if weights is None or weights.ndim != 2:
        return f"{b.name} is not a constant matrix"
    return weights


class GemmToFullyConnected(pattern.RewriteRuleClassBase):
    """TFLite's FULLY_CONNECTED: weights [N, K], bias [N], no scales."""

    def pattern(self, op, a, b):
        return op.Gemm(a, b, _allow_other_inputs=True, _outputs=["y"])

    def check(self, context, a, b, y):
        result = pattern.MatchResult()
        node, weights = y.producer(), _constant_matrix(a, b)
        if isinstance(weights, str):
            return result.fail(weights)
        if node.attributes.get_int("transA", 0):
            # The lowering takes A transposed as a layout (no op); a Transpose here would be one.
            return result.fail("transA=1")
        alpha, beta = node.attributes.get_float("alpha", 1.0), node.attributes.get_float("beta", 1.0)
        trans_b = node.attributes.get_int("transB", 0)
        n = weights.shape[0] if trans_b else weights.shape[1]
        c = node.inputs[2] if len(node.inputs) > 2 else None
        bias = None
        if c is not None:
            bias = constant(c)
            if bias is None:
                return result.fail(f"C {c.name} is not a constant")
            if bias.ndim > 2 or broadcast(bias.shape, (1, n)) != (1, n):
                return result.fail(f"C {bias.shape} is not one bias per output column ({n})")
        if trans_b == 1 and alpha == 1 and (bias is None or (beta == 1 and bias.shape == (n,))):
            return result.fail("already in fully-connected form")
        with np.errstate(all="ignore"):
            self._weights = (weights if trans_b else weights.T) * weights.dtype.type(alpha)
            scaled_bias = None if bias is None else bias.reshape(-1) * bias.dtype.type(beta)
            self._bias = None if bias is None else np.broadcast_to(scaled_bias, (n,)).copy()
        if not np.all(np.isfinite(self._weights)) or (bias is not None and not np.all(np.isfinite(self._bias))):
            return result.fail("alpha*B or beta*C overflows")
        return result

    def rewrite(self, op, a, b, y):
        c = self._new
        weights = c.array(op, f"{b.name}_fc", np.ascontiguousarray(self._weights))
        if self._bias is None:
            return op.Gemm(a, weights, transB=1)
        return op.Gemm(a, weights, c.array(op, f"{b.name}_fc_bias", self._bias), transB=1)


class GemmComputedBiasToAdd(pattern.RewriteRuleClassBase):
    """A Gemm whose C is computed (an LSTM step's x*W + b added to h*U): FULLY_CONNECTED takes a
    constant bias only, so C moves to an ADD after the product."""

    def pattern(self, op, a, b, c):
        return op.Gemm(a, b, c, _outputs=["y"])

    def check(self, context, a, b, c, y):
        result = pattern.MatchResult()
        if reason := _not_float(a):
            return result.fail(reason)
        weights = constant(b)
        if weights is None or weights.ndim != 2:
            return result.fail(f"{b.name} is not a constant matrix")
        if c is None:
            return result.fail("no C")
        if constant(c) is not None:
            return result.fail(f"C {c.name} is a constant (gemm-to-fully-connected makes it the bias)")
        if constant(a) is not None:
            return result.fail("A and B are constants (constant folding's job)")
        self._beta = y.producer().attributes.get_float("beta", 1.0)
        return result

    def rewrite(self, op, a, b, c, y):
        attributes = {name: attr.value for name, attr in y.producer().attributes.items() if name != "beta"}
        product = op.Gemm(a, b, **attributes)
        if self._beta == 0:  # onnxruntime does not read C then (the spec's 0*C is 0 for finite C)
            return product
        if self._beta != 1:
            c = op.Mul(c, self._new.scalar(op, "gemm_beta", self._beta, c))
        return op.Add(product, c)


class MatMulToFullyConnected(pattern.RewriteRuleClassBase):
    def pattern(self, op, a, b):
        return op.MatMul(a, b)

    def check(self, context, a, b):
        result = pattern.MatchResult()
        found = _by_constant_matrix(a, b)
        if isinstance(found, str):
            return result.fail(found)
        self._shape, self._weights = found[0], np.ascontiguousarray(found[1].T)
        return result

    def rewrite(self, op, a, b):
        c = self._new
        weights = c.array(op, f"{b.name}_fc", self._weights)
        if len(self._shape) == 2:
            return op.Gemm(a, weights, transB=1)
        k, n = self._weights.shape[1], self._weights.shape[0]
        rows = op.Reshape(a, c.shape(op, "fc_rows", (-1, k)))
        return op.Reshape(op.Gemm(rows, weights, transB=1), c.shape(op, "fc_out", (*self._shape[:-1], n)))


class MatMulRowsToConv(pattern.RewriteRuleClassBase):
    """A MatMul by a constant matrix with several rows and columns out (a transformer's projections:
    [1, 128, 256] x [256, 256]) as a 1x1 convolution over a column of pixels, one per row: the Edge
    TPU's FULLY_CONNECTED gives one-dimensional outputs only, its CONV_2D has no such limit. The
    rows go down H of an NCHW [1, K, R, 1] (R = the rows, every leading dimension folded in, so at
    most two dimensions exceed 1), the weights are [N, K, 1, 1], and the result is put back. Our
    TFLite lowering keeps tensors NHWC, so the two Transposes cost nothing there: RESHAPE, CONV_2D,
    RESHAPE."""

    def pattern(self, op, a, b):
        return op.MatMul(a, b)

    def check(self, context, a, b):
        result = pattern.MatchResult()
        found = _by_constant_matrix(a, b)
        if isinstance(found, str):
            return result.fail(found)
        self._shape, weights = found
        if math.prod(self._shape[:-1]) == 1 or weights.shape[1] == 1:
            return result.fail("one row or one column out: a one-dimensional FULLY_CONNECTED output")
        self._weights = np.ascontiguousarray(weights.T)
        return result

    def rewrite(self, op, a, b):
        return _conv_over_rows(op, self._new, a, self._shape, self._weights, None, b.name)


def _by_constant_matrix(a: ir.Value, b: ir.Value) -> tuple[tuple[int, ...], np.ndarray] | str:
    """A's static shape and B's values, where A (float, computed, rank >= 2) times the constant
    matrix B is a product of matrices; else why not."""
    if reason := _not_float(a):
        return reason
    weights = constant(b)
    if weights is None or weights.ndim != 2:
        return f"{b.name} is not a constant matrix"
    if constant(a) is not None:
        return "both operands are constants (constant folding's job)"
    shape = static_shape(a)
    if shape is None or len(shape) < 2:
        return f"{a.name} has no static shape of rank >= 2"
    if shape[-1] != weights.shape[0]:
        return f"{a.name} {shape} and {b.name} {weights.shape} do not multiply"
    return tuple(shape), weights


def _conv_over_rows(op, c: _Initializers, a: ir.Value, shape: tuple[int, ...], weights: np.ndarray,
                    bias: np.ndarray | None, base: str) -> ir.Value:
    """A [..., K] times weights [N, K]^T (+ bias [N]) as a 1x1 convolution: A's rows down H of an NCHW
    [1, K, R, 1], the weights [N, K, 1, 1], the result put back to [..., N]."""
    k, n = shape[-1], weights.shape[0]
    column = op.Transpose(op.Reshape(a, c.shape(op, "conv_rows", (1, math.prod(shape[:-1]), 1, k))),
                          perm=[0, 3, 1, 2])
    inputs = [column, c.array(op, f"{base}_conv", weights.reshape(n, k, 1, 1))]
    if bias is not None:
        inputs.append(c.array(op, f"{base}_conv_bias", bias))
    product = op.Conv(*inputs, kernel_shape=[1, 1])
    return op.Reshape(op.Transpose(product, perm=[0, 2, 3, 1]), c.shape(op, "conv_out", (*shape[:-1], n)))


class GemmRowsToConv(pattern.RewriteRuleClassBase):
    """A Gemm in fully-connected form (`gemm-to-fully-connected` makes it: weights [N, K], transB=1,
    alpha 1, a constant bias [N] or none) with several rows and columns out, as `MatMulRowsToConv`
    does it, the bias the convolution's."""

    def pattern(self, op, a, b):
        return op.Gemm(a, b, _allow_other_inputs=True, _outputs=["y"])

    def check(self, context, a, b, y):
        result = pattern.MatchResult()
        node, weights = y.producer(), _constant_matrix(a, b)
        if isinstance(weights, str):
            return result.fail(weights)
        if node.attributes.get_int("transA", 0) or not node.attributes.get_int("transB", 0) \
                or node.attributes.get_float("alpha", 1.0) != 1:
            return result.fail("not in fully-connected form (gemm-to-fully-connected first)")
        c = node.inputs[2] if len(node.inputs) > 2 else None
        bias = constant(c) if c is not None else None
        if c is not None and (bias is None or bias.shape != (weights.shape[0],)
                              or node.attributes.get_float("beta", 1.0) != 1):
            return result.fail("C is not one constant bias per output column")
        shape = static_shape(a)
        if shape is None or len(shape) != 2 or shape[1] != weights.shape[1]:
            return result.fail(f"{a.name} is not a static [M, K] matrix for {b.name} {weights.shape}")
        if shape[0] == 1 or weights.shape[0] == 1:
            return result.fail("one row or one column out: a one-dimensional FULLY_CONNECTED output")
        self._shape, self._weights, self._bias = tuple(shape), weights, bias
        return result

    def rewrite(self, op, a, b, y):
        return _conv_over_rows(op, self._new, a, self._shape, self._weights, self._bias, b.name)


# --- rank ---------------------------------------------------------------------------------------

# Elementwise ops, and which inputs carry the tensor (the rest are Clip's scalar bounds).
ELEMENTWISE_INPUTS = {
    **dict.fromkeys(("Add", "Sub", "Mul", "Div", "Max", "Min", "PRelu"), None),  # all
    **dict.fromkeys(("Relu", "Clip", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "LeakyRelu"), 1),
}


def _folded(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The rank-3 shape with the same elements in the same order: unit dims dropped, the outer
    dims larger than 1 merged into the first, the two innermost kept."""
    big = [d for d in shape if d != 1]
    return (math.prod(big[:-2]), *big[-2:])


class FoldRank(pattern.RewriteRuleClassBase):
    """`op(x, ...)` whose output has more than 3 dims larger than 1 (the Edge TPU maps the three
    innermost only): every tensor operand the output's shape (or of size 1), so one reshape of
    all of them keeps the elementwise correspondence."""

    def __init__(self, op_type: str):
        super().__init__(f"fold rank of {op_type}")
        self.op_type, self.tensor_inputs = op_type, ELEMENTWISE_INPUTS[op_type]

    def pattern(self, op, x):
        return getattr(op, self.op_type)(x, _allow_other_inputs=True, _outputs=["y"])

    def check(self, context, x, y):
        result = pattern.MatchResult()
        shape = static_shape(y)
        if shape is None:
            return result.fail(f"the shape of {y.name} is not static")
        if sum(d > 1 for d in shape) <= 3:
            return result.fail(f"{y.name} {list(shape)} has at most 3 dims larger than 1")
        if 0 in shape:
            return result.fail(f"{y.name} is empty")
        operands = list(y.producer().inputs[: self.tensor_inputs])
        for value in operands:
            operand = static_shape(value)
            if operand is None:
                return result.fail(f"the shape of {value.name if value is not None else 'an input'} is not static")
            if operand != shape and math.prod(operand) != 1:
                return result.fail(f"{value.name} {list(operand)} broadcasts to {list(shape)}")
        self._shape, self._operands = shape, operands
        return result

    def rewrite(self, op, x, y):
        c, node = self._new, y.producer()
        folded = _folded(self._shape)
        inputs = []
        for value in self._operands:
            if static_shape(value) == self._shape:
                inputs.append(_folded_view(op, c, value, folded))
            elif len(static_shape(value)) > len(folded):  # size 1 of a higher rank would raise the rank again
                array = constant(value)
                inputs.append(c.array(op, f"{value.name}_scalar", array.reshape(())) if array is not None
                              else op.Reshape(value, c.shape(op, "scalar", ())))
            else:
                inputs.append(value)
        inputs += list(node.inputs[len(self._operands):])
        out = getattr(op, self.op_type)(*inputs, **{name: attr.value for name, attr in node.attributes.items()})
        # Shapes now, not at the next round's inference: a folded neighbour in this round reads them.
        out.shape, out.type = ir.Shape(folded), y.type
        return op.Reshape(out, c.shape(op, "unfolded", self._shape))


def _folded_view(op, new: _Initializers, value: ir.Value, folded: tuple[int, ...]) -> ir.Value:
    """`value` reshaped to `folded`: the input of the Reshape that produced it where that already
    had the folded shape (a folded neighbour's way back), an existing Reshape of it to `folded`
    (another op folding the same tensor), else a new Reshape."""
    producer = value.producer()
    if producer is not None and producer.op_type == "Reshape" and static_shape(producer.inputs[0]) == folded:
        return producer.inputs[0]
    for user, index in value.uses():
        if (user.op_type == "Reshape" and index == 0 and user.domain in ("", "ai.onnx")
                and static_shape(user.outputs[0]) == folded):
            return user.outputs[0]
    view = op.Reshape(value, new.shape(op, "folded", folded))
    view.shape, view.type = ir.Shape(folded), value.type
    return view


# --- reductions ---------------------------------------------------------------------------------


class ReduceMeanToAveragePool(pattern.RewriteRuleClassBase):
    def pattern(self, op, x):
        return op.ReduceMean(x, _allow_other_inputs=True, _outputs=["y"])

    def check(self, context, x, y):
        result = pattern.MatchResult()
        if reason := _not_float(x):
            return result.fail(reason)
        node = y.producer()
        shape = static_shape(x)
        if shape is None or len(shape) != 4:
            return result.fail(f"{x.name} is not a 4-d tensor of static shape")
        if len(node.inputs) > 1 and node.inputs[1] is not None:  # opset 18: axes is an input
            array = constant(node.inputs[1])
            if array is None:
                return result.fail("axes is not a constant")
            axes = [int(a) for a in array.reshape(-1)]
        else:
            attr = node.attributes.get("axes")
            axes = list(attr.as_ints()) if attr is not None and attr.type == ir.AttributeType.INTS else []
        if sorted(a % 4 for a in axes) != [2, 3]:
            return result.fail(f"axes {axes} are not the spatial axes [2, 3]")
        self._keepdims, self._shape = node.attributes.get_int("keepdims", 1), shape
        return result

    def rewrite(self, op, x, y):
        pooled = op.GlobalAveragePool(x)
        if self._keepdims:
            return pooled
        return op.Reshape(pooled, self._new.shape(op, "pooled", self._shape[:2]))


# --- indexing -----------------------------------------------------------------------------------


class _ConstantGather(pattern.RewriteRuleClassBase):
    """A Gather of constant indices from a computed float tensor of static shape: what both Gather rules
    take (`_operands`)."""

    def pattern(self, op, x, indices):
        return op.Gather(x, indices, _outputs=["y"])

    @staticmethod
    def _operands(x, indices, y) -> tuple[np.ndarray, list[int], int] | str:
        """(the indices, x's shape, the axis in [0, rank)), or why the Gather is not one of these."""
        if reason := _not_float(x):
            return reason
        index = constant(indices)
        if index is None:
            return f"indices {indices.name} are not a constant"
        if constant(x) is not None:
            return f"{x.name} is a constant (constant folding's job)"
        shape = static_shape(x)
        if shape is None:
            return f"the shape of {x.name} is not static"
        axis = y.producer().attributes.get_int("axis", 0)
        if not -len(shape) <= axis < len(shape):
            return f"axis {axis} is out of range for {x.name} {list(shape)}"
        return index, list(shape), axis % len(shape)

    def check(self, context, x, indices, y):
        result = pattern.MatchResult()
        got = self._operands(x, indices, y)
        reason = got if isinstance(got, str) else self._fits(x, indices, *got)
        return result.fail(reason) if reason else result

    def _fits(self, x, indices, index: np.ndarray, shape: list[int], axis: int) -> str | None:
        """Why these operands are not this rule's (None: they are, and the rewrite's fields are set)."""
        raise NotImplementedError


class GatherConstantIndexToSlice(_ConstantGather):
    """Gather of one constant index (an unrolled loop's TensorList read) is a slice one wide:
    STRIDED_SLICE, then a RESHAPE dropping the axis for a scalar index."""

    def _fits(self, x, indices, index, shape, axis):
        if index.size != 1 or index.ndim > 1:
            return f"indices {indices.name} {list(index.shape)} are not one scalar or one-element vector"
        k = int(index.reshape(()))
        if not -shape[axis] <= k < shape[axis]:
            # Gather fails there; a Slice would clamp and return something.
            return f"index {k} is out of range for axis {axis} of {x.name} {list(shape)}"
        self._axis, self._k, self._scalar = axis, k % shape[axis], index.ndim == 0
        return None

    def rewrite(self, op, x, indices, y):
        c, axis, k = self._new, self._axis, self._k
        sliced = op.Slice(x, c.shape(op, f"slice_start_{k}", [k]), c.shape(op, f"slice_end_{k + 1}", [k + 1]),
                          c.shape(op, f"axis_{axis}", [axis]))
        return op.Squeeze(sliced, c.shape(op, f"axis_{axis}", [axis])) if self._scalar else sliced


class GatherConstantRunToReshape(_ConstantGather):
    """Gather of constant indices that are one contiguous run k, k+1, ..., in any shape, is a slice of the
    run, reshaped: how PyTorch's exporter writes a `view` of a flattened tensor (`as_strided`: a [1280] vector
    gathered by arange(1280) shaped [1, 1280, 1, 1] before a MobileNet's classifier), which left a Gather
    (no Edge TPU op) in front of every such layer."""

    def _fits(self, x, indices, index, shape, axis):
        if index.size < 2 or index.ndim < 1:
            return f"indices {indices.name} {list(index.shape)} are not a run (one index: a slice)"
        flat = index.astype(np.int64).ravel()
        if flat.min() < -shape[axis] or flat.max() >= shape[axis]:
            return f"an index is out of range for axis {axis} of {x.name} {list(shape)}"
        flat = flat % shape[axis]
        if not np.array_equal(flat, np.arange(flat[0], flat[0] + flat.size)):
            return f"indices {indices.name} are not one contiguous run"
        self._axis, self._start, self._size = axis, int(flat[0]), int(flat.size)
        self._shape = [*shape[:axis], *index.shape, *shape[axis + 1:]]
        return None

    def rewrite(self, op, x, indices, y):
        c, axis, start, end = self._new, self._axis, self._start, self._start + self._size
        sliced = op.Slice(x, c.shape(op, f"slice_start_{start}", [start]), c.shape(op, f"slice_end_{end}", [end]),
                          c.shape(op, f"axis_{axis}", [axis]))
        return op.Reshape(sliced, c.shape(op, "shape_" + "x".join(map(str, self._shape)), self._shape))


# --- the table ------------------------------------------------------------------------------------


class _WithInitializers:
    """onnxscript calls check(context, ...) then rewrite(op, ...) for each match: rewrite needs
    the graph too (initializer names), so check sets up the match's `_Initializers`."""

    def check(self, context, **bindings):
        self._new = _Initializers(context.graph_or_function)
        return super().check(context, **bindings)


def _rule(cls, *args) -> pattern.RewriteRule:
    return type(cls.__name__, (_WithInitializers, cls), {}).rule(*args)


# a quantized model's int8 rounding of its activations, dropped where the compress stage quantizes again
QUANTIZED = "weights exact; each activation's int8 rounding dropped (at most half its step) until compress quantizes again"


def _rounding(bound: str) -> str:
    return f"exact up to float rounding ({bound})"


RULES: tuple[ExactRule, ...] = (
    ExactRule("leaky-relu-to-prelu", from_patterns("leaky-relu-to-prelu", _rule(LeakyReluToPRelu)), EXACT,
              ("LeakyRelu",), "LeakyRelu(x, a) -> PRelu(x, a); a == 0 -> Relu(x)"),
    ExactRule("hardswish-to-relu6", from_patterns("hardswish-to-relu6", _rule(HardSwishToRelu6)),
              _rounding("3 * 2^-24 * |x| absolute; the reference cancels near x = -3"),
              ("HardSwish",), "HardSwish(x) -> (x * 1/6) * Clip(x + 3, 0, 6)"),
    ExactRule("hardsigmoid-to-relu6", from_patterns("hardsigmoid-to-relu6", _rule(HardSigmoidToRelu6)),
              _rounding("2^-24 absolute"),
              ("HardSigmoid",), "HardSigmoid(x, 1/6, 0.5) -> Clip(x + 3, 0, 6) * 1/6, unless multiplied by x"),
    ExactRule("hardsigmoid-to-clip", from_patterns("hardsigmoid-to-clip", _rule(HardSigmoidToClip)), EXACT,
              ("HardSigmoid",), "HardSigmoid(x, a, b) -> Clip(x*a + b, 0, 1)"),
    ExactRule("sub-constant-to-add", from_patterns("sub-constant-to-add", _rule(SubConstantToAdd)), EXACT,
              ("Sub",), "x - c with constant c -> x + (-c)"),
    ExactRule("div-constant-to-mul", from_patterns("div-constant-to-mul", _rule(DivConstantToMul)),
              _rounding("1 ulp; exact for powers of two"),
              ("Div",), "x / c with constant nonzero c -> x * (1/c)"),
    ExactRule("pow-to-mul", from_patterns("pow-to-mul", _rule(PowToMul)),
              _rounding("x*x is bit-exact; x**3 and x**4 round twice, within 2 ulp"),
              ("Pow",), "x ** n with constant n in {2, 3, 4} -> products of x"),
    ExactRule("clip-to-relu", from_patterns("clip-to-relu", _rule(ClipToRelu)), EXACT,
              ("Clip",), "Clip(x, 0) and Clip(x, 0, inf) -> Relu(x)"),
    ExactRule("gemm-to-fully-connected", from_patterns("gemm-to-fully-connected", _rule(GemmToFullyConnected)),
              _rounding("alpha and beta folded into B and C, rounded once; only B's layout changes when they are 1"),
              (), "Gemm with constant B, C -> Gemm(A, alpha*B [N, K], beta*C [N], transB=1)", triggers=("Gemm",)),
    ExactRule("gemm-rows-to-conv", from_patterns("gemm-rows-to-conv", _rule(GemmRowsToConv)),
              _rounding("the kernel's K-summation order only"),
              (), "Gemm in fully-connected form, M rows and N > 1 out -> Reshape, Transpose, 1x1 Conv with the "
              "bias, Transpose, Reshape", triggers=("Gemm",)),
    ExactRule("gemm-computed-bias-to-add",
              from_patterns("gemm-computed-bias-to-add", _rule(GemmComputedBiasToAdd)),
              _rounding("the product is rounded before beta*C is added: ~2^-24 * (|alpha| |A| |B| + |beta C|)"),
              (), "Gemm(A, constant B, computed C) -> Gemm(A, B) + beta*C", triggers=("Gemm",)),
    # before matmul-to-fully-connected, which would take these MatMuls into a FULLY_CONNECTED the Edge TPU refuses
    ExactRule("matmul-rows-to-conv", from_patterns("matmul-rows-to-conv", _rule(MatMulRowsToConv)),
              _rounding("the kernel's K-summation order only"),
              ("MatMul",), "MatMul(A [..., R, K], constant B [K, N]), R rows and N > 1 -> "
              "Reshape, Transpose, 1x1 Conv, Transpose, Reshape"),
    ExactRule("matmul-to-fully-connected", from_patterns("matmul-to-fully-connected", _rule(MatMulToFullyConnected)),
              _rounding("the kernel's K-summation order only"),
              ("MatMul",), "MatMul(A [..., K], constant B [K, N]) -> Reshape, Gemm(transB=1), Reshape"),
    ExactRule("fold-rank-for-elementwise",
              from_patterns("fold-rank-for-elementwise", *(_rule(FoldRank, op) for op in ELEMENTWISE_INPUTS)), EXACT,
              (), "elementwise op with more than 3 dims larger than 1 -> the same op on rank 3, reshaped around",
              triggers=(RANK,)),
    ExactRule("gather-constant-index-to-slice",
              from_patterns("gather-constant-index-to-slice", _rule(GatherConstantIndexToSlice)), EXACT,
              ("Gather",), "Gather(x, constant index k, axis a) -> Squeeze(Slice(x, [k], [k+1], [a]), [a])"),
    ExactRule("gather-constant-run-to-reshape",
              from_patterns("gather-constant-run-to-reshape", _rule(GatherConstantRunToReshape)), EXACT,
              ("Gather",), "Gather(x, constant indices k..k+n-1 in any shape, axis a) -> Reshape(Slice(x, [k], [k+n], "
              "[a]), x's shape with the indices' shape at a)"),
    ExactRule("float-of-quantized", quantized.RULE, QUANTIZED, ("DequantizeLinear", "QuantizeLinear"),
              "DequantizeLinear(constant) -> its float constant; DequantizeLinear(QuantizeLinear(x)) of one grid "
              "-> x (legalization/quantized.py)"),
    ExactRule("reduce-mean-to-average-pool",
              from_patterns("reduce-mean-to-average-pool", _rule(ReduceMeanToAveragePool)),
              _rounding("summation order: ~H*W*2^-24 of mean |x|"),
              ("ReduceMean",), "ReduceMean over axes [2, 3] of NCHW -> GlobalAveragePool (+ Reshape if keepdims=0)"),
)


def apply(model: onnx.ModelProto, only: Iterable[str] | None = None) -> tuple[onnx.ModelProto, dict[str, int]]:
    """Runs the rules (all, or those named in `only`, in table order) to a fixed point; returns the
    rewritten model (shapes inferred, IR version <= 10, dead nodes removed) and how often each fired.
    The input model is not changed."""
    names = [rule.name for rule in RULES]
    if only is not None:
        only = set(only)
        if unknown := sorted(only - set(names)):
            raise ValueError(f"unknown exact rules {unknown}; known: {names}")
    rules = [rule for rule in RULES if only is None or rule.name in only]
    # the new values have no shapes yet; rules of the next round read them
    graph, run = fixed_point(ir.serde.deserialize_model(model), [rule.rule for rule in rules],
                             between_rounds=ShapeInferencePass())
    RemoveUnusedNodesPass()(graph)
    result = ir.serde.serialize_model(graph)
    result.ir_version = min(result.ir_version or irm.IR_VERSION, irm.IR_VERSION)
    try:
        result = irm.infer_shapes(result)
    except Exception:  # noqa: BLE001 - a stale value_info must not lose the model; the caller checks it
        pass
    return result, run.counts
