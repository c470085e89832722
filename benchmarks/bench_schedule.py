"""Scheduling on arm_2tpu, simulated: the placement DP and the pipelining DP against the documented
baselines under the same cost model, and the scheduler's own run time.

    .venv/bin/python benchmarks/bench_schedule.py [--out benchmarks/schedule.json]

Models: the Keras applications `benchmarks/bench_import.py` caches (weights=None). Each is built up to
the schedule stage twice (`--mode latency`, `--mode throughput`); figures come from plan.json, i.e.
from the simulator over the cost model of `devices/cost.py` with the target's figures. Those figures
are published peaks and estimates, NOT yet fitted to Coral's measurements (the scheduling issue's
`calibrate` work): read the ratios, not the milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk")]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
MODELS = ["MobileNetV2", "ResNet50", "InceptionV3", "NASNetMobile"]


def measure(name: str) -> dict:
    from bench_import import keras_app

    from edgesdk.pipeline import BuildOptions, build

    path, _ = keras_app(name)
    row: dict = {"model": name}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("latency", "throughput"):
            t0 = time.perf_counter()
            result = build(BuildOptions(model=path, target="arm_2tpu", out=Path(tmp) / mode, until="schedule",
                                        mode=mode))
            plan = json.loads((Path(tmp) / mode / ".build" / "3-schedule" / "plan.json").read_text())
            row[mode] = {"predicted": plan["predicted"], "placement": plan["placement"],
                         "segments": len(plan["segments"]), "baselines": plan["baselines"],
                         "scheduler_s": result.stages[2].record["scheduler_s"],
                         "nodes": sum(plan["placement"].values()), "build_s": round(time.perf_counter() - t0, 1)}
    return row


def table(rows: list[dict]) -> str:
    out = ["| model | nodes | DP latency ms | ARM only ms | speedup | Coral default ms | pipelined frames/s | "
           "Coral --num_segments 2 frames/s | greedy ms | scheduler s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lat, thr = r["latency"], r["throughput"]
        b = lat["baselines"]
        cpu = b["all on the cpu"]["latency_ms"]
        coral = b.get("coral default (first unsupported op onwards on the cpu)", {})
        split = thr["baselines"].get("coral --num_segments 2 (parameter-count split)", {})
        out.append(f"| {r['model']} | {lat['nodes']} | {lat['predicted']['latency_ms']:.2f} | {cpu:.1f} | "
                   f"{cpu / lat['predicted']['latency_ms']:.1f}× | {coral.get('latency_ms', float('nan')):.2f} | "
                   f"{thr['predicted']['throughput_fps']:.1f} | {split.get('throughput_fps', float('nan')):.1f} | "
                   f"{b['greedy (first capable accelerator)']['latency_ms']:.2f} | "
                   f"{lat['scheduler_s']:.3f} / {thr['scheduler_s']:.3f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "schedule.json")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    rows = []
    for name in MODELS:
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        rows.append(measure(name))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    args.out.write_text(json.dumps({"models": rows}, indent=2) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
