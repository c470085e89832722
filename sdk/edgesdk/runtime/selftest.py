"""The golden self-test: run the bundle on its stored input and compare with the stored output.

The golden output was produced at build time by this same plan on the build host (the very same
TFLite files; x86-64 twins of foreign CPU code). Each segment is checked on its own golden inputs
(`golden/boundaries.npz` holds every tensor that crosses a segment boundary), then every model output
end to end, each against the tolerance the build recorded for it in the manifest (`golden`), with
its reason (bundling/golden.py derives them; docs/bundle.md has the measurements they come from):

- an int8 tensor: `lsb` quantization steps. Another CPU's kernels round some requantizations the
  other way (ties), and later layers carry that on: measured up to 2 steps between aarch64 and x86-64;
- an int8 tensor made by a LOGISTIC, TANH or SOFTMAX: those steps of the activation's input carried
  through the activation, element by element (a logistic of logits quantized at 0.88 per step moves
  its output by up to 0.22 per step where the logit is near 0, and by little where it saturates);
- a float tensor: 1e-4 of its largest magnitude (float kernels differ by summation order);
- a model output that other segments' outputs reach: also twice the largest and twice the mean
  difference the build measured when it moved each of those outputs within its own check.

A bundle from before tolerances were recorded (no `golden` in its manifest) is judged by 1 LSB and
1e-4 relative, segment by segment; an end-to-end difference is then only a note where every segment
matches.

A segment the Edge TPU runs is judged by the same tolerance; the Edge TPU's own rounding is not
measured (Coral documents no bound against the CPU interpreter), so a failure there says so.

Then a short pipelined stream (`BundleModel.stream`, one worker per device): STREAM_FRAMES frames,
alternately the golden input and a variant of it (float inputs reversed along their last axis), so
that results in the wrong order would show; each streamed result must equal, bit for bit, what
`run()` gives for the same frame on this device. The stream's and the sequential runs' wall times
are reported (under emulation they show that it runs, not how fast a board is).
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

from .executor import BundleModel

FLOAT_RTOL = 1e-4
STREAM_FRAMES = 4


def selftest(bundle: Path) -> dict:
    bundle = Path(bundle)
    model = BundleModel(bundle, log=lambda s: print(s, file=sys.stderr))
    recorded = model.manifest.golden
    inputs = dict(np.load(bundle / "golden" / "inputs.npz"))
    expected = dict(np.load(bundle / "golden" / "outputs.npz"))
    got = model.run(inputs)
    end_to_end = recorded.get("outputs", {})
    boundaries = bundle / "golden" / "boundaries.npz"
    golden = {**inputs, **(dict(np.load(boundaries)) if boundaries.exists() else {}), **expected}
    results = [compare(spec, got[spec.name], expected[spec.name], end_to_end.get(spec.name) if recorded else None,
                       golden)
               for spec in model.manifest.outputs]
    outputs_ok = all(r["passed"] for r in results)
    notes = list(model.notes)
    segments = []
    if boundaries.exists():  # bundles from before per-segment goldens have only the end-to-end check
        tensors = recorded.get("tensors", {})
        for seg, runner in model.runners:
            out = runner.run({t.name: golden[t.name] for t in seg.inputs})
            checks = [compare(t, out[t.name], golden[t.name], tensors.get(t.name) if recorded else None, golden)
                      for t in seg.outputs]
            segments.append({"segment": seg.id, "device": seg.device, "passed": all(c["passed"] for c in checks),
                             "outputs": checks})
            if getattr(runner, "on_accelerator", False) and not segments[-1]["passed"]:
                notes.append(f"segment {seg.id} ran on {seg.device}: its tolerance comes from measurements between "
                             "CPU kernels, and the Edge TPU's own int8 rounding is not characterized (Coral documents "
                             "no bound against the CPU interpreter's results)")
    segments_ok = all(s["passed"] for s in segments)
    stream = stream_check(model, inputs)
    # without recorded tolerances an end-to-end difference is excused where every segment matches
    ok = segments_ok and (outputs_ok or (bool(segments) and not recorded)) and stream["passed"]
    if segments and segments_ok and not outputs_ok:
        notes.append("every segment matches its golden output, but the model's output differs end to end: "
                     + ("more than the build measured when it moved the segment outputs before it"
                        if recorded else "int8 rounding on this device differs from the build host's within 1 LSB "
                        "and later segments amplify it"))
    return {"passed": ok, "arch": platform.machine(), "outputs": results, "segments": segments, "notes": notes,
            "stream": stream, "load_seconds": round(model.load_seconds, 3)}


def stream_check(model: BundleModel, inputs: dict[str, np.ndarray], frames: int = STREAM_FRAMES) -> dict:
    """Stream `frames` frames through the device pipeline and compare each with `run()`."""
    variant = {k: np.ascontiguousarray(np.flip(v, -1)) if v.dtype.kind == "f" and v.ndim else v
               for k, v in inputs.items()}
    feeds = [inputs if k % 2 == 0 else variant for k in range(frames)]
    t0 = time.perf_counter()
    expected = [model.run(f) for f in feeds]
    sequential = time.perf_counter() - t0
    t0 = time.perf_counter()
    got, error = [], None
    try:
        for out in model.stream(feeds):
            got.append(out)
    except Exception as e:  # noqa: BLE001 -- a stream that fails is a failed check, reported with its reason
        error = f"{type(e).__name__}: {e}"
    streamed = time.perf_counter() - t0
    # a frame the stream never gave counts as one that differs
    wrong = [k for k, (g, e) in enumerate(zip(got, expected))
             if set(g) != set(e) or any(not np.array_equal(g[n], e[n]) for n in e)] + list(range(len(got), frames))
    return {"frames": frames, "passed": error is None and not wrong, "mismatched_frames": wrong, "error": error,
            "sequential_seconds": round(sequential, 4), "stream_seconds": round(streamed, 4)}


def compare(spec, got: np.ndarray, expected: np.ndarray, tolerance: dict | None,
            golden: dict[str, np.ndarray] | None = None) -> dict:
    """`got` against `expected`, element by element, within `tolerance` (a manifest `golden` entry; None:
    the rules of bundles from before they were recorded; `golden`: the golden tensors, where an
    activation's input is looked up). Where the bound differs by element, the tolerance shown is that of
    the element using the largest share of its bound."""
    exp = np.asarray(expected, dtype=np.float64)
    out = np.asarray(got, dtype=np.float64)
    bound, rule = allowed(spec, exp, tolerance, golden)
    result = {"output": spec.name, "max_abs_error": float("inf"), "tolerance": float(np.max(bound, initial=0.0)),
              "rule": rule, "passed": False}
    if out.shape != exp.shape:
        return result
    err = np.abs(out - exp)
    if not exp.size:
        return {**result, "max_abs_error": 0.0, "passed": True}
    per_element = np.ndim(bound) > 0
    bound = np.broadcast_to(bound, exp.shape)
    with np.errstate(divide="ignore", invalid="ignore"):  # the element using the largest share of its bound
        share = np.where(np.isnan(err), np.inf, err / bound)
    at = np.unravel_index(np.argmax(np.where(np.isnan(share), 0.0, share)), exp.shape)
    result.update(max_abs_error=float(np.max(err)), tolerance=float(bound[at]), passed=bool(np.all(err <= bound)))
    if per_element:  # the bound differs by element: the one nearest it (or furthest beyond) is shown too
        result["nearest"] = {"index": [int(i) for i in at], "error": float(err[at])}
    if tolerance is not None and "mean_abs" in tolerance:
        mean = float(np.mean(err))
        result.update(mean_abs_error=mean, mean_tolerance=tolerance["mean_abs"],
                      passed=result["passed"] and mean <= tolerance["mean_abs"])
    return result


def allowed(spec, expected: np.ndarray, tolerance: dict | None,
            golden: dict[str, np.ndarray] | None = None) -> tuple[np.ndarray | float, str]:
    """The largest difference from `expected` allowed, per element or for all, and the rule in words.
    `golden` holds the golden tensors an activation's input may be found in."""
    if tolerance is None:
        if spec.quant is not None:
            return spec.quant.scale * 1.0001, "1 LSB"
        return FLOAT_RTOL * max(float(np.max(np.abs(expected))) if expected.size else 0.0, 1e-12), "1e-4 relative"
    rule = tolerance.get("rule", "recorded")
    act = tolerance.get("activation")
    if act is None or not expected.size:
        return tolerance["abs"], rule
    before = (golden or {}).get(act.get("input", ""))
    if before is not None and np.shape(before) != expected.shape:
        before = None
    carried = through(act["op"], expected, tolerance["scale"], tolerance["lsb"] * act["input_scale"], before)
    return np.maximum(tolerance["abs"], carried), rule


def through(op: str, y: np.ndarray, step: float, delta: float, before: np.ndarray | None = None) -> np.ndarray:
    """How far an int8 activation's output `y` (rounded to `step`) may move when its input moves by up to
    `delta`, per element; the result may round a step off either way.

    LOGISTIC and TANH are monotonic: where the golden input `before` is known (the segment gives it out
    too), the output moves by what f does between before - delta and before + delta; else the input is
    recovered from `y` within a step either way (its rounding, and its kernel's), f^-1([y - step,
    y + step]), and moved by `delta` (loose where f saturates: its input could be anywhere beyond).
    SOFTMAX: every input moving by at most `delta` changes each e^z_i / sum_j e^z_j by a factor within
    e^(+-2 delta)."""
    y = np.asarray(y, np.float64)
    if op == "SOFTMAX":
        hi = np.minimum((y + step) * np.exp(2 * delta), 1.0)
        lo = np.maximum((y - step) * np.exp(-2 * delta), 0.0)
        return np.maximum(hi - y, y - lo) + step
    f, inverse, low, high = ((lambda z: 1 / (1 + np.exp(-z)), lambda v: np.log(v / (1 - v)), 0.0, 1.0)
                             if op == "LOGISTIC" else (np.tanh, np.arctanh, -1.0, 1.0))
    with np.errstate(over="ignore"):
        if before is not None:
            z = np.asarray(before, np.float64)
            return np.maximum(f(z + delta) - f(z), f(z) - f(z - delta)) + step
        tiny = 1e-12
        lo = f(inverse(np.clip(y - step, low + tiny, high - tiny)) - delta)
        hi = f(inverse(np.clip(y + step, low + tiny, high - tiny)) + delta)
    return np.maximum(hi - y, y - lo) + step


def described(r: dict) -> str:
    """One comparison in words: the error against its tolerance, and the mean where one is bounded."""
    if "nearest" in r:
        text = (f"max abs error {r['max_abs_error']:.3g}; nearest its bound: {r['nearest']['error']:.3g} at "
                f"{tuple(r['nearest']['index'])} (tolerance there {r['tolerance']:.3g}, {r['rule']})")
    else:
        text = f"max abs error {r['max_abs_error']:.3g} (tolerance {r['tolerance']:.3g}, {r['rule']})"
    if "mean_abs_error" in r:
        text += f", mean abs error {r['mean_abs_error']:.3g} (at most {r['mean_tolerance']:.3g})"
    return text


def main(argv: list[str]) -> int:
    bundle = Path(argv[0]) if argv and not argv[0].startswith("-") else Path(__file__).resolve().parents[1]
    report = selftest(bundle)
    if "--json" in argv:
        print(json.dumps(report))
    else:
        for s in report["segments"]:
            for r in s["outputs"]:
                print(f"{'ok' if r['passed'] else 'FAIL'}  segment {s['segment']} ({s['device']}) {r['output']}: "
                      + described(r))
        for r in report["outputs"]:
            print(f"{'ok' if r['passed'] else 'FAIL'}  {r['output']}: " + described(r))
        s = report["stream"]
        print(f"{'ok' if s['passed'] else 'FAIL'}  pipelined stream of {s['frames']} frames equals run() frame by frame"
              + (f" (frames {s['mismatched_frames']} differ)" if s["mismatched_frames"] else "")
              + (f" (the stream failed: {s['error']})" if s.get("error") else "")
              + f": {s['stream_seconds']:.3f} s, {s['sequential_seconds']:.3f} s one after another")
        for n in report["notes"]:
            print(f"note: {n}")
        print(f"self-test {'passed' if report['passed'] else 'FAILED'} on {report['arch']}")
    return 0 if report["passed"] else 1
