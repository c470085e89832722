"""No-op elimination: nodes that return their input unchanged become Identity, and Identity nodes
go away.

The no-ops: x*1, 1*x, x+0, 0+x, x-0, x/1; Dropout in inference mode with its mask unused;
Reshape/Flatten/Squeeze/Unsqueeze to the input's own static shape; Transpose by the identity
permutation; Cast to the input's type; Expand to the input's shape (the last three are onnxscript's
rules). This family runs before constant folding, whose partial evaluators also turn some of these
into Identity (Dropout with a used mask among them) and count under `fold-constants`.

Each rule replaces the no-op by `Identity(x)`; `remove-identity` then rewires its users to `x`.
A graph output keeps its name: where the Identity's output is a graph output, `x` is renamed to
it, and where that cannot be done (`x` is a graph input, an initializer, another graph output, or
a value of an enclosing graph) the Identity stays. onnx_ir's `IdentityEliminationPass` is not used
for this: it renames `x` when `x` is itself a graph output (the graph loses an output name) or a
value of the enclosing graph (an If branch renaming the outer value).

Why these are exact: x*1, x/1, x-0 and x+(-0.0) return x bit for bit; x+(+0.0) turns -0.0 into
+0.0, which compares equal. The constant must not broadcast x to a larger shape. onnxscript's
`mul_by_1_rule` family is not used: its constant match has rel_tol=1e-5, so it removes x*1.000005.

Needs: static shapes where a rule compares them. Guarantees: the same function, same graph
inputs and outputs.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.rules import common as onnxscript_rules

from .rule import Rule, from_patterns
from .values import SHAPE_ONLY_OPS, broadcast, constant, reshaped, static_shape


class NoOpBinary(pattern.RewriteRuleClassBase):
    """`op(x, c)` where every element of the constant `c` is the op's neutral element."""

    def __init__(self, op_type: str, neutral: float, constant_first: bool = False):
        super().__init__(f"{op_type}({'c, x' if constant_first else 'x, c'}) c={neutral:g}")
        self.op_type, self.neutral, self.constant_first = op_type, neutral, constant_first

    def pattern(self, op, x, c):
        args = (c, x) if self.constant_first else (x, c)
        return getattr(op, self.op_type)(*args)

    def check(self, context, x, c):
        result = pattern.MatchResult()
        array = constant(c)
        if array is None:
            return result.fail(f"{c.name} is not a constant")
        if array.size == 0 or not np.all(array == self.neutral):
            return result.fail(f"{c.name} is not all {self.neutral:g}")
        shape = static_shape(x)
        if shape is None:
            return result.fail(f"the shape of {x.name} is not static")
        if broadcast(shape, array.shape) != shape:
            return result.fail(f"{c.name} {array.shape} broadcasts {x.name} {shape} to a larger shape")
        return result

    def rewrite(self, op, x, c):
        return op.Identity(x)


class RemoveDropout(pattern.RewriteRuleClassBase):
    """Dropout in inference mode (training_mode absent or constant false) with its mask unused."""

    def pattern(self, op, x):
        return op.Dropout(x, _allow_other_inputs=True, _outputs=["y"])

    def check(self, context, x, y):
        result = pattern.MatchResult()
        node = y.producer()
        training = node.inputs[2] if len(node.inputs) > 2 else None
        if training is not None:
            flag = constant(training)
            if flag is None:
                return result.fail("training_mode is not a constant")
            if bool(flag.reshape(-1)[0]):
                return result.fail("training_mode is true")
        if len(node.outputs) > 1 and (node.outputs[1].uses() or node.outputs[1].is_graph_output()):
            return result.fail("the mask output is used")
        return result

    def rewrite(self, op, x, y):
        return op.Identity(x)


class NoOpShapeOp(pattern.RewriteRuleClassBase):
    """Reshape/Flatten/Squeeze/Unsqueeze whose static output shape is its input's shape."""

    def __init__(self, op_type: str):
        super().__init__(f"no-op {op_type}")
        self.op_type = op_type

    def pattern(self, op, x):
        return getattr(op, self.op_type)(x, _allow_other_inputs=True, _outputs=["y"])

    def check(self, context, x, y):
        result = pattern.MatchResult()
        shape = static_shape(x)
        if shape is None:
            return result.fail(f"the shape of {x.name} is not static")
        out = reshaped(y.producer(), shape)
        if out is None:
            return result.fail(f"the output shape of {self.op_type} is not fixed by constants")
        if out != shape:
            return result.fail(f"{self.op_type} changes {shape} to {out}")
        return result

    def rewrite(self, op, x, y):
        return op.Identity(x)


def _can_absorb(identity: ir.Node) -> bool:
    """Whether `y = Identity(x)` can go while every graph output keeps its name."""
    x, y = identity.inputs[0], identity.outputs[0]
    if x is None or len(identity.inputs) != 1 or len(identity.outputs) != 1:
        return False
    if not y.is_graph_output():
        return True
    producer = x.producer()
    return (producer is not None and producer.graph is identity.graph
            and not x.is_graph_output() and not x.is_graph_input() and not x.is_initializer())


def remove_identities(model: ir.Model) -> int:
    count = 0
    for graph in list(model.graphs()):
        for node in list(graph):
            if node.op_type != "Identity" or node.domain not in ("", "ai.onnx") or not _can_absorb(node):
                continue
            x, y = node.inputs[0], node.outputs[0]
            keep_name = y.name if y.is_graph_output() else None
            if x.shape is None:
                x.shape = y.shape
            if x.type is None:
                x.type = y.type
            ir.convenience.replace_all_uses_with(y, x, replace_graph_outputs=True)
            graph.remove(node, safe=True)
            if keep_name is not None:
                y.name = None
                x.name = keep_name
            count += 1
    return count


RULES: tuple[Rule, ...] = (
    from_patterns("remove-mul-by-one", NoOpBinary.rule("Mul", 1), NoOpBinary.rule("Mul", 1, True)),
    from_patterns("remove-add-zero", NoOpBinary.rule("Add", 0), NoOpBinary.rule("Add", 0, True),
                  NoOpBinary.rule("Sub", 0)),
    from_patterns("remove-div-by-one", NoOpBinary.rule("Div", 1)),
    from_patterns("remove-dropout", RemoveDropout.rule()),
    from_patterns("remove-no-op-reshape", *(NoOpShapeOp.rule(op) for op in SHAPE_ONLY_OPS)),
    from_patterns("remove-no-op-transpose", onnxscript_rules.no_op_transpose_rule),
    from_patterns("remove-no-op-cast", onnxscript_rules.no_op_cast_rule),
    from_patterns("remove-no-op-expand", onnxscript_rules.no_op_expand_rule),
    Rule("remove-identity", remove_identities),
)
