"""schedule: place every node on a device by cost, and cut the graph into segments.

Needs: the legalized model (every node annotated with the devices that can run it).
Guarantees: `plan.json` and one standalone ONNX model per segment under `segments/`, segments in
the graph's topological order (executing them in order is always valid); `schedule.html`, the
placement table, the baselines and Gantt charts of one inference and of a stream.

The graph becomes a numeric problem (`scheduling.graph`): each node's cost on each device that can
run it (`devices/cost.py`: a roofline of the target's figures plus per-op overhead), every tensor's
bytes, each accelerator's link. Then:

- `--mode latency`: the placement DP (`scheduling.placement`) finds, among all cuts of the node order
  into contiguous segments with one device each, the plan of least sequential latency (segments one
  after another, every tensor that changes device paying its link): optimal within that space.
- `--mode throughput`: the pipelining DP (`scheduling.pipelining`) picks contiguous stages on distinct
  devices (CPU stages allowed) that minimize the slowest stage.

- inter-operator parallelism (`--mode latency`, a CPU with more than one core and the target's
  `step_dispatch` figure): each CPU run is re-scheduled by the IOS-style DP of `scheduling.parallel`
  into stages whose independent groups run at once on worker threads; a stage of several groups
  becomes one segment per group, listed in the plan's `parallel_steps`. A plan is taken only when its
  predicted gain reaches `parallel.MIN_GAIN`; otherwise the run stays one segment and the plan's
  `inter_op.not_taken` says why. `--no-inter-op` turns it off.

The simulator (`scheduling.simulate`) plays the plan on the devices' queues and links (segments on
different devices overlap where the graph allows) for the predicted latency and the stream's frames/s.
The documented baselines (all on the CPU; Coral's default; Coral's parameter-count split over the
TPUs; greedy first-capable-accelerator) are costed and simulated beside it. A CPU segment is split by
backend (TVM, or onnxruntime for the ops TVM lacks).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from ...config import HOST
from ...devices import registry
from ...devices.cost import is_grouped, node_bytes, node_flops, node_ms, tensor_bytes
from ...errors import UserError
from ...ir import model as irm
from ...report.html import schedule_page
from ...scheduling import baselines, parallel, pipelining, placement, simulate
from ...scheduling.graph import build_problem
from ...scheduling.plan import Plan, PlanSegment
from ...scheduling.problem import Problem

OPTIONS = ("mode", "inter_op")
READS = ("legalize",)  # the earlier stages whose outputs it reads (its cache key covers them)
STREAM_FRAMES = 32  # frames the stream simulation plays to measure steady-state throughput


@dataclass
class PlannedSegment:
    """A segment the plan will cut: nodes of one device and backend (a parallel step's group carries its
    threads and time)."""

    device: str  # logical id
    backend: str
    nodes: list[int] = field(default_factory=list)
    threads: int = 0            # a group of a parallel step: its worker's threads (0: not one)
    predicted_ms: float = 0.0   # a group of a parallel step: its time on those threads


def run(artifact: Path, ctx) -> dict:
    model = onnx.load(str(artifact / "model.onnx"))
    g = model.graph
    shapes = irm.static_shapes(model)
    consts = irm.constant_names(model)
    problem, cpu_backend = build_problem(model, ctx.target, shapes, consts)

    t0 = time.perf_counter()
    try:
        latency_plan = list(placement.place(problem).segments)
        chosen, streamed = latency_plan, False
        if ctx.options.mode == "throughput":
            chosen = list(pipelining.pipeline(problem).stages)
            # The pipelining DP gives each device one contiguous stage. A graph whose CPU-only ops are
            # spread out (a captioner's frame split, RepeatVector and vocabulary Dense) then puts almost
            # everything on the CPU; the latency plan, streamed (devices holding several segments),
            # can do better. Keep whichever the simulated stream runs faster.
            fps = [simulate.stream(problem, plan, STREAM_FRAMES).throughput_fps for plan in (chosen, latency_plan)]
            if fps[1] > fps[0]:
                chosen, streamed = latency_plan, True
    except ValueError as e:  # a node no device can run: legalize refuses these first, so a bug here
        raise UserError("schedule.infeasible", str(e), "run `edgesdk check` to see which device can run what") from None
    scheduler_s = time.perf_counter() - t0
    placed = _split_by_backend(chosen, cpu_backend)
    decisions = _decisions(problem, chosen)
    t1 = time.perf_counter()
    runs, steps, inter_op, not_taken = _parallelize(placed, problem, model, ctx.target, shapes, consts,
                                                    ctx.options.mode == "latency" and ctx.options.inter_op)
    scheduler_s += time.perf_counter() - t1

    graph_inputs = [i.name for i in g.input if i.name not in consts]
    graph_outputs = [o.name for o in g.output]
    probes = _logit_probes(model)
    consumers: dict[str, set[int]] = {}
    for r_i, r in enumerate(runs):
        for n in r.nodes:
            for t in g.node[n].input:
                if t and t not in consts:
                    consumers.setdefault(t, set()).add(r_i)

    (ctx.out / "segments").mkdir()
    segments = []
    for r_i, r in enumerate(runs):
        produced = [t for n in r.nodes for t in g.node[n].output if t]
        produced_set = set(produced)
        inputs: list[str] = []
        for n in r.nodes:
            for t in g.node[n].input:
                if t and t not in consts and t not in produced_set and t not in inputs:
                    inputs.append(t)
        outputs = [t for t in produced if t in graph_outputs or t in probes.values()
                   or any(c != r_i for c in consumers.get(t, ()))]
        seg_id = f"s{r_i}"
        seg = irm.extract_segment(model, r.nodes, inputs, outputs)
        for node in seg.graph.node:
            irm.set_meta(node, irm.DEVICE_KEY, r.device)
        irm.save(seg, ctx.out / "segments" / f"{seg_id}.onnx")
        ms = (placement.segment_ms(problem, r.nodes[0], r.nodes[-1] + 1, r.device) if r.threads == 0 else
              r.predicted_ms)
        segments.append(PlanSegment(
            seg_id, r.device, r.backend, f"segments/{seg_id}.onnx", tuple(irm.node_name(g.node[n], n) for n in r.nodes),
            tuple(inputs), tuple(outputs), sum(node_flops(g.node[n], shapes) for n in r.nodes), irm.param_bytes(seg),
            round(ms, 4), r.threads))
    device_of = {n: r.device for r in runs for n in r.nodes}
    for node_i, node in enumerate(g.node):
        irm.set_meta(node, irm.DEVICE_KEY, device_of[node_i])
    irm.save(model, ctx.out / "model.onnx")

    # the simulator sees the placement's runs; a CPU run scheduled for inter-operator parallelism takes
    # its parallel plan's time
    plan_segments = [(r.nodes[0], r.nodes[-1] + 1, r.device) for r in placed]
    durations = {i: p.ms for i, p in inter_op.items()}
    one = simulate.one_inference(problem, plan_segments, durations)
    flow = simulate.stream(problem, plan_segments, STREAM_FRAMES, durations=durations)
    if ctx.options.mode == "throughput":
        # a stage is a device's contiguous range: its CPU backend pieces run as one stage
        ids = iter(s.id for s in segments)
        stages = [[next(ids) for r in _split_by_backend([stage], cpu_backend)] for stage in chosen]
    else:
        stages = [[s.id] for s in segments]
    compared = _baselines(problem, ctx.target)
    plan = Plan(
        target=ctx.target.name, mode=ctx.options.mode,
        inputs=tuple(graph_inputs), outputs=tuple(graph_outputs), probes=probes,
        segments=tuple(segments),
        pipeline_stages=tuple(tuple(st) for st in stages),
        parallel_steps=tuple(tuple(st) for st in steps),
        inter_op=_inter_op_summary(inter_op, not_taken, placed),
        predicted={"latency_ms": round(one.makespan_ms, 4), "throughput_fps": round(flow.throughput_fps, 2),
                   "sequential_ms": round(placement.sequential_ms(problem, placement.Plan(
                       tuple(placement.Span(*s) for s in plan_segments), 0.0)), 4)},
        utilization={k: round(v, 4) for k, v in flow.utilization.items()},
        cost_model="per node: roofline of the target's figures plus per-op overhead; per tensor that changes "
                   "device: the link (devices/cost.py); every figure names its source in the target file",
        search=("contiguous segments of the graph's topological order, one device each; optimal for the "
                "sequential latency (placement DP)" if ctx.options.mode == "latency" else
                "the latency plan streamed (each device running its segments in turn): its simulated "
                "frames/s beat the pipelining DP's (contiguous stages on distinct devices)" if streamed else
                "contiguous stages on distinct devices; optimal for the slowest stage (pipelining DP), and "
                "faster in the simulated stream than the latency plan"),
        baselines=compared,
        placement=_placement_counts(runs),
        decisions=tuple(decisions),
    )
    text = plan.to_json()
    (ctx.out / "plan.json").write_text(text)
    # the scheduler's run time is a measurement, not part of the plan: the bundle stays byte-reproducible
    _html_report(ctx.out / "schedule.html", {**json.loads(text), "scheduler_s": round(scheduler_s, 4)}, model,
                 problem, runs, one, flow)
    for s in segments:
        ctx.log(f"schedule: {s.id} {s.device:<10} {s.backend:<11} {len(s.nodes):4d} nodes "
                f"{s.predicted_ms:8.3f} ms predicted")
    for name, b in compared.items():
        ctx.log(f"schedule: baseline {name}: " + (f"{b['latency_ms']:.3f} ms, {b['throughput_fps']:.1f} frames/s"
                                                 if "error" not in b else f"not applicable ({b['error']})"))
    for r in plan.inter_op.get("runs", ()):
        ctx.log(f"schedule: inter-operator parallelism: {r['nodes']} cpu nodes in {r['stages']} stages, "
                f"{r['parallel_stages']} of them concurrent groups: {r['sequential_ms']:.3f} -> "
                f"{r['parallel_ms']:.3f} ms predicted")
    for r in plan.inter_op.get("not_taken", ()):
        if r["parallel_stages"]:  # concurrent groups were found, and they were not worth it
            ctx.log(f"schedule: {r['nodes']} cpu nodes stay one segment, {r['reason']} "
                    f"({r['sequential_ms']:.3f} -> {r['parallel_ms']:.3f} ms predicted)")
    ctx.log(f"schedule: placed {len(g.node)} nodes in {scheduler_s:.3f} s")
    return {"segments": len(segments), "placement": plan.placement, "predicted": plan.predicted,
            "baselines": compared, "scheduler_s": round(scheduler_s, 4), "decisions": decisions,
            "inter_op": {k: v for k, v in plan.inter_op.items() if k != "search"}}


def _split_by_backend(segments, cpu_backend: list[str]) -> list[PlannedSegment]:
    runs: list[PlannedSegment] = []
    for start, stop, device in segments:
        kind = device.split(":")[0]
        for n in range(start, stop):
            # the host's backend is chosen per node by legalize; an accelerator's is its model's first
            backend = cpu_backend[n] if kind == HOST else registry.model(kind).backends[0]
            if runs and runs[-1].device == device and runs[-1].backend == backend and runs[-1].nodes[-1] == n - 1:
                runs[-1].nodes.append(n)
            else:
                runs.append(PlannedSegment(device, backend, [n]))
    return runs


def _parallelize(placed: list[PlannedSegment], problem: Problem, model: onnx.ModelProto, target, shapes, consts,
                 enabled: bool) -> tuple[list[PlannedSegment], list[list[str]], dict[int, parallel.ParallelPlan],
                                         dict[int, tuple[parallel.ParallelPlan, str]]]:
    """Re-schedule each CPU run into stages of concurrent groups (`scheduling.parallel`).

    Returns the runs (a taken parallel stage's groups become runs of their own, next to each other),
    the parallel steps as segment ids, the parallel plan per placed run that takes one, and per placed
    run that the DP saw and that stays one segment, its best plan and why (`parallel.refusal`)."""
    cpu = target.host
    dispatch = cpu.step_dispatch
    if not enabled or cpu.cores < 2 or dispatch is None:
        return placed, [], {}, {}
    g = model.graph
    terms = [(node_flops(n, shapes), *node_bytes(n, shapes, consts), is_grouped(n)) for n in g.node]
    out_bytes = [sum(tensor_bytes(shapes.get(t)) for t in n.output if t) for n in g.node]
    producer = {t.name: t.producer for t in problem.tensors if t.producer is not None}

    def cost(n: int, threads: int) -> float:
        flops, params, acts, grouped = terms[n]
        return node_ms(target, "cpu", flops=flops, param_bytes=params, act_bytes=acts, grouped=grouped,
                       threads=threads)

    copy_ms_per_byte = 2e3 / (cpu.memory_bandwidth.value * 1e9)  # out of one segment, into the next
    memory_ms = [1e3 * (params + acts) / (cpu.memory_bandwidth.value * 1e9) for _, params, acts, _ in terms]
    runs: list[PlannedSegment] = []
    steps: list[list[str]] = []
    plans: dict[int, parallel.ParallelPlan] = {}
    not_taken: dict[int, tuple[parallel.ParallelPlan, str]] = {}
    for i, r in enumerate(placed):
        if r.device != "cpu" or len(r.nodes) < 3:
            runs.append(r)
            continue
        inside = set(r.nodes)
        preds = {n: frozenset(producer[t] for t in g.node[n].input if producer.get(t) in inside) for n in r.nodes}
        found = parallel.schedule(parallel.Run(tuple(r.nodes), preds,
                                               {n: out_bytes[n] * copy_ms_per_byte for n in r.nodes},
                                               {n: memory_ms[n] for n in r.nodes}),
                                  cost, cpu.cores, dispatch_ms=dispatch.value * 1e-3)
        why = parallel.refusal(found)
        if why is not None:
            not_taken[i] = found, why
            runs.append(r)
            continue
        plans[i] = found
        for st in found.stages:
            if not st.parallel:
                if runs and runs[-1].device == "cpu" and runs[-1].threads == 0 and runs[-1].backend == r.backend \
                        and runs[-1].nodes and runs[-1].nodes[-1] in inside:
                    runs[-1].nodes.extend(st.groups[0])
                else:
                    runs.append(PlannedSegment("cpu", r.backend, list(st.groups[0])))
                continue
            steps.append([f"s{len(runs) + k}" for k in range(len(st.groups))])
            for group, threads in zip(st.groups, st.threads):
                runs.append(PlannedSegment("cpu", r.backend, list(group), threads,
                                sum(cost(n, threads) for n in group)))
    return runs, steps, plans, not_taken


def _inter_op_summary(plans: dict[int, parallel.ParallelPlan], not_taken: dict[int, tuple[parallel.ParallelPlan, str]],
                      placed: list[PlannedSegment]) -> dict:
    if not plans and not not_taken:
        return {}

    def summary(i: int, p: parallel.ParallelPlan) -> dict:
        return {"nodes": len(placed[i].nodes), "sequential_ms": round(p.sequential_ms, 4),
                "parallel_ms": round(p.ms, 4), "stages": len(p.stages),
                "parallel_stages": sum(st.parallel for st in p.stages), "blocks": p.blocks, "split_blocks": p.splits}

    return {"runs": [summary(i, p) for i, p in sorted(plans.items())],
            "not_taken": [{**summary(i, p), "reason": f"inter-op parallelism not taken: {why}"}
                          for i, (p, why) in sorted(not_taken.items())],
            "min_gain": parallel.MIN_GAIN,
            "search": "sequences of stages inside blocks of at most 14 units of the run's topological order "
                      "(cut where fewest edges cross), units being linear clusters or single nodes (both solved, "
                      "the better kept); a stage's groups are its weakly connected components, at most one per "
                      "core; optimal within that space (IOS-style DP)"}


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


def _baselines(problem: Problem, target) -> dict[str, dict]:
    rules = {"all on the cpu": baselines.all_cpu, "greedy (first capable accelerator)": baselines.greedy}
    for m in registry.accelerators({d.kind for d in target.devices}):  # each vendor's documented rules
        rules.update(baselines.vendor_rules(m.kind, target.logical_ids(m.kind)))
    out = {}
    for name, rule in rules.items():
        try:
            segs = rule(problem)
        except ValueError as e:
            out[name] = {"error": str(e)}
            continue
        one = simulate.one_inference(problem, segs)
        flow = simulate.stream(problem, segs, STREAM_FRAMES)
        sequential = sum(placement.segment_ms(problem, *seg) for seg in segs)
        out[name] = {"latency_ms": round(one.makespan_ms, 4), "throughput_fps": round(flow.throughput_fps, 2),
                     "sequential_ms": round(sequential, 4), "segments": len(segs)}
    return out


def _placement_counts(runs: list[PlannedSegment]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.device] = counts.get(r.device, 0) + len(r.nodes)
    return counts


def _html_report(path: Path, plan: dict, model, problem: Problem, runs: list[PlannedSegment], one, flow) -> None:
    """The plan for people (`report.html.schedule_page`): the Gantt charts of one inference and of a
    stream, and per node its device, why, its predicted time and the bytes its outputs move."""
    charts = [(title, simulate.gantt(timeline, path.with_name(f"gantt_{name}.png"), title).read_bytes())
              for name, timeline, title in (("one", one, "one inference"),
                                            ("stream", flow, f"a stream of {STREAM_FRAMES} frames"))]
    device_of = {n: r.device for r in runs for n in r.nodes}
    moved = {}
    for t in problem.tensors:
        if t.producer is not None and any(device_of[c] != device_of[t.producer] for c in t.consumers):
            moved[t.producer] = moved.get(t.producer, 0) + t.nbytes
    rows = []
    for i, node in enumerate(model.graph.node):
        dev = device_of[i]
        caps = irm.get_meta(node, irm.CAPABLE_KEY) or ""
        reason = ("only the cpu can run it" if all(c.startswith("cpu") for c in caps.split(",")) else
                  "cheapest in the plan" if dev != "cpu" else "accelerator-capable, cheaper on the cpu in the plan")
        rows.append({"node": problem.nodes[i], "op": node.op_type, "device": dev, "reason": reason,
                     "ms": problem.node_ms(i, dev), "bytes_moved": moved.get(i, 0)})
    path.write_text(schedule_page(plan, rows, charts))


def _logit_probes(model: onnx.ModelProto) -> dict[str, str]:
    """output -> the tensor before its trailing Softmax: accuracy is judged on logits, not on a
    saturated softmax."""
    producers = {o: n for n in model.graph.node for o in n.output}
    probes = {}
    for out in model.graph.output:
        node = producers.get(out.name)
        if node is not None and node.op_type in ("Softmax", "LogSoftmax", "Sigmoid"):
            probes[out.name] = node.input[0]
    return probes
