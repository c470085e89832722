"""Load and soak on a real model: the long forms of tests/runtime/test_load_faults.py.

    .venv/bin/python benchmarks/bench_load.py [--calls 1000] [--frames 10000] [--rounds 3] [--soak-minutes 30]
                                             [--out benchmarks/results/load.json]

The demo model (PP-OCRv4's recognizer, 1x3x48x320) built for x86 as `make demo` builds it for arm_2tpu
(its one CPU segment on the backend the tune stage measured fastest), run in this process with the
runtime's `BundleModel`:

1. correctness under load: 8 callers x `--calls` inferences at once, each caller with its own two
   inputs; every result must equal, bit for bit, the single-threaded result for its input (so none
   was delivered to another caller);
2. throughput and latency with 1, 2, 4 and 8 callers: the same total of calls each time (400),
   interleaved round by round, medians over `--rounds` of the frames per second and of each round's
   p50 and p99 call latency;
3. a stream of `--frames` frames, each checked against `run()` of its input, in order;
4. the soak: a stream running for `--soak-minutes`, the process's resident memory sampled every 10 s;
   the least-squares slope of RSS over time (MiB per hour) over the samples after the first minute
   (warm-up: allocator pools, lazily created kernels), and the first and last values.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk")]
import _results  # noqa: E402  (after the path above)
MODEL = ROOT / ".cache" / "models" / "ch_PP-OCRv4_rec_infer.onnx"
OUT = ROOT / ".cache" / "bench-load" / "x86"


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in b)


def _callers(model, feeds, expected, count: int, calls: int) -> dict:
    """`count` callers, `calls` each, caller i on inputs i and i + 8 alternately; checked and timed."""
    lat: list[list[float]] = [[] for _ in range(count)]
    wrong = []
    start = threading.Barrier(count + 1)

    def caller(i: int) -> None:
        start.wait()
        for j in range(calls):
            k = i % 8 + 8 * (j % 2)
            t = time.perf_counter()
            out = model.run(feeds[k])
            lat[i].append((time.perf_counter() - t) * 1000)
            if not _equal(out, expected[k]):
                wrong.append((i, j))

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    every = np.concatenate([np.asarray(x) for x in lat])
    return {"callers": count, "calls": int(every.size), "fps": every.size / wall, "p50_ms": float(np.percentile(every, 50)),
            "p99_ms": float(np.percentile(every, 99)), "wrong": len(wrong)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--frames", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--soak-minutes", type=float, default=30.0)
    ap.add_argument("--parts", default="load,stream,soak", help="which parts to run (the soak's memory figures "
                    "stand noise from other jobs; the load's timings do not)")
    ap.add_argument("--out", type=Path, default=_results.path("load"),
                    help="the results file: the parts run replace theirs, the others stay")
    args = ap.parse_args()
    parts = set(args.parts.split(","))

    if not (OUT / "bundle.tar.gz").exists():
        subprocess.run([str(ROOT / ".venv" / "bin" / "edgesdk"), "build", str(MODEL), "--input-shape", "x=1x3x48x320",
                        "--target", "x86", "-o", str(OUT), "--quiet"], check=True)
    from edgesdk.runtime import BundleModel

    model = BundleModel(OUT / "bundle", log=lambda s: None)
    rng = np.random.default_rng(0)
    feeds = [{t.name: rng.standard_normal(t.shape).astype(t.dtype) for t in model.inputs} for _ in range(16)]
    expected = [model.run(f) for f in feeds]
    result: dict = {"host_cpu": _cpu(), "cores": os.cpu_count(), "model": model.manifest.model.get("name"),
                    "segments": [(s.id, s.backend) for s, _ in model.runners],
                    "command": " ".join(["benchmarks/bench_load.py", *sys.argv[1:]])}

    if "load" in parts:
        _load(args, model, feeds, expected, result)
    if "stream" in parts:
        _stream(args, model, feeds, expected, result)
    if "soak" in parts:
        _soak(args, model, feeds, expected, result)
    model.close()
    kept = json.loads(args.out.read_text())["data"] if args.out.exists() else {}
    result = {**{k: v for k, v in kept.items() if k in PARTS}, **result}
    _results.write("load", result, table(result), out=args.out, notes=notes(result))
    print(json.dumps({k: v for k, v in result.items() if k != "soak"} | ({"soak": {k: v for k, v in result["soak"].items()
                                                                                  if k != "series"}} if "soak" in result else {}),
                     indent=2))


PARTS = ("correctness_8_callers", "throughput", "stream", "soak")  # what --parts load,stream,soak write


def table(result: dict) -> str:
    rows = ["| run | frames/s | call p50 ms | call p99 ms | wrong results |", "|---|---|---|---|---|"]
    if "correctness_8_callers" in result:
        c = result["correctness_8_callers"]
        rows.append(f"| {c['callers']} callers x {c['calls'] // c['callers']:,} inferences, each caller its own "
                    f"inputs | {c['fps']:.1f} | {c['p50_ms']:.1f} | {c['p99_ms']:.1f} | {c['wrong']} of {c['calls']:,} |")
    for t in result.get("throughput", []):
        rows.append(f"| {t['callers']} caller(s) (400 calls, median of {t['rounds']} interleaved rounds) | "
                    f"{t['fps']:.1f} | {t['p50_ms']:.2f} | {t['p99_ms']:.1f} | {t['wrong']} |")
    if "stream" in result:
        s = result["stream"]
        rows.append(f"| a stream of {s['frames']:,} frames, each checked, in order | {s['fps']:.1f} | | | "
                    f"{s['out_of_order_or_wrong']} |")
    return "\n".join(rows)


def notes(result: dict) -> list[str]:
    s = result.get("soak")
    if not s:
        return []
    return [f"soak: a stream for {s['minutes']:g} minutes, {s['frames']:,} frames, every 97th checked "
            f"({s['checked_wrong']} wrong); RSS {s['rss_mib_first']:.1f} MiB at the start, {s['rss_mib_after_1min']:.1f} "
            f"after a minute, {s['rss_mib_last']:.1f} at the end; least-squares slope after the first minute "
            f"{s['slope_mib_per_hour_after_1min']:+.2f} MiB per hour (residuals' std {s['residual_std_mib']:.3f} MiB)"]


def _load(args, model, feeds, expected, result: dict) -> None:
    print(f"load: 8 callers x {args.calls} inferences", file=sys.stderr)
    result["correctness_8_callers"] = _callers(model, feeds, expected, 8, args.calls)

    rows: dict[int, list[dict]] = {c: [] for c in (1, 2, 4, 8)}
    for r in range(args.rounds):
        for c in rows:
            rows[c].append(_callers(model, feeds, expected, c, 400 // c))
        print(f"load: throughput round {r + 1}/{args.rounds}", file=sys.stderr)
    result["throughput"] = [{"callers": c, "fps": statistics.median(x["fps"] for x in rs),
                             "p50_ms": statistics.median(x["p50_ms"] for x in rs),
                             "p99_ms": statistics.median(x["p99_ms"] for x in rs),
                             "wrong": sum(x["wrong"] for x in rs), "rounds": len(rs)} for c, rs in rows.items()]



def _stream(args, model, feeds, expected, result: dict) -> None:
    print(f"load: a stream of {args.frames} frames", file=sys.stderr)
    t0, bad, n = time.perf_counter(), [], 0
    for f, out in enumerate(model.stream(feeds[f % 16] for f in range(args.frames))):
        n += 1
        if not _equal(out, expected[f % 16]):
            bad.append(f)
    result["stream"] = {"frames": n, "out_of_order_or_wrong": len(bad), "fps": n / (time.perf_counter() - t0)}



def _soak(args, model, feeds, expected, result: dict) -> None:
    print(f"load: soak for {args.soak_minutes:g} minutes", file=sys.stderr)
    samples, frames_done, stop = [], [0], time.perf_counter() + args.soak_minutes * 60
    t_start = time.perf_counter()
    next_sample = t_start
    wrong_soak = 0

    def endless():
        f = 0
        while time.perf_counter() < stop:
            yield feeds[f % 16]
            f += 1

    for f, out in enumerate(model.stream(endless())):
        frames_done[0] += 1
        if f % 97 == 0 and not _equal(out, expected[f % 16]):
            wrong_soak += 1
        now = time.perf_counter()
        if now >= next_sample:
            samples.append((now - t_start, _rss_mib()))
            next_sample += 10
    samples.append((time.perf_counter() - t_start, _rss_mib()))
    steady = [(t, m) for t, m in samples if t >= 60] or samples
    ts, ms = np.array([t for t, _ in steady]), np.array([m for _, m in steady])
    slope = float(np.polyfit(ts / 3600, ms, 1)[0]) if len(steady) > 2 else float("nan")
    result["soak"] = {"minutes": args.soak_minutes, "frames": frames_done[0], "checked_wrong": wrong_soak,
                      "samples": len(samples), "rss_mib_first": samples[0][1], "rss_mib_after_1min": steady[0][1],
                      "rss_mib_last": samples[-1][1], "rss_mib_max": max(m for _, m in samples),
                      "slope_mib_per_hour_after_1min": slope,
                      "residual_std_mib": float(np.std(ms - np.polyval(np.polyfit(ts / 3600, ms, 1), ts / 3600)))
                      if len(steady) > 2 else float("nan"),
                      "series": [(round(t, 1), round(m, 2)) for t, m in samples]}


if __name__ == "__main__":
    main()
