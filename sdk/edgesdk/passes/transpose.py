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

`transpose-through-unit-reshape`: T(R(T(x, p), s), q) where the Reshape R only drops size-1 axes
(the non-unit dimensions of its input, in order, are its output's, and the output has no unit axis)
is R'(x) followed by one transpose: the kept axes of x in the order p puts them, k = [p[a] for the
kept positions a], then q applied, give x's axes in their final order; R' drops the same unit axes
from x in x's own order (a pure reshape, since unit axes carry no data), then T(., k') with k' those
final axes numbered among x's kept ones (none when they are already in order). tf2onnx writes Keras's
multi-head attention this way (5-D transposes with a head axis of 1, a Reshape, a transpose of the
last two axes): each pair moved every element twice, the value's with a non-contiguous innermost
axis; the Keras encoder's four pairs were 0.38 ms of 2 ms in onnxruntime.

Needs: nothing (the permutation attributes must be present; the third rule a static input shape and a
constant shape). Guarantees: the same function, bit for bit.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.rules.common import transpose_transpose_rule

from .rule import Rule, from_patterns
from .values import attr_int, constant, fresh_initializer_name, static_shape

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


class TransposeThroughUnitReshape(pattern.RewriteRuleClassBase):
    """Transpose(Reshape(Transpose(x, p), s), q), the Reshape dropping unit axes only -> Reshape(x, s')
    then one Transpose (or none)."""

    def pattern(self, op, x, shape):
        first = op.Transpose(x, _outputs=["t1"])
        return op.Transpose(op.Reshape(first, shape, _outputs=["r"]), _outputs=["t2"])

    def check(self, context, x, shape, t1, r, t2):
        result = pattern.MatchResult()
        p, q = _perm(t1.producer()), _perm(t2.producer())
        if p is None or q is None:
            return result.fail("a permutation is missing")
        if attr_int(r.producer(), "allowzero", 0):
            return result.fail(f"{r.producer().name}: allowzero")
        dims, out = static_shape(x), static_shape(r)
        if dims is None or out is None or constant(shape) is None:
            return result.fail("shapes are not static")
        moved = [dims[a] for a in p]
        kept = [j for j, d in enumerate(moved) if d != 1]
        if 1 in out or [moved[j] for j in kept] != list(out) or len(q) != len(out):
            return result.fail(f"{r.producer().name} {moved} -> {list(out)} does more than drop unit axes")
        final = [p[kept[j]] for j in q]  # x's axes, in the order the two transposes leave them
        order = sorted(final)  # x's kept axes in its own order: what the reshape of x keeps
        self._shape = np.array([dims[a] for a in order], np.int64)
        self._perm = [order.index(a) for a in final]
        self._name = fresh_initializer_name(context.graph_or_function, f"{x.name}_unit_axes_dropped")
        return result

    def rewrite(self, op, x, shape, t1, r, t2):
        squeezed = op.Reshape(x, op.initializer(ir.tensor(self._shape), self._name))
        if self._perm == sorted(self._perm):
            return op.Identity(squeezed)
        return op.Transpose(squeezed, perm=self._perm)


RULES: tuple[Rule, ...] = (
    from_patterns("merge-transpose-pair", transpose_transpose_rule),
    Rule("sink-transpose", sink_transposes),
    from_patterns("transpose-through-unit-reshape", TransposeThroughUnitReshape.rule()),
)
