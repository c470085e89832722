"""From a placement to segments: runs of nodes with one device and backend, each cut out of the graph
as a standalone ONNX model with the tensors it takes and gives.

`PlannedSegment` is the planner's working structure (mutable while the plan is built); the plan
records each as a frozen `plan.PlanSegment`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import onnx

from .. import backends
from ..config import HOST
from ..devices import registry
from ..devices.cost import node_flops
from ..ir import model as irm
from ..ir.digest import graph_structure_sha256
from . import placement
from .plan import PlanSegment
from .problem import Problem


@dataclass
class PlannedSegment:
    """A segment the plan will cut: nodes of one device and backend (a parallel step's group carries its
    threads and time)."""

    device: str  # logical id
    backend: str
    nodes: list[int] = field(default_factory=list)
    threads: int = 0            # a group of a parallel step: its worker's threads (0: not one)
    predicted_ms: float = 0.0   # a group of a parallel step: its time on those threads


def split_by_backend(segments, cpu_backend: list[str], weights_bytes: tuple[int, ...] = ()) -> list[PlannedSegment]:
    """(start, stop, device) spans -> runs of consecutive nodes with one device and one backend.

    With each node's `weights_bytes`, an accelerator's run is cut before a node that would take its weights
    to its backend's bound (`Backend.max_weight_bytes`: a TFLite FlatBuffer, what the Edge TPU's compiler
    reads, holds less than 2 GiB), so that every segment of the plan can be compiled."""
    runs: list[PlannedSegment] = []
    held = 0  # the last run's weights
    for start, stop, device in segments:
        kind = device.split(":")[0]
        for n in range(start, stop):
            # the host's backend is chosen per node by legalize; an accelerator's is its model's first
            backend = cpu_backend[n] if kind == HOST else registry.model(kind).backends[0]
            size = weights_bytes[n] if weights_bytes else 0
            bound = backends.backend(backend).max_weight_bytes if kind != HOST and size else 0
            if (runs and runs[-1].device == device and runs[-1].backend == backend and runs[-1].nodes[-1] == n - 1
                    and not (bound and held + size >= bound)):
                runs[-1].nodes.append(n)
                held += size
            else:
                runs.append(PlannedSegment(device, backend, [n]))
                held = size
    return runs


def logit_probes(model: onnx.ModelProto) -> dict[str, str]:
    """output -> the tensor before its trailing Softmax: accuracy is judged on logits, not on a
    saturated softmax."""
    producers = {o: n for n in model.graph.node for o in n.output}
    probes = {}
    for out in model.graph.output:
        node = producers.get(out.name)
        if node is not None and node.op_type in ("Softmax", "LogSoftmax", "Sigmoid"):
            probes[out.name] = node.input[0]
    return probes


def cut(model: onnx.ModelProto, runs: list[PlannedSegment], problem: Problem, shapes, consts,
        probes: dict[str, str]) -> tuple[tuple[PlanSegment, ...], dict[str, onnx.ModelProto]]:
    """Each run as a plan segment `s<i>` and its standalone model (nodes annotated with the device).
    A segment's outputs: what the graph outputs or probes, and what another segment reads."""
    g = model.graph
    graph_outputs = [o.name for o in g.output]
    consumers = _consumers(g, runs, consts)
    segments, models = [], {}
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
        models[seg_id] = seg
        ms = (placement.segment_ms(problem, r.nodes[0], r.nodes[-1] + 1, r.device) if r.threads == 0 else
              r.predicted_ms)
        segments.append(PlanSegment(
            seg_id, r.device, r.backend, f"segments/{seg_id}.onnx", tuple(irm.node_name(g.node[n], n) for n in r.nodes),
            tuple(inputs), tuple(outputs), sum(node_flops(g.node[n], shapes) for n in r.nodes), irm.param_bytes(seg),
            round(ms, 4), r.threads))
    return tuple(segments), models


def shared(segments: tuple[PlanSegment, ...], models: dict[str, onnx.ModelProto]) -> tuple[PlanSegment, ...]:
    """The segments with `same_as` set on each accelerator segment that computes what an earlier one of
    the same device kind and backend computes, with the same weights (`graph_structure_sha256`): the
    captioner's per-frame CNN, cut once per frame, ships as one artifact. CPU segments are not shared
    (each is compiled and tuned on its own)."""
    first: dict[tuple, str] = {}
    out = []
    for s in segments:
        if s.device.split(":")[0] == HOST:
            out.append(s)
            continue
        key = (s.device.split(":")[0], s.backend, graph_structure_sha256(models[s.id]))
        rep = first.setdefault(key, s.id)
        out.append(dataclasses.replace(s, same_as=rep) if rep != s.id else s)
    return tuple(out)


def _consumers(g: onnx.GraphProto, runs: list[PlannedSegment], consts) -> dict[str, set[int]]:
    """tensor -> the runs that read it."""
    consumers: dict[str, set[int]] = {}
    for r_i, r in enumerate(runs):
        for n in r.nodes:
            for t in g.node[n].input:
                if t and t not in consts:
                    consumers.setdefault(t, set()).add(r_i)
    return consumers


def annotate(model: onnx.ModelProto, runs: list[PlannedSegment]) -> onnx.ModelProto:
    """`model`, each of whose nodes now names its device (`irm.DEVICE_KEY`): annotated in place, not
    copied (a copy would hold every weight again)."""
    device_of = {n: r.device for r in runs for n in r.nodes}
    for node_i, node in enumerate(model.graph.node):
        irm.set_meta(node, irm.DEVICE_KEY, device_of[node_i])
    return model


def placement_counts(runs: list[PlannedSegment]) -> dict[str, int]:
    """device -> how many nodes it runs."""
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.device] = counts.get(r.device, 0) + len(r.nodes)
    return counts
