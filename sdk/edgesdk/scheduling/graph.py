"""The placement problem of an ONNX graph on a target: each node's cost on each device that can run
it (`devices/cost.py`: a roofline of the target's figures plus per-op overhead; on the host, the figures
of the node's CPU backend where the target has them), every tensor's bytes, each accelerator's link.

The schedule stage places the graph with it; the package stage re-costs a segment with the very same
numbers when the Edge TPU compiler maps only part of it.
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx

from ..config import HOST
from ..devices import registry
from ..devices.cost import is_grouped, link_ms_per_byte, node_bytes, node_flops, node_ms, tensor_bytes
from ..ir import model as irm
from .problem import Link, Problem, Tensor


def build_problem(model: onnx.ModelProto, target, shapes, consts,
                  cpu_only: frozenset[str] = frozenset()) -> tuple[Problem, list[str]]:
    """The numeric problem of `model` on `target`, and each node's CPU backend. Devices: the host, then
    each accelerator kind's instances, kinds by preference (`devices.registry.accelerators`). The nodes
    named in `cpu_only` (`irm.node_name`) can run on the host alone, whatever legalize says they can run
    elsewhere: a constraint of the placement (the accuracy remedy's culprits, `--keep-on-cpu`), which
    every placement made from this problem (the DPs', the baselines') keeps.

    The costs assume a kind's weights spread evenly over its instances' caches (`streamed_fraction` of
    the weights of every node the kind can run, each use counted): a view before any placement.
    `cache.recost` prices a plan with each instance holding the distinct weights placed on it; the
    problem carries what that needs (`weight_keys`, `key_bytes`, `cache_bytes`, `stream_ms`)."""
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
    caps = [[x for x in c if x.split("/")[0] == HOST] or [f"{HOST}/onnxruntime"]
            if irm.node_name(n, i) in cpu_only else c for i, (n, c) in enumerate(zip(g.node, caps))]
    kinds_of = [{x.split("/")[0] for x in c} for c in caps]
    weights, acts = zip(*(node_bytes(n, shapes, consts) for n in g.node)) if g.node else ((), ())
    # per kind: the share of the weights its capable nodes hold that streams over its link every inference
    streamed = {m.kind: m.streamed_fraction(target.devices_of(m.kind),
                                            sum(w for w, k in zip(weights, kinds_of) if m.kind in k))
                for m in accelerators}
    cached = {m.kind: m.cache(target.device(m.kind)) for m in accelerators if hasattr(m, "cache")}
    cost, cpu_backend, stream_ms, fractions = [], [], [], []
    for n, c, k, w, act in zip(g.node, caps, kinds_of, weights, acts):
        flops, grouped = node_flops(n, shapes), is_grouped(n)
        # on the host, the node costs what it costs on the backend that will compile it (the target's
        # figures of that backend where it has them: `CpuDevice.backends`)
        cpu_backend.append(next((x.split("/")[1] for x in c if x.startswith(f"{HOST}/")), "onnxruntime"))
        per = {HOST: node_ms(target, HOST, flops=flops, param_bytes=w, act_bytes=act, grouped=grouped,
                             backend=cpu_backend[-1])}
        full, fraction = {}, {}
        for m in accelerators:
            if m.kind in k:
                ms = node_ms(target, m.kind, flops=flops, param_bytes=w, act_bytes=act,
                             streamed_fraction=streamed[m.kind], grouped=grouped)
                per.update({dev: ms for dev in target.logical_ids(m.kind)})
                if m.kind in cached and w:
                    extra = (node_ms(target, m.kind, flops=flops, param_bytes=w, act_bytes=act,
                                     streamed_fraction=1.0, grouped=grouped)
                             - node_ms(target, m.kind, flops=flops, param_bytes=w, act_bytes=act, grouped=grouped))
                    full.update(dict.fromkeys(target.logical_ids(m.kind), extra))
                    fraction.update(dict.fromkeys(target.logical_ids(m.kind), streamed[m.kind]))
        cost.append(per)
        stream_ms.append(full)
        fractions.append(fraction)
    outputs = {o.name for o in g.output}
    tensors = [Tensor(t, tensor_bytes(shapes.get(t)), producer.get(t), tuple(consumers.get(t, ())), t in outputs)
               for t in dict.fromkeys([*consumers, *outputs])]
    links = {}
    for dev in devices[1:]:
        latency, per_byte = link_ms_per_byte(target, dev.split(":")[0])
        links[dev] = Link(latency, per_byte)
    names = tuple(irm.node_name(n, i) for i, n in enumerate(g.node))
    keys, key_bytes = _weight_keys(model, shapes, consts)
    cache_bytes = {dev: cached[m.kind].capacity for m in accelerators if m.kind in cached for dev in target.logical_ids(m.kind)}
    return Problem(names, tuple(devices), tuple(cost), tuple(tensors), {d: 0.0 for d in devices}, links,
                   tuple(weights), keys, key_bytes, cache_bytes, tuple(stream_ms), tuple(fractions)), cpu_backend


def _weight_keys(model: onnx.ModelProto, shapes, consts) -> tuple[tuple[tuple[str, ...], ...], dict[str, int]]:
    """Per node, the keys of the weights it reads, and each key's float32 bytes (as `node_bytes` counts
    them). A key is the initializer's name; initializers with the same bytes (one tensor exported
    twice) share the first one's name, so a cache holds them once."""
    first: dict[tuple, str] = {}
    alias: dict[str, str] = {}
    for init in model.graph.initializer:
        if init.name in consts and (irm.is_mapped(init) or init.raw_data):
            raw = irm.array(init).reshape(-1).view(np.uint8) if irm.is_mapped(init) else init.raw_data  # (mapped: not copied)
            content = (init.data_type, tuple(init.dims), hashlib.blake2b(raw, digest_size=16).digest())
            alias[init.name] = first.setdefault(content, init.name)
    keys, key_bytes = [], {}
    for n in model.graph.node:
        mine = tuple(dict.fromkeys(alias.get(t, t) for t in n.input if t in consts))
        keys.append(mine)
        for t in n.input:
            if t in consts:
                key_bytes.setdefault(alias.get(t, t), tensor_bytes(shapes.get(t)))
    return tuple(keys), key_bytes
