"""Elementwise chain fusion: two constant operands applied one after the other become one.

    (x * c1) * c2 -> x * (c1*c2)      (x / c1) / c2 -> x / (c1*c2)
    (x * c1) / c2 -> x * (c1/c2)      (x / c1) * c2 -> x * (c2/c1)
    (x + c1) + c2 -> x + (c1+c2)      (x - c1) - c2 -> x - (c1+c2)
    (x + c1) - c2 -> x + (c1-c2)      (x - c1) + c2 -> x + (c2-c1)

The result's shape is unchanged by construction (broadcasting is associative: x, c1, c2 broadcast
to the same shape as x and the broadcast of c1 with c2); the rules refuse a combined constant larger
than the two originals together (c1 (3,1) with c2 (1,3) would store 9 numbers for 6).

Exactness: integers are exact (two's-complement arithmetic is a ring, wrap-around included; integer
Div is left alone, truncation does not compose). Floats are reassociated, and the constants are
combined in float64 then rounded once:
- multiplicative chains change the result by at most ~3 ulp (each side has two or three roundings
  of relative error 2^-24 for float32), a relative error below 2e-7, whatever the magnitudes;
- additive chains change it by at most ~2^-24 * (|x| + |c1| + |c2|) in absolute terms, which is
  relative to the output only where the constants do not cancel x.
Both are within rtol 1e-5 / atol 1e-6 for activations and constants of ordinary magnitude. A combined
constant that overflows, or underflows to zero where neither factor was zero, is refused.

Div by a constant alone is not rewritten to Mul by 1/c: that is only within rounding (x * fl(1/c)
differs from x / c by up to 1 ulp) and gains nothing unless it meets another constant.

Needs: constant operands. Guarantees: the same function (exact for integers, within the bounds above for floats).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from .rule import Rule, from_patterns
from .values import FLOAT_TYPES, constant, fresh_initializer_name

_INT_TYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


class ConstantChain(pattern.RewriteRuleClassBase):
    """`outer(inner(x, c1), c2)`, both constants on the right (Add/Mul are also tried commuted)."""

    def __init__(self, inner: str, outer: str):
        super().__init__(f"{outer}({inner}(x, c1), c2)")
        self.inner, self.outer = inner, outer

    def pattern(self, op, x, c1, c2):
        return getattr(op, self.outer)(getattr(op, self.inner)(x, c1), c2)

    def check(self, context, x, c1, c2):
        result = pattern.MatchResult()
        a, b = constant(c1), constant(c2)
        if a is None or b is None:
            return result.fail(f"{(c2 if a is not None else c1).name} is not a constant")
        if constant(x) is not None:
            return result.fail("all operands are constants (constant folding's job)")
        dtype = a.dtype
        if b.dtype != dtype or not (c1.dtype in FLOAT_TYPES or str(dtype) in _INT_TYPES):
            return result.fail(f"element types {a.dtype}/{b.dtype} are not one float or integer type")
        is_float = c1.dtype in FLOAT_TYPES
        if "Div" in (self.inner, self.outer) and not is_float:
            return result.fail("integer division truncates: it does not compose")
        op, combined = self._combine(a, b, is_float)
        if combined.size > a.size + b.size:
            return result.fail(f"the combined constant {combined.shape} is larger than {a.shape} and {b.shape} together")
        if is_float:
            lost = (combined == 0) & (a != 0) & (b != 0) if op in ("Mul", "Div") else np.zeros((), bool)
            if not np.all(np.isfinite(combined)) or np.any(lost):
                return result.fail("the combined constant overflows or underflows")
        self._op, self._combined = op, combined
        self._name = fresh_initializer_name(context.graph_or_function, f"{c1.name}_{c2.name}")
        return result

    def _combine(self, a: np.ndarray, b: np.ndarray, is_float: bool) -> tuple[str, np.ndarray]:
        """The op and constant of the one-node form; floats combined in float64, rounded once."""
        wide = (a.astype(np.float64), b.astype(np.float64)) if is_float else (a, b)
        inner, outer = self.inner, self.outer
        with np.errstate(all="ignore"):
            if inner == outer:  # x*a*b, x/a/b, x+a+b, x-a-b: the op stays, constants combine
                value = wide[0] * wide[1] if inner in ("Mul", "Div") else wide[0] + wide[1]
                op = inner
            elif inner in ("Mul", "Div"):
                value = wide[0] / wide[1] if inner == "Mul" else wide[1] / wide[0]
                op = "Mul"
            else:
                value = wide[0] - wide[1] if inner == "Add" else wide[1] - wide[0]
                op = "Add"
            return op, np.asarray(value).astype(a.dtype)

    def rewrite(self, op, x, c1, c2):
        return getattr(op, self._op)(x, op.initializer(ir.tensor(self._combined), self._name))


def _chains(ops: tuple[str, str]) -> list[pattern.RewriteRule]:
    return [ConstantChain.rule(inner, outer) for inner in ops for outer in ops]


RULES: tuple[Rule, ...] = (
    from_patterns("merge-mul-chain", *_chains(("Mul", "Div")), commute=True),
    from_patterns("merge-add-chain", *_chains(("Add", "Sub")), commute=True),
)
