"""BatchNormalization folding into the Conv, ConvTranspose or Gemm that feeds it.

In inference mode BN is the affine map y = gamma * (x - mean) / sqrt(var + eps) + beta per channel,
so with s = gamma / sqrt(var + eps) it folds into the producer's weights and bias:
W' = W * s (along the output-channel axis), B' = (B - mean) * s + beta (onnxscript's
`_fuse_batchnorm` rules do the arithmetic). Float results differ from BN-after-Conv by rounding
only (the products are reassociated): within rtol 1e-5.

onnxscript's rules do not look at `training_mode`: with training_mode=1 BN normalizes with the
batch's own statistics, not the stored ones, and folding would change the answer. The checks here
add that, refuse BN whose running-statistics outputs are used, and refuse parameters whose dtype
differs from the weights' (numpy would promote the fused weights to another type).

Needs: constant weights and BN parameters (initializers). Guarantees: the same function.
"""

from __future__ import annotations

from onnxscript.rewriter import pattern
from onnxscript.rewriter.rules.common import _fuse_batchnorm

from .rule import Rule, from_patterns
from .values import attr_int


class _InferenceModeOnly:
    def check(self, context, x, inbound_out, batchnorm_out):
        result = pattern.MatchResult()
        bn, inbound = batchnorm_out.producer(), inbound_out.producer()
        if attr_int(bn, "training_mode", 0):
            return result.fail(f"{bn.name}: training_mode=1 normalizes with batch statistics")
        if any(o.uses() or o.is_graph_output() for o in bn.outputs[1:]):
            return result.fail(f"{bn.name}: the running mean/variance outputs are used")
        if len(inbound.inputs) < 2 or inbound.inputs[1] is None:
            return result.fail(f"{inbound.name}: no weight input")
        weight_type = inbound.inputs[1].dtype
        params = [v for v in (*bn.inputs[1:], *inbound.inputs[2:3]) if v is not None]
        if len(bn.inputs) != 5 or any(v.dtype != weight_type for v in params):
            return result.fail(f"{bn.name}: parameters and weights have different element types")
        return super().check(context, x, inbound_out, batchnorm_out)


class FoldBatchNormConv(_InferenceModeOnly, _fuse_batchnorm.FuseBatchNormIntoConv):
    pass


class FoldBatchNormConvTranspose(_InferenceModeOnly, _fuse_batchnorm.FuseBatchNormIntoConvTranspose):
    pass


class FoldBatchNormGemm(_InferenceModeOnly, _fuse_batchnorm.FuseBatchNormIntoGemm):
    pass


RULES: tuple[Rule, ...] = (
    from_patterns("fold-batchnorm-conv", FoldBatchNormConv.rule()),
    from_patterns("fold-batchnorm-conv-transpose", FoldBatchNormConvTranspose.rule()),
    from_patterns("fold-batchnorm-gemm", FoldBatchNormGemm.rule()),
)
