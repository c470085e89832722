"""compress: quantize every Edge TPU segment to a full-int8 TFLite model; with `--prune`, prune the CPU's layers.

Needs: the plan and its segment models; calibration data (`--calib DIR`), or none.
Guarantees: `segments/<id>.tflite` for each Edge TPU segment, converted by TensorFlow's converter
from our own NHWC lowering with per-channel int8 weights, and `compress.json` with each segment's
tensor specs (layout permutation, quantization) and its accuracy against the float segment.

Accuracy: the segments are calibrated on three quarters of the samples; on the quarter held out
(`held_out_split`, the package stage's split of the same samples) each segment's int8 model is run
against the float segment on its own inputs, its outputs judged by the target's accuracy gate as the
model's are (compression/accuracy.py): `compress.json`'s `segments.<id>.gate`, what the package
stage's culprit search starts from (docs/accuracy.md). Recorded and logged, never refused here.

Calibration: `--calib DIR` holds `.npy` files (one sample shaped like the model's input, or a stack
of samples along a new first axis) for a single-input model, or `.npz` files with one array per
input name, or images for a model with one image input (`--calib-preprocess` states how pixels
become inputs: ir/calibration.py). The float model runs on them with onnxruntime to get each
segment's own inputs. With no `--calib`, synthetic samples (seeded) are used, each input uniform over
its range: `--input-range`, else the range `--calib-preprocess` gives 8-bit pixels, else the one the
model states (metadata, an index input's table), else [-1, 1] (ir/calibration.py `input_ranges`); the
build warns that int8 accuracy on real inputs is unknown, and the manifest's `calibration` says so.

`--calib-method` chooses each activation's range (ir/calibrators.py, backends/tflite/narrowing.py):
`minmax` (the smallest and largest value seen), `percentile` (the `--calib-percentile` percentiles),
`mse` (least squared error through int8), `entropy` (TensorRT's KL), or `auto` (the default with
`--calib` data; minmax without), per tensor the method of least measured error. `compress.json` records
each segment's ranges (with auto, each tensor's method and error by every method) and the manifest's
`calibration` the method and how many tensors each method calibrated (`methods`).

Pruning (`--prune METHOD`, `--prune-layers`, `--prune-plan`, `--prune-correct`, `--eval`; compression/): the
layers the tune stage's plan names (`prune_plan.json`, the one file of that stage this one reads: by default
the prunable layers that run on the CPU but the first and last, each with `--prune`'s method, or each with its
own from a plan file or the auto plan) are pruned in the whole model and written as `pruned.onnx`; the
package stage puts those weights into the CPU segments. An accelerator's layers stay
dense: the Edge TPU computes every weight, zero or not. With `--prune-correct`, the kept weights are refit
by least squares on three quarters of the calibration samples. `compress.json`'s `pruning` records each
layer and the pruned model's fidelity to the dense one (cosine, max error, top-1 agreement, per layer and
end to end; on the held-out quarter when corrected): fidelity on the calibration data, not accuracy, and
no retraining; with `--eval DIR`, top-1 accuracy on its labelled samples beside it (where `--task` is
classification or not given; the package stage measures every task on the finished bundle). The Edge TPU segments
are then calibrated on the pruned model's activations.

Shared segments (`PlanSegment.same_as`: a captioner's per-frame CNN) are quantized once, the first of
them calibrated on every one's inputs (interleaved, at most `SHARED_SAMPLES` times the calibration
samples); the others' records name it (`same_as`) and carry its int8 model with their own tensor names.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx

from ... import backends
from ...backends import onnxruntime as ort_backend
from ...compression import build as pruning
from ...compression import accuracy as measures
from ...compression import correct_weights, fidelity
from ...compression.fidelity import accuracy
from ...errors import UserError
from ...ir import model as irm
from ...ir.calibration import LABELS, load_calibration, load_labelled, synthetic_warnings
from ...ir.digest import tree_sha256
from ...ir.memory import give_back
from ...ir.grids import grids as quantized_grids
from ...runtime.backends import open_runner
from ...runtime.manifest import Segment, tensor_from_dict
from ...scheduling.plan import Plan
from ...scheduling.selection import held_out_split
from . import auto, reuse

SHARED_SAMPLES = 2  # a shared segment calibrates on at most this many times the samples, from all its uses
OPTIONS = ("calib", "calib_samples", "calib_method", "calib_percentile", "calib_preprocess", "input_ranges", "seed",
           "prune", "prune_layers", "prune_correct", "sparse_kernels", "prune_plan", "eval_data", "task", "decoder",
           "task_options", "output_activations")
PRUNED = "pruned.onnx"  # the whole model with its CPU layers pruned (written only with --prune)
READS = ("import", "schedule")  # the earlier stages whose outputs it reads (its cache key covers them)
# and of the tune stage only its pruning plan: a new tuning database reruns tune, not the int8 conversion here
READS_FILES = {"tune": (pruning.PLAN_FILE,)}


def cache_inputs(options, target) -> dict:
    return {"calib_sha256": tree_sha256(Path(options.calib)) if options.calib else None,
            **({"eval_sha256": tree_sha256(Path(options.eval_data)) if Path(options.eval_data).is_dir() else None}
               if options.eval_data else {})}


def run(artifact: Path, ctx) -> dict:
    # the tune stage's output is upstream of us, but what we quantize is the schedule's
    sched = ctx.artifact("schedule")
    plan = Plan.load(sched)
    quantized = [s for s in plan.segments if backends.backend(s.backend).quantizes]
    io = json.loads((ctx.artifact("import") / "import.json").read_text())
    (ctx.out / "segments").mkdir()
    record: dict = {"segments": {}, "calibration": {}}
    prunes = bool(ctx.options.prune or ctx.options.prune_plan)
    if not quantized and not prunes:
        (ctx.out / "compress.json").write_text(json.dumps(record, indent=2) + "\n")
        return {"int8_segments": 0}

    samples, calib_info = load_calibration(ctx.options, io["inputs"])
    method = ctx.options.calibration_method()
    calib_info = {**calib_info, "method": method}
    if method in ("percentile", "auto"):
        calib_info["percentile"] = ctx.options.calib_percentile
    record["calibration"] = calib_info
    if calib_info["synthetic"]:
        for line in synthetic_warnings(calib_info, len(samples), "int8 ranges are calibrated" if quantized else
                                       "the pruned model's fidelity is measured"):
            ctx.warn(line)
    elif ctx.options.input_ranges:
        ctx.warn("--input-range shapes synthetic calibration samples only: with --calib the samples are real, and "
                 f"the ranges given ({', '.join(sorted(ctx.options.input_ranges))}) are not used")

    full = irm.read(sched / "model.onnx")
    if prunes:
        full = _prune(full, samples, ctx, record)
    if not quantized:
        (ctx.out / "compress.json").write_text(json.dumps(record, indent=2) + "\n")
        return {"int8_segments": 0, "pruning": _summary(record["pruning"])}
    # and the model's outputs, which auto's candidates are weighed by (auto.py)
    wanted = sorted({t for s in quantized for t in s.inputs + s.outputs} | set(plan.outputs))
    ctx.log(f"compress: running the float model on {len(samples)} calibration samples")
    acts = ort_backend.run_many(full, samples, wanted)  # one session: each holds the weights once more
    grids = quantized_grids(full)  # the tensors a quantized model had rounded itself: they keep its grids
    if grids:
        record["calibration"]["model_grids"] = len(grids)
    del full  # each segment is read from its own file: the whole model is not held while TensorFlow converts
    give_back()  # and what the session freed goes back before the converter runs
    inputs = samples  # the model's: `samples` is each segment's own below
    # calibrated on three quarters, gated on the quarter held out: the package stage's split of the same samples
    acts, held = held_out_split(acts)
    gate = measures.Gate.of(ctx.target.accuracy)
    declared = measures.declared(ctx.options)  # outputs read through an activation the model does not hold
    parts = measures.views(irm.read(ctx.artifact("import") / "model.onnx"), declared)
    if not calib_info["synthetic"]:
        for line in unlit_scores(acts, parts):
            ctx.warn(line)
    record["accuracy_gate"] = gate.to_json()
    # an earlier plan's conversions of the same segments (the accuracy remedy's rounds), unless --from asks anew
    kept = reuse.Kept(ctx.build_dir, ctx.sdk, enabled=bool(ctx.sdk) and ctx.options.start is None)
    for seg in quantized:
        if seg.same_as:
            continue
        uses = [seg, *(s for s in quantized if s.same_as == seg.id)]
        names = seg.inputs + seg.outputs
        # every use's own tensors under this segment's names, interleaved: sample 0 of each use, then 1, ...
        samples = [{k: a[t] for k, t in zip(names, u.inputs + u.outputs)} for a in acts for u in uses]
        if len(uses) > 1:
            samples = samples[:SHARED_SAMPLES * len(acts)]
            ctx.log(f"compress: {seg.id}: also stands for {', '.join(u.id for u in uses[1:])} (the same graph and "
                    f"weights): calibrated on {len(samples)} samples of their inputs")
        job = backends.QuantizeJob(
            segment=seg, model=irm.read(sched / seg.artifact), samples=samples, out_dir=ctx.out / "segments",
            method=method, percentile=ctx.options.calib_percentile, log=ctx.log, alternatives=method == "auto",
            activations={o: declared[o] for o in seg.outputs if o in declared},
            model_inputs=tuple(i for i in seg.inputs if i in plan.inputs), grids=grids)
        entry = kept.quantized(seg, job, sched / seg.artifact, lambda: backends.backend(seg.backend).quantize(job),
                               ctx.log)
        record["segments"][seg.id] = entry
        for u in uses[1:]:
            rename = dict(zip(names, u.inputs + u.outputs))
            record["segments"][u.id] = {**entry, "same_as": seg.id,
                                        **{k: [{**t, "name": rename[t["name"]]} for t in entry[k]]
                                           for k in ("inputs", "outputs")},
                                        "accuracy_vs_float": {rename[o]: a for o, a in entry["accuracy_vs_float"].items()}}
        worst = min(a["cosine"] for a in entry["accuracy_vs_float"].values())
        ctx.log(f"compress: {seg.id}: cosine similarity to float {worst:.5f}")
    kept.forget_unused()
    if method == "auto":
        # the model's inputs of the calibration samples, the held-out ones aside, as `acts` holds their outputs
        chosen = auto.choose(plan, sched, ctx.out, record["segments"], inputs[:len(acts)],
                             [{o: a[o] for o in plan.outputs} for a in acts], ctx.log, parts)
        if chosen is not None:
            calib_info["auto"] = chosen
    # each segment as it ships (after auto's whole-model choice), against its float segment on held-out samples
    for seg in (s for s in quantized if not s.same_as):
        entry = record["segments"][seg.id]
        entry["gate"] = _segment_gate(seg, entry, [{k: a[k] for k in seg.inputs + seg.outputs} for a in held],
                                      held is not acts, parts, gate, ctx)
    for seg in (s for s in quantized if s.same_as):
        record["segments"][seg.id]["gate"] = {**record["segments"][seg.same_as]["gate"], "of": seg.same_as}
    calib_info["methods"] = method_counts(record["segments"])
    (ctx.out / "compress.json").write_text(json.dumps(record, indent=2) + "\n")
    out = {"int8_segments": len(quantized), "calibration": calib_info,
           "accuracy_vs_float": {k: v["accuracy_vs_float"] for k, v in record["segments"].items()}}
    return {**out, "pruning": _summary(record["pruning"])} if "pruning" in record else out


def unlit_scores(acts: list[dict], parts: dict) -> list[str]:
    """A warning for each sigmoid scores part (a detector's class scores, declared or in the graph) that no
    calibration sample in `acts` (the float model's outputs) raises to where a score decides (`DECIDES`, the
    accuracy gate's: no detection, no decision was calibrated): the int8 ranges of what
    computes it saw background only (nudenet's YOLOv8n calibrated on photographs without people read a
    third fewer of the people on held-out ones than calibrated with faces among them)."""
    out = []
    for name, vs in parts.items():
        if not acts or name not in acts[0]:
            continue
        for v in vs:
            if v.kind != measures.SCORES or v.activation != "sigmoid":
                continue
            best = max(float(np.max(v.of(np.asarray(a[name]), batched=False))) for a in acts)
            if best < measures.DECIDES:
                out.append(f"{v.name}: no calibration sample raises a score above {best:.3g} (of 1), so the int8 "
                           "ranges of the layers computing it were calibrated on background alone and may cut "
                           "what a detection needs: calibrate on inputs that hold what the model detects")
    return out


def _segment_gate(seg, entry: dict, held: list[dict], held_out: bool, parts: dict, gate, ctx) -> dict:
    """The segment's int8 model against the float segment on its own held-out inputs (as the fp32 model
    computes them), each output judged as the model's own outputs are (`parts`; a tensor between segments
    by the segment's own graph): the figures the culprit search starts from. Recorded and said, never refused here: the
    package stage judges the bundle end to end."""
    runner = open_runner(ctx.out, Segment(id=seg.id, device="cpu", backend=backends.backend(seg.backend).runner,
                                          artifact=entry["artifact"], fallback_artifact=entry["artifact"],
                                          inputs=tuple(tensor_from_dict(t) for t in entry["inputs"]),
                                          outputs=tuple(tensor_from_dict(t) for t in entry["outputs"])), None)
    got = [runner.run({k: s[k] for k in seg.inputs}) for s in held]
    own = measures.views(irm.read(ctx.artifact("schedule") / seg.artifact))  # a tensor between segments: by its own graph
    judged = {o: parts.get(o) or own.get(o) or [measures.View(o, measures.VALUES)] for o in seg.outputs}
    figures = measures.measure([{o: s[o] for o in seg.outputs} for s in held], got, judged)
    failures = measures.judge(figures, gate)
    on = f"{len(held)} held-out sample(s)" if held_out else "its calibration sample (none held out)"
    if failures:
        ctx.log(f"compress: {seg.id}: int8 against its float segment on {on}: under the accuracy gate: "
                + "; ".join(f.describe() for f in failures))
    else:
        ctx.log(f"compress: {seg.id}: int8 against its float segment on {on}: within the accuracy gate")
    return {"samples": len(held), "held_out": held_out, "parts": figures, "failures": [f.to_json() for f in failures]}


def _prune(dense: onnx.ModelProto, samples: list[dict], ctx, record: dict) -> onnx.ModelProto:
    """The model with the tune stage's plan pruned (and corrected), written as PRUNED; its record in `record`."""
    opts = ctx.options
    plan_file = ctx.file("tune", pruning.PLAN_FILE)
    planned = json.loads(plan_file.read_text())
    pruned, layers, chosen = pruning.prune_for_build(dense, pruning.load_plan(plan_file, dense), opts.sparse_kernels)
    methods = sorted({r["method"] for r in layers})
    entry: dict = {"method": ", ".join(methods) if methods else (opts.prune or "none"),
                   "plan": {k: v for k, v in planned.items() if k in ("source", "budget_ms", "predicted_ms",
                                                                      "measured_ms", "dense_ms")},
                   "layers_spec": opts.prune_layers or ("the plan's" if opts.prune_plan else "all but the first and last"),
                   "retrained": False, "layers": layers}
    accel = planned.get("accelerator_layers_dense", [])
    if accel:
        entry["accelerator_layers_dense"] = accel
        ctx.log(f"compress: prune: the Edge TPU gains nothing from sparsity (it computes every weight, zero or not): "
                f"its {len(accel)} prunable layer(s) stay dense; only the CPU's layers are pruned")
    if not chosen:
        ctx.warn((f"--prune-plan {opts.prune_plan}: the plan prunes no layer on the CPU" if opts.prune_plan else
                  f"--prune {opts.prune}: no layer to prune on the CPU ("
                  + ("--prune-layers chose none of its layers" if opts.prune_layers else
                     "it runs no prunable layer besides the first and last, which stay dense by default") + ")")
                 + "; the model is unchanged")
    fit, held = held_out_split(samples) if opts.prune_correct else (samples, samples)
    uncorrected = pruned
    if opts.prune_correct and chosen:
        before = fidelity(dense, pruned, held, [])["end_to_end"]
        ctx.log(f"compress: prune: refitting the kept weights of {len(chosen)} layer(s) by least squares on "
                f"{len(fit)} calibration sample(s)")
        pruned, corrected = correct_weights(dense, pruned, chosen, layers, fit)
        entry["correction"] = {"method": "least squares on the kept weights (damped conjugate gradients)",
                               "samples": len(fit), "held_out": len(held) if held is not fit else 0,
                               "end_to_end_before": before, "layers": corrected}
    outputs = [r["output"] for r in layers]
    measured = fidelity(dense, pruned, held, outputs)
    entry["fidelity"] = {"against": "the dense model (onnxruntime), on "
                         + ("the held-out calibration samples" if held is not fit else "the calibration samples"),
                         "samples": measured["samples"], "end_to_end": measured["end_to_end"]}
    for r in layers:
        r["fidelity"] = measured["layers"][r["output"]]
    kept = sum(r["kept"] for r in layers)
    size = sum(r["size"] for r in layers)
    entry["sparsity"] = round(1 - kept / size, 4) if size else 0.0
    if opts.eval_data and opts.task in (None, "classification"):  # another task is measured on the bundle alone
        entry["accuracy"] = _accuracy(dense, uncorrected, pruned if "correction" in entry else None, ctx)
    record["pruning"] = entry
    irm.save(pruned, ctx.out / PRUNED)
    for name, f in measured["end_to_end"].items():
        top1 = f"top-1 agreement {f['top1_agreement']:.3f}, " if f["top1_agreement"] is not None else ""
        ctx.log(f"compress: prune {entry['method']}: {len(chosen)} layer(s), {entry['sparsity']:.1%} of their weights zero; "
                f"fidelity of output '{name}' to the dense model: cosine {f['cosine']:.5f}, {top1}"
                f"max error {f['max_error_of_scale']:.2%} of its scale (no retraining"
                f"{', least-squares correction' if 'correction' in entry else ''})")
    return pruned


def _accuracy(dense: onnx.ModelProto, pruned: onnx.ModelProto, corrected: onnx.ModelProto | None, ctx) -> dict:
    """`--eval DIR`: top-1 accuracy on its labelled samples of the dense model, the pruned one and (with
    `--prune-correct`) the corrected one, by onnxruntime."""
    io = json.loads((ctx.artifact("import") / "import.json").read_text())
    samples, labels, info = load_labelled(Path(ctx.options.eval_data), io["inputs"], ctx.options.calib_preprocess)
    models = {"dense": dense, "pruned": pruned, **({"corrected": corrected} if corrected is not None else {})}
    try:
        got = accuracy(models, samples, labels)
    except ValueError as e:
        raise UserError("compress.eval-labels", f"--eval {ctx.options.eval_data}: {e}",
                        f"{LABELS} holds one integer class per row of the model's first output, in sample order") from None
    top1 = got["top1"]
    final = "corrected" if corrected is not None else "pruned"
    ctx.log(f"compress: prune: top-1 accuracy on {got['labels']} labelled sample(s) of --eval: dense "
            f"{top1['dense']:.2%}, pruned {top1['pruned']:.2%}"
            + (f", corrected {top1['corrected']:.2%}" if corrected is not None else "")
            + f" ({(top1[final] - top1['dense']) * 100:+.2f} points)")
    return {**got, "samples": info["samples"], "source": info["source"]}


def method_counts(segments: dict) -> dict[str, int]:
    """How many activations each calibration method chose, over the segments quantized (a segment that
    stands for others counted once): the manifest's calibration summary."""
    counts: dict[str, int] = {}
    for entry in segments.values():
        if entry.get("same_as"):
            continue
        ranges = entry.get("ranges") or {}
        for m, n in (ranges.get("methods") or {ranges.get("method", "minmax"): ranges.get("tensors")}).items():
            if n:
                counts[m] = counts.get(m, 0) + n
    return counts


def _summary(entry: dict) -> dict:
    """The stage record's short form of the pruning: what the build summary shows."""
    return {"method": entry["method"], "layers": len(entry["layers"]), "sparsity": entry["sparsity"],
            "corrected": "correction" in entry, "fidelity": entry["fidelity"]["end_to_end"],
            "accelerator_layers_dense": len(entry.get("accelerator_layers_dense", [])),
            **({"accuracy": entry["accuracy"]["top1"]} if "accuracy" in entry else {})}
