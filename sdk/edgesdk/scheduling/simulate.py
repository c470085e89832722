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

import heapq
import math
from dataclasses import dataclass
from pathlib import Path
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
    return Timeline(tuple(events), resources, busy, max(done),
                    tuple(d - s for s, d in zip(first, done)), steady_fps(done))


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


def gantt(timeline: Timeline, path, title: str = "") -> Path:
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
    # one collection of bars per row and kind: a stream's chart has hundreds of bars, and an artist per bar
    # (ax.barh) took seconds of every build to draw
    bars: dict[tuple[int, str], tuple[list, list]] = {}
    for e in timeline.events:
        spans, faces = bars.setdefault((rows.index(e.resource), e.kind), ([], []))
        spans.append((e.start_ms, e.end_ms - e.start_ms))
        faces.append(colours(e.segment % 20))
    for (y, kind), (spans, faces) in bars.items():
        ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=faces, hatch="//" if kind == "transfer" else None,
                       edgecolor="black", linewidth=0.3)
    ax.set_xlim(left=0.0)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # the first row on top
    ax.set_yticks(range(len(rows)), [f"{r} ({util.get(r, 0.0):.0%})" for r in rows])
    ax.set_xlabel("ms")
    ax.set_title(title or f"makespan {timeline.makespan_ms:.3f} ms")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


# --- the runtime's stream, worker by worker -------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """A segment of one frame as the runtime's stream runs it (runtime/streaming.py): on one device's
    worker, for `ms` (an accelerator's transfers included: its call holds the worker), once the tasks
    `after` of the same frame are done."""

    id: str
    device: str
    ms: float
    after: tuple[str, ...] = ()


def steady_fps(done_ms: Sequence[float]) -> float:
    """Frames per second from the frames' completion times: over the last half of the frames, where a
    pipeline is full ((completions in the window - 1) / (last - first in the window)); one frame, or
    frames finishing together: the average over the run."""
    window = list(done_ms[(len(done_ms) - 1) // 2:])
    span = window[-1] - window[0] if window else 0.0
    if span > 0:
        return 1000.0 * (len(window) - 1) / span
    return 1000.0 * len(done_ms) / done_ms[-1] if done_ms and done_ms[-1] > 0 else math.inf


def worker_stream(plans: Sequence[Sequence[Task]], frames: int, depth: int) -> Timeline:
    """`frames` frames through the runtime's stream policy (runtime/streaming.py), played in time:

    - frame f runs the tasks of `plans[f % len(plans)]` (one plan; or a plan and its replicas, frames
      dealt in turn);
    - at most `depth` frames are in flight: frame f + depth is fed when frame f is yielded, and frames
      are yielded in order, each once all its tasks are done (a caller taking each result at once);
    - every device has one worker; an idle worker starts, among its device's tasks of the frames in
      flight whose `after` tasks are done, the one first in (frame, position in its plan) order.

    Exact for that policy when every task takes its `ms` (the runtime test with sleeping device
    doubles checks the runtime against it). The timeline's events are the tasks (`segment`: the
    position in its frame's plan), a frame's latency runs from its feeding to its yield, and the
    throughput is `steady_fps` of the yields."""
    if frames < 1 or depth < 1:
        raise ValueError(f"frames and depth must be at least 1, got {frames} and {depth}")
    devices = list(dict.fromkeys(t.device for plan in plans for t in plan))
    # per plan: each task's position, and the positions waiting for it
    where = [{t.id: pos for pos, t in enumerate(plan)} for plan in plans]
    waiting_for = [[[] for _ in plan] for plan in plans]
    for k, plan in enumerate(plans):
        for pos, t in enumerate(plan):
            for a in t.after:
                if a not in where[k]:
                    raise ValueError(f"the stream is stuck: task {t.id} waits for {a}, which its plan does not have")
                waiting_for[k][where[k][a]].append(pos)
    busy = dict.fromkeys(devices, 0.0)
    running: dict[str, tuple[float, int, int]] = {}              # device -> (end, frame, position)
    missing: dict[int, list[int]] = {}                          # frame -> per position, tasks still awaited
    remaining: dict[int, int] = {}
    ready: dict[str, list[tuple[int, int]]] = {d: [] for d in devices}   # heaps of (frame, position)
    yielded: list[float] = []
    fed_at: list[float] = []
    events: list[Event] = []
    fed, now = 0, 0.0
    while len(yielded) < frames:
        while fed < frames and fed - len(yielded) < depth:      # feed up to `depth` frames in flight
            plan = plans[fed % len(plans)]
            remaining[fed] = len(plan)
            missing[fed] = [len(t.after) for t in plan]
            fed_at.append(now)
            for pos, task in enumerate(plan):
                if not task.after:
                    heapq.heappush(ready[task.device], (fed, pos))
            fed += 1
        for d in devices:                                       # idle workers take their first ready task
            if d not in running and ready[d]:
                f, pos = heapq.heappop(ready[d])
                task = plans[f % len(plans)][pos]
                running[d] = (now + task.ms, f, pos)
                busy[d] += task.ms
                events.append(Event(d, pos, "compute", now, now + task.ms, f))
        if not running:
            raise ValueError("the stream is stuck: a task waits for one that never runs")
        now = min(end for end, _, _ in running.values())
        for d in [d for d, (end, _, _) in running.items() if end <= now]:
            _, f, pos = running.pop(d)
            remaining[f] -= 1
            k = f % len(plans)
            for q in waiting_for[k][pos]:
                missing[f][q] -= 1
                if missing[f][q] == 0:
                    heapq.heappush(ready[plans[k][q].device], (f, q))
        while len(yielded) < fed and remaining[len(yielded)] == 0:
            yielded.append(now)
    return Timeline(tuple(events), tuple(devices), busy, yielded[-1],
                    tuple(y - f for y, f in zip(yielded, fed_at)), steady_fps(yielded))


def tasks(problem: Problem, segments: Sequence, durations: dict[int, float] | None = None) -> list[Task]:
    """A plan's segments as the runtime's stream runs them (`worker_stream`): each takes its
    `placement.segment_ms` (or its device's overhead plus `durations[index]`), after the segments
    producing its inputs. One pass over the tensors (the reference `segment_ms` is one per segment)."""
    plan = _plan(problem, segments)
    span = [0] * len(problem.nodes)
    for s, (i, j, _) in enumerate(plan):
        span[i:j] = [s] * (j - i)
    ms = [problem.overhead_ms.get(d, 0.0) + sum(problem.node_ms(k, d) for k in range(i, j)) for i, j, d in plan]
    after: list[set[int]] = [set() for _ in plan]
    for t in problem.tensors:
        p = None if t.producer is None else span[t.producer]
        takers = {span[c] for c in t.consumers} - {p}
        for s in takers:                             # an input of each other segment that reads it
            if p is not None:
                after[s].add(p)
            d = plan[s][2]
            if d != "cpu":
                ms[s] += problem.links[d].ms(t.nbytes)
        if p is not None and (takers or t.graph_output) and plan[p][2] != "cpu":
            ms[p] += problem.links[plan[p][2]].ms(t.nbytes)   # an output of its producer's segment
    out = []
    for s, (i, j, d) in enumerate(plan):
        given = (durations or {}).get(s)
        time = ms[s] if given is None else problem.overhead_ms.get(d, 0.0) + given
        out.append(Task(f"s{s}", d, time, tuple(f"s{a}" for a in sorted(after[s]))))
    return out
