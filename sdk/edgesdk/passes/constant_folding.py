"""Constant folding: every node whose inputs are all constants becomes a constant.

onnxscript's constant folder evaluates such nodes with the ONNX reference evaluator (so the folded
value is what the op computes), resolves Shape/Size of static shapes, inlines an If whose condition
is constant, and turns the no-ops it recognises into Identity. It keeps QuantizeLinear /
DequantizeLinear (the int8 information the compress stage and the accelerators need) and
ConstantOfShape of more than 1024 elements (folding it would only grow the file; a small one is
usually shape arithmetic, such as the pads of a Pad, which must fold for shapes to be static), leaves graph inputs that have a default
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

# ConstantOfShape up to this many elements is folded (onnxscript keeps every one).
SMALL_CONSTANT_OF_SHAPE = 1024


def _should_fold(node: ir.Node) -> bool | None:
    if node.op_type == "ConstantOfShape" and node.domain in ("", "ai.onnx"):
        shape = node.inputs[0].const_value if node.inputs and node.inputs[0] is not None else None
        if shape is not None:
            dims = shape.numpy().reshape(-1)
            return bool(dims.size == 0 or (dims >= 0).all() and int(dims.prod()) <= SMALL_CONSTANT_OF_SHAPE) or None
    return None


class CountingFolder(_constant_folding.FoldConstantsPass):
    """onnxscript's folder, counting the nodes it replaces."""

    def __init__(self):
        # Per-node shape inference as it folds: a folded Pad or an inlined If gives its consumers static
        # shapes, which the Shape/If nodes after them need in the same round.
        super().__init__(shape_inference=True,
                         input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                         output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
                         should_fold=_should_fold)
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
