"""The golden self-test: run the bundle on its stored input and compare with the stored output.

Tolerances (docs/bundle.md): an output produced by an int8 segment may differ by one quantization step
(1 LSB = its scale); a float output by 1e-4 relative to the largest magnitude of the expected
output. The golden output was produced at build time by this same plan on the build host.

Each segment is also checked on its own golden inputs (`golden/boundaries.npz` holds every tensor
that crosses a segment boundary), with the same tolerances. The bundle passes when every segment
does and every model output does. One exception, reported as such: when every segment matches its
golden but a model output does not, the difference is the build host's and this device's int8
kernels rounding differently (1 LSB is within tolerance) and later segments amplifying it; LiteRT
does not promise bit-equal int8 across CPU architectures, so that is a note, not a failure.

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
    inputs = dict(np.load(bundle / "golden" / "inputs.npz"))
    expected = dict(np.load(bundle / "golden" / "outputs.npz"))
    got = model.run(inputs)
    results = [_compare(spec, got[spec.name], expected[spec.name]) for spec in model.manifest.outputs]
    outputs_ok = all(r["passed"] for r in results)
    notes = list(model.notes)
    segments = []
    boundaries = bundle / "golden" / "boundaries.npz"
    if boundaries.exists():  # bundles from before per-segment goldens have only the end-to-end check
        golden = {**inputs, **dict(np.load(boundaries)), **expected}
        for seg, runner in model.runners:
            out = runner.run({t.name: golden[t.name] for t in seg.inputs})
            checks = [_compare(t, out[t.name], golden[t.name]) for t in seg.outputs]
            segments.append({"segment": seg.id, "device": seg.device, "passed": all(c["passed"] for c in checks),
                             "outputs": checks})
    segments_ok = all(s["passed"] for s in segments)
    stream = stream_check(model, inputs)
    ok = segments_ok and (outputs_ok or bool(segments)) and stream["passed"]
    if segments and segments_ok and not outputs_ok:
        notes.append("every segment matches its golden output, but the model's output differs end to end: int8 "
                     "rounding on this device differs from the build host's within 1 LSB and later segments "
                     "amplify it")
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


def _compare(spec, got: np.ndarray, expected: np.ndarray) -> dict:
    exp = np.asarray(expected, dtype=np.float64)
    out = np.asarray(got, dtype=np.float64)
    err = float(np.max(np.abs(out - exp))) if exp.size and out.shape == exp.shape else float("inf")
    if spec.quant is not None:
        tol, rule = spec.quant.scale * 1.0001, "1 LSB"
    else:
        tol, rule = FLOAT_RTOL * max(float(np.max(np.abs(exp))) if exp.size else 0.0, 1e-12), "1e-4 relative"
    return {"output": spec.name, "max_abs_error": err, "tolerance": tol, "rule": rule,
            "passed": out.shape == exp.shape and err <= tol}


def main(argv: list[str]) -> int:
    bundle = Path(argv[0]) if argv and not argv[0].startswith("-") else Path(__file__).resolve().parents[1]
    report = selftest(bundle)
    if "--json" in argv:
        print(json.dumps(report))
    else:
        for s in report["segments"]:
            for r in s["outputs"]:
                print(f"{'ok' if r['passed'] else 'FAIL'}  segment {s['segment']} ({s['device']}) {r['output']}: "
                      f"max abs error {r['max_abs_error']:.3g} (tolerance {r['tolerance']:.3g}, {r['rule']})")
        for r in report["outputs"]:
            print(f"{'ok' if r['passed'] else 'FAIL'}  {r['output']}: max abs error {r['max_abs_error']:.3g} "
                  f"(tolerance {r['tolerance']:.3g}, {r['rule']})")
        s = report["stream"]
        print(f"{'ok' if s['passed'] else 'FAIL'}  pipelined stream of {s['frames']} frames equals run() frame by frame"
              + (f" (frames {s['mismatched_frames']} differ)" if s["mismatched_frames"] else "")
              + (f" (the stream failed: {s['error']})" if s.get("error") else "")
              + f": {s['stream_seconds']:.3f} s, {s['sequential_seconds']:.3f} s one after another")
        for n in report["notes"]:
            print(f"note: {n}")
        print(f"self-test {'passed' if report['passed'] else 'FAILED'} on {report['arch']}")
    return 0 if report["passed"] else 1
