"""Transpose pair cancellation and sinking.

`merge-transpose-pair` (onnxscript's TransposeTranspose): Transpose(Transpose(x, p), q) is
Transpose(x, k) with k[j] = p[q[j]], or Identity where k is the identity permutation.

`sink-transpose`: T(x, p) followed by a chain of elementwise ops and then T(., q) (the NHWC<->NCHW
sandwich converters leave around activations). An elementwise op commutes with a transpose,
f(T(x, p)) = T(f'(x), p), where f' takes each constant operand c transposed back: c padded with
leading 1s to the tensor's rank r, then transposed by p^-1 (numpy broadcasting pads on the left, so
the padded constant broadcasts exactly as before). The chain is then applied to x directly and the
two transposes meet: T(T(y, p), q) = T(y, k), Identity when k is the identity. A rewrite always
removes at least one Transpose; a transpose with no partner downstream is left where it is, so
transposes never move back and forth between rounds.

Refused: a chain value with more than one use or that is a graph output (its layout would change),
a non-constant second operand, a constant of higher rank than the tensor, a chain that crosses
into a subgraph. Elementwise ops are exact, so the rewrite is exact.

Needs: nothing (the permutation attributes must be present). Guarantees: the same function, bit for bit.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter.rules.common import transpose_transpose_rule

from .rule import Rule, from_patterns
from .values import constant, fresh_initializer_name

UNARY = frozenset({
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Cast", "Ceil", "Celu", "Cos", "Cosh", "Elu",
    "Erf", "Exp", "Floor", "Gelu", "HardSigmoid", "HardSwish", "Identity", "IsInf", "IsNaN", "LeakyRelu",
    "Log", "Mish", "Neg", "Not", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin", "Sinh",
    "Softplus", "Softsign", "Sqrt", "Tan", "Tanh", "ThresholdedRelu",
})
# These also read scalar operands (Clip's bounds; per-tensor quantization's scale and zero point).
UNARY_WITH_SCALARS = frozenset({"Clip", "QuantizeLinear", "DequantizeLinear"})
BINARY = frozenset({
    "Add", "And", "BitShift", "Div", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Max",
    "Min", "Mod", "Mul", "Or", "Pow", "PRelu", "Sub", "Xor",
})


def _perm(node: ir.Node) -> list[int] | None:
    attr = node.attributes.get("perm")
    if attr is None or attr.is_ref() or attr.type != ir.AttributeType.INTS:
        return None
    perm = list(attr.as_ints())
    return perm if sorted(perm) == list(range(len(perm))) else None


def _commutes(node: ir.Node, index: int, rank: int) -> bool:
    """Whether `node`, reading the chain at input `index`, commutes with a transpose of a rank-`rank` tensor."""
    if node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
        return False
    others = [v for i, v in enumerate(node.inputs) if i != index and v is not None]
    arrays = [constant(v) for v in others]
    if any(a is None for a in arrays):
        return False
    if node.op_type in UNARY:
        return not others
    if node.op_type in UNARY_WITH_SCALARS:
        return all(a.ndim == 0 for a in arrays)
    if node.op_type in BINARY:
        return len(node.inputs) == 2 and all(a.ndim <= rank for a in arrays)
    return False


def _chain_to_partner(first: ir.Node, rank: int) -> tuple[list[tuple[ir.Node, int]], ir.Node] | None:
    """The elementwise chain after `first` and the Transpose that ends it, or None."""
    chain: list[tuple[ir.Node, int]] = []
    value = first.outputs[0]
    while True:
        if value.is_graph_output() or len(value.uses()) != 1:
            return None
        user, index = next(iter(value.uses()))
        if user.graph is not first.graph:
            return None
        if user.op_type == "Transpose" and user.domain in ("", "ai.onnx"):
            return (chain, user) if chain and _perm(user) is not None and len(_perm(user)) == rank else None
        if not _commutes(user, index, rank):
            return None
        chain.append((user, index))
        value = user.outputs[0]


def _sink(first: ir.Node) -> bool:
    perm = _perm(first)
    if perm is None:
        return False
    rank = len(perm)
    found = _chain_to_partner(first, rank)
    if found is None:
        return False
    chain, second = found
    graph = first.graph
    inverse = [int(i) for i in np.argsort(perm)]
    head, index = chain[0]
    head.replace_input_with(index, first.inputs[0])
    for node, index in chain:
        for i, operand in enumerate(node.inputs):
            if i == index or operand is None:
                continue
            array = constant(operand)
            if array.ndim == 0:
                continue
            padded = array.reshape((1,) * (rank - array.ndim) + array.shape)
            moved = ir.tensor(np.ascontiguousarray(np.transpose(padded, inverse)))
            name = fresh_initializer_name(graph, f"{operand.name}_transposed")
            value = ir.Value(name=name, shape=ir.Shape(moved.shape), type=ir.TensorType(moved.dtype),
                             const_value=moved)
            graph.register_initializer(value)
            node.replace_input_with(i, value)
        out = node.outputs[0]
        if out.shape is not None and len(out.shape) == rank:
            out.shape = ir.Shape([out.shape[inverse[j]] for j in range(rank)])
    graph.remove(first, safe=True)
    merged = [perm[q] for q in _perm(second)]
    last = chain[-1][0].outputs[0]
    if merged == list(range(rank)):
        identity = ir.node("Identity", [last])
        ir.convenience.replace_nodes_and_values(graph, second, [second], [identity], second.outputs,
                                                identity.outputs)
    else:
        second.attributes["perm"] = ir.AttrInt64s("perm", merged)
    return True


def sink_transposes(model: ir.Model) -> int:
    count = 0
    for graph in list(model.graphs()):
        for node in list(graph):
            if node.graph is graph and node.op_type == "Transpose" and node.domain in ("", "ai.onnx"):
                count += _sink(node)
    return count


RULES: tuple[Rule, ...] = (
    from_patterns("merge-transpose-pair", transpose_transpose_rule),
    Rule("sink-transpose", sink_transposes),
)
