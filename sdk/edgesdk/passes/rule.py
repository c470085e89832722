"""A named rewrite and how it counts its firings.

Pattern rules (onnxscript's `RewriteRule`: pattern, check that says why it did not match,
replacement) count one firing per rewritten match; graph passes (onnx_ir's, or ours where a chain
of any length has to be followed) count the nodes they removed.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

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
    """One named rule from onnxscript rewrite rules (variants of one rewrite, e.g. operand orders).

    A model without any op its patterns are rooted at is passed over: onnxscript tries every rule at every
    node, and most rules of a pipeline meet none of their ops in a given model (a captioner's build made
    650,000 such tries)."""
    rule_set = pattern.RewriteRuleSet(list(rules), commute=commute)
    roots = _root_ops(rules)

    def apply(model: ir.Model) -> int:
        if roots is not None and roots.isdisjoint(op_types(model)):
            return 0
        try:
            return rule_set.apply_to_model(model)
        finally:
            _forget_matches(rule_set)

    return Rule(name, apply)


def op_types(model: ir.Model) -> set[str]:
    """The op types of every node of the model: its graph, their subgraphs, its functions."""
    types = {node.op_type for node in ir.traversal.RecursiveGraphIterator(model.graph)}
    for function in model.functions.values():
        types.update(node.op_type for node in ir.traversal.RecursiveGraphIterator(function))
    return types


def _root_ops(rules: Sequence[pattern.RewriteRule]) -> frozenset[str] | None:
    """One op type each rule's match must include (its pattern's output node's, a fixed name), or None
    where a rule's output nodes are not fixed ops (then its rule set is always tried)."""
    from onnxscript.rewriter._pattern_ir import StringConstantPattern

    ops = set()
    for rule in rules:
        outputs = getattr(getattr(rule, "_target_pattern", None), "output_nodes", None)
        fixed = [node.op.value() for node in outputs or () if isinstance(getattr(node, "op", None), StringConstantPattern)]
        if not fixed:
            return None
        ops.add(fixed[0])
    return frozenset(ops)


def _forget_matches(rule_set: pattern.RewriteRuleSet) -> None:
    """Let go of the last match each rule's matcher keeps: it holds values of the model it matched, and
    through them the model, its weights and the proto they were read from (VGG16's 528 MiB stayed held
    through the whole build). The rules live as long as the process; the models must not."""
    for rule in rule_set.rules:
        matcher = getattr(rule, "_matcher", None)
        reset = getattr(matcher, "_init_match", None)  # onnxscript's own reset before each match
        if reset is not None:
            reset(0)
        if getattr(matcher, "_graph", None) is not None:  # the graph of its last match
            matcher._graph = None


def from_pass(name: str, run: Callable[[ir.Model], object]) -> Rule:
    """One named rule from a graph pass (an onnx_ir pass or a function); it fired once per node it removed."""

    def apply(model: ir.Model) -> int:
        before = count_nodes(model)
        run(model)
        return max(before - count_nodes(model), 0)

    return Rule(name, apply)


# Rounds until nothing fires; real models settle in 2-3 (each rule already visits every node).
MAX_ROUNDS = 8

log = logging.getLogger(__name__)


@dataclasses.dataclass
class FixedPoint:
    """What `fixed_point` did: firings per rule (every rule, 0 included, in the order they ran), the
    rounds run (the last, quiet one included), and the rules switched off because they raised."""

    counts: dict[str, int]
    rounds: int
    errors: dict[str, str]


def fixed_point(model: ir.Model, rules: Sequence[Rule], *, between_rounds: Callable[[ir.Model], object] | None = None,
                isolate_errors: bool = False, max_rounds: int = MAX_ROUNDS) -> tuple[ir.Model, FixedPoint]:
    """Apply `rules` in order, round after round, until a round fires none (at most `max_rounds`).

    `between_rounds` runs after a round that fired, before the next (shape inference: the next
    round's rules read the new values' shapes). With `isolate_errors`, a rule that raises is
    switched off and its round is run again from the model as it was before that round, so one
    broken rule never loses the model (the firings of an abandoned round are not counted);
    otherwise the error propagates. Returns the model (a new object after a restored round) and
    the record."""
    counts = {rule.name: 0 for rule in rules}
    errors: dict[str, str] = {}
    rounds = 0
    while rounds < max_rounds:
        rounds += 1
        snapshot = ir.serde.serialize_model(model) if isolate_errors else None
        fired: dict[str, int] = {}
        for rule in rules:
            if rule.name in errors:
                continue
            try:
                fired[rule.name] = rule.apply(model)
            except Exception as e:  # noqa: BLE001 - re-raised unless isolated
                if not isolate_errors:
                    raise
                errors[rule.name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                log.warning("passes: rule %s raised %s; switched off", rule.name, errors[rule.name])
                model = ir.serde.deserialize_model(snapshot)
                break
        else:
            for name, n in fired.items():
                counts[name] += n
            if not any(fired.values()):
                break
            if between_rounds is not None:
                between_rounds(model)
    return model, FixedPoint(counts, rounds, errors)
