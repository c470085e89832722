"""Reshape chains: two shape-only ops in a row become one Reshape.

Reshape, Flatten, Squeeze and Unsqueeze only relabel the shape of a row-major buffer, so any chain
of them is one Reshape to the last static shape (exact: no element moves). `merge-reshape-chain`
does this where the chain's input shape is static and each op's constants fix its output shape;
`merge-reshape-pair` (onnxscript's ReshapeReshape) covers Reshape(Reshape(x)) where shapes are not
static (inside Loop bodies), keeping the 0/-1 entries that onnxscript can resolve.

Refused: an intermediate result used elsewhere or that is a graph output (it must survive), a
shape not fixed by constants.

Needs: static shapes for `merge-reshape-chain`. Guarantees: the same function, bit for bit.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.rules.common import reshape_reshape_rule

from .rule import Rule, from_patterns
from .values import SHAPE_ONLY_OPS, fresh_initializer_name, reshaped, static_shape


class ShapeOpChain(pattern.RewriteRuleClassBase):
    """`outer(inner(x))` for two shape-only ops, with x's shape static."""

    def __init__(self, inner: str, outer: str):
        super().__init__(f"{outer}({inner}(x))")
        self.inner, self.outer = inner, outer

    def pattern(self, op, x):
        mid = getattr(op, self.inner)(x, _allow_other_inputs=True, _outputs=["mid"])
        return getattr(op, self.outer)(mid, _allow_other_inputs=True, _outputs=["out"])

    def check(self, context, x, mid, out):
        result = pattern.MatchResult()
        shape = static_shape(x)
        if shape is None:
            return result.fail(f"the shape of {x.name} is not static")
        middle = reshaped(mid.producer(), shape)
        final = None if middle is None else reshaped(out.producer(), middle)
        if final is None:
            return result.fail("a shape in the chain is not fixed by constants")
        if 0 in final:
            return result.fail("an empty dimension would need allowzero")
        self._shape = np.array(final, np.int64)
        self._name = fresh_initializer_name(context.graph_or_function, f"{out.name}_shape")
        return result

    def rewrite(self, op, x, mid, out):
        return op.Reshape(x, op.initializer(ir.tensor(self._shape), self._name))


RULES: tuple[Rule, ...] = (
    from_patterns("merge-reshape-chain",
                  *(ShapeOpChain.rule(inner, outer) for inner in SHAPE_ONLY_OPS for outer in SHAPE_ONLY_OPS)),
    from_patterns("merge-reshape-pair", reshape_reshape_rule),
)
