"""Runs of a model's nodes timed on each CPU backend as a bundle runs them: what `edgesdk calibrate`
fits a backend's own figures to (`devices/calibrate.fit_backend`).

A run (the whole model, or consecutive nodes of it) on one backend is made a bundle of its own the way
the tune stage makes a candidate (`selection.open_candidate`: compiled by the backend, TVM with the tuning
database's records, opened by the runtime's executor), checked against onnxruntime on the float model
(`agrees`: a run whose outputs disagree is not timed, and says why), and timed as the tune stage times
a candidate (a `timing.Runner`, `timing.FreshProcess` unless given): `rounds` measurements, every run on
every backend in turn, each a fresh process that loads the run alone and times `runs` inferences after
`timing.WARMUP`.
The run's time is the least of the measurements' medians, where the tune stage keeps their median: the
figures describe the host's CPU, and on a shared host another process only ever adds time (on this
project's 2-core build host, a CPU-bound process beside a 2-thread onnxruntime run made it 3.6x slower
for as long as it ran: ResNet50's last blocks took 17 ms in 3 of 5 rounds, 4.8 ms alone). The load
average is logged with each round.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from .. import backends
from ..config import HOST
from ..devices.cost import tensor_bytes
from ..ir import model as irm
from ..timing import FreshProcess, Runner, failure
from . import selection
from .plan import PlanSegment


# A timed run must compute the model, not match it to the tune stage's 1e-3 (`selection.TOLERANCE`): on
# random inputs through a deep network with random weights, fp32 kernels that sum in another order drift
# by about that much (EfficientNetB0 on LiteRT: 1.01e-3 of its output's scale), where a lowering that drops
# or garbles an op is off by the order of the scale itself.
TOLERANCE = 1e-2


@dataclass(frozen=True)
class Timed:
    """One run of `model`'s nodes on one backend: its median time, or why it has none."""

    model: str
    label: str  # "whole" or "nodes i-j" (1-based, inclusive)
    backend: str
    nodes: range  # indices into the model's nodes
    ms: float | None
    skipped: str | None = None
    cut_bytes: int = 0  # the bytes of the tensors it takes from or gives to the rest of the model


def label(nodes: range, total: int) -> str:
    return "whole" if len(nodes) == total else f"nodes {nodes.start + 1}-{nodes.stop}"


def time_runs(model: onnx.ModelProto, name: str, runs_of_nodes: Sequence[range], names: Sequence[str], target,
              feeds: dict[str, np.ndarray], *, tuning_db: Path, work: Path, threads: int, runs: int, rounds: int,
              log: Callable[[str], None], runner: Runner | None = None) -> list[Timed]:
    """Each run of `runs_of_nodes` on each backend of `names` (the model needs static shapes; `feeds`
    are its inputs), timed by `runner` on `threads` threads. A backend that cannot lower a node of a run, or whose
    build, check or timing fails, gives that run no time and the reason."""
    runner = runner or FreshProcess()
    g = model.graph
    shapes, consts = irm.static_shapes(model), irm.constant_names(model)
    graph_outputs = [o.name for o in g.output]
    cuts = [_cut(model, nodes, consts, graph_outputs) for nodes in runs_of_nodes]
    outer = set(feeds) | set(graph_outputs)
    cut_bytes = [sum(tensor_bytes(shapes.get(t)) for t in (*inputs, *outputs) if t not in outer)
                 for inputs, outputs in cuts]
    boundary = sorted({t for inputs, outputs in cuts for t in (*inputs, *outputs)} - set(feeds))
    from ..backends import onnxruntime as ort_backend

    values = {**feeds, **ort_backend.run(model, feeds, boundary)}
    work.mkdir(parents=True, exist_ok=True)
    feeds_file = work / "values.npz"
    np.savez(feeds_file, **values)

    done: dict[tuple[int, str], Timed] = {}
    bundles: dict[tuple[int, str], Path] = {}
    checks = {b: backends.backend(b).lowering_check() for b in names}
    for k, (nodes, (inputs, outputs)) in enumerate(zip(runs_of_nodes, cuts)):
        what = label(nodes, len(g.node))
        part = irm.extract_segment(model, list(nodes), inputs, outputs)
        for node in part.graph.node:
            irm.set_meta(node, irm.DEVICE_KEY, HOST)
        for b in names:
            why = next((f"cannot lower {irm.node_name(g.node[i], i)}: {w}" for i in nodes
                        if (w := checks[b](g.node[i], shapes, consts))), None)
            if why is None:
                seg = PlanSegment(f"t{k}", HOST, b, f"segments/t{k}.onnx",
                                  tuple(irm.node_name(g.node[i], i) for i in nodes), tuple(inputs), tuple(outputs),
                                  0.0, irm.param_bytes(part), 0.0, threads)
                cand = selection.Candidate(b, (seg,))
                try:
                    with closing(selection.open_candidate(cand, {seg.id: part}, target, work / f"{k}-{b}", tuning_db,
                                                          runner=runner)) as handle:
                        agrees(handle, values)
                    bundles[k, b] = handle.bundle
                except Exception as e:  # noqa: BLE001 -- a run that does not build, load or agree is not timed
                    why = failure(e)
            if why is not None:
                done[k, b] = Timed(name, what, b, nodes, None, why, cut_bytes[k])
                log(f"calibrate: {name} {what} on {b}: skipped: {why}")

    laps: dict[tuple[int, str], list[float]] = {key: [] for key in bundles}
    for r in range(rounds):
        log(f"calibrate: timing {len(bundles)} runs of {name}, round {r + 1} of {rounds} (load average "
            f"{os.getloadavg()[0]:.2f})")
        for key, path in bundles.items():
            if key in done:
                continue
            try:
                laps[key].append(statistics.median(runner.measure(path, feeds_file, runs=runs)))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                done[key] = Timed(name, label(runs_of_nodes[key[0]], len(g.node)), key[1], runs_of_nodes[key[0]], None,
                                  failure(e), cut_bytes[key[0]])
    for key, lap in laps.items():
        if key not in done:
            done[key] = Timed(name, label(runs_of_nodes[key[0]], len(g.node)), key[1], runs_of_nodes[key[0]],
                              min(lap), None, cut_bytes[key[0]])
    return [done[k, b] for k in range(len(runs_of_nodes)) for b in names]


def agrees(bundle, values: dict[str, np.ndarray], tolerance: float = TOLERANCE) -> None:
    """Every output of the run within `tolerance` of its scale of onnxruntime's value (the tune
    stage's check of a candidate); raises ValueError saying which output is off and by how much."""
    selection.check(bundle, [values], tolerance)


def _cut(model: onnx.ModelProto, nodes: range, consts: set[str],
         graph_outputs: list[str]) -> tuple[list[str], list[str]]:
    """A run's inputs (what it reads that no node of it writes) and outputs (what it writes that the
    graph gives or a node after it reads), as the schedule cuts a segment."""
    g = model.graph
    inside = set(nodes)
    produced = {t for i in nodes for t in g.node[i].output if t}
    inputs = list(dict.fromkeys(t for i in nodes for t in g.node[i].input
                                if t and t not in consts and t not in produced))
    read_after = {t for i, n in enumerate(g.node) if i not in inside for t in n.input if t}
    outputs = [t for i in nodes for t in g.node[i].output if t and (t in graph_outputs or t in read_after)]
    return inputs, outputs


@contextlib.contextmanager
def runner_threads(threads: int) -> Iterator[None]:
    """TVM's thread pool and LiteRT's interpreters on `threads` threads (the runtime's variables, which
    the timing processes inherit), as they were afterwards."""
    saved = {var: os.environ.get(var) for var in ("TVM_NUM_THREADS", "EDGESDK_NUM_THREADS")}
    os.environ.update({var: str(threads) for var in saved})
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
