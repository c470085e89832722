"""What the runtime's input checks (names, shapes, dtypes, NaN/inf, index ranges) cost per
inference, beside the inference itself, on real bundles.

    .venv/bin/python benchmarks/bench_inputs.py [--runs 60]

For each bundle (MobileNetV2 on x86, the PP-OCR classifier on x86; built once into
.cache/bench-inputs with --trials 0), interleaved, median of N after warm-up: the bundle's input check
alone (`FeedCheck`, built once per model as `BundleModel` builds it), and `BundleModel.run` (which
includes it). Results in benchmarks/results/input-checks.json.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk")]
import _results  # noqa: E402  (after the path above)
CACHE = ROOT / ".cache" / "bench-inputs"


def bundle(name: str, model: Path, shapes: dict) -> Path:
    from edgesdk.pipeline import BuildOptions, build

    out = CACHE / name
    if not (out / "bundle" / "manifest.json").exists():
        build(BuildOptions(model=model, target="x86", out=out, input_shapes=shapes, tuning_db=CACHE / "db"))
    return out / "bundle"


def main() -> None:
    import numpy as np

    from edgesdk.runtime import BundleModel
    from edgesdk.runtime.inputs import FeedCheck
    from tests import model_zoo

    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=60)
    args = parser.parse_args()
    cases = {"MobileNetV2 (x86)": bundle("mnv2", model_zoo.mobilenet_v2(), {}),
             "PP-OCR cls (x86, pretrained)": bundle("ppocr-cls", model_zoo.ppocr_cls(), {"x": (1, 3, 48, 192)})}
    results = {"cpu": platform.processor() or platform.machine(), "runs": args.runs, "models": {}}
    for name, path in cases.items():
        model = BundleModel(path, log=lambda s: None)
        check_feeds = FeedCheck(model.inputs)
        rng = np.random.default_rng(0)
        feeds = {t.name: rng.uniform(-1, 1, t.shape).astype(t.dtype) for t in model.inputs}
        for _ in range(5):
            model.run(feeds)
        check, run = [], []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            check_feeds(feeds)
            check.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            model.run(feeds)
            run.append(time.perf_counter() - t0)
        row = {"check_us": round(statistics.median(check) * 1e6, 1), "run_ms": round(statistics.median(run) * 1e3, 3)}
        row["share"] = round(row["check_us"] / 1e3 / row["run_ms"], 4)
        results["models"][name] = row
        print(f"{name}: input check {row['check_us']} us of {row['run_ms']} ms per run ({row['share']:.1%})")
    _results.write("input-checks", results, table(results))


def table(results: dict) -> str:
    rows = ["| bundle | check µs | run ms (check included) | share |", "|---|---:|---:|---:|"]
    rows += [f"| {name} | {r['check_us']} | {r['run_ms']} | {r['share']:.1%} |" for name, r in results["models"].items()]
    return "\n".join(rows)


if __name__ == "__main__":
    main()
