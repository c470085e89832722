"""Bundles of one model timed against each other: before and after a change to a backend.

    .venv/bin/python benchmarks/ab_bundles.py FEEDS.npz BUNDLE_A BUNDLE_B [...] [--runs 20] [--rounds 6] [--threads 2]

Each bundle's outputs are first compared with the first one's (max |difference| over the first
bundle's max |output|). Then `--rounds` rounds, each timing every bundle in turn in a process of its own
(`timing.measure_alone`: `--runs` inferences after 5 warm-up ones, the runtime a device
runs); per bundle the median of all its inferences, and its ratio to the first. Prints a JSON line
with the host CPU. `bench_cpu.py` keeps the bundles it builds under .cache/bench-cpu/NAME-{selected,tvm}
and the inputs it timed them on as .cache/bench-cpu/NAME-feeds.npz: copy a bundle aside, change the
code, rebuild, and compare the two.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "sdk")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("feeds", type=Path)
    ap.add_argument("bundles", type=Path, nargs="+")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ["TVM_NUM_THREADS"] = os.environ["EDGESDK_NUM_THREADS"] = str(args.threads)
    from edgesdk.runtime import BundleModel
    from edgesdk.scheduling import selection
    from edgesdk.timing import measure_alone

    feeds = dict(np.load(args.feeds))
    outputs = []
    for bundle in args.bundles:
        model = BundleModel(bundle, log=lambda s: None)
        outputs.append(model.run({t.name: feeds[t.name] for t in model.manifest.inputs}))
    first = outputs[0]
    errors = [max(float(np.max(np.abs(o[k] - first[k]))) / max(float(np.max(np.abs(first[k]))), 1e-12)
                  for k in first) for o in outputs]
    laps: list[list[float]] = [[] for _ in args.bundles]
    for _ in range(args.rounds):
        for i, bundle in enumerate(args.bundles):
            laps[i] += measure_alone(bundle, args.feeds, warmup=5, runs=args.runs)
    medians = [statistics.median(v) for v in laps]
    print(json.dumps({
        "host": selection.host_name(), "threads": args.threads, "runs": args.runs * args.rounds,
        "bundles": [{"bundle": str(b), "median_ms": round(m, 3), "over_first": round(m / medians[0], 3),
                     "max_difference_of_scale": e} for b, m, e in zip(args.bundles, medians, errors)],
    }))


if __name__ == "__main__":
    main()
