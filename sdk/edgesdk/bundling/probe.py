"""Which int8 segments cost the bundle the most, end to end: each int8 segment on an accelerator run in float
in turn, the others int8, then the first k of them and the last k (errors grow along the model: what is
lost early is amplified, what is lost late reaches the outputs unmended), and the measure the bundle failed
taken again.

The culprit search (compression/culprits.py) ranks layers by the error each adds on its own inputs; it
does not see how the layers after one amplify what it adds. PP-OCRv4's text detector is the case: its
first Edge TPU segment (the stem, 5 nodes) adds 0.16 % of its output's range and is within the gate on
its own, yet with it alone in float the masks of held-out pages agree with fp32's at IoU 96 % instead of
87 %, while the culprits named (deep convolutions clipped by calibration) moved nothing in two rounds.
The probe measures that directly, on the compress stage's own files (`chain.run`: no bundle is built),
and the accuracy remedy (`pipeline.build`) keeps the segment whose float version helps the most on the
CPU before it tries the culprits.

Needs: the scheduled plan and the compress stage's record of its int8 segments; samples; a `judge` taking
the float run and a run with reduced precision to {met, shortfall, said}. Guarantees: at most
PROBE_SAMPLES samples; nothing is written.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path

from ..compression import accuracy as measures
from ..compression import tasks
from . import chain

PROBE_SAMPLES = 8


def probe(plan, scheduled: Path, compressed: Path, entries: Mapping[str, dict], samples: list[dict],
          judge: Callable[[list, list], dict], measure: str, log: Callable[[str], None]) -> dict | None:
    """The all-int8 figure and, per set of int8 segments on accelerators in float (each alone, the first k,
    the last k, in plan order), the figure, ranked best first: those that meet the measure by the fewest
    nodes they move, then the rest by least shortfall; None where no segment can be probed."""
    int8 = {s.id: entries[s.id] for s in plan.segments if s.id in entries}
    on_accelerator = [s for s in plan.segments if s.id in int8 and s.device != "cpu"]
    if not on_accelerator or not samples:
        return None
    samples = samples[:PROBE_SAMPLES]
    n = len(on_accelerator)
    sets = list(dict.fromkeys([(s,) for s in on_accelerator] + [tuple(on_accelerator[:k]) for k in range(2, n + 1)]
                              + [tuple(on_accelerator[-k:]) for k in range(2, n)]))
    log(f"package: accuracy probe: {len(sets)} set(s) of the {n} int8 segment(s) on accelerators in float in "
        f"turn, on {len(samples)} sample(s)")
    runners: dict = {}  # each segment's float and int8 runner, opened once for every set
    reference = chain.run(plan, scheduled, compressed, {}, samples, runners)
    base = judge(reference, chain.run(plan, scheduled, compressed, int8, samples, runners))
    rows = []
    for chosen in sets:
        ids = {s.id for s in chosen}
        got = chain.run(plan, scheduled, compressed, {k: v for k, v in int8.items() if k not in ids}, samples, runners)
        rows.append({"segments": [s.id for s in chosen], "devices": sorted({s.device for s in chosen}),
                     "nodes": [n for s in chosen for n in s.nodes], **judge(reference, got)})
    rows.sort(key=lambda r: (not r["met"], len(r["nodes"]) if r["met"] else r["shortfall"], len(r["nodes"])))
    return {"samples": len(samples), "measure": measure, "int8": base, "float": rows}


def parts_judge(parts: Mapping[str, list], gate: measures.Gate) -> Callable[[list, list], dict]:
    """The accuracy gate's verdict on the output parts, with its shortfall: over the measures missed, each
    one's distance to its threshold as a share of the threshold."""
    def judge(reference: list, got: list) -> dict:
        figures = measures.measure(reference, got, {o: parts[o] for o in reference[0] if o in parts})
        failures = measures.judge(figures, gate)
        short = 0.0
        for f in failures:
            for m, (value, limit) in f.missed.items():
                side = gate.thresholds(f.kind)[m][0]
                gap = (limit - value if side == "min" else value - limit) / (abs(limit) or 1.0)
                short += gap if math.isfinite(gap) else 1e3
        return {"met": not failures, "shortfall": round(short, 6),
                "said": "; ".join(f.describe() for f in failures) or "within the gate"}
    return judge


def task_judge(task: str, labels, spec: dict) -> Callable[[list, list], dict]:
    """The task's verdict (`--eval`), with its shortfall (tasks.shortfall)."""
    def judge(reference: list, got: list) -> dict:
        figures = tasks.measure_task(task, reference, got, labels, **spec)
        return {"met": figures["verdict"]["met"], "shortfall": round(tasks.shortfall(figures, spec.get("goal")), 6),
                "said": tasks.summary(figures)}
    return judge
