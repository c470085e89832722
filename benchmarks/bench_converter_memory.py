"""What TensorFlow's TFLite converter holds converting one segment: `convert_float` (LiteRT's
fp32) and `convert_int8` (the Edge TPU's full int8, 4 calibration samples) of an MLP of MatMul + Relu
layers, `--width` x `--width` float32 weights each, read from an ONNX file with external data (as the
stages hand segments on). Each conversion runs in a Python of its own, whose resident memory another
process samples every 50 ms (a sampler thread would stall: the converter holds the GIL).

    .venv/bin/python benchmarks/bench_converter_memory.py [--width 4096] [--layers 8] [--out FILE.json]

Per conversion: the process's resident memory once TensorFlow and edgesdk are imported (the base), its peak,
of it anonymous, and (peak - base) / weights; `limits.py` prices the converter from these. Written to
benchmarks/results/converter-memory.json (--out) and printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _results

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".cache" / "bench-converter-memory"

CHILD = r"""
import os, sys, json, time
import numpy as np
from edgesdk.ir import model as irm
model = irm.read(sys.argv[1])
import tensorflow as tf
from edgesdk.backends.tflite import convert
time.sleep(0.3)
with open("/proc/self/statm") as f:
    base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
print(json.dumps({"base": base}), flush=True)
out = sys.argv[3]
t = time.perf_counter()
if sys.argv[2] == "int8":
    x = model.graph.input[0]
    shape = [d.dim_value for d in x.type.tensor_type.shape.dim]
    samples = [{x.name: np.random.default_rng(i).standard_normal(shape, dtype=np.float32)} for i in range(4)]
    convert.convert_int8(model, samples, out)
else:
    convert.convert_float(model, out, cpu=True)
print(json.dumps({"seconds": round(time.perf_counter() - t, 1), "bytes": os.path.getsize(out)}), flush=True)
"""


def mlp(width: int, layers: int) -> Path:
    path = WORK / f"mlp-{width}x{layers}.onnx"
    if path.exists():
        return path
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    WORK.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    inits, nodes, x = [], [], "x"
    for i in range(layers):
        inits.append(numpy_helper.from_array(rng.standard_normal((width, width), dtype=np.float32) * 0.01, f"w{i}"))
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]), helper.make_node("Relu", [f"m{i}"], [f"r{i}"])]
        x = f"r{i}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")
    return path


def measured(model: Path, kind: str) -> dict:
    """One conversion in a Python of its own, its resident memory sampled from outside."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "sdk"), "TF_CPP_MIN_LOG_LEVEL": "3"}
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(model), kind, str(Path(tmp) / "out.tflite")],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        peak = anonymous = 0

        def sample() -> None:
            nonlocal peak, anonymous
            page = os.sysconf("SC_PAGE_SIZE")
            while child.poll() is None:
                try:
                    with open(f"/proc/{child.pid}/statm") as f:
                        resident, shared = (int(v) * page for v in f.read().split()[1:3])
                except (OSError, ValueError):
                    break
                peak, anonymous = max(peak, resident), max(anonymous, resident - shared)
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        said = [json.loads(line) for line in child.stdout]
        child.wait()
        sampler.join()
    if child.returncode:
        raise SystemExit(f"bench-converter-memory: the {kind} conversion failed (exit {child.returncode})")
    return {**said[0], **said[1], "peak": peak, "anonymous": anonymous}


def table(result: dict) -> str:
    gib, weights = 2**30, result["weights"]
    rows = ["| conversion | weights MiB | base GiB | peak GiB | of it anonymous | (peak - base) / weights | s |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for kind, r in result["runs"].items():
        rows.append(f"| {kind} | {weights / 2**20:.0f} | {r['base'] / gib:.2f} | {r['peak'] / gib:.2f} | "
                    f"{r['anonymous'] / gib:.2f} | {(r['peak'] - r['base']) / weights:.1f} | {r['seconds']:.0f} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", type=Path, default=_results.path("converter-memory"))
    args = parser.parse_args()
    model = mlp(args.width, args.layers)
    weights = args.width * args.width * 4 * args.layers
    rows = {}
    for kind in ("float", "int8"):
        rows[kind] = measured(model, kind)
        print(f"bench-converter-memory: {kind}: {json.dumps(rows[kind])}", file=sys.stderr, flush=True)
    result = {"weights": weights, "width": args.width, "layers": args.layers, "runs": rows}
    _results.write("converter-memory", result, table(result), out=args.out)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
