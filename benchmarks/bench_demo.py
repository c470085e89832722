"""`edgesdk bench` on the demo model's bundles: the x86 bundle on this host, the arm_2tpu bundle under qemu-user.

    .venv/bin/python benchmarks/bench_demo.py [--targets x86,arm_2tpu] [--out benchmarks/results/demo-bench.json]

Each bundle is built once for the demo model (PP-OCRv4's recognizer, 1x3x48x320) under .cache/bench-demo/<target>
(calibrated on `make demo`'s rendered text lines where out/demo-lines has them), then measured by `edgesdk bench
--json` with the arguments below: an aarch64 bundle runs under qemu-user, and its figures say they are emulated.
Written to benchmarks/results/demo-bench.json and printed.
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

EDGESDK = [sys.executable, "-c", "import sys; from edgesdk.cli import main; sys.exit(main())"]
MODEL = ROOT / ".cache" / "models" / "ch_PP-OCRv4_rec_infer.onnx"
LINES = ROOT / "out" / "demo-lines" / "calib"
WORK = ROOT / ".cache" / "bench-demo"
# an emulated run is ~1 s per inference: fewer runs there
BENCH_ARGS = {"x86": ["--runs", "200", "--callers", "1,2,4,8", "--depth", "1,2", "--frames", "200"],
              "arm_2tpu": ["--runs", "20", "--warmup", "2", "--callers", "1,2", "--depth", "1,4", "--frames", "12"]}


def built(target: str) -> Path:
    out = WORK / target
    if not (out / "bundle" / "manifest.json").exists():
        calib = (["--calib", str(LINES), "--calib-preprocess", "scale=1/255,mean=0.5,std=0.5", "--calib-method",
                  "percentile", "--calib-percentile", "99.999"] if LINES.is_dir() else [])
        subprocess.run([*EDGESDK, "build", str(MODEL), "--input-shape", "x=1x3x48x320", "--target", target,
                        "-o", str(out), "--quiet", *calib], check=True)
    return out / "bundle"


def table(result: dict) -> str:
    rows = ["| bundle | ran | load ms | resident MiB after load, peak | latency p50 / p90 / p99 ms | predicted ms | "
            "callers: frames/s | stream: frames/s (predicted) |", "|---|---|---|---|---|---|---|---|"]
    for target, r in result["bundles"].items():
        lat, load = r["latency_ms"], r["load"]
        callers = ", ".join(f"{c['callers']}: {c['fps']:.1f}" for c in r["callers"])
        stream = ", ".join(f"depth {d['depth']}: {d['fps']:.1f}" for d in r["stream"]["depths"])
        rows.append(f"| {r['model']} for {target} | {'EMULATED (' + r['emulated'] + ')' if r['emulated'] else 'here'} | "
                    f"{load['seconds'] * 1e3:.1f} | {load['rss_mib_after']:.0f}, {r['peak_rss_mib']:.0f} | "
                    f"{lat['p50']:.3f} / {lat['p90']:.3f} / {lat['p99']:.3f} | {lat['predicted']} | {callers} | "
                    f"{stream} ({r['stream']['predicted_fps']}) |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="x86,arm_2tpu")
    ap.add_argument("--out", type=Path, default=_results.path("demo-bench"))
    args = ap.parse_args()
    result: dict = {"bundles": {}}
    for target in args.targets.split(","):
        bundle = built(target)
        print(f"bench-demo: edgesdk bench {bundle} {' '.join(BENCH_ARGS[target])}", file=sys.stderr, flush=True)
        done = subprocess.run([*EDGESDK, "bench", str(bundle), *BENCH_ARGS[target], "--json"], check=True,
                              capture_output=True, text=True)
        result["bundles"][target] = {**json.loads(done.stdout), "bench_args": BENCH_ARGS[target]}
    _results.write("demo-bench", result, table(result), out=args.out)
    print(table(result))


if __name__ == "__main__":
    main()
