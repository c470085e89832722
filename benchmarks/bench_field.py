"""The arm_2tpu field bundle, per model: bundle size, int8 accuracy, load time and latency on this host
and under emulation, and the pipelined stream's throughput beside sequential runs of the same plan.

    .venv/bin/python benchmarks/bench_field.py [--frames 32] [--out benchmarks/results/field-arm2tpu.json]

Models, each built for targets/arm_2tpu.yaml (builds cached under .cache/bench-field/):
- MobileNetV2 224 (tf.keras.applications, weights=None, BatchNorm statistics set; tests/model_zoo.py),
  32 synthetic calibration samples;
- PP-OCR's text-direction classifier (pretrained, from the rapidocr-onnxruntime wheel), calibrated on 16
  PNG text lines (upright and flipped; tests/model_zoo.py draws them) with PP-OCR's preprocessing, once
  per calibration method (min-max, percentile 99.99); top-1 agreement with the fp32 model is measured
  on 48 held-out lines;
- PP-OCRv4's text recognizer (pretrained; the demo model): Edge TPU and CPU segments interleaved;
- The DenseNet-LSTM video captioner the product was designed around, at CI sizes (2 frames of 32x32, LSTM(32), 4 steps, 100 words;
  tests/model_zoo.captioner), 32 synthetic samples.

Host: this x86-64 machine runs the bundle's own plan, with the x86-64 twins of its aarch64 TVM segments
(what the build makes the golden output with) and the int8 TFLite segments on LiteRT's CPU interpreter
(no Edge TPU here): load time, the median of `--frames` single runs, and `--frames` frames streamed
(`BundleModel.stream`, one worker per device) against the same frames run one after another.
Emulated: `edgesdk verify` under qemu-user in the arm64 root file system (the self-test: load time, and
4 frames run and streamed); these figures show that it runs, not how fast a board is.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk")]
import _results  # noqa: E402  (after the path above)
from edgesdk.pipeline import stage_dir  # noqa: E402  (after the path above)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
CACHE = ROOT / ".cache" / "bench-field"


def build(name: str, model: Path, **kw):
    from edgesdk.pipeline import BuildOptions, build as run_build

    out = out_dir(name)
    t0 = time.perf_counter()
    run_build(BuildOptions(model=model, target="arm_2tpu", out=out, tuning_db=CACHE / "tuning-db", **kw),
              log=lambda s: None)
    return out, round(time.perf_counter() - t0, 1)


def out_dir(name: str) -> Path:
    return CACHE / re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")


def text_calib() -> Path:
    import numpy as np
    from PIL import Image

    from tests import model_zoo

    d = CACHE / "calib-text"
    if not d.exists():
        tmp = CACHE / "calib-text.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        pixels = np.concatenate([model_zoo.text_line_pixels(8, seed=10),
                                 model_zoo.text_line_pixels(8, seed=11, flipped=True)])
        for k, p in enumerate(pixels):
            Image.fromarray(np.repeat(p[..., None], 3, axis=2)).save(tmp / f"line{k:02d}.png")
        tmp.rename(d)
    return d


def held_out_top1(out: Path) -> dict:
    """The classifier's int8 bundle against the fp32 model on 48 new text lines (24 flipped)."""
    import numpy as np
    import onnx

    from edgesdk.backends import onnxruntime as ort_backend
    from edgesdk.ir.numeric import compare
    from edgesdk.runtime import BundleModel
    from tests import model_zoo

    model = BundleModel(out / "bundle", artifacts=twins(out), log=lambda s: None)
    ref = onnx.load(str(out / ".build/1-import/model.onnx"))
    logits = next(iter(model.manifest.accuracy["tensors"]))
    xs = np.concatenate([model_zoo.text_lines(24, seed=30), model_zoo.text_lines(24, seed=31, flipped=True)])
    got = np.stack([model.run({"x": x}, extra_outputs=[logits])[logits] for x in xs])
    want = np.stack([ort_backend.run(ref, {"x": x}, [logits])[logits] for x in xs])
    c = compare(got, want)
    return {"lines": len(xs), "top1_agreement": round(float(np.mean(got.argmax(-1) == want.argmax(-1))), 4),
            "top1_fp32_correct": round(float(np.mean(want.argmax(-1).ravel() == np.repeat([0, 1], 24))), 4),
            "top1_int8_correct": round(float(np.mean(got.argmax(-1).ravel() == np.repeat([0, 1], 24))), 4),
            "cosine": round(c["cosine"], 5), "max_abs_error": round(c["max_abs_error"], 4)}


def twins(out: Path) -> dict[str, Path]:
    return {p.stem: p for p in (stage_dir(out, "package") / "twin").glob("*.so")}


def host(out: Path, frames: int) -> dict:
    import numpy as np

    from edgesdk.runtime import BundleModel

    model = BundleModel(out / "bundle", artifacts=twins(out), log=lambda s: None)
    golden = dict(np.load(out / "bundle" / "golden" / "inputs.npz"))
    rng = np.random.default_rng(0)
    feeds = [{k: (v + rng.normal(0, 0.01, v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v
              for k, v in golden.items()} for _ in range(frames)]
    for f in feeds[:3]:
        model.run(f)
    singles = []
    for f in feeds:
        t0 = time.perf_counter()
        model.run(f)
        singles.append(time.perf_counter() - t0)
    seq, streamed = [], []
    for _ in range(3):  # interleaved rounds, medians
        t0 = time.perf_counter()
        expected = [model.run(f) for f in feeds]
        seq.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = list(model.stream(feeds))
        streamed.append(time.perf_counter() - t0)
        assert all(np.array_equal(g[k], e[k]) for g, e in zip(got, expected) for k in e)
    return {"load_s": round(model.load_seconds, 3), "latency_ms": round(statistics.median(singles) * 1e3, 2),
            "sequential_fps": round(frames / statistics.median(seq), 1),
            "stream_fps": round(frames / statistics.median(streamed), 1),
            "devices": sorted({s.device for s in model.manifest.segments})}


def emulated(out: Path) -> dict:
    from edgesdk.verify import verify

    t0 = time.perf_counter()
    report = verify(out / "bundle")
    s = report.stream
    return {"selftest": report.selftest, "verify_s": round(time.perf_counter() - t0, 1),
            "load_s": report.load_seconds, "latency_ms": round(s["sequential_seconds"] / s["frames"] * 1e3, 1),
            "sequential_fps": round(s["frames"] / s["sequential_seconds"], 2),
            "stream_fps": round(s["frames"] / s["stream_seconds"], 2), "stream_equal": s["passed"]}


def measure(name: str, model: Path, frames: int, **kw) -> dict:
    from edgesdk.runtime import Manifest

    out, build_s = build(name, model, **kw)
    m = Manifest.load(out / "bundle")
    acc = m.accuracy
    tarball = (out / "bundle.tar.gz").stat().st_size
    row = {"model": name, "build_s": build_s, "segments": len(m.segments),
           "bundle_bytes": sum(f["size"] for f in m.files.values()), "tar_gz_bytes": tarball,
           "calibration": {k: m.calibration.get(k) for k in ("synthetic", "samples", "method", "percentile", "images")},
           "accuracy": {"tensors": {k: {"cosine": round(v["cosine"], 5), "max_abs_error": round(v["max_abs_error"], 4)}
                                    for k, v in acc["tensors"].items()},
                        "top1_agreement": acc.get("top1_agreement")},
           "per_segment_cosine": {}}
    compress = json.loads((stage_dir(out, "compress") / "compress.json").read_text())
    for sid, seg in compress["segments"].items():
        row["per_segment_cosine"][sid] = round(min(a["cosine"] for a in seg["accuracy_vs_float"].values()), 5)
    row["host"] = host(out, frames)
    row["emulated"] = emulated(out)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=32)
    parser.add_argument("--out", type=Path, default=_results.path("field-arm2tpu"))
    args = parser.parse_args()
    from tests import model_zoo

    cls = dict(input_shapes={"x": (1, 3, 48, 192)}, calib=text_calib(), calib_samples=16,
               calib_preprocess=model_zoo.PPOCR_CLS_PREPROCESS)
    rows = [measure("MobileNetV2", model_zoo.mobilenet_v2(), args.frames)]
    for method in ("minmax", "percentile"):
        row = measure(f"PP-OCR cls ({method})", model_zoo.ppocr_cls(), args.frames, calib_method=method, **cls)
        row["held_out"] = held_out_top1(out_dir(f"PP-OCR cls ({method})"))
        print(json.dumps(row["held_out"]), flush=True)
        rows.append(row)
    rows.append(measure("PP-OCRv4 rec", model_zoo.ppocr_rec(), args.frames, input_shapes={"x": (1, 3, 48, 320)}))
    rows.append(measure("captioner (CI sizes)", model_zoo.captioner(), args.frames))
    _results.write("field-arm2tpu", {"models": rows}, table(rows), out=args.out)
    print(table(rows))


def table(rows: list[dict]) -> str:
    """Size, int8 accuracy against fp32 (the build's report), and load, latency and stream on the host and emulated."""
    out = ["| model | calibration | segments | bundle MB | .tar.gz MB | end-to-end cosine | top-1 agreement | "
           "host: load s, latency ms | host: sequential / stream frames/s | emulated: load s, latency ms | "
           "emulated: sequential / stream frames/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, h, e = r["calibration"], r["host"], r["emulated"]
        cal = f"{c['samples']} {'synthetic' if c['synthetic'] else 'images'}, {c['method']}" + (
            f" {c['percentile']}" if c.get("percentile") else "")
        cos = ", ".join(f"{t['cosine']:.4f}" for t in r["accuracy"]["tensors"].values())
        top1 = f"{r['accuracy']['top1_agreement']:.2f}" if r["accuracy"].get("top1_agreement") is not None else "—"
        out.append(f"| {r['model']} | {cal} | {r['segments']} | {r['bundle_bytes'] / 1e6:.2f} | "
                   f"{r['tar_gz_bytes'] / 1e6:.2f} | {cos} | {top1} | {h['load_s']}, {h['latency_ms']} | "
                   f"{h['sequential_fps']} / {h['stream_fps']} | {e.get('load_s', '-')}, {e.get('latency_ms', '-')} | "
                   f"{e.get('sequential_fps', '-')} / {e.get('stream_fps', '-')} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
