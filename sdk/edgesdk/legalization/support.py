"""Which of a target's devices can run each node, why the others cannot, and what that adds up to.

The tables themselves are data elsewhere: each device kind's own limits are its device model's
`refusal` (`devices/<kind>.py`; the Edge TPU's is `devices.edgetpu.OPS`, Coral's published list and
limits), and what each backend can lower is asked of the backend (`Backend.lowering`: our TFLite lowering,
`backends.tflite.LOWERINGS`; the op types TVM's ONNX importer converts, `backends.tvm.importer_ops`;
every standard op for onnxruntime). A kind's backends are tried in its model's order, so on the CPU
onnxruntime takes every standard op TVM lacks. A node that depends on no graph input (what import did
not fold: a tensor past its bound, a random op, a quantized weight) is the host's alone, on its last
backend: on an accelerator it is no work, and as a segment's output a constant the segment cannot
compute (`CONSTANT`); legalize puts such nodes first (`irm.constants_first`), so that they make one run
on the host before the rest. This module asks them per node and sums up: coverage
of each accelerator by op count and by FLOPs, and the tensors that cross between the CPU and an
accelerator when every node runs where it can (the most preferred capable device).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

import onnx

from .. import backends
from ..config import HOST
from ..devices import registry
from ..devices.cost import node_flops
from ..ir import model as irm

# backend -> why it cannot lower a node (None: it can)
Lowering = Callable[[onnx.NodeProto, dict, set], "str | None"]
# the refusal of a node that depends on no graph input, on every accelerator
CONSTANT = "legalize.constant"


def label(kind: str, backend: str, backends: tuple[str, ...]) -> str:
    """A capability as `edgesdk.capable` spells it: the kind alone when one backend serves it (`edgetpu`),
    else kind/backend (`cpu/tvm`)."""
    return kind if len(backends) == 1 else f"{kind}/{backend}"


def kind_of(capability: str) -> str:
    return capability.split("/")[0]


@dataclass
class NodeSupport:
    name: str
    op: str
    capable: list[str]  # device kinds, most preferred first; the CPU as cpu/tvm or cpu/onnxruntime
    refusals: list[dict] = field(default_factory=list)  # {device, code, reason}
    flops: float = 0.0

    @property
    def device(self) -> str:
        return self.capable[0].split("/")[0] if self.capable else "none"


class Tables:
    """The support tables of one target's device kinds, asked per node."""

    def __init__(self, kinds: list[str]):
        self.kinds = kinds
        self.lowerings: dict[str, Lowering] = {}  # each backend's own check (Backend.lowering), asked once
        # the accelerators by preference, then the host, which takes what none of them does
        self.models = [*registry.accelerators(kinds), registry.model(HOST)]

    def node(self, node: onnx.NodeProto, index: int, shapes, consts, types, *, constant: bool = False) -> NodeSupport:
        """Each kind in turn: its own refusal, else its first backend that lowers the node. A backend that
        fails is recorded (under its model's `unlowerable` code) when a later backend takes the node, or
        when it was the kind's last resort. A `constant` node (it depends on no graph input) is refused by
        every accelerator."""
        support = NodeSupport(irm.node_name(node, index), node.op_type, [], flops=node_flops(node, shapes))
        for m in self.models:
            if constant and m.kind != HOST:
                support.refusals.append({"device": m.kind, "code": CONSTANT, "reason": (
                    "it depends on no model input: a constant that import did not fold runs on the cpu, never in an "
                    "accelerator segment")})
                continue
            r = m.refusal(node, shapes, consts, types)
            if r is not None:
                support.refusals.append({"device": m.kind, "code": r.code, "reason": r.reason})
                continue
            failed = []
            # a constant's run on the host may have no input at all, which only its last resort compiles
            # (onnxruntime; TVM's cross-compiled library of constants alone does not link)
            for backend in m.backends[-1:] if constant else m.backends:
                if backend not in self.lowerings:
                    self.lowerings[backend] = backends.backend(backend).lowering_check()
                why = self.lowerings[backend](node, shapes, consts)
                if why is None:
                    support.capable.append(label(m.kind, backend, m.backends))
                    break
                failed.append((backend, why))
            else:
                failed = failed[-1:]
            for backend, why in failed:
                if backend in m.unlowerable:
                    code, sentence = m.unlowerable[backend]
                    support.refusals.append({"device": label(m.kind, backend, m.backends), "code": code,
                                             "reason": sentence or why})
        return support

    def model(self, model: onnx.ModelProto) -> list[NodeSupport]:
        shapes, consts, types = irm.static_shapes(model), irm.constant_names(model), irm.elem_types(model)
        constant = irm.input_free_nodes(model)
        return [self.node(n, i, shapes, consts, types, constant=i in constant) for i, n in enumerate(model.graph.node)]


def summarize(model: onnx.ModelProto, nodes: list[NodeSupport]) -> dict:
    """Coverage of each accelerator (ops and FLOPs it can take) and the CPU<->accelerator crossings
    when each node runs on its most preferred capable device."""
    total_ops, total_flops = len(nodes), sum(n.flops for n in nodes) or 1.0
    coverage = {}
    accelerators = [m.kind for m in registry.accelerators()]
    for kind in accelerators:
        if not any(kind in n.capable or any(r["device"] == kind for r in n.refusals) for n in nodes):
            continue
        on = [n for n in nodes if kind in n.capable]
        coverage[kind] = {"ops": len(on), "of_ops": total_ops, "ops_fraction": round(len(on) / max(total_ops, 1), 4),
                          "flops": sum(n.flops for n in on), "of_flops": total_flops,
                          "flops_fraction": round(sum(n.flops for n in on) / total_flops, 4)}
    device_of = {}
    for node, support in zip(model.graph.node, nodes):
        for out in node.output:
            device_of[out] = support.device
    crossing, runs, last = set(), 0, None
    for node, support in zip(model.graph.node, nodes):
        for name in node.input:
            src = device_of.get(name)
            if src is not None and src != support.device:
                crossing.add((name, support.device))
        if support.device != last:
            runs, last = runs + 1, support.device
    refused = collections.Counter((r["device"], r["code"], n.op) for n in nodes for r in n.refusals
                                  if kind_of(r["device"]) in accelerators)
    return {"coverage": coverage, "transitions": len(crossing), "segments_in_order": runs,
            "refused": [{"device": d, "code": c, "op": op, "count": k} for (d, c, op), k in sorted(refused.items())]}
