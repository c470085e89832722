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

from ...errors import UserError
from ...ir import model as irm
from ...legalization import support

OPTIONS: tuple[str, ...] = ()


def run(artifact: Path, ctx) -> dict:
    model = onnx.load(str(artifact / "model.onnx"))
    tables = support.Tables([d.kind for d in ctx.target.devices])
    nodes = tables.model(model)
    refusals, impossible, counts = [], [], collections.Counter()
    for node, s in zip(model.graph.node, nodes):
        refusals += [{"node": s.name, "op": s.op, **r} for r in s.refusals]
        if not s.capable:
            impossible.append(f"node '{s.name}' ({s.op}): no device of target '{ctx.target.name}' can run it")
        irm.set_meta(node, irm.CAPABLE_KEY, ",".join(s.capable))
        counts[s.capable[0] if s.capable else "none"] += 1
    if impossible:
        raise UserError("legalize.unsupported-op", f"{len(impossible)} node(s) cannot run on any device of the target",
                        "replace these ops before export, or choose a target whose devices support them",
                        notes=impossible)

    irm.save(model, ctx.out / "model.onnx")
    (ctx.out / "legalize.json").write_text(json.dumps({"refusals": refusals}, indent=2) + "\n")
    by_reason = collections.Counter((r["device"], r["op"], r["code"]) for r in refusals)
    for (dev, op, code), n in sorted(by_reason.items()):
        ctx.log(f"legalize: {n} x {op} cannot run on {dev} ({code})")
    return {"preferred_device": dict(counts), "refusals": len(refusals),
            "refused_ops": {f"{d}:{op}": n for (d, op, _), n in sorted(by_reason.items())},
            **support.summarize(model, nodes)}
