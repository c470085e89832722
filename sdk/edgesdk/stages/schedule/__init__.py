"""schedule: place every node on a device and cut the graph into segments.

Needs: the legalized model (every node annotated with the devices that can run it).
Guarantees: `plan.json` and one standalone ONNX model per segment under `segments/`. Segments
are maximal runs of consecutive nodes (in the graph's topological order) with the same device
and backend, so executing them in order is always valid.

Placement rule (the simple one; the cost-optimal DP comes with the scheduling issue): a node
goes to the first accelerator that can run it, otherwise to the CPU; then an accelerator run whose
predicted time, link transfers included, is no better than the CPU's goes back to the CPU (so a
lone Add between two CPU ops does not cross USB twice). Accelerator runs are dealt
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

    runs, decisions = _runs(model, ctx, shapes, consts)
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
    device_of = {n: r.device for r in runs for n in r.nodes}
    for node_i, node in enumerate(g.node):
        irm.set_meta(node, irm.DEVICE_KEY, device_of[node_i])
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
        "decisions": decisions,
    }
    (ctx.out / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
    for s in segments:
        ctx.log(f"schedule: {s['id']} {s['device']:<10} {s['backend']:<11} {len(s['nodes']):4d} nodes "
                f"{s['predicted_ms']:8.3f} ms predicted")
    if decisions:
        ctx.log(f"schedule: {len(decisions)} accelerator-capable run(s) stay on the cpu, cheaper than crossing "
                "the link (plan.json lists each)")
    return {"segments": len(segments), "placement": plan["placement"], "predicted": plan["predicted"],
            "decisions": decisions}


def _runs(model: onnx.ModelProto, ctx, shapes, consts) -> tuple[list[Run], list[str]]:
    """Maximal runs of one device kind and backend, with accelerator islands that cost more than
    they save (link transfers included) given back to the CPU."""
    accelerators = {"edgetpu": ("edgetpu", "tflite"), "gpu": ("gpu", "tvm")}
    labels: list[tuple[str, str]] = []
    cpu_labels: list[tuple[str, str]] = []
    for node in model.graph.node:
        caps = (irm.get_meta(node, irm.CAPABLE_KEY) or "cpu/onnxruntime").split(",")
        cpu = next((c for c in caps if c.startswith("cpu/")), "cpu/onnxruntime")
        cpu_labels.append(("cpu", cpu.split("/")[1]))
        labels.append(accelerators[caps[0]] if caps[0] in accelerators else cpu_labels[-1])
    decisions = []
    for r in _group(labels):
        if r.device == "cpu":
            continue
        acc_ms = _run_ms(r.nodes, r.device, model, ctx, shapes, consts)
        cpu_ms = _run_ms(r.nodes, "cpu", model, ctx, shapes, consts)
        if cpu_ms <= acc_ms:
            for n in r.nodes:
                labels[n] = cpu_labels[n]
            ops = sorted({model.graph.node[n].op_type for n in r.nodes})
            decisions.append(f"{len(r.nodes)} node(s) ({', '.join(ops)}) stay on the cpu: {cpu_ms:.3f} ms there, "
                             f"{acc_ms:.3f} ms on {r.device} with its link transfers")
    return _group(labels), decisions


def _group(labels: list[tuple[str, str]]) -> list[Run]:
    runs: list[Run] = []
    for i, (device, backend) in enumerate(labels):
        if runs and runs[-1].device == device and runs[-1].backend == backend:
            runs[-1].nodes.append(i)
        else:
            runs.append(Run(device, backend, [i]))
    return runs


def _run_ms(nodes: list[int], device: str, model, ctx, shapes, consts) -> float:
    g = model.graph
    inside = set(nodes)
    produced = {t for n in nodes for t in g.node[n].output}
    ins = {t for n in nodes for t in g.node[n].input if t and t not in consts and t not in produced}
    used_later = {t for i, n in enumerate(g.node) if i not in inside for t in n.input} | {o.name for o in g.output}
    outs = produced & used_later
    params = sum(tensor_bytes(shapes.get(t)) for n in nodes for t in g.node[n].input if t in consts)
    return segment_ms(ctx.target, device, flops=sum(node_flops(g.node[n], shapes) for n in nodes),
                      param_bytes=params, io_bytes=sum(tensor_bytes(shapes.get(t)) for t in ins | outs),
                      act_bytes=sum(tensor_bytes(shapes.get(t)) for t in produced), nodes=len(nodes))


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
