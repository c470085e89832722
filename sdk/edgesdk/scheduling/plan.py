"""The schedule's output as data: `plan.json` read into frozen dataclasses and written back.

The schedule stage writes a `Plan`; the tune stage writes it again with each CPU span on the backend it
measured fastest (`selection.py`); compress reads the schedule's, package the tune stage's, with
`Plan.load`. A plan is never changed in place: a stage that corrects it (tune; package, after the Edge
TPU compiler) makes a new one with `dataclasses.replace`. `to_json` writes the keys in one fixed order, so a plan read and
written again is the same bytes (plan.json is in every bundle, which must be reproducible).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class PlanSegment:
    """A segment as the schedule cut it: its nodes on one device, compiled by one backend."""

    id: str
    device: str  # logical id: cpu, edgetpu:0, gpu:0
    backend: str  # a registered backend's name (backends/registry.py)
    artifact: str  # its ONNX graph, relative to the schedule stage's directory (segments/<id>.onnx)
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    flops: float
    param_bytes: int
    predicted_ms: float
    threads: int = 0  # a group of a parallel step: its worker's threads (0: not one; not written)
    # the id of an earlier segment of the same kind and backend that computes the same thing with the same
    # weights (`ir.digest.graph_structure_sha256`): the package ships that one's artifact for both, its inputs
    # and outputs in the same order; "" (not written) where none does
    same_as: str = ""

    def to_json(self) -> dict[str, Any]:
        out = {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name not in ("threads", "same_as")}
        return {**out, **({"threads": self.threads} if self.threads else {}),
                **({"same_as": self.same_as} if self.same_as else {})}

    @staticmethod
    def from_json(d: dict[str, Any]) -> "PlanSegment":
        return PlanSegment(d["id"], d["device"], d["backend"], d["artifact"], tuple(d["nodes"]), tuple(d["inputs"]),
                           tuple(d["outputs"]), d["flops"], d["param_bytes"], d["predicted_ms"], d.get("threads", 0),
                           d.get("same_as", ""))


@dataclass(frozen=True)
class Plan:
    target: str
    mode: str  # latency | throughput
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    probes: dict[str, str]  # model output -> the logits tensor before its softmax
    segments: tuple[PlanSegment, ...]
    pipeline_stages: tuple[tuple[str, ...], ...]  # segment ids per stage of a stream
    parallel_steps: tuple[tuple[str, ...], ...]  # segment ids that run at once
    inter_op: dict[str, Any]
    predicted: dict[str, float]
    utilization: dict[str, float]
    cost_model: str
    search: str
    baselines: dict[str, dict]
    placement: dict[str, int]
    decisions: tuple[str, ...]
    # the tune stage's choice of each CPU span's backend by measurement (scheduling/selection.py)
    cpu_selection: dict[str, Any] = field(default_factory=dict)
    # each cached accelerator instance the plan uses: capacity, weights placed, cached and streamed, its
    # segments in the order they are co-compiled (scheduling/cache.py); empty where no device has a cache
    caches: dict[str, Any] = field(default_factory=dict)
    # data parallelism in a stream: each replica's device map (two Edge TPUs: edgetpu:0 and edgetpu:1
    # swapped); frame f runs replica f mod (1 + len(replicas)), replica 0 being the plan itself
    replicas: tuple[dict[str, str], ...] = ()
    # which candidate the plan is: the scheduler's own, or a baseline's placement predicted better on the
    # same cost model; its figure on the mode's objective, the runner-up's, and the margin in per cent
    chosen: dict[str, Any] = field(default_factory=dict)
    # nodes kept off every accelerator, in float on the CPU (the accuracy remedy's culprits, `--keep-on-cpu`):
    # the names, each pinned node's segment, the predicted figures with and without the constraint, and the
    # remedy's rounds (`remedy`: what the gate measured before each, and why each node was moved); empty
    # (not written) where nothing is pinned
    keep_on_cpu: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({f.name: _plain(getattr(self, f.name)) for f in fields(self)
                           if f.name not in ("cpu_selection", "caches", "replicas", "chosen", "keep_on_cpu")
                           or getattr(self, f.name)},
                          indent=2) + "\n"

    def replica_segments(self) -> tuple[tuple[PlanSegment, ...], ...]:
        """Per replica k >= 1, the segments its frames run, in plan order: each segment on a device the
        replica moves as a segment of its own, `<id>.r<k>` on the other device and `same_as` the segment
        it repeats (the package ships one artifact per device for them); the others as they are."""
        return tuple(tuple(replace(s, id=f"{s.id}.r{k}", device=m[s.device], same_as=s.same_as or s.id)
                           if s.device in m else s for s in self.segments)
                     for k, m in enumerate(self.replicas, 1))

    @staticmethod
    def from_json(text: str) -> "Plan":
        d = json.loads(text)
        return Plan(d["target"], d["mode"], tuple(d["inputs"]), tuple(d["outputs"]), d["probes"],
                    tuple(PlanSegment.from_json(s) for s in d["segments"]),
                    tuple(tuple(s) for s in d["pipeline_stages"]), tuple(tuple(s) for s in d.get("parallel_steps", ())),
                    d.get("inter_op", {}), d["predicted"], d.get("utilization", {}), d.get("cost_model", ""),
                    d.get("search", ""), d.get("baselines", {}), d.get("placement", {}), tuple(d.get("decisions", ())),
                    d.get("cpu_selection", {}), d.get("caches", {}),
                    tuple(dict(m) for m in d.get("replicas", ())), d.get("chosen", {}), d.get("keep_on_cpu", {}))

    @staticmethod
    def load(directory: Path) -> "Plan":
        """The plan in a schedule or tune stage's output directory."""
        return Plan.from_json((Path(directory) / "plan.json").read_text())


def _plain(value: Any) -> Any:
    if isinstance(value, PlanSegment):
        return value.to_json()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value
