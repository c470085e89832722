"""Inter-operator parallelism on one device: an IOS-style DP over stages of concurrent groups.

The input is one run of the placement (nodes on one device, in topological order), the data
dependencies among its nodes, each node's time on p worker threads, t(n, p) for p = 1..P (P: the
device's cores, its resource limit), and the cost of dispatching a parallel stage.

Execution model (what `runtime/executor.py` does). The run becomes a sequence of *stages*. A stage
is a set S of nodes whose predecessors inside the run all ran in earlier stages or are in S. Its
*groups* are the weakly connected components of S: inside a group nodes depend on each other and run
one after another in topological order; different groups share no edge and may run at once.

- A stage of one group runs on the calling thread with all P threads: sum over S of t(n, P).
- A stage of k > 1 groups (k <= P) runs each group on its own worker with p_g >= 1 threads,
  sum p_g <= P, and ends when the last group does; each group is a segment of its own, so its inputs
  and outputs are copied across a segment boundary; and the groups share the memory bandwidth, so the
  stage takes at least the memory time of all its nodes together:

      stage_ms(S) = dispatch_ms + max( min over allotments p of max_g sum_{n in g} (t(n, p_g) + copy_ms(n)),
                                       sum_{n in S} memory_ms(n) )

Search space, and optimality within it. First every *linear cluster* (a maximal chain n1 -> ... -> nk
where each node is the only successor of the one before and that one its only predecessor) becomes
one unit: a chain has nothing to run at once inside it, and an Inception branch or a NASNet separable
convolution stack becomes one unit, so that a block holds a whole module. The DP runs twice, over
units and over single nodes (a stage may then hold part of a chain), and the better plan is kept: the
optimum over the union of the two spaces. The units (or nodes) are cut into
*blocks* of at most `block` consecutive units of the topological order (each cut placed where the fewest tensors cross it, see `blocks`);
a stage lies inside one block; a stage has at most P groups. Within a block, every sequence of such
stages is a path in the DAG of *executed sets* X (the down-closed subsets of the block):

      f(block) = 0,    f(X) = min over stages S valid after X of  stage_ms(S) + f(X ∪ S)

and the DP (IOS, Ding et al., MLSys 2021: "IOS: Inter-Operator Scheduler for CNN Acceleration")
solves it exactly by memoized recursion; blocks are independent, so the run's optimum is the sum of
the blocks'. A property test compares it with brute force over the same space. Sequential execution
(one node per stage, all threads) is in the space, so the result is never worse than it under the
model.

Complexity: per block, O(D * E * A) where D is the number of down-closed sets (at most 2^block, far
fewer on narrow graphs: a block of b parallel chains of lengths l_i has prod (l_i + 1)), E the
stages enumerated from one of them (at most 2^width) and A the thread allotments (compositions of P
into k parts). When a block's work passes `budget` stage evaluations it is split in two at its best
cut and solved again: the space shrinks, and the docstring of `schedule` says when that happened.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

ThreadCost = Callable[[int, int], float]   # (node, threads) -> ms

# The least predicted gain over the sequential run, relative to it, for which a plan with concurrent
# groups is taken. Each group is a segment of its own (a TVM library, its tensors handed across segment
# boundaries at run time), and the prediction is not exact to a few per cent: on x86, plans predicted
# 0.1 % and 3 % faster measured 1.00x and 0.75x (docs/design-notes.md, "Inter-operator parallelism on x86"),
# per-node cost errors of 20-50 % unbalancing the groups and a step costing about 500 us against the
# 61 us measured on trivial segments. A smaller predicted gain is noise that the extra segments pay for.
MIN_GAIN = 0.05


@dataclass(frozen=True)
class Step:
    """Groups of nodes that run at once, each on its own threads (a parallel step of the plan; not a
    build stage, nor a pipeline stage)."""

    groups: tuple[tuple[int, ...], ...]     # node ids, each group in topological order
    threads: tuple[int, ...]                # per group
    ms: float

    @property
    def parallel(self) -> bool:
        return len(self.groups) > 1


@dataclass(frozen=True)
class ParallelPlan:
    stages: tuple[Step, ...]
    ms: float                               # sum of the stages' ms
    sequential_ms: float                    # every node alone, all threads
    blocks: int
    splits: int = 0                         # blocks split because they passed the budget
    evaluations: int = 0                    # stages costed


@dataclass(frozen=True)
class Run:
    """One device's run of nodes: ids in topological order, and the predecessors of each inside it."""

    nodes: tuple[int, ...]
    preds: dict[int, frozenset[int]]
    io_ms: dict[int, float] = field(default_factory=dict)   # per node: copying its outputs across a
                                                            # segment boundary (0 when absent)
    memory_ms: dict[int, float] = field(default_factory=dict)  # per node: its bytes at the full bandwidth


def schedule(run: Run, cost: ThreadCost, cores: int, *, dispatch_ms: float, block: int = 14,
             budget: int = 200_000, clusters: bool = True) -> ParallelPlan:
    """The least-time sequence of stages for `run` within the module's search space (with `clusters`
    False, over single nodes only: the tests compare each space with brute force)."""
    if cores < 1:
        raise ValueError(f"cores must be at least 1, got {cores}")
    if clusters:
        nodes = schedule(run, cost, cores, dispatch_ms=dispatch_ms, block=block, budget=budget, clusters=False)
        units, members = contract(run)
        plan = schedule(units, lambda u, p: sum(cost(n, p) for n in members[u]), cores,
                        dispatch_ms=dispatch_ms, block=block, budget=budget, clusters=False)
        if nodes.ms <= plan.ms:
            return nodes
        expand = lambda unit_group: tuple(n for u in unit_group for n in members[u])  # noqa: E731
        stages = tuple(Step(tuple(expand(g) for g in st.groups), st.threads, st.ms) for st in plan.stages)
        return ParallelPlan(stages, plan.ms, nodes.sequential_ms, plan.blocks, plan.splits,
                            plan.evaluations + nodes.evaluations)
    sequential = sum(cost(n, cores) for n in run.nodes)
    stages: list[Step] = []
    evaluations = splits = 0
    pending = list(blocks(run, block))
    count = 0
    while pending:
        part = pending.pop(0)
        solver = _BlockDP(run, part, cost, cores, dispatch_ms, budget)
        try:
            found = solver.solve()
        except _OverBudget:
            left, right = _split(run, part)
            pending[:0] = [left, right]
            splits += 1
            evaluations += solver.evaluations
            continue
        stages.extend(found)
        evaluations += solver.evaluations
        count += 1
    return ParallelPlan(tuple(stages), sum(s.ms for s in stages), sequential, count, splits, evaluations)


def refusal(plan: ParallelPlan) -> str | None:
    """Why `plan` is not worth its extra segments, or None when it is."""
    if not any(st.parallel for st in plan.stages):
        return "no stage of concurrent groups pays for its hand-off"
    gain = 1 - plan.ms / plan.sequential_ms if plan.sequential_ms > 0 else 0.0
    if gain < MIN_GAIN:
        return f"predicted gain {100 * gain:.2f} % < {100 * MIN_GAIN:g} %"
    return None


def contract(run: Run) -> tuple[Run, dict[int, tuple[int, ...]]]:
    """The run with each linear cluster as one unit (named by its first node), and each unit's nodes.
    A unit's copy cost is its last node's (the others' outputs stay inside the group); its memory time
    is its nodes' sum."""
    inside = set(run.nodes)
    succs: dict[int, list[int]] = {n: [] for n in run.nodes}
    for n in run.nodes:
        for p in run.preds.get(n, ()):
            if p in inside:
                succs[p].append(n)
    preds = {n: [p for p in run.preds.get(n, ()) if p in inside] for n in run.nodes}
    head: dict[int, int] = {}
    members: dict[int, list[int]] = {}
    for n in run.nodes:
        ps = preds[n]
        if len(ps) == 1 and len(succs[ps[0]]) == 1:
            head[n] = head[ps[0]]
            members[head[n]].append(n)
        else:
            head[n] = n
            members[n] = [n]
    units = tuple(members)
    unit_preds = {u: frozenset(head[p] for p in preds[members[u][0]]) for u in units}
    io = {u: run.io_ms.get(members[u][-1], 0.0) for u in units}
    memory = {u: sum(run.memory_ms.get(n, 0.0) for n in members[u]) for u in units}
    return Run(units, unit_preds, io, memory), {u: tuple(m) for u, m in members.items()}


def stage_ms(run: Run, nodes: Sequence[int], cost: ThreadCost, cores: int, dispatch_ms: float
             ) -> tuple[float, tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """(ms, groups, threads) of one stage holding `nodes`; infinite when it has more groups than cores."""
    groups = components(run, nodes)
    if len(groups) == 1:
        return sum(cost(n, cores) for n in groups[0]), groups, (cores,)
    if len(groups) > cores:
        return math.inf, groups, ()
    best, best_threads = math.inf, ()
    for threads in allotments(cores, len(groups)):
        ms = max(sum(cost(n, p) + run.io_ms.get(n, 0.0) for n in g) for g, p in zip(groups, threads))
        if ms < best:
            best, best_threads = ms, threads
    memory = sum(run.memory_ms.get(n, 0.0) for g in groups for n in g)
    return dispatch_ms + max(best, memory), groups, best_threads


def components(run: Run, nodes: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """The weakly connected components of `nodes` (edges among them only), each in topological order,
    ordered by their first node."""
    inside = set(nodes)
    parent = {n: n for n in inside}

    def find(n: int) -> int:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in inside:
        for p in run.preds.get(n, ()):
            if p in inside:
                parent[find(p)] = find(n)
    order = {n: i for i, n in enumerate(run.nodes)}
    groups: dict[int, list[int]] = {}
    for n in sorted(inside, key=order.__getitem__):
        groups.setdefault(find(n), []).append(n)
    return tuple(tuple(g) for g in sorted(groups.values(), key=lambda g: order[g[0]]))


# The most thread splits tried for one stage of k groups. There are C(cores - 1, k - 1) ways to split
# `cores` threads among k groups: 3 for 4 cores and 2 groups, but 178 million for 1,024 cores and 4
# groups (a valid target), which stalled the schedule stage. Beyond this many, threads are split in
# units of several (the first group also takes the remainder).
MAX_ALLOTMENTS = 512


def allotments(cores: int, k: int) -> list[tuple[int, ...]]:
    """The ways to give k groups at least one thread each, using all `cores`: every way while there are
    at most MAX_ALLOTMENTS of them, else every way in units of the fewest threads that keeps them
    within it."""
    if k > cores:
        return []
    unit = 1
    while math.comb(cores // unit - 1, k - 1) > MAX_ALLOTMENTS and cores // (unit + 1) >= k:
        unit += 1
    units, rest = cores // unit, cores % unit
    return [tuple((b - a) * unit + (rest if i == 0 else 0) for i, (a, b) in enumerate(zip((0, *cuts), (*cuts, units))))
            for cuts in itertools.combinations(range(1, units), k - 1)]


def blocks(run: Run, size: int) -> list[tuple[int, ...]]:
    """Cut the run into pieces of at most `size` nodes of its order. Each cut goes, among the positions
    in the second half of the allowed window, where the fewest dependency edges cross (ties: the later
    position): an Inception module or a NASNet cell tends to stay in one block."""
    if size < 1:
        raise ValueError(f"block size must be at least 1, got {size}")
    nodes = run.nodes
    crossing = _crossing(run)
    out, start = [], 0
    while start < len(nodes):
        stop = min(start + size, len(nodes))
        if stop < len(nodes):
            lo = start + max(1, size // 2)
            stop = min(range(lo, stop + 1), key=lambda c: (crossing[c], -c))
        out.append(nodes[start:stop])
        start = stop
    return out


def _crossing(run: Run) -> list[int]:
    """crossing[c]: edges from a node before position c to a node at or after it."""
    pos = {n: i for i, n in enumerate(run.nodes)}
    delta = [0] * (len(run.nodes) + 1)
    for n, ps in run.preds.items():
        for p in ps:
            if p in pos and n in pos:
                delta[pos[p] + 1] += 1
                delta[pos[n] + 1] -= 1
    return list(itertools.accumulate(delta))


def _split(run: Run, part: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    sub = Run(part, run.preds)
    crossing = _crossing(sub)
    cut = min(range(1, len(part)), key=lambda c: (crossing[c], abs(2 * c - len(part))))
    return part[:cut], part[cut:]


class _OverBudget(Exception):
    pass


class _BlockDP:
    """f(X) over the down-closed subsets X of one block, memoized on bitmasks."""

    def __init__(self, run: Run, part: tuple[int, ...], cost: ThreadCost, cores: int, dispatch_ms: float,
                 budget: int):
        self.run, self.part, self.cost, self.cores, self.dispatch = run, part, cost, cores, dispatch_ms
        self.budget, self.evaluations = budget, 0
        index = {n: i for i, n in enumerate(part)}
        self.pred_mask = [sum(1 << index[p] for p in run.preds.get(n, ()) if p in index) for n in part]
        # undirected neighbours inside the block, for the components of a stage
        self.adjacent = list(self.pred_mask)
        for i, mask in enumerate(self.pred_mask):
            for j in range(len(part)):
                if mask >> j & 1:
                    self.adjacent[j] |= 1 << i
        # per node and thread count: its time, and with its outputs copied across a segment boundary
        self.alone = [cost(n, cores) for n in part]
        self.in_group = [[math.inf] + [cost(n, p) + run.io_ms.get(n, 0.0) for p in range(1, cores + 1)] if cores > 1 else []
                         for n in part]
        self.memory = [run.memory_ms.get(n, 0.0) for n in part]
        self.full = (1 << len(part)) - 1
        self.best: dict[int, tuple[float, int]] = {self.full: (0.0, 0)}
        self.stage_cache: dict[int, tuple[float, tuple, tuple]] = {}

    def solve(self) -> list[Step]:
        self._f(0)
        stages, done = [], 0
        while done != self.full:
            _, s = self.best[done]
            ms, groups, threads = self.stage_cache[s]
            stages.append(Step(groups, threads, ms))
            done |= s
        return stages

    def _f(self, done: int) -> float:
        hit = self.best.get(done)
        if hit is not None:
            return hit[0]
        best, best_s = math.inf, 0
        for s in self._stages(done):
            ms = self._stage(s)
            if ms >= best:
                continue
            total = ms + self._f(done | s)
            if total < best:
                best, best_s = total, s
        self.best[done] = (best, best_s)
        return best

    def _stages(self, done: int):
        """Every nonempty S with done ∪ S down-closed: each node not done is in or out, in order; a node
        may be in only when its predecessors are done or in."""
        n = len(self.part)
        free = [i for i in range(n) if not done >> i & 1]

        def walk(k: int, s: int):
            if k == len(free):
                if s:
                    yield s
                return
            i = free[k]
            yield from walk(k + 1, s)
            if self.pred_mask[i] & ~(done | s) == 0:
                yield from walk(k + 1, s | 1 << i)

        return walk(0, 0)

    def _stage(self, s: int) -> float:
        hit = self.stage_cache.get(s)
        if hit is None:
            self.evaluations += 1
            if self.evaluations > self.budget:
                raise _OverBudget
            hit = self._cost(s)
            self.stage_cache[s] = hit
        return hit[0]

    def _cost(self, s: int) -> tuple[float, tuple, tuple]:
        """`stage_ms` on bitmasks: the same value (a test checks it)."""
        groups, rest = [], s
        while rest:
            seed = rest & -rest
            comp, frontier = seed, seed
            while frontier:
                low = frontier & -frontier
                frontier ^= low
                grow = self.adjacent[low.bit_length() - 1] & s & ~comp
                comp |= grow
                frontier |= grow
            groups.append(comp)
            rest &= ~comp
            if len(groups) > self.cores:
                return math.inf, (), ()
        members = [[i for i in range(len(self.part)) if g >> i & 1] for g in groups]
        named = tuple(tuple(self.part[i] for i in m) for m in members)
        if len(groups) == 1:
            return sum(self.alone[i] for i in members[0]), named, (self.cores,)
        best, best_threads = math.inf, ()
        for threads in allotments(self.cores, len(groups)):
            ms = max(sum(self.in_group[i][p] for i in m) for m, p in zip(members, threads))
            if ms < best:
                best, best_threads = ms, threads
        memory = sum(self.memory[i] for m in members for i in m)
        return self.dispatch + max(best, memory), named, best_threads


def exhaustive(run: Run, part: Sequence[int], cost: ThreadCost, cores: int, dispatch_ms: float) -> float:
    """Brute force over the same space for one block (tests): every ordered sequence of valid stages."""
    part = tuple(part)

    def best(done: frozenset[int]) -> float:
        rest = [n for n in part if n not in done]
        if not rest:
            return 0.0
        out = math.inf
        for r in range(1, len(rest) + 1):
            for s in itertools.combinations(rest, r):
                chosen = set(s)
                if any(p in part and p not in done and p not in chosen for n in s for p in run.preds.get(n, ())):
                    continue
                ms = stage_ms(run, s, cost, cores, dispatch_ms)[0]
                if ms < math.inf:
                    out = min(out, ms + best(done | chosen))
        return out

    return best(frozenset())
