"""Which of a target's devices can run each node, why the others cannot, and what that adds up to.

The tables themselves are data elsewhere: the Edge TPU's is `devices.edgetpu.OPS` (Coral's published
list and limits) combined with what our TFLite lowering can express (`backends.tflite.LOWERINGS`);
the CPU's and GPU's are the op types TVM's ONNX importer converts (`backends.tvm.importer_ops`), with
onnxruntime taking, on the CPU, every standard op TVM lacks. This module asks them per node and sums
up: coverage of each accelerator by op count and by FLOPs, and the tensors that cross between the CPU
and an accelerator when every node runs where it can (the most preferred capable device).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import onnx

from ..backends import tflite as tflite_backend
from ..backends import tvm as tvm_backend
from ..devices import edgetpu
from ..devices.cost import node_flops
from ..devices.edgetpu import Refusal
from ..ir import model as irm

ACCELERATORS = ("edgetpu", "gpu")  # in order of preference over the CPU

# codes of the non-Edge-TPU refusals (the Edge TPU's are edgetpu.REASONS)
REASONS: dict[str, str] = {
    **edgetpu.REASONS,
    "gpu.tvm-unsupported": "TVM's ONNX importer has no converter for this op, so no GPU kernel is generated",
    "cpu.tvm-unsupported": "TVM's ONNX importer has no converter for this op: onnxruntime runs it on the CPU",
}


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
        self._tvm_ops = tvm_backend.importer_ops()

    def refusal(self, kind: str, node: onnx.NodeProto, shapes, consts, types) -> Refusal | None:
        if kind == "edgetpu":
            floats = [t for t in list(node.input) + list(node.output)
                      if t and t not in consts and types.get(t, onnx.TensorProto.FLOAT) != onnx.TensorProto.FLOAT]
            if floats:
                return Refusal("edgetpu.data-type", f"tensor '{floats[0]}' is not float32, and only float32 tensors "
                                                    "are quantized to the edge tpu's int8")
            if r := edgetpu.unsupported_reason(node, shapes, consts):
                return r
            if why := tflite_backend.lowering_reason(node, shapes, consts):
                return Refusal("edgetpu.no-lowering", why)
            return None
        if kind == "gpu":
            return None if node.op_type in self._tvm_ops else Refusal("gpu.tvm-unsupported", REASONS["gpu.tvm-unsupported"])
        return None

    def node(self, node: onnx.NodeProto, index: int, shapes, consts, types) -> NodeSupport:
        support = NodeSupport(irm.node_name(node, index), node.op_type, [], flops=node_flops(node, shapes))
        for kind in ACCELERATORS:
            if kind not in self.kinds:
                continue
            r = self.refusal(kind, node, shapes, consts, types)
            if r is None:
                support.capable.append(kind)
            else:
                support.refusals.append({"device": kind, "code": r.code, "reason": r.reason})
        if node.op_type in self._tvm_ops:
            support.capable.append("cpu/tvm")
        elif not node.domain or node.domain == "ai.onnx":
            support.capable.append("cpu/onnxruntime")
            support.refusals.append({"device": "cpu/tvm", "code": "cpu.tvm-unsupported",
                                     "reason": REASONS["cpu.tvm-unsupported"]})
        return support

    def model(self, model: onnx.ModelProto) -> list[NodeSupport]:
        shapes, consts, types = irm.static_shapes(model), irm.constant_names(model), irm.elem_types(model)
        return [self.node(n, i, shapes, consts, types) for i, n in enumerate(model.graph.node)]


def summarize(model: onnx.ModelProto, nodes: list[NodeSupport]) -> dict:
    """Coverage of each accelerator (ops and FLOPs it can take) and the CPU<->accelerator crossings
    when each node runs on its most preferred capable device."""
    total_ops, total_flops = len(nodes), sum(n.flops for n in nodes) or 1.0
    coverage = {}
    for kind in ACCELERATORS:
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
                                  if r["device"] in ACCELERATORS)
    return {"coverage": coverage, "transitions": len(crossing), "segments_in_order": runs,
            "refused": [{"device": d, "code": c, "op": op, "count": k} for (d, c, op), k in sorted(refused.items())]}
