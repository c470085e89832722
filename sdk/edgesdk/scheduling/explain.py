"""The plan for people: the data of `schedule.html` computed from a `planner.Scheduled`, rendered by
`report.html.schedule_page` (which computes nothing)."""

from __future__ import annotations

import json
from pathlib import Path

from ..ir import model as irm
from ..report.html import schedule_page
from . import simulate
from .planner import STREAM_FRAMES, Scheduled


def write_report(scheduled: Scheduled, path: Path) -> None:
    """`path` (schedule.html): the plan's figures and baselines, the Gantt charts of one inference and
    of a stream (also written beside it as gantt_one.png and gantt_stream.png), and per node its device,
    why, its predicted time and the bytes its outputs move."""
    # the scheduler's run time is a measurement, not part of the plan: the bundle stays byte-reproducible
    plan = {**json.loads(scheduled.plan.to_json()), "scheduler_s": round(scheduled.scheduler_s, 4)}
    charts = [(title, simulate.gantt(timeline, path.with_name(f"gantt_{name}.png"), title).read_bytes())
              for name, timeline, title in (("one", scheduled.one, "one inference"),
                                            ("stream", scheduled.flow, f"a stream of {STREAM_FRAMES} frames"))]
    path.write_text(schedule_page(plan, node_rows(scheduled), charts))


def node_rows(scheduled: Scheduled) -> list[dict]:
    """Per node of the graph: node, op, device, reason, ms (predicted on its device), bytes_moved (what
    its outputs carry to another device)."""
    problem = scheduled.problem
    device_of = {n: r.device for r in scheduled.runs for n in r.nodes}
    moved: dict[int, int] = {}
    for t in problem.tensors:
        if t.producer is not None and any(device_of[c] != device_of[t.producer] for c in t.consumers):
            moved[t.producer] = moved.get(t.producer, 0) + t.nbytes
    rows = []
    kept = (scheduled.plan.keep_on_cpu or {}).get("segments", {})
    for i, node in enumerate(scheduled.model.graph.node):
        dev = device_of[i]
        caps = irm.get_meta(node, irm.CAPABLE_KEY) or ""
        reason = ("only the cpu can run it" if all(c.startswith("cpu") for c in caps.split(",")) else
                  "kept in float on the cpu for accuracy (plan.json keep_on_cpu)" if problem.nodes[i] in kept else
                  "cheapest in the plan" if dev != "cpu" else "accelerator-capable, cheaper on the cpu in the plan")
        rows.append({"node": problem.nodes[i], "op": node.op_type, "device": dev, "reason": reason,
                     "ms": problem.node_ms(i, dev), "bytes_moved": moved.get(i, 0)})
    return rows
