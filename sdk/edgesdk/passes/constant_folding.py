"""Constant folding: every node whose inputs are all constants becomes a constant.

onnxscript's constant folder evaluates such nodes with the ONNX reference evaluator (so the folded
value is what the op computes), resolves Shape/Size of static shapes, inlines an If whose condition
is constant, and turns the no-ops it recognises into Identity. It keeps QuantizeLinear /
DequantizeLinear (the int8 information the compress stage and the accelerators need) and
ConstantOfShape (folding it would only grow the file), leaves graph inputs that have a default
initializer alone, and folds nothing with more than 8192 input or 262144 output elements.

Constant nodes are then lifted to initializers (onnx_ir's `LiftConstantsToInitializersPass`):
the weight-rewriting rules (onnxscript's BatchNormalization fusion among them) look for initializers.

Needs: nothing. Guarantees: the same function. Counts: nodes the folder replaced, Constant nodes lifted.
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript.optimizer import _constant_folding

from .rule import Rule, from_pass


class CountingFolder(_constant_folding.FoldConstantsPass):
    """onnxscript's folder, counting the nodes it replaces."""

    def __init__(self):
        # Shapes are already inferred (the import stage runs ONNX shape inference first).
        super().__init__(shape_inference=False,
                         input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                         output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT)
        self.replaced = 0

    def replace_node(self, node, replacement, root) -> None:
        self.replaced += 1
        super().replace_node(node, replacement, root)


def fold_constants(model: ir.Model) -> int:
    folder = CountingFolder()
    folder(model)
    return folder.replaced


RULES: tuple[Rule, ...] = (
    Rule("fold-constants", fold_constants),
    from_pass("lift-constants-to-initializers",
              common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)),
)
