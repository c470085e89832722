"""Optimal placement of one inference: contiguous segments of the fixed topological order, each on
one device instance, minimizing the latency when the segments run one after another.

The space. A plan cuts the order 0..n-1 at positions 0 = c_0 < c_1 < ... < c_m = n and puts
segment [c_k, c_{k+1}) on a device d_k. Its cost is

    sequential_ms(plan) = sum_k segment_ms(c_k, c_{k+1}, d_k)

with `segment_ms` exactly as `problem.py` defines it. Every per-node assignment of devices is in
this space (its maximal runs of equal devices are such segments); what the space leaves out is
other topological orders and any overlap of segments in time (that is the simulator's business).

The DP. A segment's cost depends only on (i, j, d), so the objective is a sum of arc weights on
the DAG of cut positions 0..n with arcs i -> j (i < j) of weight min_d segment_ms(i, j, d), and the
best plan is a shortest path from 0 to n:

    best[0] = 0,    best[j] = min over i < j, d of best[i] + segment_ms(i, j, d)

Positions are settled in increasing order, so best[i] is final when the arcs out of i are relaxed:
the result is optimal within the space (no pruning; ties within a relative 1e-12 keep the earlier
start, i.e. the longer last segment).

Segment costs for one start i and every stop j > i come from `SegmentCosts.row(i)` in O(E + n|D|)
vectorized work (E = tensor uses): a tensor becomes an input of [i, j) at the stop after its first
use at or after i (when it is produced before i or is a graph input) and stays one; a tensor
produced at p >= i is an output for stops p+1 .. last_use (for ever if it is a graph output). These
are events on the stop axis, and a cumulative sum turns them into per-stop transfer counts and
bytes, as an incremental sweep over j would. Compute is a cumulative sum of node costs, which
turns infinite at the first node the device cannot run (no plan uses those arcs).

Complexity: O(n (E + n |D|)) time, i.e. O(n^2 |D|) when E = O(n |D|); O(n + E) memory.

Identical instances (same kind, same node costs, overhead and link: two edgetpu's on equal links)
cost the same on every segment, so the DP runs over one instance per such class and the plan then
deals the class's instances round-robin in segment order: consecutive accelerator segments
alternate edgetpu:0, edgetpu:1, edgetpu:0, ... Instances that differ (a slower link) are distinct
classes and are chosen on cost alone.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .problem import Problem


class Span(NamedTuple):
    """A segment of the plan as the DP sees it: a contiguous span of the node order on one device
    (`runtime.manifest.Segment` is the bundle's, with its artifact and tensors)."""

    start: int          # first node
    stop: int           # one past the last node
    device: str


@dataclass(frozen=True)
class Plan:
    segments: tuple[Span, ...]          # cover 0..n-1 in order
    cost_ms: float                      # sequential_ms of the segments

    def assignment(self) -> tuple[str, ...]:
        return tuple(s.device for s in self.segments for _ in range(s.start, s.stop))


Objective = Callable[[Problem, Plan], float]


def segment_ms(problem: Problem, i: int, j: int, device: str) -> float:
    """The cost of nodes i..j-1 as one segment on `device`, straight from the definition in
    `problem.py` (the reference the DP is tested against); inf if a node cannot run there."""
    inside = range(i, j)
    if not all(problem.can(k, device) for k in inside):
        return math.inf
    ms = problem.overhead_ms.get(device, 0.0) + sum(problem.cost[k][device] for k in inside)
    if problem.kind(device) == "cpu":
        return ms
    link = problem.links[device]
    for t in problem.tensors:
        produced = t.producer in inside
        used_inside = any(c in inside for c in t.consumers)
        used_outside = any(c not in inside for c in t.consumers)
        if (used_inside and not produced) or (produced and (used_outside or t.graph_output)):
            ms += link.ms(t.nbytes)
    return ms


def sequential_ms(problem: Problem, plan: Plan) -> float:
    """The latency of one inference when the plan's segments run one after another."""
    return sum(segment_ms(problem, *s) for s in plan.segments)


def check_feasible(problem: Problem) -> None:
    """Raise ValueError naming every node that no device of the problem can run."""
    stuck = [problem.nodes[k] for k in range(len(problem.nodes))
             if not any(problem.can(k, d) for d in problem.devices)]
    if stuck:
        raise ValueError(f"no device can run node(s) {', '.join(stuck)} "
                         f"(devices: {', '.join(problem.devices)})")


class SegmentCosts:
    """segment_ms(i, j, d) for one start i and all stops j at once (see the module docstring)."""

    def __init__(self, problem: Problem):
        n = self.n = len(problem.nodes)
        self.problem = problem
        # inputs: one row per use (consumer k of tensor t); it opens a transfer at stop k+1 when t is
        # produced before i (or is a graph input: -1) and its previous use is before i (-1: none)
        use_node, use_producer, use_previous, use_bytes = [], [], [], []
        # outputs: a transfer at stops producer+1 .. end-1 (end = n+1: a graph output, never closes)
        out_producer, out_end, out_bytes = [], [], []
        for t in problem.tensors:
            previous = -1
            for c in t.consumers:
                use_node.append(c)
                use_producer.append(-1 if t.producer is None else t.producer)
                use_previous.append(previous)
                use_bytes.append(t.nbytes)
                previous = c
            if t.producer is not None and (t.consumers or t.graph_output):
                out_producer.append(t.producer)
                out_end.append(n + 1 if t.graph_output else max(t.consumers) + 1)
                out_bytes.append(t.nbytes)
        self.use_node, self.use_producer, self.use_previous = (
            np.array(a, dtype=np.int64) for a in (use_node, use_producer, use_previous))
        self.use_bytes = np.array(use_bytes, dtype=np.float64)
        self.out_producer, self.out_end = (np.array(a, dtype=np.int64) for a in (out_producer, out_end))
        self.out_bytes = np.array(out_bytes, dtype=np.float64)
        self.node_ms = {d: np.array([problem.node_ms(k, d) for k in range(n)], dtype=np.float64)
                        for d in problem.devices}

    def transfers(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(count, bytes) of tensors crossing the boundary of [i, j), for j = i+1..n."""
        size = self.n + 2
        use = (self.use_node >= i) & (self.use_producer < i) & (self.use_previous < i)
        out = self.out_producer >= i
        opens = np.concatenate((self.use_node[use], self.out_producer[out])) + 1
        opens_bytes = np.concatenate((self.use_bytes[use], self.out_bytes[out]))
        closes = self.out_end[out]
        count = np.bincount(opens, minlength=size) - np.bincount(closes, minlength=size)
        nbytes = (np.bincount(opens, opens_bytes, minlength=size)
                  - np.bincount(closes, self.out_bytes[out], minlength=size))
        return np.cumsum(count)[i + 1:self.n + 1], np.cumsum(nbytes)[i + 1:self.n + 1]

    def row(self, i: int, devices: Iterable[str]) -> dict[str, np.ndarray]:
        """device -> array a with a[j - i - 1] = segment_ms(i, j, device), j = i+1..n."""
        p = self.problem
        count, nbytes = self.transfers(i)
        row = {}
        for d in devices:
            ms = p.overhead_ms.get(d, 0.0) + np.cumsum(self.node_ms[d][i:])
            if p.kind(d) != "cpu":
                link = p.links[d]
                ms += link.latency_ms * count + link.ms_per_byte * nbytes
            row[d] = ms
        return row


def instance_classes(problem: Problem) -> dict[str, tuple[str, ...]]:
    """First instance of each class of identical instances -> the class, in device order."""
    classes: dict[tuple, list[str]] = {}
    for d in problem.devices:
        key = (problem.kind(d), tuple(problem.node_ms(k, d) for k in range(len(problem.nodes))),
               problem.overhead_ms.get(d, 0.0), problem.links.get(d))
        classes.setdefault(key, []).append(d)
    return {members[0]: tuple(members) for members in classes.values()}


def place(problem: Problem) -> Plan:
    """The plan of least sequential_ms over contiguous segments of the order (module docstring).
    Raises ValueError naming the nodes no device can run."""
    check_feasible(problem)
    n = len(problem.nodes)
    classes = instance_classes(problem)
    costs = SegmentCosts(problem)
    best = np.full(n + 1, math.inf)
    best[0] = 0.0
    came_from = np.zeros(n + 1, dtype=np.int64)
    on_class = np.zeros(n + 1, dtype=np.int64)
    for i in range(n):
        for c, (d, ms) in enumerate(costs.row(i, classes).items()):
            reach = best[i] + ms
            # (1 - 1e-12): a rounding-level "improvement" is a tie, and ties keep the earlier start
            better = reach < best[i + 1:] * (1 - 1e-12)
            best[i + 1:][better] = reach[better]
            came_from[i + 1:][better] = i
            on_class[i + 1:][better] = c
    segments, j = [], n
    representative = list(classes)
    while j > 0:
        segments.append(Span(int(came_from[j]), j, representative[on_class[j]]))
        j = int(came_from[j])
    segments.reverse()
    dealt = dict.fromkeys(classes, 0)
    for k, s in enumerate(segments):
        members = classes[s.device]
        segments[k] = s._replace(device=members[dealt[s.device] % len(members)])
        dealt[s.device] += 1
    return Plan(tuple(segments), float(best[n]))


def exhaustive_segments(problem: Problem) -> Plan:
    """Brute force over the DP's space (n <= ~12): every set of cut positions; each segment then
    takes its cheapest device, since the cost is a sum of independent per-segment terms."""
    check_feasible(problem)
    n = len(problem.nodes)
    if n == 0:
        return Plan((), 0.0)
    best = Plan((), math.inf)
    for cuts in itertools.product((False, True), repeat=n - 1):
        bounds = [0] + [k + 1 for k, cut in enumerate(cuts) if cut] + [n]
        segments, total = [], 0.0
        for a, b in itertools.pairwise(bounds):
            ms, d = min((segment_ms(problem, a, b, d), d) for d in problem.devices)
            segments.append(Span(a, b, d))
            total += ms
        if total < best.cost_ms:
            best = Plan(tuple(segments), total)
    return best


def runs(assignment: tuple[str, ...]) -> tuple[Span, ...]:
    """The segments an assignment induces: its maximal runs of equal devices."""
    segments, start = [], 0
    for k in range(1, len(assignment) + 1):
        if k == len(assignment) or assignment[k] != assignment[start]:
            segments.append(Span(start, k, assignment[start]))
            start = k
    return tuple(segments)


def exhaustive_assignments(problem: Problem, objective: Objective = sequential_ms
                           ) -> tuple[tuple[str, ...], float]:
    """The best of all |D|^n per-node assignments under `objective(problem, plan)` (n <= ~10),
    each assignment played as the plan of its maximal runs."""
    cache: dict[Span, float] = {}
    best: tuple[tuple[str, ...], float] = ((), math.inf)
    for assignment in itertools.product(problem.devices, repeat=len(problem.nodes)):
        segments = runs(assignment)
        for s in segments:
            if s not in cache:
                cache[s] = segment_ms(problem, *s)
        plan = Plan(segments, sum(cache[s] for s in segments))
        # the sequential objective is the plan's own cost: skip recomputing it without the cache
        value = plan.cost_ms if objective is sequential_ms else objective(problem, plan)
        if value < best[1]:
            best = (assignment, value)
    return best


def gap_to_unrestricted(problem: Problem, objective: Objective = sequential_ms) -> tuple[float, float]:
    """(objective of the DP's plan, best objective over all per-node assignments), small n only.

    Under sequential_ms the two are equal: every assignment's runs are a plan of the DP's space,
    and the DP's plan has no two adjacent segments on one instance (with non-negative costs,
    overheads and link parameters a merged segment never costs more, and ties keep the longer
    segment), so it is itself an assignment's runs. The gap measures what the restricted space
    loses under an objective that lets segments overlap in time (the simulator's)."""
    return objective(problem, place(problem)), exhaustive_assignments(problem, objective)[1]
