"""The placement problem of an ONNX graph on a target: each node's cost on each device that can run
it (`devices/cost.py`: a roofline of the target's figures plus per-op overhead), every tensor's bytes,
each accelerator's link.

The schedule stage places the graph with it; the package stage re-costs a segment with the very same
numbers when the Edge TPU compiler maps only part of it.
"""

from __future__ import annotations

import onnx

from ..devices.cost import (is_grouped, link_ms_per_byte, node_bytes, node_flops, node_ms, streamed_fraction,
                            tensor_bytes)
from ..ir import model as irm
from .problem import Link, Problem, Tensor


def build_problem(model: onnx.ModelProto, target, shapes, consts) -> tuple[Problem, list[str]]:
    """The numeric problem of `model` on `target`, and each node's CPU backend."""
    g = model.graph
    kinds = {d.kind for d in target.devices}
    devices = ["cpu"] + [i for kind in ("edgetpu", "gpu") if kind in kinds for i in target.logical_ids(kind)]
    producer = {t: i for i, n in enumerate(g.node) for t in n.output if t}
    consumers: dict[str, list[int]] = {}
    for i, n in enumerate(g.node):
        for t in dict.fromkeys(n.input):
            if t and t not in consts:
                consumers.setdefault(t, []).append(i)
    caps = [(irm.get_meta(n, irm.CAPABLE_KEY) or "cpu/onnxruntime").split(",") for n in g.node]
    weights, acts = zip(*(node_bytes(n, shapes, consts) for n in g.node)) if g.node else ((), ())
    tpu_weights = sum(w for w, c in zip(weights, caps) if "edgetpu" in c)
    streamed = streamed_fraction(target, tpu_weights)
    cost, cpu_backend = [], []
    for n, c, w, act in zip(g.node, caps, weights, acts):
        flops = node_flops(n, shapes)
        per = {"cpu": node_ms(target, "cpu", flops=flops, param_bytes=w, act_bytes=act, grouped=is_grouped(n))}
        for kind in ("edgetpu", "gpu"):
            if kind in c and kind in kinds:
                ms = node_ms(target, kind, flops=flops, param_bytes=w, act_bytes=act,
                             streamed_fraction=streamed if kind == "edgetpu" else 0.0)
                per.update({dev: ms for dev in target.logical_ids(kind)})
        cost.append(per)
        cpu_backend.append(next((x.split("/")[1] for x in c if x.startswith("cpu/")), "onnxruntime"))
    outputs = {o.name for o in g.output}
    tensors = [Tensor(t, tensor_bytes(shapes.get(t)), producer.get(t), tuple(consumers.get(t, ())), t in outputs)
               for t in dict.fromkeys([*consumers, *outputs])]
    links = {}
    for dev in devices[1:]:
        latency, per_byte = link_ms_per_byte(target, dev.split(":")[0])
        links[dev] = Link(latency, per_byte)
    names = tuple(irm.node_name(n, i) for i, n in enumerate(g.node))
    return Problem(names, tuple(devices), tuple(cost), tuple(tensors), {d: 0.0 for d in devices}, links,
                   tuple(weights)), cpu_backend
