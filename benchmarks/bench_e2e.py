"""Build cost and x86 latency of the end-to-end pipeline, side by side with onnxruntime.

    .venv/bin/python benchmarks/bench_e2e.py [--runs 50] [--threads 2] [--out benchmarks/results/build-stages.json]

1. `edgesdk build` of MobileNetV2 (tf.keras.applications, weights=None, tf2onnx) for each
   target, each in its own process with an empty tuning database: wall time per stage (from
   the build's --json summary), peak resident memory of the build process, bundle size.
2. Latency of one inference on this host, median of N after warm-up, all with the same thread
   count, in one run: the x86 bundle as shipped (AVX2 `haswell`), the same bundle rebuilt for this
   host's own CPU (onnxruntime picks the host's best instructions at run time), and
   onnxruntime (all graph optimizations) on the original ONNX file. Kernels are untuned
   (--trials 0): tuning is the tune issue's work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk")]
import _results  # noqa: E402  (after the path above)


def build_one(model: Path, target: str, out: Path, db: Path) -> dict:
    """Run one build in a child process; its peak RSS is the child's ru_maxrss."""
    code = (
        "import resource, subprocess, sys, json;"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True);"
        "r = resource.getrusage(resource.RUSAGE_CHILDREN);"
        "print(json.dumps({'rc': p.returncode, 'maxrss_kb': r.ru_maxrss, 'stdout': p.stdout, 'stderr': p.stderr[-2000:]}))"
    )
    cmd = [sys.executable, "-c", code, str(ROOT / ".venv/bin/edgesdk"), "build", str(model), "--target", target,
           "-o", str(out), "--tuning-db", str(db), "--json", "--quiet"]
    t0 = time.perf_counter()
    res = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    wall = time.perf_counter() - t0
    if res["rc"] != 0:
        raise SystemExit(f"build for {target} failed:\n{res['stderr']}")
    summary = json.loads(res["stdout"])
    size = sum(f.stat().st_size for f in (out / "bundle").rglob("*") if f.is_file())
    package = next((s.get("record") or {} for s in summary["stages"] if s["name"] == "package"), {})
    remedy = (package.get("accuracy") or {}).get("remedy") or {}
    # the summary's stages are the round that shipped: an accuracy remedy's earlier rounds are in the wall time
    return {"target": target, "wall_s": round(wall, 2), "peak_rss_mb": round(res["maxrss_kb"] / 1024, 1),
            "stages_s": {s["name"]: round(s["seconds"], 2) for s in summary["stages"]},
            "remedy_rounds": len(remedy.get("rounds") or []),
            "bundle_bytes": size, "tarball_bytes": (out / "bundle.tar.gz").stat().st_size}


def median_ms(fn, runs: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def host_target(tmp: Path) -> Path:
    """targets/x86.yaml with `mcpu` set to this host's CPU."""
    import yaml
    from tvm.target import codegen

    cpu = str(codegen.llvm_get_system_cpu())
    data = yaml.safe_load((ROOT / "targets/x86.yaml").read_text())
    data["name"] = "x86_host"
    data["devices"][0]["codegen"]["mcpu"] = "native"  # the host's name and its real features (backends/tvm.host_cpu)
    data["description"] = f"this benchmark host (llvm mcpu={cpu})"
    path = tmp / "x86_host.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=_results.path("build-stages"))
    args = ap.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["EDGESDK_NUM_THREADS"] = str(args.threads)  # LiteRT interpreter threads

    import numpy as np
    import onnxruntime as ort

    from tests.model_zoo import mobilenet_v2

    model = mobilenet_v2()
    results: dict = {"model": "MobileNetV2 224 (keras, weights=None, tf2onnx opset 13)", "builds": [], "latency_ms": {}}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        for target in ("arm_2tpu", "x86", "rtx3090", str(host_target(tmp))):
            name = Path(target).stem
            print(f"building for {name} ...", file=sys.stderr)
            results["builds"].append(build_one(model, target, tmp / name, tmp / f"db-{name}"))
            print(json.dumps(results["builds"][-1]), file=sys.stderr)

        from edgesdk.runtime import BundleModel

        x = np.random.default_rng(0).uniform(-1, 1, (1, 224, 224, 3)).astype(np.float32)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = args.threads
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        sess = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
        lat = results["latency_ms"]
        for label, fn in [
            ("onnxruntime (fp32, all optimizations)", lambda: sess.run(None, {"input": x})),
            ("edgesdk x86 bundle (each CPU span on the backend its build timed fastest, mcpu=haswell, --trials 0)", (lambda m: lambda: m.run({"input": x}))(
                BundleModel(tmp / "x86" / "bundle", log=lambda s: None))),
            ("edgesdk x86 bundle rebuilt for this host's CPU (the same, --trials 0)", (lambda m: lambda: m.run({"input": x}))(
                BundleModel(tmp / "x86_host" / "bundle", log=lambda s: None))),
            ("arm_2tpu bundle's int8 TFLite on this host's LiteRT (CPU interpreter)", (lambda m: lambda: m.run({"input": x}))(
                BundleModel(tmp / "arm_2tpu" / "bundle", log=lambda s: None))),
        ]:
            lat[label] = round(median_ms(fn, args.runs), 3)
            print(f"{label}: {lat[label]:.3f} ms", file=sys.stderr)
    results["runs"], results["threads"] = args.runs, args.threads
    results["host_cpu"] = _cpu_name()
    _results.write("build-stages", results, table(results), out=args.out, notes=notes(results))
    print(table(results))


def table(results: dict) -> str:
    """Per target: each stage's seconds, the whole build's wall time and peak memory, the bundle's size."""
    stages = ["import", "legalize", "schedule", "tune", "compress", "package"]
    rows = ["| target | " + " | ".join(f"{s} s" for s in stages) + " | total wall s | peak RSS MB | bundle MB | .tar.gz MB |",
            "|---|" + "---:|" * (len(stages) + 4)]
    for b in results["builds"]:
        rows.append(f"| {Path(b['target']).stem} | " + " | ".join(f"{b['stages_s'].get(s, 0):.2f}" for s in stages)
                    + f" | {b['wall_s']:.1f} | {b['peak_rss_mb']:.0f} | {b['bundle_bytes'] / 1e6:.1f} | "
                    f"{b['tarball_bytes'] / 1e6:.1f} |")
    return "\n".join(rows)


def notes(results: dict) -> list[str]:
    said = [f"latency of one inference on this host, median of {results['runs']}, {results['threads']} threads: "
            + "; ".join(f"{k} {v:.2f} ms" for k, v in results["latency_ms"].items())]
    for b in results["builds"]:
        if b.get("remedy_rounds"):
            said.append(f"{Path(b['target']).stem}: the accuracy remedy planned {b['remedy_rounds']} more round(s) "
                        "(culprit layers kept in float on the CPU): the stage columns are the round that shipped "
                        "(import and legalize cached in it), the wall time holds every round")
    return said


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
