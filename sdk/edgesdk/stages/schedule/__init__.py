"""schedule: place every node on a device and cut the graph into segments.

Needs: the legalized model (every node annotated with the devices that can run it).
Guarantees: `plan.json` and one standalone ONNX model per segment under `segments/`. Segments
are maximal runs of consecutive nodes (in the graph's topological order) with the same device
and backend, so executing them in order is always valid.

Placement rule (the simple one; the cost-optimal DP comes with the scheduling issue): a node
goes to the first accelerator that can run it, otherwise to the CPU. Accelerator runs are dealt
round-robin over the target's accelerators of that kind; in `--mode throughput`, when there are
fewer runs than accelerators, the largest run is split by parameter bytes (Coral's
`--num_segments` rule) so that every accelerator holds one pipeline stage.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from ...devices.cost import node_flops, segment_ms, tensor_bytes
from ...ir import model as irm

OPTIONS = ("mode",)


@dataclass
class Run:
    device: str  # logical id
    backend: str
    nodes: list[int] = field(default_factory=list)


def run(artifact: Path, ctx) -> dict:
    model = onnx.load(str(artifact / "model.onnx"))
    g = model.graph
    shapes = irm.static_shapes(model)
    consts = irm.constant_names(model)

    runs = _runs(model)
    runs = _deal_accelerators(runs, model, ctx)

    # tensors each node consumes / the graph's outputs; a run's outputs are what later runs
    # or the graph need
    graph_inputs = [i.name for i in g.input if i.name not in consts]
    graph_outputs = [o.name for o in g.output]
    probes = _logit_probes(model)
    consumers: dict[str, set[int]] = {}
    for r_i, r in enumerate(runs):
        for n in r.nodes:
            for t in g.node[n].input:
                if t and t not in consts:
                    consumers.setdefault(t, set()).add(r_i)

    (ctx.out / "segments").mkdir()
    segments = []
    for r_i, r in enumerate(runs):
        produced = [t for n in r.nodes for t in g.node[n].output if t]
        produced_set = set(produced)
        inputs: list[str] = []
        for n in r.nodes:
            for t in g.node[n].input:
                if t and t not in consts and t not in produced_set and t not in inputs:
                    inputs.append(t)
        outputs = [t for t in produced if t in graph_outputs or t in probes.values()
                   or any(c != r_i for c in consumers.get(t, ()))]
        seg_id = f"s{r_i}"
        seg = irm.extract_segment(model, r.nodes, inputs, outputs)
        for node in seg.graph.node:
            irm.set_meta(node, irm.DEVICE_KEY, r.device)
        irm.save(seg, ctx.out / "segments" / f"{seg_id}.onnx")
        flops = sum(node_flops(g.node[n], shapes) for n in r.nodes)
        params = irm.param_bytes(seg)
        io = sum(tensor_bytes(shapes.get(t)) for t in inputs + outputs)
        act = sum(tensor_bytes(shapes.get(t)) for t in produced)
        ms = segment_ms(ctx.target, r.device, flops=flops, param_bytes=params, io_bytes=io, act_bytes=act,
                        nodes=len(r.nodes))
        segments.append({
            "id": seg_id, "device": r.device, "backend": r.backend, "artifact": f"segments/{seg_id}.onnx",
            "nodes": [irm.node_name(g.node[n], n) for n in r.nodes], "inputs": inputs, "outputs": outputs,
            "flops": flops, "param_bytes": params, "predicted_ms": round(ms, 4),
        })
    for node_i, node in enumerate(g.node):
        irm.set_meta(node, irm.DEVICE_KEY, next(r.device for r in runs if node_i in r.nodes))
    irm.save(model, ctx.out / "model.onnx")

    # One pipeline stage per segment: a device works on frame k+1 while the next device works on k.
    latency = sum(s["predicted_ms"] for s in segments)
    per_device: dict[str, float] = {}
    for s in segments:
        per_device[s["device"]] = per_device.get(s["device"], 0.0) + s["predicted_ms"]
    bottleneck = max(per_device.values())
    plan = {
        "target": ctx.target.name, "mode": ctx.options.mode,
        "inputs": graph_inputs, "outputs": graph_outputs, "probes": probes,
        "segments": segments,
        "pipeline_stages": [[s["id"]] for s in segments],
        "predicted": {"latency_ms": round(latency, 4), "throughput_fps": round(1000.0 / bottleneck, 2)},
        "cost_model": "roofline over the target's published figures (devices/cost.py); not yet fitted",
        "placement": {dev: sum(len(s["nodes"]) for s in segments if s["device"] == dev) for dev in per_device},
    }
    (ctx.out / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
    for s in segments:
        ctx.log(f"schedule: {s['id']} {s['device']:<10} {s['backend']:<11} {len(s['nodes']):4d} nodes "
                f"{s['predicted_ms']:8.3f} ms predicted")
    return {"segments": len(segments), "placement": plan["placement"], "predicted": plan["predicted"]}


def _runs(model: onnx.ModelProto) -> list[Run]:
    runs: list[Run] = []
    for i, node in enumerate(model.graph.node):
        first = (irm.get_meta(node, irm.CAPABLE_KEY) or "cpu/onnxruntime").split(",")[0]
        accelerators = {"edgetpu": ("edgetpu", "tflite"), "gpu": ("gpu", "tvm")}
        device, backend = accelerators[first] if first in accelerators else ("cpu", first.split("/")[1])
        if runs and runs[-1].device == device and runs[-1].backend == backend:
            runs[-1].nodes.append(i)
        else:
            runs.append(Run(device, backend, [i]))
    return runs


def _deal_accelerators(runs: list[Run], model: onnx.ModelProto, ctx) -> list[Run]:
    for kind in ("edgetpu", "gpu"):
        ids = ctx.target.logical_ids(kind)
        mine = [r for r in runs if r.device == kind]
        if not mine:
            continue
        if ctx.options.mode == "throughput" and len(mine) < len(ids):
            biggest = max(mine, key=lambda r: len(r.nodes))
            pieces = _split_by_params(biggest, model, len(ids) - len(mine) + 1)
            at = runs.index(biggest)
            runs = runs[:at] + pieces + runs[at + 1:]
            mine = [r for r in runs if r.device == kind]
        for r, dev in zip(mine, itertools.cycle(ids)):
            r.device = dev
    return runs


def _split_by_params(run: Run, model: onnx.ModelProto, parts: int) -> list[Run]:
    """Cut a run into `parts` contiguous pieces of about equal parameter bytes."""
    sizes = {i.name: len(i.raw_data) or 4 * max(1, len(i.float_data)) for i in model.graph.initializer}
    weights = [sum(sizes.get(t, 0) for t in model.graph.node[n].input) for n in run.nodes]
    total = sum(weights) or 1
    pieces, acc, cur = [], 0.0, Run(run.device, run.backend)
    for n, w in zip(run.nodes, weights):
        cur.nodes.append(n)
        acc += w
        if acc >= total * (len(pieces) + 1) / parts and len(pieces) < parts - 1:
            pieces.append(cur)
            cur = Run(run.device, run.backend)
    if cur.nodes:
        pieces.append(cur)
    return pieces


def _logit_probes(model: onnx.ModelProto) -> dict[str, str]:
    """output -> the tensor before its trailing Softmax: accuracy is judged on logits, not on a
    saturated softmax."""
    producers = {o: n for n in model.graph.node for o in n.output}
    probes = {}
    for out in model.graph.output:
        node = producers.get(out.name)
        if node is not None and node.op_type in ("Softmax", "LogSoftmax", "Sigmoid"):
            probes[out.name] = node.input[0]
    return probes
