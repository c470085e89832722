"""Conv/Gemm + bias + activation: per-channel affine ops fold into the Conv, MatMul+Add becomes
Gemm, and activation chains become one activation in a canonical form.

Standard ONNX has no fused conv+activation op, so nothing here fuses an activation into a Conv:
each backend does that itself (TVM's FuseOps puts a Conv and the elementwise ops after it in one
kernel; the TFLite converter sets a CONV_2D's fused_activation_function from the RELU/RELU6 that
follows). These rules put the activations in the forms those backends recognise: Relu, Clip(0, 6)
(ReLU6), HardSigmoid, HardSwish; one Clip instead of Min(Max(...)) or a Relu/Clip chain.

Arithmetic and tolerance:
- `Conv(x, W, B) * s` with s constant per output channel is `Conv(x, W*s, B*s)`; `/ s` uses 1/s;
  `+ c` / `- c` is `Conv(x, W, B ± c)` (also for ConvTranspose, whose bias is per output channel too). The products and sums are reassociated: float results
  differ by rounding only (relative error a few ulp of the accumulated sum: within rtol 1e-5).
- MatMul+Add -> Gemm only where A and B are 2-D and the bias broadcasts to the (M, N) output
  (Gemm's C is unidirectionally broadcast; onnxscript's rule checks only the ranks of A and B).
  onnxruntime makes the same fusion itself (MatMulAddFusion), so this is never slower there.
- Clip chains: onnxscript's rules merge Clip(Clip), Clip(Relu), Relu(Clip) by intersecting the
  intervals, which is wrong where the intervals are disjoint (Clip(Clip(x, 0, 6), 7, 8) is 7
  everywhere; Clip(x, 7, 6) is 6, by the spec and in onnxruntime): the check here refuses disjoint
  intervals. Min/Max -> Clip also needs the bounds not to broadcast x to a higher rank.
- HardSigmoid/HardSwish: onnxscript matches the constants 3 and 6 with rel_tol 1e-4; here they must
  be exactly 0, 3 and 6 (HardSigmoid(alpha=1/6) then differs from Clip(x+3, 0, 6)/6 by float
  rounding). HardSwish needs opset 14.

Needs: static output shapes of the Conv/Add nodes. Guarantees: the same function within rtol 1e-5.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.rules.common import _fuse_hardswish, _fuse_relus_clips, _matmul_add_to_gemm, _min_max_to_clip

from .rule import Rule, from_patterns
from .values import FLOAT_TYPES, broadcast, constant, fresh_initializer_name, opset, per_channel, static_shape

# --- Conv followed by a per-channel constant -------------------------------------------------


class _ConvAffine(pattern.RewriteRuleClassBase):
    """`op_type(Conv(x, W[, B]), c)` (or `(c, Conv)`) with c constant per output channel."""

    def __init__(self, op_type: str, constant_first: bool = False, conv_type: str = "Conv"):
        super().__init__(f"{conv_type} then {op_type}{' (constant first)' if constant_first else ''}")
        self.op_type, self.constant_first, self.conv_type = op_type, constant_first, conv_type

    def pattern(self, op, x, w, c):
        conv = getattr(op, self.conv_type)(x, w, _allow_other_inputs=True, _outputs=["conv_out"])
        return getattr(op, self.op_type)(*((c, conv) if self.constant_first else (conv, c)))

    def check(self, context, x, w, c, conv_out):
        result = pattern.MatchResult()
        conv = conv_out.producer()
        weights, array = constant(w), constant(c)
        if weights is None or array is None:
            return result.fail(f"{w.name if weights is None else c.name} is not a constant")
        if w.dtype not in FLOAT_TYPES or c.dtype != w.dtype:
            return result.fail(f"{conv.name}: weights are not float, or the constant's type differs")
        shape = static_shape(conv_out)
        if shape is None:
            return result.fail(f"{conv.name}: output shape is not static")
        vector = per_channel(array, shape)
        if vector is None:
            return result.fail(f"{c.name} {array.shape} is not per-channel for output {shape}")
        bias_value = conv.inputs[2] if len(conv.inputs) > 2 else None
        bias = np.zeros(vector.shape[0], weights.dtype) if bias_value is None else constant(bias_value)
        if bias is None:
            return result.fail(f"{conv.name}: bias is not a constant")
        return self.fold(result, context, conv, weights, bias, vector)

    def rewrite(self, op, x, w, c, conv_out):
        conv = conv_out.producer()
        weights = w if self._weights is None else op.initializer(ir.tensor(self._weights), self._weights_name)
        bias = op.initializer(ir.tensor(self._bias), self._bias_name)
        return getattr(op, self.conv_type)(x, weights, bias, **conv.attributes)

    def _names(self, context, conv: ir.Node) -> None:
        graph = context.graph_or_function
        self._weights_name = fresh_initializer_name(graph, f"{conv.inputs[1].name}_scaled")
        base = conv.inputs[2].name if len(conv.inputs) > 2 and conv.inputs[2] is not None else conv.inputs[1].name
        self._bias_name = fresh_initializer_name(graph, f"{base}_bias")


class FoldScaleIntoConv(_ConvAffine):
    """Conv * s -> Conv(W*s, B*s); Conv / s -> Conv(W/s, B/s). Conv only: its weights' first axis
    is the output channel (ConvTranspose's is the input channel)."""

    def fold(self, result, context, conv, weights, bias, vector):
        if vector.shape[0] != weights.shape[0]:
            return result.fail(f"{conv.name}: {weights.shape[0]} output channels, {vector.shape[0]} factors")
        with np.errstate(all="ignore"):
            factor = 1.0 / vector.astype(np.float64) if self.op_type == "Div" else vector.astype(np.float64)
            scaled = (weights * factor.reshape((-1,) + (1,) * (weights.ndim - 1))).astype(weights.dtype)
            self._bias = (bias * factor).astype(weights.dtype)
        if not (np.all(np.isfinite(scaled)) and np.all(np.isfinite(self._bias))):
            return result.fail(f"{conv.name}: the scaled weights overflow")
        self._weights = scaled
        self._names(context, conv)
        return result


class FoldBiasIntoConv(_ConvAffine):
    """Conv + c -> Conv(B + c); Conv - c -> Conv(B - c); the same for ConvTranspose."""

    def fold(self, result, context, conv, weights, bias, vector):
        sign = -1.0 if self.op_type == "Sub" else 1.0
        with np.errstate(all="ignore"):
            self._bias = (bias.astype(np.float64) + sign * vector).astype(weights.dtype)
        if not np.all(np.isfinite(self._bias)):
            return result.fail(f"{conv.name}: the folded bias overflows")
        self._weights = None
        self._names(context, conv)
        return result


# --- MatMul + Add -> Gemm --------------------------------------------------------------------


class _GemmBiasBroadcasts:
    """MatMul+Add -> Gemm where the bias broadcasts; the Gemm keeps the MatMul's name (a layer's name is how
    a user picks it, e.g. `--prune-layers fc2`)."""

    _name = ""

    def check(self, context, input_a, input_b, input_c, **_):
        result = super().check(context, input_a, input_b)
        if not result:
            return result
        self._name = next((n.name for n in context.nodes if n.op_type == "MatMul" and n.name), "")
        out, bias = static_shape(context.output_values[0]), static_shape(input_c)
        if out is None or bias is None or len(out) != 2:
            return result.fail("the output or the bias shape is not static")
        if len(bias) > 2 or broadcast(out, bias) != out:
            return result.fail(f"bias {bias} does not broadcast to the {out} output")
        if input_a.dtype not in FLOAT_TYPES:
            return result.fail("Gemm takes float operands here")
        return result

    def rewrite(self, op, input_a, input_b, input_c):
        out = super().rewrite(op, input_a, input_b, input_c)
        if self._name:
            out.producer().name = self._name
        return out


class MatMulAddToGemm(_GemmBiasBroadcasts, _matmul_add_to_gemm.MatMulAddToGemm):
    pass


class TransAMatMulAddToGemm(_GemmBiasBroadcasts, _matmul_add_to_gemm.TransAMatMulAddToGemm):
    pass


class TransBMatMulAddToGemm(_GemmBiasBroadcasts, _matmul_add_to_gemm.TransBMatMulAddToGemm):
    pass


class TransABMatMulAddToGemm(_GemmBiasBroadcasts, _matmul_add_to_gemm.TransABMatMulAddToGemm):
    pass


# --- activation chains -----------------------------------------------------------------------


def _bounds(node: ir.Node) -> tuple[float, float] | None:
    """The interval a Relu or Clip maps into, or None where its bounds are not constants."""
    if node.op_type == "Relu":
        return 0.0, np.inf
    lo, hi = -np.inf, np.inf
    for i, value in ((1, "min"), (2, "max")):
        if len(node.inputs) > i and node.inputs[i] is not None:
            array = constant(node.inputs[i])
            if array is None or array.size != 1:
                return None
            bound = float(array.reshape(-1)[0])
            lo, hi = (bound, hi) if value == "min" else (lo, bound)
    return lo, hi


class _IntervalsMeet:
    """Clip/Relu chains merge only where their intervals intersect."""

    def check(self, context, **bindings):
        result = pattern.MatchResult()
        x = bindings["x"]
        if x.dtype is None:
            return result.fail(f"the element type of {x.name} is unknown")
        intervals = [_bounds(n) for n in context.nodes if n.op_type in ("Relu", "Clip")]
        if any(i is None for i in intervals):
            return result.fail("a Clip bound is not a scalar constant")
        lo, hi = max(i[0] for i in intervals), min(i[1] for i in intervals)
        if lo > hi:
            return result.fail(f"the intervals do not meet (max of lows {lo} > min of highs {hi})")
        return super().check(context, **bindings)


class MergeClipClip(_IntervalsMeet, _fuse_relus_clips.FuseSuccessiveClip):
    pass


class MergeClipRelu(_IntervalsMeet, _fuse_relus_clips.FuseSuccessiveClipRelu):
    pass


class MergeReluClip(_IntervalsMeet, _fuse_relus_clips.FuseSuccessiveReluClip):
    pass


class _TrueConstantsKeepRank:
    """Min/Max operands must be true constants (not overridable inputs) that do not raise x's rank.
    Min(Max(x, a), b) is Clip(x, a, b) even for a > b (the spec defines Clip as Min(max, Max(x, min)));
    onnxscript's own check refuses Max(Min(x, b), a) with a > b, which Clip cannot express."""

    def check(self, context, x, out1, out2):
        result = pattern.MatchResult()
        arrays = [constant(v) for v in (*out1.producer().inputs[1:], *out2.producer().inputs[1:])]
        if any(a is None for a in arrays):
            return result.fail("an operand is not a constant")
        if x.shape is None or any(a.ndim > len(x.shape) for a in arrays):
            return result.fail(f"the rank of {x.name} is unknown or a constant raises it")
        return super().check(context, out1=out1, out2=out2)


class MergeMinMin(_TrueConstantsKeepRank, _min_max_to_clip.FuseSuccessiveMin):
    pass


class MergeMaxMax(_TrueConstantsKeepRank, _min_max_to_clip.FuseSuccessiveMax):
    pass


class MaxMinToClip(_TrueConstantsKeepRank, _min_max_to_clip.FuseMaxMinToClip):
    pass


class MinMaxToClip(_TrueConstantsKeepRank, _min_max_to_clip.FuseMinMaxToClip):
    pass


def _exactly(value: ir.Value, expected: float, rank: int) -> bool:
    array = constant(value)
    return array is not None and array.size == 1 and array.ndim <= rank and float(array.reshape(-1)[0]) == expected


class _ExactHardSigmoidConstants:
    """Clip(x + 3, 0, 6) / 6 with exactly those constants, float x; HardSwish needs opset 14."""

    def check(self, context, x, clip_min, clip_max, bias, divisor):
        result = pattern.MatchResult()
        if x.dtype not in FLOAT_TYPES or x.shape is None:
            return result.fail(f"{x.name} is not a float tensor of known rank")
        rank = len(x.shape)
        for value, expected in ((clip_min, 0.0), (clip_max, 6.0), (bias, 3.0), (divisor, 6.0)):
            if not _exactly(value, expected, rank):
                return result.fail(f"{value.name} is not the scalar constant {expected:g}")
        if self.produces_hardswish and opset(context.model) < 14:
            return result.fail("HardSwish needs opset 14")
        return super().check(context, x, clip_min, clip_max, bias, divisor)


class FuseHardSigmoid(_ExactHardSigmoidConstants, _fuse_hardswish.HardSigmoidFusion):
    produces_hardswish = False


class FuseHardSwish(_ExactHardSigmoidConstants, _fuse_hardswish.HardSwishFusion):
    produces_hardswish = True


class FuseHardSwishFromHardSigmoid(_fuse_hardswish.HardSwishFusionFromHardSigmoid):
    """HardSigmoid(x, alpha=1/6, beta=0.5) * x, alpha within float32 rounding of 1/6."""

    def check(self, context, x, hardsigmoid_out):
        result = pattern.MatchResult()
        node = hardsigmoid_out.producer()
        alpha, beta = node.attributes.get_float("alpha", 0.2), node.attributes.get_float("beta", 0.5)
        if abs(alpha - 1 / 6) > 1e-7 or beta != 0.5:
            return result.fail(f"HardSigmoid alpha={alpha}, beta={beta} is not alpha=1/6, beta=0.5")
        if opset(context.model) < 14:
            return result.fail("HardSwish needs opset 14")
        return result


RULES: tuple[Rule, ...] = (
    from_patterns("merge-min-min", MergeMinMin.rule()),
    from_patterns("merge-max-max", MergeMaxMax.rule()),
    from_patterns("min-max-to-clip", MaxMinToClip.rule(), MinMaxToClip.rule()),
    from_patterns("merge-relu-relu", _fuse_relus_clips.FuseSuccessiveRelu.rule()),
    from_patterns("merge-relu-clip", MergeClipRelu.rule(), MergeReluClip.rule()),
    from_patterns("merge-clip-clip", MergeClipClip.rule()),
    from_patterns("fuse-hardswish", FuseHardSwish.rule(), FuseHardSwishFromHardSigmoid.rule(), commute=True),
    from_patterns("fuse-hardsigmoid", FuseHardSigmoid.rule(), commute=True),
    from_patterns("fold-scale-into-conv", FoldScaleIntoConv.rule("Mul"), FoldScaleIntoConv.rule("Mul", True),
                  FoldScaleIntoConv.rule("Div")),
    from_patterns("fold-bias-into-conv", *(rule for conv in ("Conv", "ConvTranspose") for rule in (
        FoldBiasIntoConv.rule("Add", False, conv), FoldBiasIntoConv.rule("Add", True, conv),
        FoldBiasIntoConv.rule("Sub", False, conv)))),
    from_patterns("matmul-add-to-gemm", TransABMatMulAddToGemm.rule(), TransAMatMulAddToGemm.rule(),
                  TransBMatMulAddToGemm.rule(), MatMulAddToGemm.rule(), commute=True),
)
