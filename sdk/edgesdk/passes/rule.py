"""A named rewrite and how it counts its firings.

Pattern rules (onnxscript's `RewriteRule`: pattern, check that says why it did not match,
replacement) count one firing per rewritten match; graph passes (onnx_ir's, or ours where a chain
of any length has to be followed) count the nodes they removed.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import onnx_ir as ir
from onnxscript.rewriter import pattern


@dataclasses.dataclass(frozen=True)
class Rule:
    """`apply` rewrites the model in place and returns how many times the rule fired."""

    name: str
    apply: Callable[[ir.Model], int]


def count_nodes(model: ir.Model) -> int:
    """Nodes of the main graph and of every subgraph (If branches, Loop bodies)."""
    return sum(1 for _ in ir.traversal.RecursiveGraphIterator(model.graph))


def from_patterns(name: str, *rules: pattern.RewriteRule, commute: bool = False) -> Rule:
    """One named rule from onnxscript rewrite rules (variants of one rewrite, e.g. operand orders)."""
    rule_set = pattern.RewriteRuleSet(list(rules), commute=commute)
    return Rule(name, lambda model: rule_set.apply_to_model(model))


def from_pass(name: str, run: Callable[[ir.Model], object]) -> Rule:
    """One named rule from a graph pass (an onnx_ir pass or a function); it fired once per node it removed."""

    def apply(model: ir.Model) -> int:
        before = count_nodes(model)
        run(model)
        return max(before - count_nodes(model), 0)

    return Rule(name, apply)
