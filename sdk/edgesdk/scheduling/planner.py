"""The schedule as one function: a legalized model and a target in, a `Plan` and its segments out.

`make_plan` builds the numeric problem (`graph.build_problem`), places the nodes (the placement DP
for latency; for throughput the pipelining DP or the latency plan streamed, whichever the simulated
stream runs faster), by place-and-recost over the accelerators' parameter caches (`cache.place`: each
plan priced with each instance holding the weights placed on it), splits CPU runs by backend, re-schedules CPU runs for inter-operator parallelism
(`interop`), cuts the segments (`segments`), simulates one inference and a stream of `STREAM_FRAMES`
frames (`simulate`), costs the documented baselines (`baselines`), and assembles the frozen `Plan`.
Every baseline is a candidate: carried through the same steps (backend split, inter-operator
parallelism, simulation) it is costed exactly as the plan would be, and where it predicts better than
the scheduler's own plan its placement becomes the plan (`Plan.chosen` says which won, by how much), so
a plan is never predicted worse than a baseline it reports.
It reads and writes no file: the schedule stage writes what it returns.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import onnx

from ..devices import registry
from ..errors import UsageError, UserError
from ..ir import model as irm
from . import baselines, cache, interop, pipelining, placement, simulate
from .graph import build_problem
from .plan import Plan, PlanSegment
from .problem import Problem
from .segments import PlannedSegment, annotate, cut, logit_probes, placement_counts, shared, split_by_backend

STREAM_FRAMES = 32  # frames the stream simulation plays to measure steady-state throughput
COST_MODEL = ("per node: roofline of the target's figures plus per-op overhead; per tensor that changes "
              "device: the link (devices/cost.py); every figure names its source in the target file")


@dataclass(frozen=True)
class Scheduled:
    plan: Plan
    segments: dict[str, onnx.ModelProto]  # segment id -> its standalone model, nodes annotated with the device
    model: onnx.ModelProto  # the whole model, every node annotated with its device
    problem: Problem
    runs: tuple[PlannedSegment, ...]  # the segments' nodes (graph indices), in the plan's order
    one: simulate.Timeline  # one inference
    flow: simulate.Timeline  # a stream of STREAM_FRAMES frames
    # the placement's, the baselines' and the inter-op DP's run time: a measurement, not part of the plan
    scheduler_s: float


def make_plan(model: onnx.ModelProto, target, *, mode: str, inter_op: bool,
              as_imported: Callable[[], onnx.ModelProto] | None = None, rewritten: bool = False,
              approximations: list[dict] = (),
              with_approximations: Callable[[set[int]], onnx.ModelProto] | None = None,
              keep_on_cpu: tuple[str, ...] = ()) -> Scheduled:
    """Place every node of `model` (legalized: each node annotated with the devices that can run it)
    on a device of `target` by cost, for `mode` latency or throughput, and cut the segments.
    `as_imported` (the model before legalize's rewrites, annotated the same way: what `--no-rewrites`
    gives; loaded at most once) adds the vendors' baselines on it, where a vendor of the target's
    accelerators has rules: what their own compilers would do with the user's model. Where legalize
    `rewritten` the model, it is also placed as imported, and the plan is made of whichever of the two
    predicts faster (latency: one inference; throughput: frames/s), so legalize's rewrites never make
    a plan slower than `--no-rewrites` would; `decisions` says which and by how much. Per region: where
    the plan places every node of one of legalize's `approximations` (its report entries) on the CPU,
    the model is made again with that region as exported (`with_approximations(keep)`: the legalized
    model with only the approximations numbered `keep`), placed, and kept where it predicts faster.
    Last, every baseline is a candidate (`_baseline_candidates`): where one predicts better than that
    plan, on the mode's objective, its placement is the plan (`Plan.chosen`, `decisions`).

    `keep_on_cpu`: node names (the model's own, as the culprit search names them; an approximation's
    replaced nodes stand for all of its nodes) that no accelerator may run, in every model placed here
    and every candidate: kept in float on the CPU (`cpu_only`). The plan is made a second time without
    them, and `Plan.keep_on_cpu` records the pinned nodes, where they landed, and both predictions: what
    the constraint costs. A name that is no node of `model` is refused (`schedule.keep-on-cpu-unknown`)."""
    if keep_on_cpu:
        _known(model, keep_on_cpu, approximations)
        free = make_plan(model, target, mode=mode, inter_op=inter_op, as_imported=as_imported, rewritten=rewritten,
                         approximations=approximations, with_approximations=with_approximations)
    load = functools.cache(as_imported) if as_imported is not None else None
    t0 = time.perf_counter()

    def pinned(m: onnx.ModelProto) -> frozenset[str]:
        return cpu_only(m, keep_on_cpu, approximations)

    best = _Candidate.of(model, target, mode, pinned(model))
    choice = []
    if approximations and with_approximations is not None:
        on_cpu = _approximations_on_cpu(best, approximations)
        if on_cpu:
            keep = set(range(len(approximations))) - on_cpu
            exact = with_approximations(keep)
            fewer = _Candidate.of(exact, target, mode, pinned(exact))
            best, said = _faster(best, fewer, mode, "legalize's approximations",
                                 f"with approximation(s) {', '.join(map(str, sorted(on_cpu)))} (all their nodes on the "
                                 f"cpu) left as exported", "keeps them approximated on the cpu", "leaves them exact")
            choice.append(said)
    if rewritten and load is not None:
        best, said = _with_or_without_rewrites(best, _Candidate.of(load(), target, mode, pinned(load())), mode)
        choice.append(said)
    # every baseline is a candidate, finished and costed exactly as the plan is; the best one is the plan
    ours = _finish(best, target, mode, inter_op)
    costed, candidates = _baseline_candidates(best, load, target, mode, inter_op, ours, pinned)
    won, winner = _best_of(ours, candidates, mode)
    scheduler_s = time.perf_counter() - t0
    if winner:
        choice.append(_said(winner, won, ours, mode))
    best, placed, par, one, stream = won.candidate, won.placed, won.par, won.one, won.stream
    model, shapes, consts, cpu_backend = best.model, best.shapes, best.consts, best.cpu_backend
    placed_ = best.placed
    chosen, problem, maps = placed_.spans, placed_.problem, placed_.replicas
    probes = logit_probes(model)
    segments, models = cut(model, par.runs, problem, shapes, consts, probes)
    segments = shared(segments, models)
    plan = Plan(
        target=target.name, mode=mode,
        inputs=tuple(i.name for i in model.graph.input if i.name not in consts),
        outputs=tuple(o.name for o in model.graph.output), probes=probes,
        segments=segments,
        pipeline_stages=_pipeline_stages(mode, chosen, segments, cpu_backend, problem.weights_bytes),
        parallel_steps=tuple(tuple(st) for st in par.steps),
        inter_op=interop.summary(par, placed),
        predicted=_predicted(problem, placed, one, stream),
        utilization={k: round(v, 4) for k, v in stream.utilization.items()},
        cost_model=COST_MODEL, search=_search(mode, placed_.how, len(maps)),
        baselines=costed,
        placement=placement_counts(par.runs),
        decisions=tuple(choice + _decisions(problem, chosen)),
        caches=_caches(problem, target, chosen, segments, placed_.rounds, maps),
        replicas=maps,
        chosen=_chosen(won, winner, ours, candidates, mode),
    )
    if keep_on_cpu:
        plan = replace(plan, keep_on_cpu=_kept(plan, pinned(model), keep_on_cpu, free.plan))
    return Scheduled(plan, models, annotate(model, par.runs), problem, tuple(par.runs), one, stream, scheduler_s)


REPLICA_GAIN = 0.02  # a replicated stream must predict this much more frames/s than the plan alone


@dataclass(frozen=True)
class _Candidate:
    """A model placed: the legalized one, or the one as imported (`placed` None: its problem built only)."""

    model: onnx.ModelProto
    shapes: dict
    consts: set
    built: Problem
    cpu_backend: list[str]
    placed: "_Placed | None"

    @staticmethod
    def of(model: onnx.ModelProto, target, mode: str, cpu_only: frozenset[str] = frozenset()) -> "_Candidate":
        unplaced = _Candidate.unplaced(model, target, cpu_only)
        return replace(unplaced, placed=_place(unplaced.built, mode))

    @staticmethod
    def unplaced(model: onnx.ModelProto, target, cpu_only: frozenset[str] = frozenset()) -> "_Candidate":
        """The model's problem built, nothing placed yet (`placed` None); the nodes named in `cpu_only` on
        the host alone."""
        shapes, consts = irm.static_shapes(model), irm.constant_names(model)
        built, cpu_backend = build_problem(model, target, shapes, consts, cpu_only)
        return _Candidate(model, shapes, consts, built, cpu_backend, None)

    def placed_as(self, spans, maps: tuple[dict[str, str], ...], how: str) -> "_Candidate":
        """This model with a placement given (a baseline's), priced by the caches it and its replicas load."""
        plans = [list(spans), *(replicate(spans, m) for m in maps)]
        return replace(self, placed=_Placed(list(spans), how, tuple(maps), cache.recost(self.built, plans), ()))


def _with_or_without_rewrites(legalized: _Candidate, imported: _Candidate, mode: str) -> tuple[_Candidate, str]:
    """Whichever of the legalized model and the model as imported (`--no-rewrites`) predicts faster, and the
    decision in words with both figures."""
    return _faster(legalized, imported, mode, "legalize's rewrites", "the model as imported (no rewrites)",
                   "keeps the rewrites", "places the model as imported, every op as the user exported it "
                   "(what --no-rewrites gives)")


def _faster(ours: _Candidate, other: _Candidate, mode: str, our_name: str, other_name: str, keep: str, take: str
            ) -> tuple[_Candidate, str]:
    """Whichever of two placed candidates predicts faster (a tie keeps `ours`), and why, with both figures."""
    a, b = _score(ours.placed, mode), _score(other.placed, mode)
    shown = ((lambda v: f"{v:.3f} ms per inference") if mode == "latency" else (lambda v: f"{-v:.1f} frames/s"))
    said = f"{our_name} predict {shown(a)}, {other_name} {shown(b)}: the plan "
    return (other, said + take) if b < a else (ours, said + keep)


def cpu_only(model: onnx.ModelProto, names, approximations: list[dict] = ()) -> frozenset[str]:
    """The nodes of `model` (`irm.node_name`) that `names` keep on the CPU: each named node, and every node
    of an approximation whose replaced nodes are named (its nodes' names start with its `prefix`)."""
    if not names:
        return frozenset()
    wanted = set(names)
    prefixes = tuple(e["prefix"] for e in approximations if e.get("prefix") and wanted & set(e.get("nodes", ())))
    return frozenset(name for i, n in enumerate(model.graph.node) for name in [irm.node_name(n, i)]
                     if name in wanted or (prefixes and name.startswith(prefixes)))


def _known(model: onnx.ModelProto, names, approximations: list[dict]) -> None:
    """Refuse a name to keep on the CPU that is no node of `model` and no approximation's replaced node."""
    have = {irm.node_name(n, i) for i, n in enumerate(model.graph.node)}
    have |= {x for e in approximations for x in e.get("nodes", ())}
    unknown = [n for n in names if n not in have]
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise UsageError("schedule.keep-on-cpu-unknown",
                         f"--keep-on-cpu names {len(unknown)} node(s) the model does not have: {shown}",
                         "give the model's own node names, as the accuracy gate's culprits and `edgesdk check --json` "
                         "name them")


def _kept(plan: Plan, pinned: frozenset[str], names, free: Plan) -> dict:
    """`Plan.keep_on_cpu`: the names asked, each pinned node's segment (on the CPU), and the predicted figures
    with and without the constraint (`cost_ms`: what keeping them off the accelerators costs one inference)."""
    where = {n: s.id for s in plan.segments for n in s.nodes if n in pinned}
    with_, without = plan.predicted, free.predicted
    return {"nodes": sorted(set(names)), "segments": dict(sorted(where.items())),
            "predicted": {"latency_ms": with_["latency_ms"], "latency_ms_without": without["latency_ms"],
                          "cost_ms": round(with_["latency_ms"] - without["latency_ms"], 4),
                          "throughput_fps": with_["throughput_fps"],
                          "throughput_fps_without": without["throughput_fps"]}}


def _approximations_on_cpu(candidate: _Candidate, approximations: list[dict]) -> set[int]:
    """The approximations (positions in legalize's report) whose nodes the candidate's plan all puts on the
    cpu (an approximation's nodes are named with its `prefix`; one whose nodes the graph optimizations
    removed is not counted)."""
    device = {candidate.built.nodes[k]: d for i, j, d in candidate.placed.spans for k in range(i, j)}
    out = set()
    for k, e in enumerate(approximations):
        mine = [d for name, d in device.items() if e.get("prefix") and name.startswith(e["prefix"])]
        if mine and all(d == "cpu" for d in mine):
            out.add(k)
    return out


@dataclass(frozen=True)
class _Placed:
    spans: list                         # the chosen (start, stop, device) spans
    how: str                            # "latency" (the placement DP), "pipeline" (the pipelining DP), "moved"
    replicas: tuple[dict[str, str], ...]  # device maps of the replicas that take frames in turn (throughput)
    problem: Problem                    # priced by the caches of the plan and its replicas
    rounds: tuple                       # the place-and-recost rounds (`cache.place`)


def _place(built: Problem, mode: str) -> _Placed:
    """The chosen spans by place-and-recost (`cache.place`) over the DPs' candidates (latency: the
    placement DP; throughput: the pipelining DP and the latency plan streamed, each also replicated where
    that streams faster), and how they were found."""
    how: dict[tuple, str] = {}
    replicated: dict[tuple, tuple] = {}

    def placer(view: Problem) -> list[list]:
        latency_plan = [tuple(s) for s in placement.place(view).segments]
        how.setdefault(tuple(latency_plan), "latency")
        if mode != "throughput":
            return [latency_plan]
        # The pipelining DP gives each device one contiguous stage. A graph whose CPU-only ops are spread
        # out (a captioner's frame split, RepeatVector and vocabulary Dense) then puts almost everything on
        # the CPU; the latency plan, streamed (devices holding several segments), can do better.
        stages = [tuple(s) for s in pipelining.pipeline(view).stages]
        how.setdefault(tuple(stages), "pipeline")
        return [stages, latency_plan]

    def objective(priced: Problem, spans: list) -> float:
        if mode != "throughput":
            return simulate.one_inference(priced, spans).makespan_ms
        fps = flow(priced, [spans]).throughput_fps
        maps = replica_maps(built, spans)
        if maps:
            copies = [replicate(spans, m) for m in maps]
            both = flow(cache.recost(built, [spans, *copies]), [spans, *copies]).throughput_fps
            if both > fps * (1 + REPLICA_GAIN):
                replicated[tuple(spans)] = tuple(maps)
                return -both
        replicated.pop(tuple(spans), None)
        return -fps

    try:
        placed = cache.place(built, placer, objective)
    except ValueError as e:  # a node no device can run: legalize refuses these first, so a bug here
        raise UserError("schedule.infeasible", str(e), "run `edgesdk check` to see which device can run what") from None
    key = tuple(placed.plan)
    objective(placed.problem, placed.plan)        # the chosen plan's replication decided last
    maps = replicated.get(key, ())
    problem = cache.recost(built, [placed.plan, *(replicate(placed.plan, m) for m in maps)]) if maps else placed.problem
    return _Placed(placed.plan, how.get(key, "moved"), maps, problem, placed.rounds)


def _score(placed: "_Placed", mode: str) -> float:
    """A placement's objective, lower better: one inference's ms, or minus a stream's frames/s."""
    if mode == "latency":
        return simulate.one_inference(placed.problem, placed.spans).makespan_ms
    return -flow(placed.problem, [placed.spans, *(replicate(placed.spans, m) for m in placed.replicas)]).throughput_fps


def replica_maps(problem: Problem, spans) -> list[dict[str, str]]:
    """Device maps of a plan's replicas: for each accelerator kind with several instances, replica k moves
    instance i's segments to instance i + k (mod their count), k = 1 .. count - 1 (two Edge TPUs: the plan
    with edgetpu:0 and edgetpu:1 swapped). None where the plan uses no such kind."""
    kinds: dict[str, list[str]] = {}
    for d in problem.devices:
        if d != "cpu":
            kinds.setdefault(problem.kind(d), []).append(d)
    used = {problem.kind(d) for _, _, d in spans if d != "cpu"}
    count = max((len(kinds[k]) for k in used), default=1)
    return [{d: ids[(i + k) % len(ids)] for kind in used for ids in [kinds[kind]] for i, d in enumerate(ids)}
            for k in range(1, count)]


def replicate(spans, device_map: dict[str, str]) -> list:
    """The spans with each device moved by `device_map` (a replica of the plan)."""
    return [(i, j, device_map.get(d, d)) for i, j, d in spans]


def flow(problem: Problem, plans: list, durations: dict[int, float] | None = None) -> simulate.Timeline:
    """A stream of `STREAM_FRAMES` frames through `plans` (a plan, or a plan and replicas taking frames in
    turn) as the bundle's runtime streams it (`simulate.worker_stream`: one worker per device, a
    segment started as soon as its inputs are ready, the runtime's default depth of one frame in
    flight per device plus one). `durations` (segment index -> ms) apply to the first plan."""
    runs = [simulate.tasks(problem, plan, durations if k == 0 else None) for k, plan in enumerate(plans)]
    devices = {t.device for run in runs for t in run}
    return simulate.worker_stream(runs, STREAM_FRAMES, len(devices) + 1)


def _caches(problem: Problem, target, chosen, segments: tuple[PlanSegment, ...], rounds,
            maps: tuple[dict[str, str], ...] = ()) -> dict:
    """The plan's record of each cached instance it uses (`cache.summary`) with its replicas (`maps`), its
    segments in cache priority (the order the package co-compiles them in; a replica's segment as
    `<id>.r<k>`, `Plan.replica_segments`), and the place-and-recost rounds."""
    scale, source = {}, {}
    for m in registry.accelerators({d.kind for d in target.devices}):
        if hasattr(m, "cache"):
            spec = m.cache(target.device(m.kind))
            scale.update(dict.fromkeys(target.logical_ids(m.kind), spec.stored_per_byte))
            source.update(dict.fromkeys(target.logical_ids(m.kind), spec.source))
    if not scale:
        return {}
    by_first = {s.nodes[0]: s.id for s in segments if s.nodes}
    named = [(tuple(s), by_first[problem.nodes[s[0]]]) for s in chosen]
    for k, m in enumerate(maps, 1):
        named += [(span, f"{sid}.r{k}") for (i, j, d), sid in named[:len(chosen)] if d in m
                  for span in [(i, j, m[d])]]
    copies = [replicate(chosen, m) for m in maps]
    instances = cache.summary(problem, [chosen, *copies], scale, source)
    for d, record in instances.items():
        mine = [(span, sid) for span, sid in named if span[2] == d]
        record["compile_order"] = [mine[k][1] for k in cache.priority(problem, [span for span, _ in mine])]
    return {"instances": instances, "search": "place-and-recost (scheduling/cache.py): each plan priced with "
            "each instance holding the distinct weights placed on it",
            "rounds": [{"start": name, "round": r, "objective": score} for name, r, score in rounds]}


def _spans(placed: list[PlannedSegment]) -> list[tuple[int, int, str]]:
    return [(r.nodes[0], r.nodes[-1] + 1, r.device) for r in placed]


def _simulate(problem: Problem, placed: list[PlannedSegment], par: interop.InterOp,
              maps: tuple[dict[str, str], ...] = ()):
    """One inference and a stream (with the plan's replicas taking frames in turn), played on the
    placement's runs; a CPU run scheduled for inter-operator parallelism takes its parallel plan's time."""
    durations = {i: p.ms for i, p in par.plans.items()}
    spans = _spans(placed)
    return (simulate.one_inference(problem, spans, durations),
            flow(problem, [spans, *(replicate(spans, m) for m in maps)], durations))


def _predicted(problem: Problem, placed: list[PlannedSegment], one, flow) -> dict[str, float]:
    sequential = placement.sequential_ms(problem, placement.Plan(tuple(placement.Span(*s) for s in _spans(placed)), 0.0))
    return {"latency_ms": round(one.makespan_ms, 4), "throughput_fps": round(flow.throughput_fps, 2),
            "sequential_ms": round(sequential, 4)}


def _pipeline_stages(mode: str, chosen, segments: tuple[PlanSegment, ...], cpu_backend: list[str],
                     weights_bytes: tuple[int, ...]):
    """Segment ids per stage of a stream: in throughput mode a stage is a device's contiguous range (its
    CPU backend pieces run as one stage); in latency mode each segment is a stage."""
    if mode != "throughput":
        return tuple((s.id,) for s in segments)
    ids = iter(s.id for s in segments)
    return tuple(tuple(next(ids) for _ in split_by_backend([stage], cpu_backend, weights_bytes)) for stage in chosen)


def _search(mode: str, how: str, replicas: int) -> str:
    caches = ("; placed and recosted with each Edge TPU holding the weights placed on it (scheduling/cache.py)")
    if mode == "latency":
        text = ("contiguous segments of the graph's topological order, one device each; optimal for the "
                "sequential latency under the costs it was placed on (placement DP)")
    elif how == "latency":
        text = ("the latency plan streamed (each device running its segments in turn): its simulated "
                "frames/s beat the pipelining DP's (contiguous stages on distinct devices)")
    elif how == "pipeline":
        text = ("contiguous stages on distinct devices; optimal for the slowest stage (pipelining DP), and "
                "faster in the simulated stream than the latency plan")
    elif how.startswith(BASELINE):
        text = (f"the placement of the baseline '{how[len(BASELINE):]}', predicted better than the scheduler's own "
                "plan on the same cost model (a baseline is a candidate; `chosen` gives both figures)")
    else:
        text = "a DP's plan with segments moved or split between the accelerators, faster in the simulated stream"
    if replicas and how.startswith(BASELINE):
        text += f"; replicated: {replicas + 1} copies with the accelerators rotated take frames in turn"
    elif replicas:
        text += (f"; replicated: {replicas + 1} copies with the accelerators swapped take frames in turn, "
                 f"more than {REPLICA_GAIN:.0%} faster in the simulated stream than one")
    return text + caches


def _decisions(problem: Problem, segments) -> list[str]:
    """Accelerator-capable runs the plan leaves on the CPU, and why: the cost both ways."""
    out = []
    for start, stop, device in segments:
        if device != "cpu":
            continue
        n = start
        while n < stop:
            accel = next((d for d in problem.devices[1:] if problem.can(n, d)), None)
            if accel is None:
                n += 1
                continue
            end = n
            while end < stop and problem.can(end, accel):
                end += 1
            cpu = placement.segment_ms(problem, n, end, "cpu")
            acc = placement.segment_ms(problem, n, end, accel)
            out.append(f"{end - n} node(s) ({problem.nodes[n]}..{problem.nodes[end - 1]}) stay on the cpu: "
                       f"{cpu:.3f} ms there, {acc:.3f} ms on {accel} with its link transfers, "
                       "or the plan around them is cheaper so")
            n = end
    return out


def _rule_plans(problem: Problem, target, *, vendors_only: bool = False) -> dict[str, list | str]:
    """The documented rules (all on the CPU, greedy, each accelerator vendor's; `vendors_only`: the
    vendors' alone) applied to `problem`: name -> the rule's plans (one plan; a vendor's data-parallel
    advice, the model on each of several instances, a plan per instance, frames dealt to them in turn),
    or why the rule cannot place the graph."""
    rules, copies = _vendor_rules(target)
    if not vendors_only:
        rules = {"all on the cpu": baselines.all_cpu, "greedy (first capable accelerator)": baselines.greedy, **rules}
    out: dict[str, list | str] = {}
    for name, rule in rules.items():
        try:
            out[name] = [rule(problem)]
        except ValueError as e:
            out[name] = str(e)
    for name, (rule, ids) in copies.items():
        try:
            out[name] = rule(problem, ids)
        except ValueError as e:
            out[name] = str(e)
    return out


BASELINE = "baseline: "   # `_Placed.how` of a baseline's placement taken as the plan, before its name


@dataclass(frozen=True)
class _Finished:
    """A candidate carried through to what the plan would run: its spans split by backend, CPU runs
    re-scheduled for inter-operator parallelism (latency mode), one inference and a stream simulated."""

    candidate: _Candidate
    placed: list[PlannedSegment]
    par: interop.InterOp
    one: simulate.Timeline
    stream: simulate.Timeline

    def score(self, mode: str) -> float:
        """The mode's objective, lower better: one inference's ms, or minus a stream's frames/s."""
        return self.one.makespan_ms if mode == "latency" else -self.stream.throughput_fps

    def predicted(self) -> dict[str, float]:
        return _predicted(self.candidate.placed.problem, self.placed, self.one, self.stream)


def _finish(candidate: _Candidate, target, mode: str, inter_op: bool) -> _Finished:
    p = candidate.placed
    placed = split_by_backend(p.spans, candidate.cpu_backend, p.problem.weights_bytes)
    par = interop.parallelize(placed, p.problem, candidate.model, target, candidate.shapes, candidate.consts,
                              mode == "latency" and inter_op)
    one, stream = _simulate(p.problem, placed, par, p.replicas)
    return _Finished(candidate, placed, par, one, stream)


def _as_replicas(problem: Problem, plans: list) -> tuple[dict[str, str], ...] | None:
    """The device maps (`replica_maps`' rotations, the form a plan's `replicas` take) under which plans[1:]
    are copies of plans[0], or None where they are not (the runtime deals frames only over such copies)."""
    first, rest = [tuple(s) for s in plans[0]], plans[1:]
    if not rest:
        return ()
    maps = replica_maps(problem, first)
    if len(maps) == len(rest) and all(replicate(first, m) == [tuple(s) for s in p] for m, p in zip(maps, rest)):
        return tuple(maps)
    return None


def _baseline_candidates(ours: _Candidate, load: Callable[[], onnx.ModelProto] | None, target, mode: str,
                         inter_op: bool, finished: _Finished,
                         pinned: Callable[[onnx.ModelProto], frozenset[str]] = lambda m: frozenset()
                         ) -> tuple[dict[str, dict], dict[str, _Finished | str]]:
    """Each baseline's reported figures ({name: figures}, or {"error": why} where its rule cannot place the
    graph), and the baselines as candidates ({name: finished}, or why it cannot be a plan). A baseline is
    finished like the plan (`_finish`): its figures are what the plan would predict with its placement.
    The vendors' rules are applied to the model as imported too (`AS_IMPORTED` after each name); a
    placement the scheduler's own plan already has is not finished twice. In latency mode a replicated
    baseline is a candidate without its replicas (one inference runs the first copy only)."""
    rules = {name: (ours, plans) for name, plans in _rule_plans(ours.built, target).items()}
    if load is not None and any(_vendor_rules(target)):
        imported = _Candidate.unplaced(load(), target, pinned(load()))
        rules.update({name + AS_IMPORTED: (imported, plans)
                      for name, plans in _rule_plans(imported.built, target, vendors_only=True).items()})
    seen = {(id(ours.model), tuple(map(tuple, ours.placed.spans)), _key(ours.placed.replicas)): finished}
    costed: dict[str, dict] = {}
    candidates: dict[str, _Finished | str] = {}
    for name, (model, plans) in rules.items():
        if isinstance(plans, str):
            costed[name] = {"error": plans}
            continue
        spans = [tuple(s) for s in plans[0]]
        maps = _as_replicas(model.built, plans)
        reported = _finished(seen, model, spans, maps or (), BASELINE + name, target, mode, inter_op)
        figures = {**reported.predicted(), "segments": len(spans)}
        costed[name] = {**figures, "replicas": len(plans)} if len(plans) > 1 else figures
        if maps is None:
            candidates[name] = ("its copies are not the plan with the accelerators rotated, the only copies the "
                                "runtime deals frames to")
        elif mode == "latency" and maps:
            candidates[name] = _finished(seen, model, spans, (), BASELINE + name, target, mode, inter_op)
        else:
            candidates[name] = reported
    return costed, candidates


def _key(maps) -> tuple:
    return tuple(tuple(sorted(m.items())) for m in maps)


def _finished(seen: dict, model: _Candidate, spans: list, maps: tuple, how: str, target, mode: str,
              inter_op: bool) -> _Finished:
    key = (id(model.model), tuple(spans), _key(maps))
    if key not in seen:
        seen[key] = _finish(model.placed_as(spans, maps, how), target, mode, inter_op)
    return seen[key]


def _best_of(ours: _Finished, candidates: dict[str, _Finished | str], mode: str) -> tuple[_Finished, str]:
    """The candidate predicted best (a baseline only where strictly better: a tie keeps the scheduler's
    plan), and the winning baseline's name ("" for the scheduler's own)."""
    won, winner = ours, ""
    for name, c in candidates.items():
        if not isinstance(c, str) and c.score(mode) < won.score(mode):
            won, winner = c, name
    return won, winner


def _figure(f: _Finished, mode: str) -> tuple[str, float]:
    p = f.predicted()
    return ("latency_ms", p["latency_ms"]) if mode == "latency" else ("throughput_fps", p["throughput_fps"])


def _margin(better: float, worse: float, mode: str) -> float:
    """How much better, in per cent of the worse figure: less latency, or more frames/s."""
    if not worse:
        return 0.0
    return round(100 * ((worse - better) if mode == "latency" else (better - worse)) / worse, 2)


def _said(winner: str, won: _Finished, ours: _Finished, mode: str) -> str:
    key, theirs = _figure(won, mode)
    _, mine = _figure(ours, mode)
    unit = " ms per inference" if key == "latency_ms" else " frames/s"
    return (f"the baseline '{winner}' predicts {theirs:g}{unit}, the scheduler's own plan {mine:g}{unit}: the plan "
            f"takes the baseline's placement ({_margin(theirs, mine, mode):+.2f} %)")


OURS = "the scheduler's own plan"


def _chosen(won: _Finished, winner: str, ours: _Finished, candidates: dict[str, _Finished | str], mode: str) -> dict:
    """`Plan.chosen`: which candidate the plan is (the scheduler's own plan, or a baseline's placement) and
    its figure on the mode's objective; `versus`: the scheduler's own plan where a baseline won, else the
    best baseline, with its figure and the margin; any baseline that cannot be a plan, and why."""
    key, value = _figure(won, mode)
    out: dict = {"candidate": BASELINE + winner if winner else OURS, "objective": key, key: value}
    others = {BASELINE + n: c for n, c in candidates.items() if not isinstance(c, str)}
    versus = (OURS, ours) if winner else min(others.items(), key=lambda kv: kv[1].score(mode), default=None)
    if versus is not None:
        theirs = _figure(versus[1], mode)[1]
        out.update({"versus": versus[0], f"versus_{key}": theirs, "margin_percent": _margin(value, theirs, mode)})
    refused = {n: why for n, why in candidates.items() if isinstance(why, str)}
    if refused:
        out["not_candidates"] = refused
    return out


AS_IMPORTED = ", model as imported (no legalize rewrites)"


def _vendor_rules(target) -> tuple[dict, dict]:
    """The target's accelerator vendors' rules ({name: rule}) and data-parallel advice ({name: (rule,
    instance ids)}, for kinds with several instances)."""
    rules, copies = {}, {}
    for m in registry.accelerators({d.kind for d in target.devices}):
        ids = target.logical_ids(m.kind)
        rules.update(baselines.vendor_rules(m.kind, ids))
        if len(ids) > 1 and m.kind in baselines.VENDOR_REPLICATION:
            name, rule = baselines.VENDOR_REPLICATION[m.kind]
            copies[name] = (rule, ids)
    return rules, copies
