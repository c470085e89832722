"""Which nodes of a model are not standard ONNX ops, and where each sits.

Walks the main graph, every subgraph (If branches, Loop and Scan bodies, at any depth) and the
bodies of model-local functions, so that all problems are reported at once: one error, one note
per node (the TVM frontend's habit), not onnx.checker's first complaint.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

# Domains whose ops onnx.defs knows; every other domain is custom by definition.
STANDARD_DOMAINS = ("", "ai.onnx.ml", "ai.onnx.preview.training")


@dataclass(frozen=True)
class OpSite:
    op_type: str
    domain: str
    node: str     # the node's name, or OpType_index when it has none
    where: str    # "" in the main graph, else e.g. "inside If 'cond' then_branch"
    reason: str   # why it is not standard

    @property
    def qualified(self) -> str:
        return f"{self.domain}::{self.op_type}" if self.domain else self.op_type

    @property
    def located(self) -> str:
        return f"node '{self.node}'" + (f" {self.where}" if self.where else "")

    def note(self) -> str:
        return f"{self.located}: op {self.qualified} {self.reason}"


def nonstandard_ops(model: onnx.ModelProto) -> list[OpSite]:
    """Every node whose op no ONNX schema defines at the opset the model imports for its domain.
    Calls of the model's own functions are fine; their bodies are checked instead."""
    functions = {(f.domain, f.name) for f in model.functions}
    sites: list[OpSite] = []

    def visit(nodes, opsets: dict[str, int], where: str) -> None:
        for i, n in enumerate(nodes):
            name = n.name or f"{n.op_type}_{i}"
            domain = "" if n.domain == "ai.onnx" else n.domain
            if (n.domain, n.op_type) not in functions:
                reason = _schema_problem(n.op_type, domain, opsets)
                if reason:
                    sites.append(OpSite(n.op_type, domain, name, where, reason))
            for a in n.attribute:
                inside = f"inside {n.op_type} '{name}' {a.name}"
                if a.type == onnx.AttributeProto.GRAPH:
                    visit(a.g.node, opsets, _nest(inside, where))
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for k, g in enumerate(a.graphs):
                        visit(g.node, opsets, _nest(f"{inside}[{k}]", where))

    model_opsets = _opsets(model.opset_import)
    visit(model.graph.node, model_opsets, "")
    for f in model.functions:
        visit(f.node, {**model_opsets, **_opsets(f.opset_import)}, f"inside function '{f.domain}::{f.name}'")
    return sites


def _nest(inner: str, outer: str) -> str:
    return f"{inner}, {outer}" if outer else inner


def _opsets(imports) -> dict[str, int]:
    return {("" if o.domain == "ai.onnx" else o.domain): o.version for o in imports}


def _schema_problem(op_type: str, domain: str, opsets: dict[str, int]) -> str | None:
    if domain not in STANDARD_DOMAINS:
        return f"is not a standard ONNX op (custom domain '{domain}')"
    version = opsets.get(domain)
    if version is None:
        return f"is in domain '{domain or 'ai.onnx'}', which the model does not import"
    try:
        onnx.defs.get_schema(op_type, version, domain)
        return None
    except Exception:
        pass
    try:
        first = onnx.defs.get_schema(op_type, 1 << 30, domain)
    except Exception:
        return "is not a standard ONNX op"
    return f"is not defined at opset {version} (ONNX has it from opset {_since(op_type, domain, first)})"


def _since(op_type: str, domain: str, latest) -> int:
    """The opset that first defines `op_type`: walk back through the schema's versions."""
    since = latest.since_version
    while since > 1:
        try:
            since = onnx.defs.get_schema(op_type, since - 1, domain).since_version
        except Exception:
            break
    return since
