"""A placement problem in numbers: what the scheduling algorithms see of a graph and a target.

Nodes are in one fixed topological order (index 0..n-1). Each node has a cost in ms on each device
it can run on (a missing entry: it cannot). Tensors carry bytes; a tensor is produced by at most one
node (graph inputs by none) and consumed by nodes after it. Devices are instances: "cpu" (the host,
exactly one), and accelerators such as "edgetpu:0", "edgetpu:1", "gpu:0", each behind a link to the
host.

Data model of the runtime this describes: segments exchange tensors through host memory. A segment
on an accelerator receives every input it does not produce itself over its link (once per segment),
and sends every tensor it produces that is used outside it (or is a graph output) back over its link
(once per tensor). A segment on the CPU pays no link. Every segment pays its device's per-segment
overhead (an invocation) once. So a segment's cost depends only on its node range and its device:

    segment_ms(i, j, d) = overhead(d) + sum(cost[k][d] for k in i..j-1)
                          + [d != cpu] * (sum(link_in(d, bytes(t)) for t in inputs(i, j))
                                          + sum(link_out(d, bytes(t)) for t in outputs(i, j)))

`inputs(i, j)`: tensors consumed by nodes i..j-1 and produced outside them (graph inputs included;
constants are not tensors here). `outputs(i, j)`: tensors produced by nodes i..j-1 and consumed by a
node outside them, or graph outputs.

An accelerator with a parameter cache (the Edge TPU) streams over its link, on every invocation, the
weights its cache does not hold. `cost` includes that at the fraction `streamed` gives per node and
device; `stream_ms` is what the node would add if all its weights streamed, `weight_keys` names the
distinct weights each node reads and `cache_bytes` what each instance's cache holds, so that
`cache.recost` can price a plan with each instance holding the weights placed on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Link:
    latency_ms: float        # per transfer
    ms_per_byte: float       # 1 / bandwidth

    def ms(self, nbytes: int) -> float:
        return self.latency_ms + nbytes * self.ms_per_byte


@dataclass(frozen=True)
class Tensor:
    name: str
    nbytes: int
    producer: int | None                 # node index, or None for a graph input
    consumers: tuple[int, ...]           # node indices, increasing
    graph_output: bool = False


@dataclass(frozen=True)
class Problem:
    nodes: tuple[str, ...]                          # names, in topological order
    devices: tuple[str, ...]                        # "cpu" first, then accelerator instances
    cost: tuple[dict[str, float], ...]              # per node: device -> ms (absent: cannot run there)
    tensors: tuple[Tensor, ...]
    overhead_ms: dict[str, float] = field(default_factory=dict)   # per segment invocation, per device
    links: dict[str, Link] = field(default_factory=dict)          # accelerator -> its link to the host
    weights_bytes: tuple[int, ...] = ()             # per node: parameter bytes (on-chip capacity checks)
    # the parameter cache (scheduling/cache.py); all empty where no device has one
    weight_keys: tuple[tuple[str, ...], ...] = ()   # per node: its distinct weights (a shared tensor: one key)
    key_bytes: dict[str, int] = field(default_factory=dict)        # weight key -> its float32 bytes
    cache_bytes: dict[str, float] = field(default_factory=dict)    # device -> float32 bytes its cache holds
    stream_ms: tuple[dict[str, float], ...] = ()    # per node: device -> extra ms if all its weights stream
    streamed: tuple[dict[str, float], ...] = ()     # per node: device -> the fraction `cost` includes

    def can(self, node: int, device: str) -> bool:
        return device in self.cost[node]

    def node_ms(self, node: int, device: str) -> float:
        return self.cost[node].get(device, math.inf)

    def kind(self, device: str) -> str:
        return device.split(":")[0]
