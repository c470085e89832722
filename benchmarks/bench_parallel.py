"""Inter-operator parallelism on x86, measured, and the simulator's prediction against the real run.

    .venv/bin/python benchmarks/bench_parallel.py [--runs 30] [--out benchmarks/results/inter-op-parallel.json]

One run does everything on this host, with its CPUs as the resource limit (2 on the build machine):

1. Host figures, measured here, on models that are then NOT evaluated:
   - step_dispatch: a parallel step of two trivial TVM segments on the runtime's worker threads,
     minus one such segment called on the calling thread (the hand-off and the extra segment call);
   - parallel_efficiency e: the TVM bundles of ResNet50 and MobileNetV2 at one thread and at all
     threads, e = (T1 / TP - 1) / (P - 1), the median of the two.
2. The CPU's compute figures: `edgesdk calibrate` on ResNet50 and MobileNetV2 (onnxruntime per-op
   profiles). Host target: targets/x86.yaml with the fitted figures, this host's cores and LLVM CPU,
   and the figures of step 1.
3. InceptionV3 and NASNetMobile (tf.keras.applications, weights=None; held out from every fit),
   built with that target twice: with the inter-operator DP, and with --no-inter-op. Timed in
   interleaved rounds (medians): the --no-inter-op bundle, the parallel bundle, the parallel bundle's
   segments one after another (EDGESDK_SEQUENTIAL), onnxruntime sequential (all threads) and
   onnxruntime's parallel executor (ORT_PARALLEL). Spinning is off in every onnxruntime session.
4. The plan's predicted latency (simulator over the cost model) next to each measured bundle.

Builds are cached under .cache/bench-parallel/ (the stage cache makes a rerun fast).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk"), str(ROOT / "benchmarks")]
import _results  # noqa: E402  (after the path above)
from edgesdk.pipeline import stage_dir  # noqa: E402  (after the path above)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
CACHE = ROOT / ".cache" / "bench-parallel"
FIT = ["ResNet50", "MobileNetV2"]
EVAL = ["InceptionV3", "NASNetMobile"]


def median_ms(times: list[float]) -> float:
    return round(statistics.median(times) * 1e3, 3)


def build(model: Path, target: Path, out: Path, **kw) -> dict:
    from edgesdk.pipeline import BuildOptions, build as run_build

    t0 = time.perf_counter()
    run_build(BuildOptions(model=model, target=str(target), out=out, **kw), log=lambda s: None)
    plan = json.loads((out / "bundle" / "plan.json").read_text())
    return {"build_s": round(time.perf_counter() - t0, 1), "segments": len(plan["segments"]),
            "parallel_steps": len(plan["parallel_steps"]), "predicted_ms": plan["predicted"]["latency_ms"],
            "inter_op": plan.get("inter_op", {})}


def dispatch_us(cores: int, runs: int) -> float:
    """A parallel step of `cores` trivial TVM segments on the runtime's workers, minus one inline."""
    import numpy as np
    from onnx import TensorProto, helper

    from edgesdk.backends import tvm as tvm_backend
    from edgesdk.runtime.backends.tvm_runner import TvmRunner
    from edgesdk.runtime.executor import _call
    from edgesdk.runtime.manifest import Segment

    import concurrent.futures

    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8, 8])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    lib = CACHE / "relu.so"
    res = tvm_backend.compile_onnx(m, {"kind": "llvm"}, lib)
    seg = Segment("s0", "cpu", "tvm", "relu.so", res.inputs, res.outputs, threads=1)
    runners = [TvmRunner(lib, seg, 0) for _ in range(cores)]
    feeds = {"x": np.ones((1, 8, 8, 8), np.float32)}
    pool = concurrent.futures.ThreadPoolExecutor(cores)
    inline, step = [], []
    for _ in range(runs * 20):
        t0 = time.perf_counter()
        runners[0].run(feeds)
        inline.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for f in [pool.submit(_call, r, 1, feeds) for r in runners]:
            f.result()
        step.append(time.perf_counter() - t0)
    pool.shutdown()
    return round((statistics.median(step) - statistics.median(inline)) * 1e6, 1)


def efficiency(bundles: dict[str, Path], cores: int, runs: int) -> dict:
    """e from each fit model's bundle at 1 thread and at `cores` threads, on the calling thread."""
    import numpy as np
    import tvm

    from edgesdk.runtime import BundleModel

    config = tvm.get_global_func("runtime.config_threadpool")
    out = {}
    for name, bundle in bundles.items():
        model = BundleModel(bundle, log=lambda s: None)
        x = {t.name: np.random.default_rng(0).uniform(-1, 1, t.shape).astype(t.dtype) for t in model.inputs}
        times = {1: [], cores: []}
        for _ in range(runs):
            for p in times:
                config(1, p)
                t0 = time.perf_counter()
                model.run(x)
                times[p].append(time.perf_counter() - t0)
        config(1, cores)
        t1, tp = median_ms(times[1]), median_ms(times[cores])
        out[name] = {"one_thread_ms": t1, f"{cores}_threads_ms": tp, "e": round((t1 / tp - 1) / (cores - 1), 3)}
    out["e"] = round(statistics.median(v["e"] for v in out.values()), 3)
    return out


def host_target(fitted: dict, cores: int, dispatch: float, eff: dict) -> Path:
    import yaml
    from tvm.target import codegen

    cpu_name = str(codegen.llvm_get_system_cpu())
    cpu = next(d for d in fitted["devices"] if d["kind"] == "cpu")
    cpu["codegen"]["mcpu"] = "native"  # the host's name and its real features (backends/tvm.host_cpu)
    cpu["cores"] = cores
    cpu["step_dispatch"] = {"value": dispatch, "unit": "us",
                            "source": "measured by benchmarks/bench_parallel.py on this host"}
    cpu["parallel_efficiency"] = {
        "value": max(eff["e"], 0.01), "unit": "1",  # the field must be > 0: a kernel that does not scale
        "source": f"measured by benchmarks/bench_parallel.py on this host: TVM bundles of {', '.join(FIT)} "
                  f"at 1 and {cores} threads"}
    fitted["name"] = "x86_host"
    fitted["description"] = f"this benchmark host ({cores} CPUs, llvm mcpu={cpu_name}), calibrated"
    path = CACHE / "x86_host.yaml"
    path.write_text(yaml.safe_dump(fitted, sort_keys=False))
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--out", type=Path, default=_results.path("inter-op-parallel"))
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    os.environ["TVM_NUM_THREADS"] = str(cores)
    os.environ["TVM_BIND_THREADS"] = "0"
    CACHE.mkdir(parents=True, exist_ok=True)

    import numpy as np
    import onnxruntime as ort

    from bench_import import keras_app

    from edgesdk.pipeline import calibrate
    from edgesdk.runtime import BundleModel

    result: dict = {"cores": cores, "runs": args.runs}
    paths = {name: keras_app(name)[0] for name in FIT + EVAL}
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731

    log("measuring the step hand-off ...")
    result["step_dispatch_us"] = dispatch_us(cores, args.runs)
    log(f"  {result['step_dispatch_us']} us")
    x86 = ROOT / "targets" / "x86.yaml"
    fit_bundles = {}
    for name in FIT:
        log(f"building {name} for the efficiency fit ...")
        build(paths[name], x86, CACHE / f"fit-{name}", inter_op=False)
        fit_bundles[name] = CACHE / f"fit-{name}" / "bundle"
    result["parallel_efficiency"] = efficiency(fit_bundles, cores, args.runs)
    log(f"  {result['parallel_efficiency']}")
    log("calibrating the CPU figures ...")
    cal = calibrate(str(x86), [(paths[n], {}) for n in FIT], [], threads=cores, runs=10, log=log)
    result["calibrate"] = {"on_fitted": cal["on_fitted"], "fit": cal["fit"]}
    target = host_target(cal["fitted_target"], cores, result["step_dispatch_us"], result["parallel_efficiency"])

    result["models"] = {}
    for name in EVAL:
        row: dict = {}
        for variant, kw in (("parallel", {}), ("sequential", {"inter_op": False})):
            log(f"building {name} ({variant}) ...")
            row[variant] = build(paths[name], target, CACHE / f"{name}-{variant}", **kw)
            log(f"  {row[variant]}")
        onnx_path = stage_dir(CACHE / f"{name}-sequential", "import") / "model.onnx"
        par = BundleModel(CACHE / f"{name}-parallel" / "bundle", log=lambda s: None)
        seq = BundleModel(CACHE / f"{name}-sequential" / "bundle", log=lambda s: None)
        feeds = {t.name: np.random.default_rng(0).uniform(-1, 1, t.shape).astype(t.dtype) for t in seq.inputs}
        sessions = {}
        for label, mode, inter, intra in (("onnxruntime sequential", ort.ExecutionMode.ORT_SEQUENTIAL, 1, cores),
                                          ("onnxruntime ORT_PARALLEL", ort.ExecutionMode.ORT_PARALLEL, cores, 1)):
            opts = ort.SessionOptions()
            opts.execution_mode, opts.inter_op_num_threads, opts.intra_op_num_threads = mode, inter, intra
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
            opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
            sessions[label] = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])

        def sequential_run():
            par.parallel = False
            try:
                return par.run(feeds)
            finally:
                par.parallel = True

        calls = {"edgesdk --no-inter-op (one TVM segment)": lambda: seq.run(feeds),
                 "edgesdk inter-op parallel": lambda: par.run(feeds),
                 "edgesdk inter-op bundle, groups one after another": sequential_run,
                 **{k: (lambda s: lambda: s.run(None, feeds))(s) for k, s in sessions.items()}}
        ref = sessions["onnxruntime sequential"].run(None, feeds)[0]
        row["max_abs_error_vs_onnxruntime"] = {
            k: float(np.max(np.abs(list(f().values())[0] - ref))) for k, f in list(calls.items())[:3]}
        times: dict[str, list[float]] = {k: [] for k in calls}
        for f in calls.values():
            f()  # warm up
        for _ in range(args.runs):
            for k, f in calls.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
        row["measured_ms"] = {k: median_ms(v) for k, v in times.items()}
        row["speedup_parallel_over_sequential"] = round(
            row["measured_ms"]["edgesdk --no-inter-op (one TVM segment)"] /
            row["measured_ms"]["edgesdk inter-op parallel"], 3)
        row["predicted_vs_measured"] = {
            "parallel": [row["parallel"]["predicted_ms"], row["measured_ms"]["edgesdk inter-op parallel"]],
            "sequential": [row["sequential"]["predicted_ms"],
                           row["measured_ms"]["edgesdk --no-inter-op (one TVM segment)"]]}
        par.close()
        result["models"][name] = row
        log(json.dumps(row, indent=1))
    _results.write("inter-op-parallel", result, table(result), out=args.out)
    print(table(result))


def table(result: dict) -> str:
    out = ["| model | segments (steps) | --no-inter-op ms | inter-op ms | groups in order ms | ORT seq ms | "
           "ORT_PARALLEL ms | speedup | predicted seq / par ms |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in result["models"].items():
        m = r["measured_ms"]
        out.append(f"| {name} | {r['parallel']['segments']} ({r['parallel']['parallel_steps']}) | "
                   f"{m['edgesdk --no-inter-op (one TVM segment)']:.2f} | {m['edgesdk inter-op parallel']:.2f} | "
                   f"{m['edgesdk inter-op bundle, groups one after another']:.2f} | "
                   f"{m['onnxruntime sequential']:.2f} | {m['onnxruntime ORT_PARALLEL']:.2f} | "
                   f"{r['speedup_parallel_over_sequential']:.2f}× | "
                   f"{r['sequential']['predicted_ms']:.2f} / {r['parallel']['predicted_ms']:.2f} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
