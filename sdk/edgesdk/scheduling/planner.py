"""The schedule as one function: a legalized model and a target in, a `Plan` and its segments out.

`make_plan` builds the numeric problem (`graph.build_problem`), places the nodes (the placement DP
for latency; for throughput the pipelining DP or the latency plan streamed, whichever the simulated
stream runs faster), by place-and-recost over the accelerators' parameter caches (`cache.place`: each
plan priced with each instance holding the weights placed on it), splits CPU runs by backend, re-schedules CPU runs for inter-operator parallelism
(`interop`), cuts the segments (`segments`), simulates one inference and a stream of `STREAM_FRAMES`
frames (`simulate`), costs the documented baselines (`baselines`), and assembles the frozen `Plan`.
It reads and writes no file: the schedule stage writes what it returns.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import onnx

from ..devices import registry
from ..errors import UserError
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
    scheduler_s: float  # the placement's and the inter-op DP's run time: a measurement, not part of the plan


def make_plan(model: onnx.ModelProto, target, *, mode: str, inter_op: bool,
              as_imported: Callable[[], onnx.ModelProto] | None = None, rewritten: bool = False,
              approximations: list[dict] = (),
              with_approximations: Callable[[set[int]], onnx.ModelProto] | None = None) -> Scheduled:
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
    model with only the approximations numbered `keep`), placed, and kept where it predicts faster."""
    load = functools.cache(as_imported) if as_imported is not None else None
    t0 = time.perf_counter()
    best = _Candidate.of(model, target, mode)
    choice = []
    if approximations and with_approximations is not None:
        on_cpu = _approximations_on_cpu(best, approximations)
        if on_cpu:
            keep = set(range(len(approximations))) - on_cpu
            fewer = _Candidate.of(with_approximations(keep), target, mode)
            best, said = _faster(best, fewer, mode, "legalize's approximations",
                                 f"with approximation(s) {', '.join(map(str, sorted(on_cpu)))} (all their nodes on the "
                                 f"cpu) left as exported", "keeps them approximated on the cpu", "leaves them exact")
            choice.append(said)
    if rewritten and load is not None:
        best, said = _with_or_without_rewrites(best, _Candidate.of(load(), target, mode), mode)
        choice.append(said)
    model, shapes, consts, built, cpu_backend = best.model, best.shapes, best.consts, best.built, best.cpu_backend
    placed_ = best.placed
    chosen, problem, maps = placed_.spans, placed_.problem, placed_.replicas
    scheduler_s = time.perf_counter() - t0
    placed = split_by_backend(chosen, cpu_backend, problem.weights_bytes)
    t1 = time.perf_counter()
    par = interop.parallelize(placed, problem, model, target, shapes, consts, mode == "latency" and inter_op)
    scheduler_s += time.perf_counter() - t1
    probes = logit_probes(model)
    segments, models = cut(model, par.runs, problem, shapes, consts, probes)
    segments = shared(segments, models)
    one, stream = _simulate(problem, placed, par, maps)
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
        baselines={**_baselines(built, target), **_imported_baselines(load, target)},
        placement=placement_counts(par.runs),
        decisions=tuple(choice + _decisions(problem, chosen)),
        caches=_caches(problem, target, chosen, segments, placed_.rounds, maps),
        replicas=maps,
    )
    return Scheduled(plan, models, annotate(model, par.runs), problem, tuple(par.runs), one, stream, scheduler_s)


REPLICA_GAIN = 0.02  # a replicated stream must predict this much more frames/s than the plan alone


@dataclass(frozen=True)
class _Candidate:
    """A model placed: the legalized one, or the one as imported."""

    model: onnx.ModelProto
    shapes: dict
    consts: set
    built: Problem
    cpu_backend: list[str]
    placed: "_Placed"

    @staticmethod
    def of(model: onnx.ModelProto, target, mode: str) -> "_Candidate":
        shapes, consts = irm.static_shapes(model), irm.constant_names(model)
        built, cpu_backend = build_problem(model, target, shapes, consts)
        return _Candidate(model, shapes, consts, built, cpu_backend, _place(built, mode))


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
    else:
        text = "a DP's plan with segments moved or split between the accelerators, faster in the simulated stream"
    if replicas:
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


def _baselines(problem: Problem, target, *, vendors_only: bool = False) -> dict[str, dict]:
    """The documented rules (all on the CPU, greedy, each accelerator vendor's; `vendors_only`: the
    vendors' alone), costed and simulated on the same cost model, each plan priced by its own caches
    (`cache.recost`); a rule that cannot place the graph says why. A vendor's data-parallel advice (the
    model on each of several instances: each holds all its weights) is streamed with the frames dealt to
    the instances in turn."""
    rules, copies = _vendor_rules(target)
    if not vendors_only:
        rules = {"all on the cpu": baselines.all_cpu, "greedy (first capable accelerator)": baselines.greedy, **rules}
    out = {}
    for name, rule in rules.items():
        try:
            segs = rule(problem)
        except ValueError as e:
            out[name] = {"error": str(e)}
            continue
        out[name] = _costed(problem, segs)
    for name, (rule, ids) in copies.items():
        try:
            plans = rule(problem, ids)
        except ValueError as e:
            out[name] = {"error": str(e)}
            continue
        out[name] = {**_costed(problem, plans[0], plans[1:]), "replicas": len(plans)}
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


def _imported_baselines(load: Callable[[], onnx.ModelProto] | None, target) -> dict[str, dict]:
    """The vendors' rules on the model before legalize (`AS_IMPORTED` after each name); none, and the
    model not loaded, where it was not given or the target has no accelerator with rules of its vendor."""
    if load is None or not any(_vendor_rules(target)):
        return {}
    model = load()
    shapes, consts = irm.static_shapes(model), irm.constant_names(model)
    problem, _ = build_problem(model, target, shapes, consts)
    vendor = _baselines(problem, target, vendors_only=True)
    return {name + AS_IMPORTED: b for name, b in vendor.items()}


def _costed(problem: Problem, segs, replicas=()) -> dict:
    problem = cache.recost(problem, [segs, *replicas])
    one = simulate.one_inference(problem, segs)
    stream = flow(problem, [segs, *replicas])
    sequential = sum(placement.segment_ms(problem, *seg) for seg in segs)
    return {"latency_ms": round(one.makespan_ms, 4), "throughput_fps": round(stream.throughput_fps, 2),
            "sequential_ms": round(sequential, 4), "segments": len(segs)}
