"""ResNet-18's convolutions, dense against pruned: time per layer and effective GFLOP/s.

    .venv/bin/python benchmarks/bench_sparse.py [--batches 16,1] [--trials 48] [--runs 15] [--rounds 3]

Each distinct convolution of ResNet-18 at 224x224 (He et al.; the 7x7 stem stays dense and is left out),
random weights (seed 0), at each batch size, measured in one process, interleaved (`--rounds` rounds, each
timing every variant `--runs` times in turn after a warm-up), medians:
  - onnxruntime, dense: the convolution alone as an ONNX model (NCHW in and out), all graph optimizations,
    2 intra-op threads, in a process of its own each round (in this one, TVM's idle worker threads spin on the
    2 cores and slowed onnxruntime 2x);
  - TVM dense, untuned: the convolution's own kernel as the TVM backend compiles it on x86 (channels-last,
    the default schedule), timed alone (its layout changes belong to the network's edges);
  - TVM dense, tuned: the same kernel with MetaSchedule's best of `--trials` candidates (a database per
    run under .cache/bench-sparse);
  - sparse, for 2:4, 1:4, magnitude 75 % and 90 %, column combining (groups of 4): the kernel of
    backends/tvm/sparse_kernels.py as the compiler builds it (CHWN with a batch, W-vectorized at batch 1), timed alone.
Effective GFLOP/s counts the dense layer's FLOPs (2 per multiply-add) over the time. The per-network line sums
each layer's time times its count in ResNet-18. Each batch measured replaces that batch's tables in
benchmarks/results/sparse-layers.json (--out; the other batches stay); prints the tables.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk")]
import _results  # noqa: E402  (after the path above)
CACHE = ROOT / ".cache" / "bench-sparse"
THREADS = 2
TARGET = {"kind": "llvm", "mcpu": "native", "num-cores": THREADS}
# (in channels, out channels, input size, kernel, stride, count in ResNet-18)
LAYERS = [(64, 64, 56, 3, 1, 4), (64, 128, 56, 3, 2, 1), (64, 128, 56, 1, 2, 1), (128, 128, 28, 3, 1, 3),
          (128, 256, 28, 3, 2, 1), (128, 256, 28, 1, 2, 1), (256, 256, 14, 3, 1, 3), (256, 512, 14, 3, 2, 1),
          (256, 512, 14, 1, 2, 1), (512, 512, 7, 3, 1, 3)]
METHODS = ["2:4", "1:4", "magnitude:0.75", "magnitude:0.9", "column-combine:4"]


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def conv_model(n: int, ci: int, co: int, size: int, k: int, stride: int, weight: np.ndarray):
    from onnx import helper, numpy_helper

    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[k // 2] * 4, strides=[stride] * 2)
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("x", 1, [n, ci, size, size])],
                              [helper.make_tensor_value_info("y", 1, None)], [numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def timer(fn, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def ort_child(model, x, runs: int):
    """A function that times `runs` inferences of `model` by onnxruntime in a child process (after 5 warm-up
    ones) and returns them."""
    import subprocess

    import onnx

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_cpu import ORT_CHILD

    CACHE.mkdir(parents=True, exist_ok=True)
    path, feeds = CACHE / "conv.onnx", CACHE / "conv-feeds.npz"
    onnx.save(model, str(path))
    np.savez(feeds, x=x)

    def run() -> list[float]:
        done = subprocess.run([sys.executable, "-c", ORT_CHILD, str(path), str(feeds), str(THREADS), str(runs)],
                              capture_output=True, text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    return run


def shape_of(n: int, ci: int, co: int, size: int, k: int, stride: int):
    from edgesdk.backends.tvm.sparse_format import ConvShape

    return ConvShape(n, ci, size, size, co, k, k, (k // 2,) * 4, (stride, stride))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="16,1")
    ap.add_argument("--trials", type=int, default=48)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(_results.path("sparse-layers")))
    args = ap.parse_args()
    import os

    os.environ.setdefault("TVM_NUM_THREADS", str(THREADS))
    from edgesdk.backends.tvm.sparse_format import pack
    from edgesdk.backends.tvm.sparse_measured import dense_runner, sparse_runner
    from edgesdk.backends.tvm.targets import _resolve_target, host_cpu
    from edgesdk.backends.tvm.tuning import tune_onnx
    from edgesdk.compression import mask, parse_method

    # the newest figure of every batch: this run's batches replace theirs, the others stay
    results: dict = (json.loads(Path(args.out).read_text())["data"] if Path(args.out).exists()
                     else {"batches": {}, "commits": {}})
    results.update(host=f"{platform.processor() or 'x86_64'} {host_cpu()[0]}, {THREADS} threads", trials=args.trials)
    for batch in [int(b) for b in args.batches.split(",")]:
        rows = []
        for ci, co, size, k, stride, count in LAYERS:
            rng = np.random.default_rng(0)
            dense = (rng.standard_normal((co, ci, k, k)) / np.sqrt(ci * k * k)).astype(np.float32)
            model = conv_model(batch, ci, co, size, k, stride, dense)
            x = rng.standard_normal((batch, ci, size, size)).astype(np.float32)
            name = f"{ci}->{co} {k}x{k}/{stride} @{size}"
            db = CACHE / f"db-b{batch}" / name.replace(" ", "_").replace(">", "").replace("/", "s").replace("@", "at")
            if args.trials:
                db.mkdir(parents=True, exist_ok=True)
                log(f"b{batch} {name}: tuning the dense kernel ({args.trials} trials)")
                tune_onnx(model, TARGET, db, trials=args.trials, log=lambda s: None)
            ort_alone = ort_child(model, x, args.runs)
            # the kernels as the backend compiles and times them (backends/tvm/sparse_measured.py)
            shape = shape_of(batch, ci, co, size, k, stride)
            target = _resolve_target(TARGET)[0]
            runners = {"TVM dense untuned": dense_runner(shape, target)}
            if args.trials:
                runners["TVM dense tuned"] = dense_runner(shape, target, db)
            padding = {}
            for method in METHODS:
                ell = pack(dense * mask(dense, parse_method(method)))
                runners[method], padding[method] = sparse_runner(shape, ell, target), ell.padding
            times: dict[str, list[float]] = {"onnxruntime dense": [], **{k: [] for k in runners}}
            for fn in runners.values():
                fn()
            for _ in range(args.rounds):
                times["onnxruntime dense"] += ort_alone()
                for key, fn in runners.items():
                    times[key] += timer(fn, args.runs)
            out = size // stride
            flops = 2 * batch * co * ci * k * k * out * out
            row = {"layer": name, "count": count, "gflop": flops / 1e9, "padding": padding,
                   "ms": {key: statistics.median(v) for key, v in times.items()}}
            row["gflops"] = {key: flops / ms / 1e6 for key, ms in row["ms"].items()}
            rows.append(row)
            log(f"b{batch} {name}: " + ", ".join(f"{key} {ms:.3f} ms" for key, ms in row["ms"].items()))
        results["batches"][str(batch)] = rows
        results.setdefault("commits", {})[str(batch)] = _results.commit()[:7]
        _results.write("sparse-layers", results, table(results), out=Path(args.out))
    print(tables(results))


def table(results: dict) -> str:
    """ResNet-18's convolutions in all, per batch and variant: ms, and speedup over dense TVM tuned and onnxruntime."""
    lines = ["| batch | variant | ResNet-18's convolutions ms | over TVM dense tuned | over onnxruntime dense | commit |",
             "|---|---|---:|---:|---:|---|"]
    for batch, rows in sorted(results["batches"].items(), key=lambda kv: -int(kv[0])):
        total = {k: sum(r["ms"][k] * r["count"] for r in rows) for k in rows[0]["ms"]}
        base = total.get("TVM dense tuned", total["TVM dense untuned"])
        for k, ms in total.items():
            lines.append(f"| {batch} | {k} | {ms:.2f} | {base / ms:.2f}x | {total['onnxruntime dense'] / ms:.2f}x | "
                         f"{results.get('commits', {}).get(batch, '-')} |")
    return "\n".join(lines)


def tables(results: dict) -> str:
    lines = [f"Host: {results['host']}; TVM dense tuned: {results['trials']} MetaSchedule trials per layer."]
    for batch, rows in results["batches"].items():
        keys = list(rows[0]["ms"])
        lines += ["", f"### batch {batch}: ms per layer (effective GFLOP/s)", "",
                  "| layer | x | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
        for r in rows:
            lines.append(f"| {r['layer']} | {r['count']} | " + " | ".join(
                f"{r['ms'][k]:.3f} ({r['gflops'][k]:.0f})" for k in keys) + " |")
        total = {k: sum(r["ms"][k] * r["count"] for r in rows) for k in keys}
        lines.append("| **ResNet-18's convolutions** | | " + " | ".join(f"**{total[k]:.2f}**" for k in keys) + " |")
        base = total.get("TVM dense tuned", total["TVM dense untuned"])
        lines.append("| speedup over TVM dense tuned | | " + " | ".join(f"{base / total[k]:.2f}x" for k in keys) + " |")
        lines.append("| speedup over onnxruntime dense | | " + " | ".join(
            f"{total['onnxruntime dense'] / total[k]:.2f}x" for k in keys) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
