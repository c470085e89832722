"""legalize: decide, for every node, which of the target's devices can run it.

Needs: the imported model (static shapes).
Guarantees: `model.onnx` whose every node carries `edgesdk.capable` (a comma-separated list of
device kinds, most preferred first, and the CPU backend: `cpu/tvm` or `cpu/onnxruntime`), and
`legalize.json` with the reason for every refusal. A node that no device can run fails the build,
all such nodes listed in one error. Exact rewrites and ReLU-sum approximations come with the
legalize issue; this stage rewrites nothing yet.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import onnx

from ...backends import tflite as tflite_backend
from ...backends import tvm as tvm_backend
from ...devices import edgetpu
from ...errors import UserError
from ...ir import model as irm

OPTIONS: tuple[str, ...] = ()


def run(artifact: Path, ctx) -> dict:
    model = onnx.load(str(artifact / "model.onnx"))
    shapes = irm.static_shapes(model)
    consts = irm.constant_names(model)
    types = irm.elem_types(model)
    tvm_ops = tvm_backend.importer_ops()
    kinds = [d.kind for d in ctx.target.devices]

    refusals, impossible, counts = [], [], collections.Counter()
    for i, node in enumerate(model.graph.node):
        name = irm.node_name(node, i)
        capable: list[str] = []
        for kind in ("edgetpu", "gpu"):
            if kind not in kinds:
                continue
            reason = _refusal(kind, node, shapes, consts, types, tvm_ops)
            if reason is None:
                capable.append(kind)
            else:
                refusals.append({"node": name, "op": node.op_type, "device": kind, "reason": reason})
        # The CPU runs what TVM's importer takes; onnxruntime takes the standard ops TVM lacks.
        if node.op_type in tvm_ops:
            capable.append("cpu/tvm")
        elif not node.domain or node.domain == "ai.onnx":
            capable.append("cpu/onnxruntime")
            refusals.append({"node": name, "op": node.op_type, "device": "cpu/tvm",
                             "reason": "tvm's onnx importer has no converter for this op; onnxruntime runs it"})
        if not capable:
            impossible.append(f"node '{name}' ({node.op_type}): no device of target '{ctx.target.name}' can run it")
        irm.set_meta(node, irm.CAPABLE_KEY, ",".join(capable))
        counts[capable[0] if capable else "none"] += 1
    if impossible:
        raise UserError("legalize.unsupported-op", f"{len(impossible)} node(s) cannot run on any device of the target",
                        "replace these ops before export, or choose a target whose devices support them",
                        notes=impossible)

    irm.save(model, ctx.out / "model.onnx")
    (ctx.out / "legalize.json").write_text(json.dumps({"refusals": refusals}, indent=2) + "\n")
    by_reason = collections.Counter((r["device"], r["op"]) for r in refusals)
    for (dev, op), n in sorted(by_reason.items()):
        ctx.log(f"legalize: {n} x {op} cannot run on {dev}")
    return {"preferred_device": dict(counts), "refusals": len(refusals),
            "refused_ops": {f"{d}:{op}": n for (d, op), n in sorted(by_reason.items())}}


def _refusal(kind, node, shapes, consts, types, tvm_ops) -> str | None:
    if kind == "edgetpu":
        floats = [t for t in list(node.input) + list(node.output)
                  if t and t not in consts and types.get(t, 1) != onnx.TensorProto.FLOAT]
        if floats:
            return f"tensor '{floats[0]}' is not float32, and only float32 tensors are quantized to the Edge TPU's int8"
        return edgetpu.unsupported_reason(node, shapes, consts) or tflite_backend.lowering_reason(node, shapes, consts)
    if kind == "gpu":
        return None if node.op_type in tvm_ops else "tvm's onnx importer has no converter for this op"
    return None
