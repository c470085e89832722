"""Pipelining a stream of inferences (`--mode throughput`): contiguous stages of the topological
order, each on its own device instance, so that the stages work on successive frames at once.

Model: stage k runs nodes [c_k, c_{k+1}) on device d_k, d_k all distinct (the CPU may hold one
stage), and takes segment_ms(c_k, c_{k+1}, d_k) per frame, its transfers included. In steady state
a frame leaves every bottleneck = max_k stage_ms; a frame's latency is sum_k stage_ms. We minimize
the bottleneck, then the latency among pipelines with that bottleneck.

The DP runs over states (cut position j, set S of devices used for [0, j)), in two exact passes
(a single pass keeping the lexicographically least (bottleneck, latency) per state would not be
exact: a prefix with a smaller bottleneck but a larger latency loses once a later stage dominates
the bottleneck):

    pass 1:  B[0, {}] = 0,  B[j, S+d] = min over i < j, d not in S of max(B[i, S], segment_ms(i, j, d))
             bottleneck = min over S of B[n, S]
    pass 2:  L[0, {}] = 0,  L[j, S+d] = min of L[i, S] + segment_ms(i, j, d)
             over the arcs with segment_ms(i, j, d) <= bottleneck;  latency = min over S of L[n, S]

Both are shortest paths over a DAG of states settled in increasing j. Complexity:
O(n^2 |D| 2^|D|) time (vectorized over j: O(n |D| 2^|D|) numpy steps, plus the segment rows of
`placement.SegmentCosts`), O(n 2^|D|) memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .placement import SegmentCosts, Span, check_feasible
from .problem import Problem


@dataclass(frozen=True)
class Pipeline:
    stages: tuple[Span, ...]            # cover 0..n-1 in order, devices distinct
    bottleneck_ms: float                # the slowest stage: one frame leaves every bottleneck_ms
    latency_ms: float                   # one frame through all stages

    @property
    def throughput_fps(self) -> float:
        return 1000.0 / self.bottleneck_ms if self.bottleneck_ms > 0 else math.inf


def pipeline(problem: Problem, max_stages: int | None = None) -> Pipeline:
    """The pipeline of least bottleneck, then least latency (module docstring). Raises ValueError
    naming the nodes no device can run, or when no pipeline of distinct devices covers the graph."""
    check_feasible(problem)
    devices = problem.devices
    max_stages = len(devices) if max_stages is None else max_stages
    if max_stages < 1:
        raise ValueError(f"max_stages must be at least 1, got {max_stages}")
    n, costs = len(problem.nodes), SegmentCosts(problem)
    if n == 0:
        return Pipeline((), 0.0, 0.0)
    sets = [s for s in range(1 << len(devices)) if s.bit_count() < max_stages]

    bound = np.full((1 << len(devices), n + 1), math.inf)
    bound[0, 0] = 0.0
    for i in range(n):
        row = costs.row(i, devices)
        for s in sets:
            if bound[s, i] == math.inf:
                continue
            for k, d in enumerate(devices):
                if not s >> k & 1:
                    t = s | 1 << k
                    bound[t, i + 1:] = np.minimum(bound[t, i + 1:], np.maximum(bound[s, i], row[d]))
    bottleneck = float(bound[:, n].min())
    if bottleneck == math.inf:
        raise ValueError(f"no pipeline of at most {max_stages} stage(s) on distinct devices "
                         f"({', '.join(devices)}) covers the graph; place() allows a device to "
                         "hold several segments")

    latency = np.full((1 << len(devices), n + 1), math.inf)
    latency[0, 0] = 0.0
    came_from = np.zeros((1 << len(devices), n + 1), dtype=np.int64)
    via = np.zeros((1 << len(devices), n + 1), dtype=np.int64)
    for i in range(n):
        row = costs.row(i, devices)
        for s in sets:
            if latency[s, i] == math.inf:
                continue
            for k, d in enumerate(devices):
                if s >> k & 1:
                    continue
                t = s | 1 << k
                # the same floats as pass 1, so "<= bottleneck" is exact
                reach = np.where(row[d] <= bottleneck, latency[s, i] + row[d], math.inf)
                better = reach < latency[t, i + 1:] * (1 - 1e-12)
                latency[t, i + 1:][better] = reach[better]
                came_from[t, i + 1:][better] = i
                via[t, i + 1:][better] = k
    stages, j, s = [], n, int(latency[:, n].argmin())
    total = float(latency[s, n])
    while j > 0:
        i, k = int(came_from[s, j]), int(via[s, j])
        stages.append(Span(i, j, devices[k]))
        j, s = i, s & ~(1 << k)
    return Pipeline(tuple(reversed(stages)), bottleneck, total)
