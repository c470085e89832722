"""Random placement problems for the scheduling tests.

Node k consumes node k-1's output (node 0: the graph input). Unless `chain`, with probability
`p_edge` it consumes a random earlier tensor instead (a branch: nodes k-1 and k are then
independent, so segments may overlap in time), and with probability `p_edge` one more (a skip
connection or a join). At most two uses per node keep E = O(n) on large graphs. Tensors nobody
consumes are graph outputs, as is the last node's. The CPU runs every node; each accelerator kind runs a node with probability
`capable_fraction`, at 0.05x to 1.5x the CPU's cost. Instances of one kind ("edgetpu:0",
"edgetpu:1") are identical: same costs, overhead and link, as two equal chips on equal links.
"""

from __future__ import annotations

import numpy as np

from edgesdk.scheduling.problem import Link, Problem, Tensor


def random_problem(rng: np.random.Generator, n_nodes: int, devices: tuple[str, ...], *, chain: bool = False,
                   p_edge: float = 0.3, capable_fraction: float = 0.7) -> Problem:
    kinds = sorted({d.split(":")[0] for d in devices} - {"cpu"})
    cpu_ms = rng.uniform(0.1, 5.0, n_nodes)
    kind_ms = {kind: [cpu_ms[k] * rng.uniform(0.05, 1.5) if rng.random() < capable_fraction else None
                      for k in range(n_nodes)] for kind in kinds}
    cost = tuple({"cpu": float(cpu_ms[k]),
                  **{d: float(kind_ms[d.split(":")[0]][k]) for d in devices
                     if d != "cpu" and kind_ms[d.split(":")[0]][k] is not None}}
                 for k in range(n_nodes))

    consumers: list[list[int]] = [[] for _ in range(n_nodes + 1)]   # index 0: the graph input
    for k in range(n_nodes):
        sources = {k}                                               # tensor k = node k-1's output
        if not chain and k > 1:
            if rng.random() < p_edge:                               # a branch: start from elsewhere
                sources = {int(rng.integers(0, k))}
            if rng.random() < p_edge:                               # a skip connection or a join
                sources.add(int(rng.integers(0, k)))
        for s in sources:
            consumers[s].append(k)
    tensors = tuple(Tensor(name=f"t{s}", nbytes=int(rng.integers(100, 1_000_000)),
                           producer=None if s == 0 else s - 1, consumers=tuple(sorted(consumers[s])),
                           graph_output=s == n_nodes or (s > 0 and not consumers[s]))
                    for s in range(n_nodes + 1))

    kind_overhead = {kind: float(rng.uniform(0.05, 1.0)) for kind in kinds}
    kind_link = {kind: Link(latency_ms=float(rng.uniform(0.01, 0.3)),
                            ms_per_byte=float(rng.uniform(1e-7, 1e-5))) for kind in kinds}
    return Problem(nodes=tuple(f"n{k}" for k in range(n_nodes)), devices=tuple(devices), cost=cost,
                   tensors=tensors,
                   overhead_ms={"cpu": float(rng.uniform(0.0, 0.05)),
                                **{d: kind_overhead[d.split(":")[0]] for d in devices if d != "cpu"}},
                   links={d: kind_link[d.split(":")[0]] for d in devices if d != "cpu"},
                   weights_bytes=tuple(int(b) for b in rng.integers(0, 4_000_000, n_nodes)))
