"""compress: quantize every Edge TPU segment to a full-int8 TFLite model.

Needs: the plan and its segment models; calibration data (`--calib DIR`), or none.
Guarantees: `segments/<id>.tflite` for each Edge TPU segment, converted by TensorFlow's converter
from our own NHWC lowering with per-channel int8 weights, and `compress.json` with each segment's
tensor specs (layout permutation, quantization) and its accuracy against the float segment.

Calibration: `--calib DIR` holds `.npy` files (one sample shaped like the model's input, or a stack
of samples along a new first axis) for a single-input model, or `.npz` files with one array per
input name, or images for a model with one image input (`--calib-preprocess` states how pixels
become inputs: ir/calibration.py). The float model runs on them with onnxruntime to get each
segment's own inputs. With no `--calib`, synthetic samples (uniform in [-1, 1], seeded) are used,
and the build says so in its output and in the manifest: int8 ranges then do not reflect real data.

`--calib-method minmax` (the default) takes each activation's range from the smallest and largest
value seen; `percentile` from the `--calib-percentile` (99.99) percentiles, clipping rare outliers
(backends/tflite/narrowing.py). The method goes into `compress.json` and the manifest's `calibration`.

Shared segments (`PlanSegment.same_as`: a captioner's per-frame CNN) are quantized once, the first of
them calibrated on every one's inputs (interleaved, at most `SHARED_SAMPLES` times the calibration
samples); the others' records name it (`same_as`) and carry its int8 model with their own tensor names.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx

from ... import backends
from ...backends import onnxruntime as ort_backend
from ...ir.calibration import load_calibration
from ...ir.digest import tree_sha256
from ...scheduling.plan import Plan

SHARED_SAMPLES = 2  # a shared segment calibrates on at most this many times the samples, from all its uses
OPTIONS = ("calib", "calib_samples", "calib_method", "calib_percentile", "calib_preprocess", "seed")
READS = ("import", "schedule")  # the earlier stages whose outputs it reads (its cache key covers them)


def cache_inputs(options, target) -> dict:
    return {"calib_sha256": tree_sha256(Path(options.calib)) if options.calib else None}


def run(artifact: Path, ctx) -> dict:
    # the tune stage's output is upstream of us, but what we quantize is the schedule's
    sched = ctx.artifact("schedule")
    plan = Plan.load(sched)
    quantized = [s for s in plan.segments if backends.backend(s.backend).quantizes]
    io = json.loads((ctx.artifact("import") / "import.json").read_text())
    (ctx.out / "segments").mkdir()
    record: dict = {"segments": {}, "calibration": {}}
    if not quantized:
        (ctx.out / "compress.json").write_text(json.dumps(record, indent=2) + "\n")
        return {"int8_segments": 0}

    samples, calib_info = load_calibration(ctx.options, io["inputs"])
    calib_info = {**calib_info, "method": ctx.options.calib_method}
    if ctx.options.calib_method == "percentile":
        calib_info["percentile"] = ctx.options.calib_percentile
    record["calibration"] = calib_info
    if calib_info["synthetic"]:
        ctx.warn(f"no --calib data: int8 ranges come from {len(samples)} synthetic samples (uniform in [-1, 1]); "
                 "accuracy on real inputs may be worse")

    full = onnx.load(str(sched / "model.onnx"))
    wanted = sorted({t for s in quantized for t in s.inputs + s.outputs})
    ctx.log(f"compress: running the float model on {len(samples)} calibration samples")
    acts = [ort_backend.run(full, feeds, wanted) for feeds in samples]
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
        entry = backends.backend(seg.backend).quantize(backends.QuantizeJob(
            segment=seg, model=onnx.load(str(sched / seg.artifact)), samples=samples, out_dir=ctx.out / "segments",
            method=ctx.options.calib_method, percentile=ctx.options.calib_percentile, log=ctx.log))
        record["segments"][seg.id] = entry
        for u in uses[1:]:
            rename = dict(zip(names, u.inputs + u.outputs))
            record["segments"][u.id] = {**entry, "same_as": seg.id,
                                        **{k: [{**t, "name": rename[t["name"]]} for t in entry[k]]
                                           for k in ("inputs", "outputs")},
                                        "accuracy_vs_float": {rename[o]: a for o, a in entry["accuracy_vs_float"].items()}}
        worst = min(a["cosine"] for a in entry["accuracy_vs_float"].values())
        ctx.log(f"compress: {seg.id}: cosine similarity to float {worst:.5f}")
    (ctx.out / "compress.json").write_text(json.dumps(record, indent=2) + "\n")
    return {"int8_segments": len(quantized), "calibration": calib_info,
            "accuracy_vs_float": {k: v["accuracy_vs_float"] for k, v in record["segments"].items()}}
