"""Common-subexpression elimination, dead-code elimination, initializer deduplication (onnx_ir's
passes).

- CSE: a node with the same op, attributes and input values as an earlier one is replaced by it
  (control flow and random ops are never merged; only the main graph is visited). Where the
  removed node's output is a graph output, onnx_ir renames the kept value, or adds an Identity
  where the kept value is itself a graph input or output, so output names survive.
- Dead code: nodes and initializers nothing uses, in every graph; graph inputs and outputs stay.
- Initializers with the same type, shape and bytes become one (up to 2^20 elements each), which
  lets CSE merge the nodes that read them.

Needs: nothing. Guarantees: the same function, bit for bit. Counts: nodes removed, initializers merged.
"""

from __future__ import annotations

import logging

import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnx_ir.passes.common import initializer_deduplication

from .rule import Rule, from_pass

_DEDUP = common_passes.DeduplicateInitializersPass(size_limit=1 << 20)
_CSE = common_passes.CommonSubexpressionEliminationPass()


def eliminate_common_subexpressions(model: ir.Model) -> int:
    """Counts the nodes merged away; an Identity that CSE adds so that two graph outputs keep their
    names (both computed by one node now) does not offset the node it replaced."""

    def computing() -> int:
        return sum(n.op_type != "Identity" for n in ir.traversal.RecursiveGraphIterator(model.graph))

    before = computing()
    _CSE(model)
    return max(before - computing(), 0)


def deduplicate_initializers(model: ir.Model) -> int:
    def count() -> int:
        return sum(len(g.initializers) for g in model.graphs())

    # The pass warns about every initializer that is also a graph input, on every round: that is
    # expected here (such defaults are never merged), not news for the user.
    quiet = logging.getLogger(initializer_deduplication.__name__)
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        before = count()
        _DEDUP(model)
        return max(before - count(), 0)
    finally:
        quiet.setLevel(level)


RULES: tuple[Rule, ...] = (
    Rule("deduplicate-initializers", deduplicate_initializers),
    Rule("eliminate-common-subexpressions", eliminate_common_subexpressions),
    from_pass("remove-dead-nodes", common_passes.RemoveUnusedNodesPass()),
)
