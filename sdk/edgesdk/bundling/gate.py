"""The package stage's accuracy gate: a bundle with any reduced precision (int8 on the Edge TPU or on the
CPU) against the fp32 model on held-out samples, each output in the parts its meaning cuts it into
(compression/accuracy.py), held to the target's `accuracy:` thresholds. Below them the bundle is not
published: the build fails (`accuracy.gate`, exit 1) naming each failing part, its figures and the layers
that lose the most (compression/culprits.py), unless `--accept-accuracy-loss` publishes it anyway, with
the loss in the manifest's `accuracy`. docs/accuracy.md is the user's page of it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import onnx

from .. import backends
from ..backends import onnxruntime as ort_backend
from ..compression import accuracy as measures
from ..compression import culprits as layers
from ..errors import UserError
from ..ir import model as irm
from ..scheduling.plan import Plan

CULPRIT_SAMPLES = 2  # held-out samples the culprit search compares layers on (each layer's figures are over all of their values)
CULPRIT_SEGMENTS = 8  # int8 segments searched at most, those under their own gate in compress first


class GateFailure(UserError):
    """`accuracy.gate`: the bundle below the target's gate, with the verdict's record (`accuracy`: the parts'
    figures, `failures`, `culprits`), from which the build's accuracy remedy (`pipeline.build`) plans again."""

    def __init__(self, message: str, hint: str, notes: list[str], accuracy: dict, code: str = "accuracy.gate"):
        super().__init__(code, message, hint=hint, notes=notes)
        self.accuracy = accuracy


def judge(accuracy: dict, plan: Plan, target, options, calibration: dict, *, search: Callable[[list], list],
          log: Callable[[str], None], warn: Callable[[str], None]) -> dict:
    """`accuracy` (`golden.accuracy`'s record) judged by the target's gate, for a plan with reduced
    precision; returns it with the verdict (`gate`), and where it failed, the failing parts and the
    culprits (`search(failures)`, compression/culprits.Culprit). Raises `accuracy.gate` where it failed
    and the user did not accept the loss."""
    gate = measures.Gate.of(target.accuracy)
    failures = measures.judge(accuracy["parts"], gate)
    n = accuracy["samples"]
    on = f"{n} held-out sample(s)" if accuracy.get("held_out", True) else "the calibration sample (none held out)"
    synthetic = bool(calibration.get("synthetic"))
    # the model as imported: fp32, or a quantized TFLite model's own int8 (golden.accuracy's `own`)
    against = "the model's own int8 (LiteRT)" if accuracy.get("reference", "").startswith("LiteRT") else "fp32"
    accuracy = {**accuracy, "gate": {"thresholds": gate.to_json(), "passed": not failures,
                                     "calibration": "synthetic" if synthetic else "real"}}
    failed = {f.part: f for f in failures}
    blind = measures.unjudged(accuracy["parts"])
    if blind:
        accuracy["gate"]["unjudged"] = blind
    for part, m in accuracy["parts"].items():
        verdict = (f"BELOW THE GATE ({failed[part].describe().split(': ', 1)[1]})" if part in failed
                   else "NOT JUDGED" if part in blind else "passes")
        log(f"package: accuracy of {part} ({_kind(m)}) vs {against} on {on}: {figures(m)}: {verdict}")
    for part, why in blind.items():
        warn(f"the accuracy gate cannot judge {part}: {why}; what reduced precision keeps of its decisions is "
             "unchecked: hold out samples the model decides on (real inputs of its classes, in --calib)")
    kinds = [backends.backend(s.backend) for s in plan.segments]
    float16_only = not any(b.quantizes for b in kinds) and any(b.precision in ("bf16", "fp16") for b in kinds)
    unknown = ("" if not synthetic else
               "its 16-bit float segments were chosen on synthetic samples (no --calib), and the gate measured on "
               "synthetic held-out samples too: its accuracy on real data is unknown" if float16_only else
               "its int8 ranges come from synthetic samples (no --calib), and so do the held-out samples the "
               "gate measured on: its accuracy on real data is unknown")
    if not failures:
        if synthetic:
            warn(f"the bundle passes the accuracy gate on {on}, but {unknown}; give --calib with real inputs")
        return accuracy
    found = search(failures)
    accuracy["failures"] = [f.to_json() for f in failures]
    accuracy["culprits"] = [c.to_json() for c in found]
    notes = [f"{f.describe()}; {figures(accuracy['parts'][f.part])}" for f in failures]
    notes += [f"culprit: {c.describe()}" for c in found] or ["culprits: none found (no int8 segment could be "
                                                             "compared layer by layer)"]
    if synthetic:
        notes.append(f"calibration: {unknown}")
    if not getattr(options, "accept_accuracy_loss", False):
        raise GateFailure(f"the bundle misses the target's accuracy gate against {against} on {on}: "
                          + "; ".join(f.describe() for f in failures),
                          _remedies(plan, options, calibration, found), notes, accuracy)
    accuracy["accepted_loss"] = True
    warn("--accept-accuracy-loss: the bundle is published BELOW its accuracy gate: "
         + "; ".join(f.describe() for f in failures)
         + (f"; culprit: {found[0].node} ({found[0].cause})" if found else ""))
    return accuracy


def remedy(kept: dict, accuracy: dict) -> dict:
    """The manifest's `accuracy.remedy` for a plan with nodes kept on the CPU (`Plan.keep_on_cpu`): the nodes,
    why each (the accuracy remedy's round and its culprit figures, or `--keep-on-cpu`), the gate's figures
    before each round and after (`after`: this verdict), and the predicted latency with and without the
    constraint (what the remedy costs)."""
    rounds = kept.get("remedy") or []
    by_remedy = {m["node"]: {**m, "round": r["round"]} for r in rounds for m in r["moved"]}
    why = [by_remedy.get(n, {"node": n, "by": "--keep-on-cpu"}) for n in kept["nodes"]]
    return {"kept_on_cpu": why, "segments": kept.get("segments", {}), "predicted": kept["predicted"],
            "rounds": [{"round": r["round"], "nodes": [m["node"] for m in r["moved"]],
                        "latency_ms_before": r["latency_ms"], "failures_before": r["failures"],
                        "parts_before": r["parts"], **({"probe": r["probe"]} if r.get("probe") else {})}
                       for r in rounds],
            "after": {"passed": (accuracy.get("gate") or {}).get("passed"), "parts": accuracy["parts"]}}


def judge_task(accuracy: dict, plan: Plan, options, calibration: dict, *, search: Callable[[list], list],
               warn: Callable[[str], None]) -> dict:
    """The task's own verdict (`--eval DIR --task T`, the manifest's `accuracy.task`) as part of the gate:
    a bundle that misses its task's goal on the user's held-out samples is not published unless the user
    accepts the loss (`accuracy.task`, with the culprit layers, from which the accuracy remedy plans
    again as for the output parts); returns `accuracy`, marked where the loss was accepted."""
    task = accuracy["task"]
    verdict = task["verdict"]
    if verdict["met"]:
        return accuracy
    missed = (f"the bundle misses its {task['task']} goal on --eval {task['source']}: " + "; ".join(verdict["missed"])
              + f" (goal: {verdict['goal']})")
    if getattr(options, "accept_accuracy_loss", False):
        warn(f"--accept-accuracy-loss: the bundle is published below its task goal: {missed}")
        return {**accuracy, "accepted_loss": True}
    if getattr(options, "prune", None) or getattr(options, "prune_plan", None):
        # the figures are against the dense model: pruning's loss is the user's own choice, reported beside
        # (the pruning fidelity), and the int8 loss is judged against the pruned model by the output parts
        warn(f"{missed}; the bundle is pruned (--prune), which the figures against the dense model include")
        return accuracy
    found = search([])
    accuracy = {**accuracy, "culprits": [c.to_json() for c in found]}
    notes = [task["summary"], *(f"culprit: {c.describe()}" for c in found)]
    raise GateFailure(missed, _remedies(plan, options, calibration, found)
                      .replace("; or publish", "; lower the goal with --task-options goal=SHARE; or publish"),
                      notes, accuracy, code="accuracy.task")


def _kind(m: dict) -> str:
    if m.get("declared"):
        return f"scores, after the {m['activation']} --output-activation declares"
    return f"scores, after its {m['activation']}" if m["kind"] == measures.SCORES else "values"


def figures(m: dict) -> str:
    """A part's measures in one phrase: `cosine 0.9057, mean error 0.03% and max error 76.9% of its range,
    top-1 100%`."""
    top1 = f", top-1 {m['top1']:.1%}" if m.get("top1") is not None else ""
    return (f"cosine {m['cosine']:.4f}, mean error {m['mean_error']:.2%} and max error {m['max_error']:.1%} of its "
            f"range{top1}")


def _remedies(plan: Plan, options, calibration: dict, found: list) -> str:
    """The hint: what moves these figures, for what this build has."""
    said = []
    if calibration.get("synthetic"):
        said.append("calibrate on real inputs: --calib DIR (images with --calib-preprocess)")
    else:
        said.append("calibrate on more inputs like the deployed ones (--calib, --calib-samples)")
    # the method the build calibrated with: --calib-method unset is auto with real samples, minmax without
    method = (options.calibration_method() if hasattr(options, "calibration_method")
              else getattr(options, "calib_method", None) or "minmax")
    causes = {c.cause for c in found}
    if method == "percentile" and "calibration-clipping" in causes:
        # the tails the percentile cut are what the culprits lose: keep ten times less of them out (the
        # demo's recognizer reads 93% of the characters at 99.99, as fp32 does at 99.999)
        kept = 100 - (100 - getattr(options, "calib_percentile", 99.99)) / 10
        said.append(f"keep more of each tail: --calib-percentile {kept:.10g}, or --calib-method minmax")
    elif method == "auto":  # auto weighs each method at the default percentile only
        said.append("keep more of each tail than auto's percentile: --calib-method percentile --calib-percentile 99.999")
    else:
        said.append(f"try --calib-method {'percentile' if method == 'minmax' else 'minmax'}")
    if "approximation" in causes:
        said.append("tighten the approximations (--max-error-lsb 0.5) or keep them on the CPU (--no-rewrites)")
    if any(s.device.split(":")[0] == "cpu" and backends.backend(s.backend).quantizes for s in plan.segments):
        said.append("keep the CPU float (--cpu-precision fp32)")
    on_accelerators = [n for c in found if c.segment in {s.id for s in plan.segments if s.device != "cpu"}
                       for n in culprit_nodes(c.node)]
    if on_accelerators:
        said.append(f"keep the culprit layers in float on the CPU: --keep-on-cpu "
                    f"{','.join(dict.fromkeys(on_accelerators))}")
    else:
        said.append("keep the culprit layers on the CPU (a target without the accelerator keeps every layer in float)")
    return "; ".join(said) + ("; or publish it anyway with --accept-accuracy-loss, which the manifest and "
                              "`edgesdk inspect` then state")


def culprit_nodes(node: str) -> list[str]:
    """The model's node names a culprit stands for (an approximation's: the nodes it replaced, joined by ', ')."""
    return [n for n in node.split(", ") if n]


@dataclasses.dataclass(frozen=True)
class Searched:
    """One int8 segment the culprit search can compare layer by layer."""

    segment: object  # the plan's segment (its ONNX graph under `scheduled`)
    record: dict  # its quantizer's record
    artifact: Path


def searchable(plan: Plan, compressed: Path, compress: dict, tuned_int8: Path, int8: dict) -> list[Searched]:
    """The plan's int8 segments whose backend inspects its artifacts layer by layer, those under their own
    gate in compress first, then the worst by cosine, at most CULPRIT_SEGMENTS; a shared segment once."""
    found = []
    for s in plan.segments:
        b = backends.backend(s.backend)
        if not b.quantizes or not b.layers or s.same_as:
            continue
        if s.id in compress.get("segments", {}):
            found.append(Searched(s, compress["segments"][s.id], compressed / compress["segments"][s.id]["artifact"]))
        elif s.id in int8.get("segments", {}):
            found.append(Searched(s, int8["segments"][s.id], tuned_int8 / int8["segments"][s.id]["artifact"]))

    def worst(x: Searched) -> tuple:
        g = x.record.get("gate") or {}
        cosines = [p["cosine"] for p in (g.get("parts") or {}).values()]
        return (not g.get("failures"), min(cosines, default=1.0))

    return sorted(found, key=worst)[:CULPRIT_SEGMENTS]


def search(segments: list[Searched], scheduled: Path, reference: onnx.ModelProto, samples: list[dict],
           approximations: list[dict], log: Callable[[str], None], declared: dict[str, str] | None = None) -> list:
    """The layers that lose the most, over `segments`, each compared on its own inputs as `reference` (the
    fp32 model) computes them on `samples`; ranked (compression/culprits.py), at most culprits.TOP."""
    if not segments:
        return []
    samples = samples[:CULPRIT_SAMPLES]
    wanted = sorted({t for x in segments for t in x.segment.inputs})
    # a segment may start at a tensor legalize made (a rewrite's, an approximation's), which the imported fp32
    # model does not have: then its inputs come from the planned fp32 model, which computes them as the
    # bundle's float parts do
    known = {*(i.name for i in reference.graph.input), *(o for n in reference.graph.node for o in n.output)}
    source = reference if set(wanted) <= known else irm.read(scheduled / "model.onnx")
    try:
        acts = ort_backend.run_many(source, samples, wanted)
    except Exception as e:  # noqa: BLE001 - a diagnosis that fails must not hide the gate's verdict
        log(f"package: culprit search: the segments' inputs could not be computed in float ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''})")
        return []
    parts = {**measures.declared_chain(reference, declared), **measures.views(reference, declared)}
    every = []  # each segment's layers that add the most, whatever they add
    for x in segments:
        seg = x.segment
        log(f"package: culprit search: {seg.id}'s {len(seg.nodes)} nodes, int8 against float, layer by layer on "
            f"{len(samples)} held-out sample(s)")
        feeds = [{k: a[k] for k in seg.inputs} for a in acts]
        model = irm.read(scheduled / seg.artifact)
        try:
            values = backends.backend(seg.backend).int8_layers(backends.LayersJob(model, x.artifact, x.record, feeds))
            every += layers.rank(model, values, feeds, segment=seg.id, parts=parts, approximations=approximations,
                                 least=0.0)
        except Exception as e:  # noqa: BLE001 - a diagnosis that fails must not hide the gate's verdict
            log(f"package: culprit search: {seg.id} could not be compared layer by layer ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200] if str(e) else ''})")
    # ranked by what they add, those adding MIN_ADDED come first: the culprits of each segment
    found = [c for c in every if c.added_error >= layers.MIN_ADDED]
    if not found and every:
        # the loss is spread: each layer adds little, together they miss the gate (a MobileNetV2's 102 layers,
        # none adding 2 % of its range, ended at cosine 0.973 < 0.98 with nothing for the remedy to keep in
        # float); those that add the most are the culprits still
        log(f"package: culprit search: no layer adds {layers.MIN_ADDED:.0%} of its range: the loss is spread over "
            f"many; the {min(len(every), layers.TOP)} that add the most are named")
        found = every
    return sorted(found, key=lambda c: (-c.added_error, c.added_snr_db, c.node))[:layers.TOP]


def legalize_approximations(legalized: Path | None) -> list[dict]:
    """Legalize's record of its ReLU-sum approximations (their node prefixes), where it made any."""
    path = legalized / "legalize.json" if legalized else None
    if path is None or not path.is_file():
        return []
    return json.loads(path.read_text()).get("approximations") or []
