"""`python -B -m runtime bench`: how fast a bundle runs on this device, without the SDK.

Measured, in this order, on the bundle's golden input (`golden/inputs.npz`), which the self-test also
runs:

- load: the manifest read and every segment opened (`BundleModel`), and the resident memory after it;
- latency: `run()` timed one call at a time, `runs` calls after `warmup` untimed ones: min, p50, p90,
  p99, max, mean; beside the plan's predicted latency;
- concurrent callers: C threads each calling `run()` `runs // C` times (at least 2) at once: frames per
  second over the wall time, and each call's p50 and p99 latency;
- the pipelined stream (`BundleModel.stream`) at each depth D: `frames` frames, frames per second;
  beside the plan's predicted throughput;
- each segment alone, on its own golden inputs (`golden/boundaries.npz`): median and p90 of `seg_runs`
  calls, beside the plan's `predicted_ms`, with the runner's note where the device is absent (an Edge
  TPU segment then runs its int8 model on the CPU, and its time says nothing about the TPU);
- peak resident memory of the process (ru_maxrss).

The figures are this process's: under emulation (EDGESDK_EMULATED names the emulator, set by
`edgesdk bench` when it runs an aarch64 bundle under qemu-user) they are reported as emulated, and say
that the bundle runs, not how fast a board runs it. Progress goes to stderr, one line per phase (a bar
on a terminal); the result to stdout (`--json`: one JSON object).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from .executor import BundleModel

EMULATED_ENV = "EDGESDK_EMULATED"


def percentiles(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms, dtype=np.float64)
    return {"min": float(a.min()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max()), "mean": float(a.mean()), "n": int(a.size)}


def _rss_mib() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return float("nan")


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def bench(bundle: Path, *, runs: int = 100, warmup: int = 10, callers: tuple[int, ...] = (1, 2, 4),
          depths: tuple[int, ...] | None = None, frames: int | None = None, seg_runs: int | None = None,
          progress: Callable[[str, int, int], None] = lambda phase, done, total: None) -> dict:
    """The figures above for the bundle at `bundle`, as a dict (the `--json` document)."""
    if runs < 1 or warmup < 0 or any(c < 1 for c in callers) or (depths and any(d < 1 for d in depths)):
        raise ValueError("runs, callers and depths are at least 1; warmup at least 0")
    bundle = Path(bundle)
    rss_before = _rss_mib()
    t0 = time.perf_counter()
    model = BundleModel(bundle, log=lambda s: None)
    load_seconds = time.perf_counter() - t0
    rss_loaded = _rss_mib()
    manifest = model.manifest
    with np.load(bundle / "golden" / "inputs.npz") as z:
        feeds = dict(z)
    try:
        devices = sorted({seg.device for seg, _ in model.runners})
        depths = tuple(depths) if depths else tuple(sorted({1, len(devices) + 1}))
        frames = frames or max(2 * max(depths), min(runs, 64))
        seg_runs = seg_runs or max(5, min(runs, 50))
        for k in range(warmup):
            model.run(feeds)
            progress("warm-up", k + 1, warmup)
        latency = []
        for k in range(runs):
            t = time.perf_counter()
            model.run(feeds)
            latency.append((time.perf_counter() - t) * 1000)
            progress("latency", k + 1, runs)
        concurrent = [_callers(model, feeds, c, max(2, runs // c), progress) for c in callers]
        streams = [_stream(model, feeds, d, frames, progress) for d in depths]
        segments = _segments(model, bundle, seg_runs, progress)
    finally:
        model.close()
    predicted = manifest.predicted
    return {
        "bundle": str(bundle), "model": manifest.model.get("name"), "target": manifest.target.get("name"),
        "arch": platform.machine(), "emulated": os.environ.get(EMULATED_ENV) or None,
        "cpus": os.cpu_count(), "devices": devices, "notes": list(model.notes),
        "load": {"seconds": load_seconds, "rss_mib_before": rss_before, "rss_mib_after": rss_loaded},
        "latency_ms": {**percentiles(latency), "warmup": warmup, "predicted": predicted.get("latency_ms")},
        "callers": concurrent,
        "stream": {"frames": frames, "predicted_fps": predicted.get("throughput_fps"), "depths": streams},
        "segments": segments,
        "peak_rss_mib": _peak_mib(),
    }


def _callers(model: BundleModel, feeds: dict, count: int, each: int, progress) -> dict:
    """`count` threads calling run() `each` times at once; every result must equal the first caller's."""
    expected = model.run(feeds)
    latencies: list[list[float]] = [[] for _ in range(count)]
    wrong: list[int] = []
    failed: list[BaseException] = []   # a caller's error, raised here: a thread's own would be lost
    start = threading.Barrier(count + 1)

    def caller(i: int) -> None:
        start.wait()
        try:
            for _ in range(each):
                t = time.perf_counter()
                out = model.run(feeds)
                latencies[i].append((time.perf_counter() - t) * 1000)
                if any(not np.array_equal(out[n], expected[n]) for n in expected):
                    wrong.append(i)
        except BaseException as e:  # noqa: BLE001 -- raised by _callers once every caller has ended
            failed.append(e)

    threads = [threading.Thread(target=caller, args=(i,), name=f"bench-caller-{i}") for i in range(count)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if failed:
        raise failed[0]
    progress(f"{count} caller(s)", 1, 1)
    calls = [x for lat in latencies for x in lat]
    lat = percentiles(calls)
    return {"callers": count, "calls": len(calls), "fps": len(calls) / wall, "p50_ms": lat["p50"],
            "p99_ms": lat["p99"], "results_differ": len(wrong)}


def _stream(model: BundleModel, feeds: dict, depth: int, frames: int, progress) -> dict:
    t0 = time.perf_counter()
    done = 0
    for _ in model.stream((feeds for _ in range(frames)), depth=depth):
        done += 1
        progress(f"stream depth {depth}", done, frames)
    wall = time.perf_counter() - t0
    return {"depth": depth, "frames": done, "fps": done / wall, "seconds": wall}


def _segments(model: BundleModel, bundle: Path, runs: int, progress) -> list[dict]:
    """Each of the plan's segments alone on its golden inputs; [] for a bundle without boundaries."""
    path = bundle / "golden" / "boundaries.npz"
    if not path.exists():
        return []
    with np.load(bundle / "golden" / "inputs.npz") as a, np.load(path) as b, \
            np.load(bundle / "golden" / "outputs.npz") as c:
        golden = {**dict(a), **dict(b), **dict(c)}
    out = []
    plan = [(seg, r) for seg, r in model.runners if not seg.replica]
    for k, (seg, runner) in enumerate(plan):
        feeds = {t.name: golden[t.name] for t in seg.inputs}
        runner.run(feeds)  # its own warm-up
        ms = []
        for _ in range(runs):
            t = time.perf_counter()
            runner.run(feeds)
            ms.append((time.perf_counter() - t) * 1000)
        p = percentiles(ms)
        out.append({"segment": seg.id, "device": seg.device, "backend": seg.backend, "p50_ms": p["p50"],
                    "p90_ms": p["p90"], "predicted_ms": seg.predicted_ms,
                    "measured_over_predicted": p["p50"] / seg.predicted_ms if seg.predicted_ms > 0 else None,
                    "note": getattr(runner, "note", "") or ""})
        progress("segments", k + 1, len(plan))
    return out


def report(r: dict) -> str:
    """The bench result as text."""
    lat, load = r["latency_ms"], r["load"]
    where = f"{r['arch']}" + (f", EMULATED by {r['emulated']}: these figures show that it runs, not how fast a "
                              f"board runs it" if r["emulated"] else "")
    lines = [f"bench: {r['model']} for {r['target']} on {where} ({r['cpus']} CPUs; devices {', '.join(r['devices'])})",
             f"load        {load['seconds'] * 1000:9.1f} ms      resident {load['rss_mib_after']:.0f} MiB after load "
             f"(+{load['rss_mib_after'] - load['rss_mib_before']:.0f}); peak {r['peak_rss_mib']:.0f} MiB",
             f"latency     p50 {lat['p50']:.3f} ms  p90 {lat['p90']:.3f}  p99 {lat['p99']:.3f}  max {lat['max']:.3f}  "
             f"min {lat['min']:.3f}  ({lat['n']} runs after {lat['warmup']} warm-up)"
             + (f"; predicted {lat['predicted']:.3f} ms" if lat.get("predicted") else "")]
    for c in r["callers"]:
        lines.append(f"callers {c['callers']:>3}  {c['fps']:9.1f} frames/s   call p50 {c['p50_ms']:.3f} ms  p99 "
                     f"{c['p99_ms']:.3f} ms  ({c['calls']} calls" + (f"; {c['results_differ']} RESULTS DIFFER" if
                                                                       c["results_differ"] else "; results equal") + ")")
    s = r["stream"]
    for d in s["depths"]:
        lines.append(f"stream d={d['depth']:<3} {d['fps']:9.1f} frames/s   ({d['frames']} frames)"
                     + (f"; predicted {s['predicted_fps']:.1f} frames/s" if s.get("predicted_fps") else ""))
    if r["segments"]:
        lines.append(f"{'segment':<8} {'device':<11} {'backend':<12} {'p50 ms':>9} {'p90 ms':>9} {'predicted':>10} {'ratio':>7}")
        for g in r["segments"]:
            ratio = f"{g['measured_over_predicted']:.2f}x" if g["measured_over_predicted"] else "-"
            lines.append(f"{g['segment']:<8} {g['device']:<11} {g['backend']:<12} {g['p50_ms']:9.3f} {g['p90_ms']:9.3f} "
                         f"{g['predicted_ms']:10.3f} {ratio:>7}" + (f"  ({g['note']})" if g["note"] else ""))
    for n in r["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def progress_printer(stream=sys.stderr) -> Callable[[str, int, int], None]:
    """A bar on a terminal; elsewhere one line per finished phase (`progress: PHASE N/N`), which
    `edgesdk bench` reads from the process it starts."""
    tty = stream.isatty()
    state = {"last": 0.0}

    def show(phase: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if tty and (done == total or now - state["last"] > 0.1):
            state["last"] = now
            filled = int(30 * done / max(total, 1))
            stream.write(f"\r\x1b[K{phase:<18} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}")
            if done == total:
                stream.write("\n")
            stream.flush()
        elif not tty and (done == total or now - state["last"] > 2.0):
            state["last"] = now
            stream.write(f"progress: {phase} {done}/{total}\n")
            stream.flush()
    return show


def main(args) -> int:
    bundle = Path(args.bundle) if args.bundle else Path(__file__).resolve().parents[1]
    result = bench(bundle, runs=args.runs, warmup=args.warmup, callers=tuple(args.callers),
                   depths=tuple(args.depth) if args.depth else None, frames=args.frames,
                   progress=progress_printer() if not args.quiet else (lambda *a: None))
    print(json.dumps(result, default=float) if args.json else report(result))
    wrong = [c for c in result["callers"] if c["results_differ"]]
    if wrong:
        print(f"error: concurrent callers got results that differ from a single run ({wrong[0]['callers']} callers)",
              file=sys.stderr)
        return 1
    return 0
