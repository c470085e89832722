"""Each accelerator instance's parameter cache: which weights a plan puts on it, which it holds, what
streams, and placement that respects it.

Coral's compiler caches a model's parameters in the Edge TPU's on-chip memory as far as they fit and
streams the rest over the link on every invocation; models co-compiled for one Edge TPU (one
`edgetpu_compiler` call) share its cache, the model given first taking its share first (Coral's
"Parameter data caching" and co-compilation docs; google-coral/edgetpu #518 shows the order's effect).
The model here, per instance d with a cache (`Problem.cache_bytes`):

- d holds the distinct weights of the nodes placed on it: a key (`Problem.weight_keys`: one tensor,
  however many nodes or segments read it: the captioner's eight frame CNNs, an unrolled LSTM's
  steps) is counted once;
- its segments are cached in priority order (`priority`, the order the package co-compiles them
  in): the segment whose weights are read most often per inference first (a key read k times saves k
  transfers when cached), then plan order; within a segment its keys in node order; the first key
  that does not fit is cached in part, the keys after it stream;
- a node's streamed fraction on d is its keys' uncached bytes over its weight bytes, and its cost is
  its cost with all weights cached plus that fraction of `Problem.stream_ms`.

`occupancy` computes this for a plan (several plans: replicas dealt frames in turn, each instance
holding what any of them places on it), `recost` returns the problem priced that way: a plan's true
cost. The placement and pipelining DPs need a cost that is a sum over nodes, which a shared cache is
not, so `place` respects it by **place-and-recost iteration** (not a constraint inside the DP):

1. place on a view of the costs: once on the target-wide view `graph.build_problem` starts from (the
   kind's weights spread over all its caches, every use counted) and once with every weight cached;
2. price that plan with its own per-instance caches (`recost`) and score it (the caller's objective,
   on the recosted problem); keep the best score seen;
3. place again on the view the plan implies (`view`: nodes on d at their fraction; a node elsewhere
   as if moved to d: its keys d already holds at their fraction, others against d's free space);
   stop when a plan repeats or after `MAX_ROUNDS`;
4. refine the best plan by local moves, each scored on its own recost, kept when it improves
   (`refine`): a cached segment moved to another instance of its kind, or split where its weights
   halve with the second half on another instance (what a per-node DP cannot see: two layers that fit
   two caches but not one).

Every plan is scored at its own true cost, so the result is never worse than the first view's plan,
which is the plan without this module. It is a heuristic, not an optimum under a shared cache.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .problem import Problem

MAX_ROUNDS = 6  # place-and-recost rounds per starting view
MAX_MOVES = 60  # plans `refine` scores at most
GAIN = 1e-3     # the relative improvement a move must bring to be kept


@dataclass(frozen=True)
class Occupancy:
    """One instance's cache under a plan."""

    device: str
    capacity: float                     # float32 bytes of weights the cache holds
    placed: float                       # distinct weight bytes of the nodes placed on it
    cached: float
    uncached: dict[str, float]          # key -> the share of it that streams (keys that fit: absent)
    order: tuple[str, ...]              # keys in cache priority

    @property
    def streamed(self) -> float:
        return self.placed - self.cached

    @property
    def free(self) -> float:
        return max(0.0, self.capacity - self.cached)


def _spans(plan) -> list[tuple[int, int, str]]:
    return [tuple(s) if isinstance(s, tuple) else (s.start, s.stop, s.device) for s in plan]


def occupancy(problem: Problem, plans: Sequence[Sequence]) -> dict[str, Occupancy]:
    """Every cached instance's cache under `plans` (one plan, or a plan and its replicas): its segments
    taken in cache priority (`priority`, the order they are co-compiled in), each segment's keys in
    node order, each key once."""
    spans: dict[str, list[tuple[int, int, str]]] = {d: [] for d in problem.cache_bytes}
    for plan in plans:
        for span in _spans(plan):
            if span[2] in spans and span not in spans[span[2]]:
                spans[span[2]].append(span)
    out = {}
    for d, capacity in problem.cache_bytes.items():
        mine = spans[d]
        order = list(dict.fromkeys(key for s in priority(problem, mine) for k in range(mine[s][0], mine[s][1])
                                   for key in problem.weight_keys[k]))
        room, uncached, cached = capacity, {}, 0.0
        for key in order:
            size = problem.key_bytes.get(key, 0)
            take = min(size, room)
            room -= take
            cached += take
            if take < size:
                uncached[key] = 1.0 - take / size
        out[d] = Occupancy(d, capacity, float(sum(problem.key_bytes.get(k, 0) for k in order)), cached, uncached,
                           tuple(order))
    return out


def _fraction(problem: Problem, k: int, share: Callable[[str], float]) -> float:
    """Node k's streamed fraction when each of its keys streams `share(key)` of itself."""
    keys = problem.weight_keys[k]
    total = sum(problem.key_bytes.get(key, 0) for key in keys)
    return sum(problem.key_bytes.get(key, 0) * share(key) for key in keys) / total if total else 0.0


def _priced(problem: Problem, fraction: Callable[[int, str], float]) -> Problem:
    """The problem with each cached (node, device) costing its cached cost plus `fraction(node, device)`
    of its full streaming cost."""
    if not problem.cache_bytes or not problem.stream_ms:
        return problem
    cost, streamed = [], []
    for k, (per, full, was) in enumerate(zip(problem.cost, problem.stream_ms, problem.streamed)):
        now = {d: fraction(k, d) for d in full}
        cost.append({d: ms + (now[d] - was.get(d, 0.0)) * full[d] if d in full else ms for d, ms in per.items()})
        streamed.append(now)
    return dataclasses.replace(problem, cost=tuple(cost), streamed=tuple(streamed))


def recost(problem: Problem, plans: Sequence[Sequence]) -> Problem:
    """`problem` priced as `plans` really load the caches: each node placed on a cached instance at the
    fraction of its weights that instance streams. Nodes where no plan puts them keep the cost they
    had (the recosted problem is for playing these plans; `view` prices the alternatives)."""
    occ = occupancy(problem, plans)
    placed = {(k, d) for plan in plans for i, j, d in _spans(plan) if d in occ for k in range(i, j)}

    def fraction(k: int, d: str) -> float:
        if (k, d) in placed:
            return _fraction(problem, k, lambda key: occ[d].uncached.get(key, 0.0))
        return problem.streamed[k].get(d, 0.0)

    return _priced(problem, fraction)


def view(problem: Problem, plans: Sequence[Sequence]) -> Problem:
    """The costs the next placement round sees after `plans`: a node on a cached instance at the
    fraction that instance streams of it; a node elsewhere as if moved there alone: the keys the
    instance holds at their fraction, each other key against the instance's free space."""
    occ = occupancy(problem, plans)
    held = {d: set(o.order) for d, o in occ.items()}

    def fraction(k: int, d: str) -> float:
        o = occ[d]
        return _fraction(problem, k, lambda key: o.uncached.get(key, 0.0) if key in held[d] else
                         max(0.0, 1.0 - o.free / problem.key_bytes[key]) if problem.key_bytes.get(key) else 0.0)

    return _priced(problem, fraction)


def all_cached(problem: Problem) -> Problem:
    """Every weight cached on every instance (the optimistic starting view)."""
    return _priced(problem, lambda k, d: 0.0)


@dataclass(frozen=True)
class Placed:
    plan: list                          # the best plan's spans
    problem: Problem                    # priced by that plan's caches (`recost`)
    score: float                        # the objective on it (lower is better)
    rounds: tuple[tuple[str, int, float], ...]   # (starting view, round, score) of every plan tried


def place(problem: Problem, placer: Callable[[Problem], list[list]], objective: Callable[[Problem, list], float]
          ) -> Placed:
    """Place-and-recost (module docstring): `placer(view) -> [spans, ...]` gives a DP's candidate plans on
    a view of the costs, `objective(problem, spans)` scores a plan on its recosted problem (lower is
    better); each round goes on from its best candidate. Without caches in the problem, one placement."""
    if not problem.cache_bytes or not any(problem.weight_keys):
        plans = [[tuple(s) for s in plan] for plan in placer(problem)]
        scores = [objective(problem, plan) for plan in plans]
        k = min(range(len(plans)), key=lambda i: (scores[i], i))
        return Placed(plans[k], problem, scores[k], (("as built", 0, round(scores[k], 6)),))
    best: Placed | None = None
    rounds = []
    for name, start in (("weights spread over every cache", problem), ("every weight cached", all_cached(problem))):
        seen, current = set(), start
        for r in range(MAX_ROUNDS):
            round_best = None
            for plan in placer(current):
                plan = [tuple(s) for s in plan]
                score = objective(recost(problem, [plan]), plan)
                if round_best is None or score < round_best[1] - 1e-9 * abs(round_best[1]):
                    round_best = (plan, score)
            plan, score = round_best
            if tuple(plan) in seen:
                break
            seen.add(tuple(plan))
            rounds.append((name, r, round(score, 6)))
            if best is None or score < best.score - 1e-9 * abs(best.score):
                best = Placed(plan, problem, score, ())
            current = view(problem, [plan])
    plan, score, tried = refine(problem, best.plan, best.score, objective)
    if tried:
        rounds.append(("local moves", tried, round(score, 6)))
    return Placed(plan, recost(problem, [plan]), score, tuple(rounds))


def refine(problem: Problem, plan: list, score: float, objective: Callable[[Problem, list], float]
           ) -> tuple[list, float, int]:
    """`plan` improved by moves of its cached segments (module docstring, step 4), first improvement
    first, until none improves or `MAX_MOVES` plans were scored: the plan, its score, the count."""
    plan, tried = [tuple(s) for s in plan], 0
    improved = True
    while improved and tried < MAX_MOVES:
        improved = False
        for candidate in _moves(problem, plan):
            if tried >= MAX_MOVES:
                break
            tried += 1
            value = objective(recost(problem, [candidate]), candidate)
            if value < score - GAIN * abs(score):
                plan, score, improved = candidate, value, True
                break
    return plan, score, tried


def _moves(problem: Problem, plan: list):
    """Each cached segment on another instance of its kind that can run it, then each split in two
    where its distinct weights halve, the second half on another instance."""
    for s, (i, j, d) in enumerate(plan):
        if d not in problem.cache_bytes:
            continue
        others = [e for e in problem.cache_bytes if e != d and problem.kind(e) == problem.kind(d)
                  and all(problem.can(k, e) for k in range(i, j))]
        for e in others:
            yield _merged(plan[:s] + [(i, j, e)] + plan[s + 1:])
        if j - i > 1:
            cut = _weight_midpoint(problem, i, j)
            for e in others:
                yield _merged(plan[:s] + [(i, cut, d), (cut, j, e)] + plan[s + 1:])


def _merged(plan: list) -> list:
    """Adjacent spans on one device as one span."""
    out = []
    for i, j, d in plan:
        if out and out[-1][2] == d:
            out[-1] = (out[-1][0], j, d)
        else:
            out.append((i, j, d))
    return out


def _weight_midpoint(problem: Problem, i: int, j: int) -> int:
    """The cut in (i, j) where the distinct weights of [i, cut) come closest to half of [i, j)'s."""
    seen, acc, total = set(), [], 0.0
    for k in range(i, j):
        total += sum(problem.key_bytes.get(key, 0) for key in problem.weight_keys[k] if key not in seen)
        seen.update(problem.weight_keys[k])
        acc.append(total)
    return min(range(i + 1, j), key=lambda c: (abs(acc[c - i - 1] - total / 2), c))


def summary(problem: Problem, plans: Sequence[Sequence], scale: dict[str, float], source: dict[str, str]
            ) -> dict[str, dict]:
    """Per cached instance the plans use: its capacity (and the figure's source), the distinct weights
    placed on it, cached and streamed, in the bytes the device stores (`scale[d]` per float32 byte:
    a quarter on the int8 Edge TPU)."""
    out = {}
    for d, o in occupancy(problem, plans).items():
        if o.placed:
            out[d] = {"capacity_bytes": int(o.capacity * scale[d]), "weights_bytes": int(o.placed * scale[d]),
                      "cached_bytes": int(o.cached * scale[d]), "streamed_bytes": int(o.streamed * scale[d]),
                      "capacity_source": source[d]}
    return out


def priority(problem: Problem, spans: Sequence[tuple[int, int, str]]) -> list[int]:
    """The indices of `spans` on one instance in cache priority (the order to co-compile them in): a
    segment whose weights are read most often per inference first (a segment invoked several times,
    or sharing its weights with others), then plan order."""
    reads: Counter = Counter(key for i, j, _ in spans for k in range(i, j) for key in problem.weight_keys[k])
    rank = [max((reads[key] for k in range(i, j) for key in problem.weight_keys[k]), default=0) for i, j, _ in spans]
    return sorted(range(len(spans)), key=lambda s: (-rank[s], s))
