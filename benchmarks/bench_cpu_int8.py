"""int8 x86 bundles against onnxruntime fp32 and onnxruntime's own int8.

    .venv/bin/python benchmarks/bench_cpu_int8.py [--models A,B] [--runs 20] [--threads 2] [--calib-method percentile]

For each model of benchmarks/bench_cpu.py, and PP-OCR's text direction classifier: a build for
`targets/x86.yaml` with `--cpu-precision int8` (the tune stage measures fp32 and int8 candidates, the
int8 ones behind the accuracy gate; 24 of the 32 calibration samples calibrate, 8 are held out for
the gate); and what a user would do instead with onnxruntime: `quantize_static` (QDQ, per-channel
int8 weights, int8 activations, min-max) on the same 32 samples. The fp32 ONNX file is the one
bench_cpu.py gives onnxruntime. Calibration samples: for the pretrained PP-OCR models, 32 images of
text lines (16 upright, 16 flipped; tests/model_zoo.py), preprocessed as PP-OCR does; for the
others (random weights: Keras applications with weights=None, the encoder) and silero-vad, the
build's synthetic samples (uniform in [-1, 1], seed 0), as a build without --calib has.

Accuracy, on 16 new samples (new text lines, or seed 1), of the int8 bundle and of onnxruntime int8
against onnxruntime fp32: cosine over each model's first output, and top-1 agreement for a
classifier's (rank 2) output.
Timing, interleaved: 3 rounds, each runtime in turn in a fresh process of its own, `--runs`
inferences after 5 warm-up ones; medians. Writes benchmarks/results/x86-int8-latency.json (min-max) or
x86-int8-latency-percentile.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk"), str(ROOT / "benchmarks")]
import _results  # noqa: E402
import bench_cpu  # noqa: E402

CACHE = bench_cpu.CACHE
ROUNDS = 3
bench_cpu.MODELS["PP-OCR-cls"] = (".cache/models/ch_ppocr_mobile_v2.0_cls_infer.onnx", ["--input-shape", "x=1x3x48x192"])
# real inputs where the model is pretrained: text-line images and PP-OCR's own preprocessing
IMAGENET = "scale=1/255,mean=0.485:0.456:0.406,std=0.229:0.224:0.225"
TEXT = "scale=1/255,mean=0.5,std=0.5"
IMAGES = {"PP-OCRv4-det": IMAGENET, "PP-OCRv4-rec": TEXT, "PP-OCR-cls": TEXT}


def text_images(name: str, seed: int, n: int) -> Path:
    """A directory of `n` text-line PNGs, half of them flipped."""
    from PIL import Image

    from tests import model_zoo

    d = CACHE / f"text-{name}-{seed}-{n}"
    if not d.exists():
        tmp = d.with_suffix(".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        pixels = np.concatenate([model_zoo.text_line_pixels(n // 2, seed=seed),
                                 model_zoo.text_line_pixels(n - n // 2, seed=seed + 1, flipped=True)])
        for k, p in enumerate(pixels):
            Image.fromarray(np.repeat(p[..., None], 3, axis=2)).save(tmp / f"line{k:02d}.png")
        tmp.rename(d)
    return d


def image_feeds(directory: Path, preprocess: str, name: str, shape) -> list[dict]:
    from edgesdk.ir.calibration import load_image, parse_preprocess

    pre = parse_preprocess(preprocess, shape)
    return [{name: load_image(p, pre, "float32")} for p in sorted(directory.iterdir())]


def ort_int8(name: str, fp32: Path, samples: list[dict], method: str = "minmax") -> Path:
    """onnxruntime's own static int8 of the fp32 file, calibrated on `samples` by `method` (percentile:
    the build's default 99.99th, as edgesdk's --calib-method percentile)."""
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, quantize_static

    out = CACHE / (f"{name}-ort-int8.onnx" if method == "minmax" else f"{name}-ort-int8-{method}.onnx")
    if out.exists():
        return out

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(samples)

        def get_next(self):
            return next(self.it, None)

    tmp = out.with_suffix(".tmp.onnx")
    how = ({"calibrate_method": CalibrationMethod.Percentile, "extra_options": {"CalibPercentile": 99.99}}
           if method == "percentile" else {})
    quantize_static(str(fp32), str(tmp), Reader(), quant_format=QuantFormat.QDQ, per_channel=True, **how)
    tmp.replace(out)
    return out


def feeds_for(session, specs: dict, seed: int, n: int, frozen: dict) -> list[dict]:
    """`n` samples uniform in [-1, 1] shaped as the bundle's inputs (`specs`: name -> shape), drawn in
    the order of the bundle's inputs as the build draws its synthetic calibration samples."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        f = {name: rng.uniform(-1, 1, shape).astype(np.float32) for name, shape in specs.items()}
        out.append({i.name: (f[i.name] if i.name in f else frozen[i.name]) for i in session.get_inputs()})
    return out


def accuracy(got: list[np.ndarray], want: list[np.ndarray]) -> dict:
    from edgesdk.ir.numeric import compare

    g, w = np.stack(got), np.stack(want)
    top1 = float(np.mean(g.argmax(-1) == w.argmax(-1))) if g.ndim == 3 and g.shape[-1] >= 2 else None
    return {"cosine": compare(g, w)["cosine"], "top1": top1}


def main() -> None:
    import onnxruntime as ort

    from edgesdk.runtime import BundleModel
    from edgesdk.timing import measure_alone

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(bench_cpu.MODELS))  # PP-OCR-cls added above
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calib-method", default="minmax", choices=("minmax", "percentile"))
    ap.add_argument("--out", type=Path, default=None,
                    help="where the figures go (default benchmarks/results/x86-int8-latency.json, or "
                         "x86-int8-latency-<method>.json); a run of some models replaces the whole file")
    args = ap.parse_args()
    names = [n for n in args.models.split(",") if n]
    results: dict = {"models": {}}
    import os
    os.environ["TVM_NUM_THREADS"] = os.environ["EDGESDK_NUM_THREADS"] = str(args.threads)
    for name in names:
        out = CACHE / (f"{name}-int8" if args.calib_method == "minmax" else f"{name}-int8-{args.calib_method}")
        bench_cpu.log(f"{name}: building --cpu-precision int8")
        extra = ["--cpu-precision", "int8", "--calib-method", args.calib_method]
        if name in IMAGES:
            extra += ["--calib", str(text_images("calib", 30, 32)), "--calib-preprocess", IMAGES[name]]
        build = bench_cpu.build(name, out, extra)
        fp32 = bench_cpu.reference_onnx(name, out)
        session = ort.InferenceSession(str(fp32), providers=["CPUExecutionProvider"])
        frozen = {"sr": np.array(16000, np.int64)} if name == "silero-vad" else {}
        bundle = BundleModel(out / "bundle", log=lambda s: None)
        specs = {t.name: t.shape for t in bundle.inputs}
        if name in IMAGES:  # the same images, preprocessed by the same code as the build's
            (only,) = specs
            calib = image_feeds(text_images("calib", 30, 32), IMAGES[name], only, specs[only])
            new = image_feeds(text_images("new", 40, 16), IMAGES[name], only, specs[only])
        else:  # the build's calibration samples: uniform in [-1, 1], seed 0 (ir/calibration.py)
            calib = feeds_for(session, specs, 0, 32, frozen)
            new = feeds_for(session, specs, 1, 16, frozen)
        q = ort_int8(name, fp32, calib, args.calib_method)
        qsession = ort.InferenceSession(str(q), providers=["CPUExecutionProvider"])
        want = [session.run(None, f)[0] for f in new]
        got = [next(iter(bundle.run({t.name: f[t.name] for t in bundle.inputs}).values())) for f in new]
        ort_got = [qsession.run(None, f)[0] for f in new]
        bundle.close()
        plan = json.loads((out / "bundle" / "plan.json").read_text())
        spans = plan["cpu_selection"].get("spans", [])
        entry = {"build": build, "chosen": [s["chosen"] for s in spans],
                 "candidates": [s["candidates"] for s in spans],
                 "bundle_accuracy": accuracy(got, want), "ort_int8_accuracy": accuracy(ort_got, want)}
        feeds = CACHE / f"{name}-int8-feeds.npz"
        np.savez(feeds, **new[0])

        def ort_alone(path: Path) -> list[float]:
            done = subprocess.run([sys.executable, "-c", bench_cpu.ORT_CHILD, str(path), str(feeds), str(args.threads),
                                   str(args.runs)], capture_output=True, text=True, check=True)
            return json.loads(done.stdout.strip().splitlines()[-1])

        calls = {"onnxruntime fp32": lambda: ort_alone(fp32), "onnxruntime int8": lambda: ort_alone(q),
                 "int8 bundle": lambda: measure_alone(out / "bundle", feeds, warmup=5, runs=args.runs)}
        ov, ov_said = bench_cpu.openvino_calls([fp32, out / ".build" / "1-import" / "model.onnx"], feeds,
                                               args.threads, args.runs)
        calls.update(ov)  # "openvino" (fp32) and "openvino default"
        if ov:  # OpenVINO's default precision (bfloat16 where the CPU has it) against fp32 on the same new inputs
            import openvino as ov_runtime

            ran = fp32 if fp32.name == ov_said["openvino_on"] else out / ".build" / "1-import" / "model.onnx"
            compiled = ov_runtime.Core().compile_model(str(ran), "CPU")
            request = compiled.create_infer_request()
            names_in = {n for p in compiled.inputs for n in p.get_names()}
            ov_got = [np.asarray(next(iter(request.infer({k: v for k, v in f.items() if k in names_in}).values())))
                      for f in new]
            entry["openvino_default_accuracy"] = accuracy(ov_got, want)
        entry.update(ov_said)
        laps: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(ROUNDS):
            for label, call in calls.items():
                laps[label] += call()
        med = {k: round(statistics.median(v), 3) for k, v in laps.items()}
        best = min(("onnxruntime fp32", "openvino"), key=lambda k: med.get(k, float("inf")))
        entry.update({"ms": med, "bundle_over_ort_fp32": round(med["int8 bundle"] / med["onnxruntime fp32"], 3),
                      "ort_int8_over_ort_fp32": round(med["onnxruntime int8"] / med["onnxruntime fp32"], 3),
                      "best_fp32_peer": best, "bundle_over_best_fp32": round(med["int8 bundle"] / med[best], 3)})
        if "openvino default" in med:
            entry["bundle_over_openvino_default"] = round(med["int8 bundle"] / med["openvino default"], 3)
        entry["commit"] = _results.commit()[:7]
        results["models"][name] = entry
        bench_cpu.log(f"{name}: {json.dumps({k: entry[k] for k in ('chosen', 'ms', 'bundle_accuracy', 'ort_int8_accuracy')})}")
    results["host"] = bench_cpu.host()
    results["calib_method"] = args.calib_method
    question = "x86-int8-latency" + ("" if args.calib_method == "minmax" else f"-{args.calib_method}")
    _results.write(question, results, table(results, names), out=args.out)
    print(table(results, names))


def table(results: dict, names: list[str]) -> str:
    def acc(a: dict) -> str:
        return f"{a['cosine']:.4f}" + (f" / {a['top1']:.0%}" if a["top1"] is not None else "")

    rows = ["| model | chosen | int8 bundle | onnxruntime fp32 | **int8 bundle / ort fp32** | OpenVINO fp32 | "
            "int8 bundle / best fp32 peer | OpenVINO default (its cosine / top-1) | int8 bundle's cosine / top-1 | "
            "onnxruntime int8 | ort int8 / ort fp32 | its cosine / top-1 | build s | commit |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in names:
        e = results["models"][n]
        ov = (f"{e['ms']['openvino']:.2f} ms", f"{e['bundle_over_best_fp32']:.2f} ({e['best_fp32_peer']})",
              f"{e['ms']['openvino default']:.2f} ms, {e['openvino_default_precision']} "
              f"({acc(e['openvino_default_accuracy'])})") if "openvino" in e["ms"] else ("-", "-", "-")
        rows.append(f"| {n} | {', '.join(e['chosen'])} | {e['ms']['int8 bundle']:.2f} ms | {e['ms']['onnxruntime fp32']:.2f} ms | "
                    f"**{e['bundle_over_ort_fp32']:.2f}** | {' | '.join(ov)} | {acc(e['bundle_accuracy'])} | "
                    f"{e['ms']['onnxruntime int8']:.2f} ms | "
                    f"{e['ort_int8_over_ort_fp32']:.2f} | {acc(e['ort_int8_accuracy'])} | {e['build']['seconds']} | "
                    f"{e.get('commit', '-')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
