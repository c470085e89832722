"""Constant folding: every node whose inputs are all constants becomes a constant.

onnxscript's constant folder evaluates such nodes with the ONNX reference evaluator (so the folded
value is what the op computes), resolves Shape/Size of static shapes, inlines an If whose condition
is constant, and turns the no-ops it recognises into Identity. It keeps QuantizeLinear /
DequantizeLinear (the int8 information the compress stage and the accelerators need) and
ConstantOfShape of more than 1024 elements (folding it would only grow the file; a small one is
usually shape arithmetic, such as the pads of a Pad, which must fold for shapes to be static), leaves graph inputs that have a default
initializer alone, and folds nothing with more than 8192 input or 262144 output elements.

Those two exceptions stop at nothing but the size of one tensor, so they would leave whole subgraphs
that depend on no graph input unfolded: a detection head's anchor grid (YOLOv8's: a ConstantOfShape of
h*w strides, Range/Expand/Concat grids of up to 2 x 8400 points at 640x640) would run on every
inference, and on an accelerator it is no work at all. So every node of the main graph that depends on
no graph input is folded whatever the limits above say (`constant_subgraph`), when it is a standard,
deterministic op that is not a quantization node and each of its outputs has a static shape of at
most `MAX_FOLDED_ELEMENTS` (onnxscript's output bound, 1 MiB of float32): memory stays bounded by that
per tensor, and the file grows by at most that per tensor left. What stays (larger tensors, random ops,
quantized weights) runs on the CPU: legalize gives no accelerator a node that depends on no graph input
(`legalization.support`).

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
# a node that depends on no graph input is folded when each of its outputs has at most this many elements
MAX_FOLDED_ELEMENTS = _constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT
# never evaluated at build time: the int8 information, and ops whose every run differs
KEPT_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear",
                      "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                      "Bernoulli"})


def constant_subgraph(graph: ir.Graph) -> set[ir.Node]:
    """The nodes of `graph` (its own, not its subgraphs') that depend on no graph input and may be folded
    whole: standard ops outside `KEPT_OPS`, with no subgraph, each output of a static shape of at most
    `MAX_FOLDED_ELEMENTS` elements, every input an initializer (not a graph input's default) or an
    output of such a node."""
    constant = {v for v in graph.initializers.values() if not v.is_graph_input()}
    nodes = set()
    for node in graph:  # in topological order: a node's producers are decided before it
        if (node.domain not in ("", "ai.onnx") or node.op_type in KEPT_OPS
                or any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values())
                or any(v is not None and v not in constant for v in node.inputs)
                or not all(_small(v) for v in node.outputs)):
            continue
        nodes.add(node)
        constant.update(node.outputs)
    return nodes


def _small(value: ir.Value) -> bool:
    shape = value.shape
    if shape is None or not all(isinstance(d, int) and d >= 0 for d in shape):
        return False
    size = 1
    for d in shape:
        size *= d
    return size <= MAX_FOLDED_ELEMENTS


def _should_fold(node: ir.Node) -> bool | None:
    if node.op_type == "ConstantOfShape" and node.domain in ("", "ai.onnx"):
        shape = node.inputs[0].const_value if node.inputs and node.inputs[0] is not None else None
        if shape is not None:
            dims = shape.numpy().reshape(-1)
            return bool(dims.size == 0 or (dims >= 0).all() and int(dims.prod()) <= SMALL_CONSTANT_OF_SHAPE) or None
    return None


class CountingFolder(_constant_folding.FoldConstantsPass):
    """onnxscript's folder, counting the nodes it replaces."""

    def __init__(self, whole: set[ir.Node] = frozenset()):
        # Per-node shape inference as it folds: a folded Pad or an inlined If gives its consumers static
        # shapes, which the Shape/If nodes after them need in the same round. The nodes of `whole` (a
        # `constant_subgraph`) fold past the default limits.
        super().__init__(shape_inference=True,
                         input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                         output_size_limit=MAX_FOLDED_ELEMENTS,
                         should_fold=lambda node: True if node in whole else _should_fold(node))
        self.replaced = 0

    def replace_node(self, node, replacement, root) -> None:
        self.replaced += 1
        super().replace_node(node, replacement, root)


def fold_constants(model: ir.Model) -> int:
    folder = CountingFolder(constant_subgraph(model.graph))
    folder(model)
    return folder.replaced


RULES: tuple[Rule, ...] = (
    Rule("fold-constants", fold_constants),
    from_pass("lift-constants-to-initializers",
              common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)),
)
