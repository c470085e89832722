"""Play a plan on the devices' queues and links: the timeline the cost formula only sums.

A plan is a sequence of segments `(start, stop, device)` covering the problem's topological order
(objects with `.start`, `.stop`, `.device` work too). The runtime model is the one in `problem.py`:

- every device instance ("cpu", "edgetpu:0", ...) runs one segment at a time, and every accelerator's
  link to the host ("edgetpu:0/link") carries one transfer at a time;
- a segment on an accelerator sends each input over its link once it is on the host (graph inputs at
  t=0; others when the producing segment finished, plus its transfer out if that was on an
  accelerator), computes (overhead + its nodes' costs), then sends each tensor it produces that is
  used outside it back over the link;
- a CPU segment waits for its inputs on the host and computes.

Each resource serves its work in a fixed order: plan order within a frame, frame after frame
(frame f+1's segment on a device starts after frame f's). With the order fixed, every task starts at
`max(resource free, inputs ready)`; walking the tasks once in that order (frame, segment, in-transfers,
compute, out-transfers) gives exactly the event-by-event result, because each task depends only on
tasks walked before it. Two bounds follow and are tested: makespan >= the dependency-only critical
path, and makespan <= the sum of all task times (= sum of segment_ms, nothing overlapping).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .problem import Problem

Segment = tuple[int, int, str]


@dataclass(frozen=True)
class Event:
    resource: str            # a device, or "<device>/link"
    segment: int             # index into the plan
    kind: str                # "compute" or "transfer"
    start_ms: float
    end_ms: float
    frame: int = 0
    tensor: str | None = None   # what a transfer carries


@dataclass(frozen=True)
class Timeline:
    events: tuple[Event, ...]
    resources: tuple[str, ...]          # every device, each accelerator followed by its link
    busy_ms: dict[str, float]
    makespan_ms: float                  # last completion
    latency_ms: tuple[float, ...]       # per frame: its last task's end - its first task's start
    throughput_fps: float

    @property
    def utilization(self) -> dict[str, float]:
        return {r: (b / self.makespan_ms if self.makespan_ms > 0 else 0.0) for r, b in self.busy_ms.items()}


def link_of(device: str) -> str:
    return f"{device}/link"


def one_inference(problem: Problem, segments: Sequence, durations: dict[int, float] | None = None) -> Timeline:
    """One frame through the plan; `makespan_ms` is the latency of one inference."""
    return stream(problem, segments, frames=1, durations=durations)


def stream(problem: Problem, segments: Sequence, frames: int, interval_ms: float = 0.0,
           durations: dict[int, float] | None = None, *, replicas: Sequence[Sequence] = ()) -> Timeline:
    """`frames` frames through the same plan, frame f's graph inputs on the host at f * interval_ms
    (0: all at once, a saturated source); consecutive frames overlap as far as the resources' fixed
    order allows. Throughput is measured on the last half of the frames, where the pipeline is full:
    (completions in the window - 1) / (last - first completion in the window). A frame's latency runs
    from its first task's start, so under a saturated source it grows with the queue in front of the
    bottleneck; pace the source (interval_ms >= the bottleneck) to see the latency of a full pipeline.

    `replicas` (data parallelism): more plans of the same graph, played in turn: frame f runs plan
    f mod (1 + len(replicas)), the first being `segments` (a model replicated on every Edge TPU, each
    taking every other frame). The replicas share every resource, the CPU and the links included.
    `durations` (segment index -> ms) applies to `segments` alone."""
    plans = [_plan(problem, segments), *(_plan(problem, r) for r in replicas)]
    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    ios = [[_io(problem, i, j) for i, j, _ in plan] for plan in plans]
    resources = tuple(r for d in problem.devices for r in ((d,) if d == "cpu" else (d, link_of(d))))
    free = dict.fromkeys(resources, 0.0)
    events: list[Event] = []

    def run(resource: str, ready: float, ms: float, **kw) -> float:
        start = max(free[resource], ready)
        free[resource] = start + ms
        events.append(Event(resource, start_ms=start, end_ms=start + ms, **kw))
        return start + ms

    first, done = [], []
    for f in range(frames):
        on_host = {t: f * interval_ms for t, tensor in enumerate(problem.tensors) if tensor.producer is None}
        n_before = len(events)
        r = f % len(plans)
        timed = durations if r == 0 and durations else {}
        for s, ((i, j, d), (ins, outs)) in enumerate(zip(plans[r], ios[r])):
            compute_ms = problem.overhead_ms.get(d, 0.0) + (
                timed[s] if s in timed else sum(problem.node_ms(k, d) for k in range(i, j)))
            if d == "cpu":
                ready = max((on_host[t] for t in ins), default=0.0)
                end = run(d, ready, compute_ms, segment=s, kind="compute", frame=f)
                on_host.update(dict.fromkeys(outs, end))
                continue
            link, ready = problem.links[d], 0.0
            # Whichever input reaches the host first goes over the link first.
            for t in sorted(ins, key=lambda t: (on_host[t], t)):
                ready = run(link_of(d), on_host[t], link.ms(problem.tensors[t].nbytes),
                            segment=s, kind="transfer", frame=f, tensor=problem.tensors[t].name)
            end = run(d, ready, compute_ms, segment=s, kind="compute", frame=f)
            for t in outs:
                on_host[t] = run(link_of(d), end, link.ms(problem.tensors[t].nbytes),
                                 segment=s, kind="transfer", frame=f, tensor=problem.tensors[t].name)
        first.append(min(e.start_ms for e in events[n_before:]))
        done.append(max(e.end_ms for e in events[n_before:]))

    busy = {r: sum(e.end_ms - e.start_ms for e in events if e.resource == r) for r in resources}
    window = done[(frames - 1) // 2:]
    span = window[-1] - window[0]
    if span > 0:
        fps = 1000.0 * (len(window) - 1) / span
    else:   # one frame, or frames finishing together: fall back to the average over the run
        fps = 1000.0 * frames / done[-1] if done[-1] > 0 else math.inf
    return Timeline(tuple(events), resources, busy, max(done),
                    tuple(d - s for s, d in zip(first, done)), fps)


def _plan(problem: Problem, segments: Sequence) -> list[Segment]:
    """Segments as tuples, checked to tile 0..n in order on devices that run every node in them."""
    plan = [tuple(s) if isinstance(s, tuple) else (s.start, s.stop, s.device) for s in segments]
    errors, expect = [], 0
    for i, j, d in plan:
        if i != expect or j <= i:
            errors.append(f"segment ({i}, {j}, {d}) does not continue at node {expect}")
        if d not in problem.devices:
            errors.append(f"segment ({i}, {j}, {d}): no device {d}")
        elif d != "cpu" and d not in problem.links:
            errors.append(f"segment ({i}, {j}, {d}): {d} has no link")
        errors += [f"node {problem.nodes[k]} cannot run on {d}" for k in range(i, j)
                   if k < len(problem.nodes) and not problem.can(k, d)]
        expect = j
    if expect != len(problem.nodes):
        errors.append(f"plan ends at node {expect}, the problem has {len(problem.nodes)}")
    if errors:
        raise ValueError("bad plan: " + "; ".join(errors))
    return plan


def _io(problem: Problem, i: int, j: int) -> tuple[list[int], list[int]]:
    """Indices of the tensors segment [i, j) receives and sends (problem.py's inputs/outputs)."""
    inside = range(i, j)
    ins = [t for t, x in enumerate(problem.tensors)
           if (x.producer is None or x.producer < i) and any(c in inside for c in x.consumers)]
    outs = [t for t, x in enumerate(problem.tensors)
            if x.producer in inside and (x.graph_output or any(c not in inside for c in x.consumers))]
    return ins, outs


def gantt(timeline: Timeline, path, title: str = "") -> "Path":
    """A PNG Gantt chart of `timeline`: one row per device and link, one bar per task (computations
    coloured by segment, transfers hatched), and each resource's utilization on its label."""
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(timeline.resources)
    util = timeline.utilization
    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * len(rows)), dpi=110)
    colours = plt.get_cmap("tab20")
    for e in timeline.events:
        y = rows.index(e.resource)
        ax.barh(y, e.end_ms - e.start_ms, left=e.start_ms, height=0.7, color=colours(e.segment % 20),
                hatch="//" if e.kind == "transfer" else None, edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(rows)), [f"{r} ({util.get(r, 0.0):.0%})" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title or f"makespan {timeline.makespan_ms:.3f} ms")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path
