"""Pruning as a build does it: the layers of the CPU's share of a plan, pruned in the whole model, and the
pruned weights put into the segment models cut from that model.

The tune stage times the CPU candidates on `prune_for_build`'s weights and the compress stage makes them
(with the optional correction, which changes values, never which weights are kept), so both see the
same masks by construction: the same function of the same model, method and layer choice.
"""

from __future__ import annotations

from collections.abc import Collection

import onnx

from ..ir import model as irm
from .prune import Layer, parse_method, prunable, prune_model, select_layers


def on_cpu(model: onnx.ModelProto, layers: list[Layer], accelerated: Collection[str]) -> tuple[list[Layer], list[Layer]]:
    """`layers` split into those whose nodes run on the CPU and those on an accelerator (an accelerator such
    as the Edge TPU computes every weight, zero or not: pruning gains it nothing). `accelerated`: the names
    of the nodes placed on accelerators (`irm.node_name`, as the plan names them)."""
    on_accel = {o for i, n in enumerate(model.graph.node) if irm.node_name(n, i) in accelerated for o in n.output}
    return [x for x in layers if x.output not in on_accel], [x for x in layers if x.output in on_accel]


KERNEL_META = "edgesdk.kernel"  # on a pruned layer's node: "sparse" or "dense", the kernel --sparse-kernels forces


def prune_for_build(model: onnx.ModelProto, method: str, spec: str | None, accelerated: Collection[str] = (),
                    kernel: str = "measured") -> tuple[onnx.ModelProto, list[dict], list[Layer], list[Layer]]:
    """`model` with the layers `spec` chooses (`prune.select_layers`: all but the model's first and last by
    default) pruned by `method` where they run on the CPU; the per-layer records, the layers pruned, and the
    chosen layers an accelerator runs, left dense. `kernel` "sparse" or "dense" marks each pruned layer's node
    (KERNEL_META) with the kernel a backend must compute it with; "measured" leaves the choice to the backend."""
    chosen, accel = on_cpu(model, select_layers(prunable(model), spec), accelerated)
    pruned, records = prune_model(model, parse_method(method), chosen)
    if kernel != "measured":
        marked = {x.output for x in chosen}
        for node in pruned.graph.node:
            if node.output and node.output[0] in marked:
                irm.set_meta(node, KERNEL_META, kernel)
    outputs = {x.name: x.output for x in chosen}
    return pruned, [{**r, "output": outputs[r["layer"]]} for r in records], chosen, accel


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

