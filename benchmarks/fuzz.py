"""The fuzz suite's full run (`make fuzz`): 14,000 generated hostile inputs split across every
loader (ONNX, TFLite, Keras, SavedModel, target YAML, manifest JSON, bundle archives, the .npy inputs of
`edgesdk run`, --calib and --eval directories), from a fixed seed, in under ten minutes on the 2-core
build host.

    .venv/bin/python benchmarks/fuzz.py [--seed 21] [--count 14000] [--only LOADER] [--findings DIR]

How inputs are made and judged: tests/fuzz/harness.py (the short run of `make test` is
tests/fuzz/test_fuzz.py). Per loader: the inputs accepted, refused with a typed error (by code; `exit N`
for the inputs of `edgesdk run`, judged by its exit code), the findings, the inputs that reached the
TensorFlow converter child, and the wall time. Written to benchmarks/results/fuzz.json and printed as a markdown
table. Exits 1 on any finding, naming its loader, its input (kept under --findings) and where it was
raised; the same seed and case number make the same input again.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk")]
import _results  # noqa: E402  (after the path above)

# inputs per loader in a full run; a converter run costs ~3 s, so the TensorFlow formats get fewer
SHARES = {"onnx": 4000, "tflite": 300, "keras": 300, "savedmodel": 200, "target": 2000, "manifest": 2500,
          "bundle": 2000, "npy": 1700, "calib": 1000}


def counts_for(total: int, only: str | None) -> dict[str, int]:
    """`total` inputs split over the loaders as SHARES splits its 14,000 (all of them to `only`)."""
    if only:
        return {only: total}
    scale = total / sum(SHARES.values())
    return {loader: max(1, round(n * scale)) for loader, n in SHARES.items()}


def where_raised(detail: str) -> str:
    """The innermost frame of a finding's traceback in edgesdk's code, and the innermost of all where
    that is another (a library's); the first line of what the finding holds where it has no traceback."""
    frames = [line.strip() for line in detail.splitlines() if line.strip().startswith('File "')]
    if not frames:
        return next((line.strip() for line in detail.splitlines() if line.strip()), "")
    ours = [f for f in frames if "/edgesdk/" in f]
    return frames[-1] if not ours or ours[-1] == frames[-1] else f"{ours[-1]}\n    (innermost: {frames[-1]})"


def table(loaders: dict, wall_s: float, seeds_s: float) -> str:
    rows = ["| loader | inputs | accepted | refused (typed error) | findings (known) | converter runs | wall s | "
            "most common refusals |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, c in loaders.items():
        top = ", ".join(f"{code} {n}" for code, n in list(c["refused_by_code"].items())[:3])
        rows.append(f"| {name} | {c['inputs']:,} | {c['accepted']:,} | {c['refused']:,} | {c['findings']} "
                    f"({c['known_findings']}) | {c['converter_runs']} | {c['seconds']:.0f} | {top} |")
    total = {k: sum(c[k] for c in loaders.values()) for k in ("inputs", "accepted", "refused", "findings", "converter_runs")}
    rows.append(f"| **all** | **{total['inputs']:,}** | {total['accepted']:,} | {total['refused']:,} | "
                f"**{total['findings']}** | {total['converter_runs']} | {wall_s:.0f} (seeds {seeds_s:.0f}) | |")
    return "\n".join(rows)


def main() -> int:
    from tests.fuzz.harness import LOADERS, Session

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=21)
    parser.add_argument("--count", type=int, default=None,
                        help=f"inputs in all (default {sum(SHARES.values()):,}; with --only, that loader's share)")
    parser.add_argument("--only", choices=LOADERS, default=None)
    parser.add_argument("--findings", type=Path, default=ROOT / ".cache" / "fuzz-findings",
                        help="where each finding's input and traceback are kept (emptied first)")
    parser.add_argument("--out", type=Path, default=_results.path("fuzz"))
    args = parser.parse_args()
    total = args.count if args.count is not None else (SHARES[args.only] if args.only else sum(SHARES.values()))
    plan = counts_for(total, args.only)

    shutil.rmtree(args.findings, ignore_errors=True)
    t0 = time.perf_counter()
    loaders, findings = {}, []
    with Session(args.findings) as session:
        print(f"fuzz: seeds made in {session.seeds_seconds:.0f} s; {sum(plan.values()):,} inputs, seed {args.seed}",
              file=sys.stderr, flush=True)
        for loader, n in plan.items():
            counts = session.run(loader, n, args.seed)
            loaders[loader] = counts.as_json()
            findings += counts.findings
            print(f"fuzz: {loader}: {counts.inputs} inputs, {counts.accepted} accepted, {counts.refused} refused, "
                  f"{len(counts.findings)} finding(s) in {counts.seconds:.0f} s", file=sys.stderr, flush=True)
        left = session.close()
    wall_s = time.perf_counter() - t0

    result = {"seed": args.seed, "inputs": sum(c["inputs"] for c in loaders.values()),
              "findings": len(findings) + len(left), "wall_s": round(wall_s, 1),
              "seeds_s": round(session.seeds_seconds, 1), "left_in_temporary_directory": left,
              "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
              "loaders": loaders}
    _results.write("fuzz", result, table(loaders, wall_s, session.seeds_seconds), out=args.out)
    print(table(loaders, wall_s, session.seeds_seconds))
    for f in findings:
        print(f"\nFINDING {f.loader} case {f.index} (seed {f.seed}), {f.kind}: {f.summary}\n"
              f"  input: {f.saved / 'input'} ({f.mutation})\n  raised at: {where_raised(f.detail)}"
              + (f"\n  known: reported, its fix awaited in {f.known}" if f.known else ""))
    for path in left:
        print(f"\nFINDING left in the temporary directory: {path}")
    return 1 if findings or left else 0


if __name__ == "__main__":
    sys.exit(main())
