"""The placement problem of an ONNX graph on a target: each node's cost on each device that can run
it (`devices/cost.py`: a roofline of the target's figures plus per-op overhead; on the host, the figures
of the node's CPU backend where the target has them), every tensor's bytes, each accelerator's link.

The schedule stage places the graph with it; the package stage re-costs a segment with the very same
numbers when the Edge TPU compiler maps only part of it.
"""

from __future__ import annotations

import onnx

from ..config import HOST
from ..devices import registry
from ..devices.cost import is_grouped, link_ms_per_byte, node_bytes, node_flops, node_ms, tensor_bytes
from ..ir import model as irm
from .problem import Link, Problem, Tensor


def build_problem(model: onnx.ModelProto, target, shapes, consts, *,
                  replicated: bool = False) -> tuple[Problem, list[str]]:
    """The numeric problem of `model` on `target`, and each node's CPU backend. Devices: the host, then
    each accelerator kind's instances, kinds by preference (`devices.registry.accelerators`).

    An accelerator's weights are spread over its instances' caches (`streamed_fraction`); `replicated`
    costs every instance as holding all of them itself (the whole model on each Edge TPU)."""
    g = model.graph
    accelerators = registry.accelerators({d.kind for d in target.devices})
    devices = [HOST] + [i for m in accelerators for i in target.logical_ids(m.kind)]
    producer = {t: i for i, n in enumerate(g.node) for t in n.output if t}
    consumers: dict[str, list[int]] = {}
    for i, n in enumerate(g.node):
        for t in dict.fromkeys(n.input):
            if t and t not in consts:
                consumers.setdefault(t, []).append(i)
    caps = [(irm.get_meta(n, irm.CAPABLE_KEY) or f"{HOST}/onnxruntime").split(",") for n in g.node]
    kinds_of = [{x.split("/")[0] for x in c} for c in caps]
    weights, acts = zip(*(node_bytes(n, shapes, consts) for n in g.node)) if g.node else ((), ())
    # per kind: the share of the weights its capable nodes hold that streams over its link every inference
    streamed = {m.kind: m.streamed_fraction(_holders(target.devices_of(m.kind), replicated),
                                            sum(w for w, k in zip(weights, kinds_of) if m.kind in k))
                for m in accelerators}
    cost, cpu_backend = [], []
    for n, c, k, w, act in zip(g.node, caps, kinds_of, weights, acts):
        flops, grouped = node_flops(n, shapes), is_grouped(n)
        # on the host, the node costs what it costs on the backend that will compile it (the target's
        # figures of that backend where it has them: `CpuDevice.backends`)
        cpu_backend.append(next((x.split("/")[1] for x in c if x.startswith(f"{HOST}/")), "onnxruntime"))
        per = {HOST: node_ms(target, HOST, flops=flops, param_bytes=w, act_bytes=act, grouped=grouped,
                             backend=cpu_backend[-1])}
        for m in accelerators:
            if m.kind in k:
                ms = node_ms(target, m.kind, flops=flops, param_bytes=w, act_bytes=act,
                             streamed_fraction=streamed[m.kind], grouped=grouped)
                per.update({dev: ms for dev in target.logical_ids(m.kind)})
        cost.append(per)
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


def _holders(specs: list, replicated: bool) -> list:
    """The device entries whose caches share a kind's weights: all of them, or one instance of the
    first where every instance holds the whole model."""
    return [specs[0].model_copy(update={"count": 1})] if replicated and specs else specs
