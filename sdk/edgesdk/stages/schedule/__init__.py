"""schedule: place every node on a device by cost, and cut the graph into segments.

Needs: the legalized model (every node annotated with the devices that can run it).
Guarantees: `plan.json` and one standalone ONNX model per segment under `segments/`, segments in
the graph's topological order (executing them in order is always valid); `schedule.html`, the
placement table, the baselines and Gantt charts of one inference and of a stream.

The stage reads the model, calls `scheduling.planner.make_plan`, and writes what it returns
(`scheduling.explain` renders `schedule.html`). The planner's steps: the graph becomes a numeric
problem (`scheduling.graph`): each node's cost on each device that can run it (`devices/cost.py`: a
roofline of the target's figures plus per-op overhead), every tensor's bytes, each accelerator's link.
Then:

- `--mode latency`: the placement DP (`scheduling.placement`) finds, among all cuts of the node order
  into contiguous segments with one device each, the plan of least sequential latency (segments one
  after another, every tensor that changes device paying its link): optimal within that space.
- `--mode throughput`: the pipelining DP (`scheduling.pipelining`) picks contiguous stages on distinct
  devices (CPU stages allowed) that minimize the slowest stage.

- inter-operator parallelism (`--mode latency`, a CPU with more than one core and the target's
  `step_dispatch` figure): each CPU run is re-scheduled by the IOS-style DP of `scheduling.parallel`
  into stages whose independent groups run at once on worker threads (`scheduling.interop`); a stage
  of several groups becomes one segment per group, listed in the plan's `parallel_steps`. A plan is
  taken only when its predicted gain reaches `parallel.MIN_GAIN`; otherwise the run stays one segment
  and the plan's `inter_op.not_taken` says why. `--no-inter-op` turns it off.

The simulator (`scheduling.simulate`) plays the plan on the devices' queues and links (segments on
different devices overlap where the graph allows) for the predicted latency and the stream's frames/s.
The documented baselines (all on the CPU; Coral's default; Coral's parameter-count split over the
TPUs; Coral's data parallelism; greedy first-capable-accelerator) are costed and simulated beside it;
the vendor's rules also on the model as imported, none of legalize's rewrites (what Coral's compiler
alone gets). Each baseline is a candidate, costed exactly as the plan would be: where one predicts
better (latency, or frames/s in throughput mode), its placement is the plan, and `plan.json`'s
`chosen` says which candidate won and by how much. Where legalize rewrote the model, the model as imported is placed too, and the plan is made
of whichever predicts faster: legalize never makes a plan slower than `--no-rewrites`. Before that,
per region: an approximation whose nodes the plan puts all on the CPU is tried left as exported
(legalize's `exact.onnx` with the other approximations put back), and kept so where that is faster. Where the plan
still uses an approximation that moves a model output by more than `legalization.legalize.REFUSE_SHARE` of its range,
the build stops (`legalize.approximation-moves-output`). A CPU segment is split by
backend (TVM, or onnxruntime for the ops TVM lacks), and each segment is cut out of the graph as a
standalone model (`scheduling.segments`).

`--keep-on-cpu` and the accuracy remedy (`pipeline.build`, docs/accuracy.md) name nodes no accelerator may
run: the placement keeps them in float on the CPU, and `plan.json`'s `keep_on_cpu` records them, with the
predicted latency with and without that constraint and, for the remedy, why each was moved.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


from ...ir import model as irm
from ...legalization.legalize import annotated, refuse_moved_outputs, with_approximations
from ...report.text import chosen_line
from ...scheduling.explain import write_report
from ...scheduling.planner import make_plan

# keep_on_cpu: the nodes no accelerator may run; remedy: the accuracy remedy's rounds that pinned them (recorded)
OPTIONS = ("mode", "inter_op", "keep_on_cpu", "remedy")
# the earlier stages whose outputs it reads (its cache key covers them): the imported model too, for
# the vendors' rules on the model as a user has it (what their compilers alone would do)
READS = ("import", "legalize")


def run(artifact: Path, ctx) -> dict:
    model = irm.read(artifact / "model.onnx")
    legalized = json.loads((artifact / "legalize.json").read_text())
    scheduled = make_plan(model, ctx.target, mode=ctx.options.mode, inter_op=ctx.options.inter_op,
                          as_imported=lambda: annotated(irm.read(ctx.artifact("import") / "model.onnx"),
                                                        ctx.target),
                          rewritten=bool(legalized.get("rewrites") or legalized.get("approximations")),
                          approximations=legalized.get("approximations", []),
                          with_approximations=lambda keep: with_approximations(
                              irm.read(artifact / "exact.onnx"), legalized["approximations"], keep, ctx.target),
                          keep_on_cpu=ctx.options.keep_on_cpu)
    # an approximation that moves an output by more than legalize allows stops the build where the plan uses it
    refuse_moved_outputs(legalized.get("approximations", []), scheduled.model)
    plan = scheduled.plan
    if plan.keep_on_cpu:  # why each node is pinned: the accuracy remedy's rounds (pipeline.py), or the user's flag
        plan = dataclasses.replace(plan, keep_on_cpu={**plan.keep_on_cpu, "remedy": list(ctx.options.remedy)})
        scheduled = dataclasses.replace(scheduled, plan=plan)
    (ctx.out / "segments").mkdir()
    for s in plan.segments:
        irm.save(scheduled.segments[s.id], ctx.out / s.artifact)
    irm.save(scheduled.model, ctx.out / "model.onnx")
    (ctx.out / "plan.json").write_text(plan.to_json())
    write_report(scheduled, ctx.out / "schedule.html")
    _log(ctx, scheduled)
    return {"segments": len(plan.segments), "placement": plan.placement, "predicted": plan.predicted,
            "baselines": plan.baselines, "chosen": plan.chosen, "scheduler_s": round(scheduled.scheduler_s, 4),
            "decisions": list(plan.decisions), **({"keep_on_cpu": plan.keep_on_cpu} if plan.keep_on_cpu else {}),
            "inter_op": {k: v for k, v in plan.inter_op.items() if k != "search"}}


def _log(ctx, scheduled) -> None:
    plan = scheduled.plan
    for s in plan.segments:
        ctx.log(f"schedule: {s.id} {s.device:<10} {s.backend:<11} {len(s.nodes):4d} nodes "
                f"{s.predicted_ms:8.3f} ms predicted")
    for name, b in plan.baselines.items():
        ctx.log(f"schedule: baseline {name}: " + (f"{b['latency_ms']:.3f} ms, {b['throughput_fps']:.1f} frames/s"
                                                 if "error" not in b else f"not applicable ({b['error']})"))
    if line := chosen_line(plan.chosen):
        ctx.log(f"schedule: {line}")
    if kept := plan.keep_on_cpu:
        p = kept["predicted"]
        ctx.log(f"schedule: {len(kept['nodes'])} node(s) kept on the cpu in float ({', '.join(kept['nodes'])}): "
                f"{p['latency_ms']:.3f} ms predicted, {p['latency_ms_without']:.3f} ms without the constraint "
                f"({p['cost_ms']:+.3f} ms)")
    for r in plan.inter_op.get("runs", ()):
        ctx.log(f"schedule: inter-operator parallelism: {r['nodes']} cpu nodes in {r['stages']} stages, "
                f"{r['parallel_stages']} of them concurrent groups: {r['sequential_ms']:.3f} -> "
                f"{r['parallel_ms']:.3f} ms predicted")
    for r in plan.inter_op.get("not_taken", ()):
        if r["parallel_stages"]:  # concurrent groups were found, and they were not worth it
            ctx.log(f"schedule: {r['nodes']} cpu nodes stay one segment, {r['reason']} "
                    f"({r['sequential_ms']:.3f} -> {r['parallel_ms']:.3f} ms predicted)")
    ctx.log(f"schedule: placed {len(scheduled.model.graph.node)} nodes in {scheduled.scheduler_s:.3f} s")
