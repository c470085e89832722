"""Pruning as a build does it: a per-layer plan for the CPU's share of a plan, the layers pruned in the whole
model, and the pruned weights put into the segment models cut from that model.

The tune stage makes the plan (`--prune METHOD` for every chosen layer, a plan file, or the auto plan it
measures: plan.py), writes it as PLAN_FILE and times the CPU candidates on `prune_for_build`'s weights; the
compress stage reads that file and makes the same weights (with the optional correction, which changes
values, never which weights are kept): the same function of the same model and plan.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np
import onnx

from ..ir import model as irm
from .plan import DENSE, read_plan, write_plan
from .prune import Layer, PruneMethod, mask, oriented, parse_method, prunable, prune_model, select_layers

PLAN_FILE = "prune_plan.json"  # in the tune stage's output: the plan the compress stage prunes by


def on_cpu(model: onnx.ModelProto, layers: list[Layer], accelerated: Collection[str]) -> tuple[list[Layer], list[Layer]]:
    """`layers` split into those whose nodes run on the CPU and those on an accelerator (an accelerator such
    as the Edge TPU computes every weight, zero or not: pruning gains it nothing). `accelerated`: the names
    of the nodes placed on accelerators (`irm.node_name`, as the plan names them)."""
    on_accel = {o for i, n in enumerate(model.graph.node) if irm.node_name(n, i) in accelerated for o in n.output}
    return [x for x in layers if x.output not in on_accel], [x for x in layers if x.output in on_accel]


def candidates(model: onnx.ModelProto, spec: str | None, accelerated: Collection[str] = ()
               ) -> tuple[list[Layer], list[Layer]]:
    """The layers `spec` chooses (`prune.select_layers`: all but the model's first and last by default) that
    run on the CPU, and those an accelerator runs (left dense)."""
    return on_cpu(model, select_layers(prunable(model), spec), accelerated)


def uniform(layers: list[Layer], method: str) -> dict[str, PruneMethod]:
    """Every one of `layers` pruned by `method` (`--prune METHOD`)."""
    m = parse_method(method)
    return {x.name: m for x in layers}


def save_plan(path, methods: Mapping[str, PruneMethod], layers: list[Layer], **record) -> None:
    """PLAN_FILE: each of `layers` with its method in `methods`, or dense; `record` beside."""
    write_plan(path, {x.name: methods[x.name].text if x.name in methods else DENSE for x in layers}, **record)


def load_plan(path, model: onnx.ModelProto) -> dict[str, PruneMethod]:
    """The pruned layers of a plan file and their methods (its dense layers left out)."""
    return {k: m for k, m in read_plan(path, prunable(model)).items() if m is not None}


def pruned_weight(model: onnx.ModelProto, layer: Layer, method: PruneMethod) -> np.ndarray:
    """`layer`'s weight as `method` alone would prune it, as stored."""
    w = irm.array(next(i for i in model.graph.initializer if i.name == layer.weight))
    return np.where(oriented(mask(oriented(w, layer), method), layer), w, np.zeros((), w.dtype))


KERNEL_META = "edgesdk.kernel"  # on a pruned layer's node: "sparse" or "dense", the kernel --sparse-kernels forces


def prune_for_build(model: onnx.ModelProto, methods: Mapping[str, PruneMethod],
                    kernel: str = "measured") -> tuple[onnx.ModelProto, list[dict], list[Layer]]:
    """`model` with each layer named in `methods` pruned by its method; the per-layer records (their
    `output` added) and the layers pruned. `kernel` "sparse" or "dense" marks each pruned layer's node
    (KERNEL_META) with the kernel a backend must compute it with; "measured" leaves the choice to the backend."""
    chosen = [x for x in prunable(model) if x.name in methods]
    pruned, records = prune_model(model, dict(methods), chosen)
    if kernel != "measured":
        marked = {x.output for x in chosen}
        for node in pruned.graph.node:
            if node.output and node.output[0] in marked:
                irm.set_meta(node, KERNEL_META, kernel)
    outputs = {x.name: x.output for x in chosen}
    return pruned, [{**r, "output": outputs[r["layer"]]} for r in records], chosen


def apply(segment: onnx.ModelProto, pruned: onnx.ModelProto, records: list[dict]) -> onnx.ModelProto:
    """A copy of `segment` (cut from the model `pruned` was pruned from) whose pruned layers read their
    pruned weights: each node whose output is a pruned layer's output gets the weight `pruned` gives it.
    Nodes are matched by output name (unique in a graph) and take the pruned node's KERNEL_META, if any; a
    weight left without a user is dropped."""
    weights = {i.name: i for i in pruned.graph.initializer}
    nodes = {n.output[0]: n for n in pruned.graph.node if n.output and len(n.input) > 1 and n.input[1] in weights}
    layer_outputs = {r["output"] for r in records}
    out = onnx.ModelProto()
    out.CopyFrom(segment)
    g = out.graph
    inits = {i.name: i for i in g.initializer}
    for node in g.node:
        if not node.output or node.output[0] not in layer_outputs or len(node.input) < 2:
            continue
        name = nodes[node.output[0]].input[1]
        kernel = irm.get_meta(nodes[node.output[0]], KERNEL_META)
        if kernel is not None:
            irm.set_meta(node, KERNEL_META, kernel)
        if name in inits:
            inits[name].CopyFrom(weights[name])
        else:
            g.initializer.append(weights[name])
            inits[name] = g.initializer[-1]
        node.input[1] = name
    used = {x for n in g.node for x in n.input}
    for name, init in list(inits.items()):
        if name not in used and name not in {v.name for v in g.output}:
            g.initializer.remove(init)
    return out

