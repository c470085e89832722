"""`edgesdk calibrate` per CPU backend on this host: predicted against measured on held-out models.

    .venv/bin/python benchmarks/bench_calibrate.py [--rounds 5] [--runs 20] [--out benchmarks/results/calibrate-x86.json]

Fitted on MobileNetV2 224 and ResNet50 224 (Keras, weights=None, BatchNorm statistics from one pass), the pretrained
PP-OCR classifier and PP-OCRv4 detector (480x480); held out: EfficientNetB0 224, InceptionV3 299 and the PP-OCRv4
recognizer (48x320). The Keras files are those benchmarks/bench_import.py saves under .cache/bench-import (run it
first). Each fitted model is timed whole and in 4 cuts on every CPU backend, each held-out model whole, each run
as a bundle of its own, `--rounds` rounds of `--runs` inferences, each in a fresh process; the quickest round's
median counts. The held-out prediction is the scheduler's for the whole model as one CPU segment on that backend
with its fitted figures. Written to benchmarks/results/calibrate-x86.json (the whole `--json` report) and printed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk")]
import _results  # noqa: E402  (after the path above)

MODELS = [".cache/models/mobilenet_v2_224_1.0_bnstats.onnx", ".cache/bench-import/ResNet50.keras",
          ".cache/models/ch_ppocr_mobile_v2.0_cls_infer.onnx@x=1x3x48x192",
          ".cache/models/ch_PP-OCRv4_det_infer.onnx@x=1x3x480x480"]
HOLDOUT = [".cache/bench-import/EfficientNetB0.keras", ".cache/bench-import/InceptionV3.keras",
           ".cache/models/ch_PP-OCRv4_rec_infer.onnx@x=1x3x48x320"]


def table(report: dict) -> str:
    rows = ["| backend | held-out model | measured ms | predicted ms | error | within 25 % |", "|---|---|---:|---:|---:|---|"]
    for backend, b in report["backends"].items():
        for model, m in b["held_out"]["models"].items():
            rows.append(f"| {backend} | {model} | {m['measured_ms']:.2f} | {m['predicted_ms']:.2f} | "
                        f"{m['rel_error']:.0%} | {'**yes**' if m['within_tolerance'] else 'no'} |")
        for skipped in b.get("skipped", []):
            rows.append(f"| {backend} | {skipped} | not timed | | | |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=_results.path("calibrate-x86"))
    args = ap.parse_args()
    cmd = [sys.executable, "-c", "import sys; from edgesdk.cli import main; sys.exit(main())", "calibrate",
           "--target", "x86", *[a for m in MODELS for a in ("-m", m)], *[a for h in HOLDOUT for a in ("--holdout", h)],
           "--runs", str(args.runs), "--rounds", str(args.rounds), "--json"]
    done = subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True)
    report = json.loads(done.stdout)
    _results.write("calibrate-x86", report, table(report), out=args.out)
    print(table(report))


if __name__ == "__main__":
    main()
