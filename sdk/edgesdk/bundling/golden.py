"""The bundle's golden self-test and its accuracy, both from running the bundle's own plan on the
build host: the very same TFLite files, and for CPU/GPU segments built for another machine (aarch64,
CUDA) the x86-64 twins compiled from the same segments and tuning records.

The self-test's tolerance for each tensor it compares is derived here and recorded in the manifest
(`golden`) with its reason, from what was measured between LiteRT on x86-64 and on aarch64 (qemu's
Cortex-A72; docs/bundle.md has the table) and, for the model's outputs, from this bundle's own
sensitivity: its plan run again with every segment output moved within what its own check allows."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx

from ..backends import onnxruntime as ort_backend
from ..backends.tflite import own as own_tflite
from ..errors import UserError
from ..ir.memory import give_back
from ..ir.numeric import compare, largest_difference, nudged
from ..runtime import manifest as mf
from ..runtime.executor import BundleModel
from ..runtime.inputs import InputError, check_feeds
from .archive import savez

ACCURACY_SAMPLES = 16  # held-out samples the bundle is compared with the fp32 model on, at most

# An int8 tensor on another CPU: LiteRT's kernels on aarch64 and x86-64 round some requantizations the
# other way (ties of an int8 multiply, one step on ~1 % of its tensor), which later layers carry to at
# most 2 steps measured (PP-OCRv4's detector; the recognizer, the classifier, YOLOv8n and MobileNetV2
# were bit-exact): twice that.
INT8_STEPS = 4
INT8_REASON = ("LiteRT's int8 kernels on aarch64 and x86-64 round some requantizations differently: measured at "
               "most 2 steps apart on a segment's output (docs/bundle.md); twice that")
# A float tensor: the float kernels' summation order differs by CPU; measured at most 1.0e-5 of the largest
# magnitude (the recognizer's softmax, fed the same inputs)
FLOAT_RTOL = 1e-4
FLOAT_REASON = ("float kernels on aarch64 and x86-64 sum in another order: measured at most 1e-5 of the largest "
                "magnitude on a segment fed the same inputs (docs/bundle.md); ten times that")
ACTIVATION_REASON = ("an int8 {op} of an input quantized at {step:.4g} per step moves its output by many steps where "
                     "the input is near its steep part: {k} steps of its input ({why}) carried through it, element by "
                     "element")
# A model output after other segments: the plan run SPREAD_DRAWS times with every segment output another
# segment reads moved within what its own check allows another CPU (an int8 one by a random step in
# {-1, 0, +1}, a float one by a random share of its tolerance in [-1, 1]; seeded: the bundle's bytes are
# reproducible); the tolerance is SPREAD_MARGIN times the largest and the mean difference this made.
SPREAD_DRAWS = 3
SPREAD_MARGIN = 2.0
# A float bundle is judged against fp32 per held-out sample: where the fp32 model's own output moves by more
# than the float tolerance when each float input element moves by CONDITION_STEP of its value (16 float32
# roundings; 4 moved a sine of 4096 products less than summing them in another order did) or when
# onnxruntime's graph optimizations are off, the model is ill-conditioned on that sample (a random-weight
# LeViT's output moved by 4.6 % of its magnitude on one), no kernel can be held to the float tolerance there,
# and the bundle is held within CONDITION_MARGIN times how far fp32 moved instead (`conditioning`): 4, as a
# kernel's roundings enter at every layer and the inputs' move once (TVM's sum of 4096 products differed by
# up to 0.86 of what fp32 moved, tests/bundling/test_float_conditioning.py; LeViT's CUDA twin by 0.25).
CONDITION_STEP = 2.0**-19
CONDITION_MARGIN = 4.0
# A 16-bit float tensor (a CPU segment OpenVINO computes in bfloat16 or float16): another CPU rounds its products
# and sums otherwise (AMX's tiles, AVX-512's dot products), so the self-test allows FLOAT16_MARGIN times how far
# the segment's output is from its float32 one on the golden inputs, measured on the build host
FLOAT16_MARGIN = 4.0
FLOAT16_REASON = ("the segment computes in {precision}, which another CPU rounds otherwise (AMX's tiles, AVX-512's dot "
                  "products): here its output was {diff:.4g} from float32's on the golden inputs; {k:g} times that")


def write_golden(bundle: Path, manifest: mf.Manifest, host_model: BundleModel, samples: list[dict]) -> dict:
    """golden/inputs.npz (the first sample), outputs.npz and boundaries.npz: every tensor crossing a
    segment boundary too, so the self-test checks each segment on its own golden inputs and a device
    whose int8 kernels round differently is judged segment by segment. Returns the manifest's
    `golden`: the tolerance of each tensor the self-test compares (`tolerances`)."""
    golden_in = samples[0]
    crossing = sorted({t.name for seg in manifest.segments for t in (*seg.inputs, *seg.outputs)}
                      - set(golden_in) - {t.name for t in manifest.outputs})
    for k, sample in enumerate(samples):  # a --calib sample the bundle would refuse (an id beyond its table)
        try:
            check_feeds(manifest.inputs, sample)
        except InputError as e:
            raise UserError("package.bad-sample", f"calibration sample {k + 1} is not a valid input: {e}",
                            "give --calib samples the deployed model accepts; " + e.hint) from None
    golden_all = host_model.run(golden_in, extra_outputs=crossing)
    (bundle / "golden").mkdir()
    savez(bundle / "golden" / "inputs.npz", golden_in)
    savez(bundle / "golden" / "outputs.npz", {t.name: golden_all[t.name] for t in manifest.outputs})
    savez(bundle / "golden" / "boundaries.npz", {n: golden_all[n] for n in crossing})
    return tolerances(host_model, manifest, {**golden_in, **golden_all})


def tolerances(host_model: BundleModel, manifest: mf.Manifest, golden: dict[str, np.ndarray]) -> dict:
    """The manifest's `golden`: for every segment output (`tensors`, checked on the segment's golden
    inputs) and every model output (`outputs`, end to end) the largest difference the self-test allows
    on another CPU, with the rule and its reason. `golden` holds the golden run's inputs and every
    tensor crossing a segment boundary."""
    tensors: dict[str, dict] = {}
    for seg, runner in host_model.runners:
        # a runner computing in a reduced float precision: its outputs on the same inputs in float32
        float32 = (runner.float32_outputs({t.name: golden[t.name] for t in seg.inputs})
                   if hasattr(runner, "float32_outputs") else None)
        for spec in seg.outputs:
            arithmetic = runner.output_arithmetic(spec) if hasattr(runner, "output_arithmetic") else None
            if arithmetic is None and spec.quant is not None:
                arithmetic = {"scale": spec.quant.scale}
            if arithmetic is None and float32 is not None:
                arithmetic = {"float32": float32[spec.name], "precision": getattr(runner, "precision", "a 16-bit float")}
            tensors.setdefault(spec.name, _tolerance(arithmetic, golden[spec.name]))
    spread = _spread(host_model, golden, tensors)
    outputs = {}
    for spec in manifest.outputs:
        own, (largest, mean) = tensors[spec.name], spread.get(spec.name, (0.0, 0.0))
        if spec.name not in spread:
            outputs[spec.name] = {**own, "reason": own["reason"] + "; no other segment's output reaches it"}
            continue
        outputs[spec.name] = {
            **own, "abs": max(own["abs"], SPREAD_MARGIN * largest), "mean_abs": max(own["abs"], SPREAD_MARGIN * mean),
            "rule": own["rule"] + f", or {SPREAD_MARGIN:g}x its spread with the segment outputs before it moved",
            "reason": own["reason"] + f"; and the segment outputs before it, each moved within its own check (an int8 "
                                      f"one by a random step in {{-1, 0, +1}}, a float one by a random share of its "
                                      f"tolerance; {SPREAD_DRAWS} draws), moved it by at most {largest:.4g} "
                                      f"({mean:.4g} on average): {SPREAD_MARGIN:g} times that"}
    return {"tensors": tensors, "outputs": outputs,
            "method": f"int8: {INT8_STEPS} steps; float: {FLOAT_RTOL:g} of the largest magnitude; model outputs "
                      f"after other segments: also {SPREAD_MARGIN:g}x the spread with the segment outputs before them "
                      f"moved within their own checks (docs/bundle.md)"}


def accuracy(host_model: BundleModel, reference: Callable[[], onnx.ModelProto], samples: list[dict],
             reference_name: str = "the imported fp32 model", *, held_out: bool = True,
             declared: dict[str, str] | None = None, own: Path | None = None) -> dict:
    """The bundle against the fp32 model (a pruned build's: the pruned one) on `samples` (the held-out
    ones, `held_out`): per output (`tensors`: cosine, max abs error, as before) and per part of an output
    as its meaning cuts it (`parts`: compression/accuracy.py, after the output's own sigmoid or softmax, or the
    one `declared` says the user's code applies).
    `own`: a quantized TFLite model as the user gave it, run by LiteRT for the reference outputs where its
    one signature takes the samples as they are (its int8 arithmetic is the model's; onnxruntime's kernels
    for the converted QDQ graph round differently); else onnxruntime runs `reference()`.
    `host_model` is released once it has run the samples, before `reference()` reads the float model:
    the two are never held at once."""
    from ..compression import accuracy as measures

    names = [o.name for o in host_model.manifest.outputs]
    got = [host_model.run(f) for f in samples]
    host_model.release()
    give_back()
    model = reference()
    ref = own_tflite.outputs(own, samples, names) if own is not None else None
    runtime = "LiteRT" if ref is not None else "onnxruntime"
    if ref is None:
        ref = ort_backend.run_many(model, samples, names)  # one session: each holds the weights again
    parts = measures.views(model, declared)
    return {"reference": f"{runtime} on {reference_name}", "samples": len(samples), "held_out": held_out,
            "tensors": compared(got, ref, names),
            "parts": measures.measure(ref, got, {n: parts[n] for n in names if n in parts})}


def compared(got: list[dict], ref: list[dict], names: list[str]) -> dict[str, dict]:
    """Per output of `names`, the bundle's values (`got`, one dict per sample) against the reference's:
    `ir.numeric.compare` over all samples, and each sample's largest difference (`sample_errors`)."""
    return {n: {**compare(np.stack([g[n] for g in got]), np.stack([r[n] for r in ref])),
                "sample_errors": [largest_difference(g[n], r[n]) for g, r in zip(got, ref)]} for n in names}


def conditioning(model: onnx.ModelProto, samples: list[dict], names: list[str]) -> dict[str, list[float]]:
    """Per output of `names`, per sample: how far the fp32 model's output moves by itself, the largest
    difference from onnxruntime's run (the reference) of two others: one with its graph optimizations off
    (other kernels, other summation orders), one on the sample's float inputs each moved by CONDITION_STEP of
    its value (a random sign each, seeded). A well-conditioned model moves by about 1e-6 of its output's
    magnitude; one whose output moves by more than the float tolerance cannot judge a kernel on that sample."""
    rng = np.random.default_rng(0)
    moved = [{k: nudged(v, rng, CONDITION_STEP) for k, v in f.items()} for f in samples]
    ref = ort_backend.run_many(model, samples, names)  # as `accuracy` runs it
    unoptimized = ort_backend.run_many(model, samples, names, optimized=False)
    moved_out = ort_backend.run_many(model, moved, names)
    return {n: [max(largest_difference(a[n], r[n]), largest_difference(b[n], r[n]))
                for r, a, b in zip(ref, unoptimized, moved_out)] for n in names}


def _tolerance(arithmetic: dict | None, golden: np.ndarray) -> dict:
    """One tensor's tolerance: int8 steps (`arithmetic`: how its segment computed it, `output_arithmetic`
    of the runtime's TFLite runner), carried through the activation that made it; a 16-bit float's distance
    from float32 (`arithmetic["float32"]`: its segment's float32 output); or float."""
    largest = float(np.max(np.abs(golden))) if golden.size else 0.0
    if arithmetic is None:
        return {"abs": FLOAT_RTOL * max(largest, 1e-12), "rule": "1e-4 relative", "reason": FLOAT_REASON}
    if "float32" in arithmetic:
        diff = largest_difference(golden, arithmetic["float32"])
        precision = {"bf16": "bfloat16", "f16": "float16"}.get(arithmetic.get("precision"), "a 16-bit float")
        return {"abs": max(FLOAT_RTOL * max(largest, 1e-12), FLOAT16_MARGIN * diff),
                "rule": f"{FLOAT16_MARGIN:g}x its distance from float32",
                "reason": FLOAT16_REASON.format(precision=precision, diff=diff, k=FLOAT16_MARGIN)}
    step = arithmetic["scale"]
    out = {"abs": INT8_STEPS * step, "lsb": INT8_STEPS, "scale": step,
           "rule": f"{INT8_STEPS} LSB of {step:.4g}", "reason": INT8_REASON}
    if "activation" in arithmetic:
        op, before = arithmetic["activation"], arithmetic["input_scale"]
        out.update(activation={"op": op, "input_scale": before,
                               **({"input": arithmetic["input"]} if "input" in arithmetic else {})},
                   rule=f"{INT8_STEPS} LSB of the {op}'s input ({before:.4g} each) carried through it, per element",
                   reason=ACTIVATION_REASON.format(op=op, step=before, k=INT8_STEPS, why=INT8_REASON))
    return out


def _spread(host_model: BundleModel, golden: dict[str, np.ndarray],
            tensors: dict[str, dict]) -> dict[str, tuple[float, float]]:
    """Per model output that another segment's output reaches, the largest and the mean difference from
    the golden run when every segment output a later segment reads is moved within what its own check
    (`tensors`) allows another CPU: an int8 one by a random quantization step in {-1, 0, +1}, a float one
    by a random share in [-1, 1] of its tolerance. How far the rest of the plan carries a difference."""
    manifest = host_model.manifest
    read = {t.name for seg in manifest.segments for t in seg.inputs}
    moved = {n: t for n, t in tensors.items() if n in read}
    if not moved:
        return {}
    out: dict[str, tuple[float, float]] = {}
    for draw in range(SPREAD_DRAWS):
        rng = np.random.default_rng(draw)
        env = {t.name: golden[t.name] for t in manifest.inputs}
        made = {}  # each tensor as its segment made it: a model output is judged unmoved
        reached = set()  # the tensors a moved one flows into
        for seg, runner in host_model.runners:
            if seg.replica:
                continue
            made.update(runner.run({t.name: env[t.name] for t in seg.inputs}))
            if any(t.name in moved or t.name in reached for t in seg.inputs):
                reached.update(t.name for t in seg.outputs)
            for t in seg.outputs:
                env[t.name] = _moved(made[t.name], moved[t.name], rng) if t.name in moved else made[t.name]
        for spec in manifest.outputs:
            if spec.name not in reached:
                continue
            err = np.abs(np.asarray(made[spec.name], np.float64) - golden[spec.name])
            largest, mean = out.get(spec.name, (0.0, 0.0))
            out[spec.name] = (max(largest, float(np.max(err, initial=0.0))),
                              max(mean, float(np.mean(err)) if err.size else 0.0))
    return out


def _moved(value: np.ndarray, tolerance: dict, rng: np.random.Generator) -> np.ndarray:
    """`value` moved as another CPU may move it: a random int8 step, or a random share of a float tolerance."""
    if "lsb" in tolerance:
        step = rng.integers(-1, 2, value.shape) * tolerance["scale"]
    else:
        step = rng.uniform(-1.0, 1.0, value.shape) * tolerance["abs"]
    return np.asarray(value + step).astype(value.dtype)  # a 0-d value's sum is a numpy scalar: an array again
