"""x86 bundles against onnxruntime and OpenVINO, with each CPU span on its measured backend.

    .venv/bin/python benchmarks/bench_cpu.py [--models A,B] [--runs 30] [--threads 2] [--no-build]
        [--target-cpu native --cpu-precision auto --out benchmarks/results/OTHER.json]

`--target-cpu native --cpu-precision auto` builds for this host's CPU with its reduced precisions (bf16,
fp16, int8 where it has them, each behind the accuracy gate), into bundles of their own; every bundle's and
OpenVINO's default run's largest error against onnxruntime fp32 (of the output's scale) is recorded.

For each model, two builds for `targets/x86.yaml` (as shipped: haswell code, 4 cores; the bundle's
runtime runs on min(4, this host's) cores), into one tuning database kept in .cache/bench-cpu/db
(--trials 0: the records already there, none at first):
  - the default: every CPU span on the backend the tune stage measured fastest on this host (the
    plan's own TVM/onnxruntime cut, or the whole span on TVM, onnxruntime or LiteRT fp32);
  - `--cpu-backends planned`: the schedule's cut unmeasured (TVM, onnxruntime only for the ops TVM
    lacks): the bundle before this issue.
Build time of each (the tune stage's share: the measurement) is recorded.

Then, interleaved: `--rounds` rounds (3), each measuring every runtime in turn in a fresh process of its own (no
other runtime's threads spinning on the 2 cores: measured side by side in one process, onnxruntime's
and TVM's idle threads slowed the next runtime by up to 5x), `--runs` inferences after 5 warm-up ones;
the median of all of a runtime's inferences:
  - the default bundle and the TVM bundle (`BundleModel.run`, the runtime a device runs),
  - onnxruntime with all graph optimizations on `--threads` intra-op threads, on the ONNX file a
    user has (the model file; for a Keras model, the converter's output from the import stage).
Every bundle's outputs are checked against onnxruntime first. Writes benchmarks/results/x86-latency.json
(--out; a run of some models updates their entries, each entry with the commit it was measured at) and prints
its table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk"), str(ROOT / "benchmarks")]
import _results  # noqa: E402  (after the path above)

QUESTION = "x86-latency"
CACHE = ROOT / ".cache" / "bench-cpu"
ROUNDS = 3  # measurements of each runtime, in turn, each in a process of its own (--rounds)
MODELS = {  # name -> (file or Keras application, build arguments)
    "MobileNetV2": ("keras:MobileNetV2", []),
    "ResNet50": ("keras:ResNet50", []),
    "InceptionV3": ("keras:InceptionV3", []),
    "EfficientNetB0": ("keras:EfficientNetB0", []),
    "PP-OCRv4-det": (".cache/models/ch_PP-OCRv4_det_infer.onnx", ["--input-shape", "x=1x3x480x480"]),
    "PP-OCRv4-rec": (".cache/models/ch_PP-OCRv4_rec_infer.onnx", ["--input-shape", "x=1x3x48x320"]),
    "silero-vad": (".cache/models/silero_vad.onnx", ["--input-shape", "input=1x512", "--input-shape", "state=2x1x128",
                                                     "--input-value", "sr=16000"]),
    "transformer-encoder": ("keras:TransformerEncoder", []),
}


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def model_file(name: str) -> Path:
    source, _ = MODELS[name]
    if not source.startswith("keras:"):
        return ROOT / source
    app = source.split(":", 1)[1]
    if app == "TransformerEncoder":
        return transformer_encoder()
    from bench_import import keras_app

    return keras_app(app)[0]


def transformer_encoder() -> Path:
    """Two post-norm encoder layers (d 256, 4 heads, feed-forward 1024) over 128 tokens of 256
    features: tf.keras layers with random weights (weights=None), as a sentence encoder's body."""
    path = CACHE / "transformer_encoder.keras"
    if path.exists():
        return path
    import tensorflow as tf

    tf.keras.utils.set_random_seed(0)
    x = inp = tf.keras.Input((128, 256), batch_size=1)
    for _ in range(2):
        a = tf.keras.layers.MultiHeadAttention(num_heads=4, key_dim=64)(x, x)
        x = tf.keras.layers.LayerNormalization(epsilon=1e-6)(x + a)
        f = tf.keras.layers.Dense(1024, activation="gelu")(x)
        x = tf.keras.layers.LayerNormalization(epsilon=1e-6)(x + tf.keras.layers.Dense(256)(f))
    model = tf.keras.Model(inp, tf.keras.layers.GlobalAveragePooling1D()(x))
    CACHE.mkdir(parents=True, exist_ok=True)
    model.save(path)
    return path


def target(cpu: str) -> str:
    """targets/x86.yaml as shipped (haswell), or for another CPU model (`native`: this host's)."""
    if cpu == "haswell":
        return "x86"
    path = CACHE / f"x86-{cpu}.yaml"
    path.write_text((ROOT / "targets" / "x86.yaml").read_text().replace("mcpu: haswell", f"mcpu: {cpu}"))
    return str(path)


def build(name: str, out: Path, extra: list[str], cpu: str = "haswell") -> dict:
    _, args = MODELS[name]
    cmd = [sys.executable, "-m", "edgesdk.cli", "build", str(model_file(name)), *args, "--target", target(cpu),
           "-o", str(out), "--tuning-db", str(CACHE / f"db-{cpu}" if cpu != "haswell" else CACHE / "db"), "--json",
           *extra]
    t0 = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)  # a fresh clone has no cache yet
    with open(out.parent / f"{out.name}.log", "w") as err:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT / "sdk")})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: see {out.parent / f'{out.name}.log'}")
    summary = json.loads(done.stdout)
    stages = {s["name"]: s["seconds"] for s in summary["stages"]}
    return {"seconds": round(time.perf_counter() - t0, 1), "tune_s": stages.get("tune"), "out": str(out)}


def reference_onnx(name: str, out: Path) -> Path:
    """The ONNX file a user would give onnxruntime: the model file, or the converter's output."""
    source, _ = MODELS[name]
    if source.endswith(".onnx"):
        return ROOT / source
    return out / ".build" / "1-import" / "converted.onnx"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=ROUNDS,
                    help="more rounds spread a shared host's slow spells over every runtime alike")
    ap.add_argument("--no-build", action="store_true", help="time the bundles the last run built")
    ap.add_argument("--target-cpu", default="haswell",
                    help="the x86 target's CPU model the bundles are built for (native: this host's)")
    ap.add_argument("--cpu-precision", default="fp32", help="the measured build's --cpu-precision (auto: bf16, fp16 "
                    "and int8 candidates where the target's CPU has them, behind the accuracy gate)")
    ap.add_argument("--out", type=Path, default=_results.path(QUESTION),
                    help="the results file (a run of some models updates their entries in it)")
    args = ap.parse_args()
    names = [n for n in args.models.split(",") if n]
    CACHE.mkdir(parents=True, exist_ok=True)
    results_path = args.out
    results = json.loads(results_path.read_text())["data"] if results_path.exists() else {}
    results.setdefault("models", {})
    suffix = "" if (args.target_cpu, args.cpu_precision) == ("haswell", "fp32") else f"-{args.target_cpu}-{args.cpu_precision}"
    for name in names:
        entry = results["models"].setdefault(name, {})
        if not args.no_build:
            log(f"{name}: building (measured CPU backends)")
            entry["build_selected"] = build(name, CACHE / f"{name}-selected{suffix}",
                                            ["--cpu-precision", args.cpu_precision], args.target_cpu)
            log(f"{name}: building (the schedule's cut, unmeasured)")
            entry["build_tvm"] = build(name, CACHE / f"{name}-tvm{suffix}", ["--cpu-backends", "planned"], args.target_cpu)
        log(f"{name}: timing")
        entry.update(measure(name, args.runs, args.threads, args.rounds, suffix))
        entry.update(target_cpu=args.target_cpu, cpu_precision=args.cpu_precision)
        entry.update(commit=_results.commit()[:7], host=host())
        log(f"{name}: {json.dumps({k: v for k, v in entry.items() if k.endswith('_ms') or k == 'chosen'})}")
    results["host"] = host()
    names = [n for n in MODELS if n in results["models"]]
    from questions import QUESTIONS

    question = results_path.stem if results_path.stem in QUESTIONS else QUESTION  # x86-latency-auto: its own
    _results.write(question, results, table(results, names), out=results_path)
    print(table(results, names))


ORT_CHILD = """
import json, sys, time
import numpy as np
import onnxruntime as ort
opts = ort.SessionOptions()
opts.intra_op_num_threads = int(sys.argv[3])
opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
session = ort.InferenceSession(sys.argv[1], opts, providers=["CPUExecutionProvider"])
feeds = dict(np.load(sys.argv[2]))
feeds = {i.name: feeds[i.name] for i in session.get_inputs()}
warmup = int(sys.argv[5]) if len(sys.argv) > 5 else 5
laps = []
for k in range(warmup + int(sys.argv[4])):
    t0 = time.perf_counter()
    session.run(None, feeds)
    if k >= warmup:
        laps.append((time.perf_counter() - t0) * 1e3)
print(json.dumps(laps))
"""


# OpenVINO as a user runs it: the model file compiled for the CPU with the latency hint on `threads` threads, in
# float32 (argv[6] "f32") or in OpenVINO's own default precision ("default": bfloat16 on a CPU with AVX512_BF16
# or AMX, float32 elsewhere); the same warm-up and timed runs as ORT_CHILD
OV_CHILD = """
import json, sys, time
import numpy as np
import openvino as ov
config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": int(sys.argv[3])}
if sys.argv[6] != "default":
    config["INFERENCE_PRECISION_HINT"] = sys.argv[6]
compiled = ov.Core().compile_model(sys.argv[1], "CPU", config)
request = compiled.create_infer_request()
given = dict(np.load(sys.argv[2]))
feeds = {}
for port in compiled.inputs:
    name = next(n for n in port.get_names() if n in given)
    feeds[name] = given[name]
warmup = int(sys.argv[5])
laps = []
for k in range(warmup + int(sys.argv[4])):
    t0 = time.perf_counter()
    request.infer(feeds)
    if k >= warmup:
        laps.append((time.perf_counter() - t0) * 1e3)
print(json.dumps(laps))
"""


def openvino_default_precision() -> str:
    """The precision OpenVINO computes in on this host's CPU when not told (its INFERENCE_PRECISION_HINT)."""
    import openvino as ov

    return ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()


def openvino_calls(paths: list[Path], feeds: Path, threads: int, runs: int, warmup: int = 5) -> tuple[dict, dict]:
    """OpenVINO's two peers, float32 and its default precision, as calls for the interleaved rounds (each a
    fresh process, OV_CHILD), on the first of `paths` (the user's model file first, then the import's ONNX)
    that OpenVINO compiles; and what to record: the file it ran, its default precision here, or why none ran."""
    said = ""
    for path in paths:
        def call(precision: str, path: Path = path, runs: int = runs, warmup: int = warmup) -> list[float]:
            done = subprocess.run([sys.executable, "-c", OV_CHILD, str(path), str(feeds), str(threads), str(runs),
                                   str(warmup), precision], capture_output=True, text=True)
            if done.returncode != 0:
                lines = [line for line in done.stderr.strip().splitlines() if line.strip()] or ["?"]
                raise RuntimeError(next((line for line in lines if "No conversion rule" in line or "Error" in line),
                                        lines[-1])[:300])
            return json.loads(done.stdout.strip().splitlines()[-1])
        try:
            call("f32", runs=1, warmup=0)
        except RuntimeError as e:
            said = str(e)
            continue
        return ({"openvino": lambda: call("f32"), "openvino default": lambda: call("default")},
                {"openvino_on": str(path.name), "openvino_default_precision": openvino_default_precision()})
    return {}, {"openvino_error": said}


def peers(med: dict, bundle: float) -> dict:
    """The bundle against the best of onnxruntime and OpenVINO float32 (what a user would pick instead), and
    against OpenVINO's default precision."""
    best = min(("onnxruntime", "openvino"), key=lambda k: med.get(k, float("inf")))
    out = {"best_peer": best, "bundle_over_best": round(bundle / med[best], 3)}
    if "openvino" in med:
        out.update({"openvino_ms": round(med["openvino"], 3), "bundle_over_openvino": round(bundle / med["openvino"], 3)})
    if "openvino default" in med:
        out.update({"openvino_default_ms": round(med["openvino default"], 3),
                    "bundle_over_openvino_default": round(bundle / med["openvino default"], 3)})
    return out


def measure(name: str, runs: int, threads: int, rounds: int = ROUNDS, suffix: str = "") -> dict:
    """Each runtime alone in a process of its own (no other runtime's threads on the cores), the
    runtimes in turn, `rounds` times; per runtime the median of all its inferences."""
    import onnxruntime as ort

    from edgesdk.runtime import BundleModel
    from edgesdk.runtime.manifest import Manifest
    from edgesdk.timing import measure_alone

    os.environ["TVM_NUM_THREADS"] = os.environ["EDGESDK_NUM_THREADS"] = str(threads)
    selected, tvm = CACHE / f"{name}-selected{suffix}" / "bundle", CACHE / f"{name}-tvm{suffix}" / "bundle"
    manifest = Manifest.load(selected)
    rng = np.random.default_rng(0)
    feeds = {t.name: (rng.integers(0, (t.valid_range or (0, 2))[1], t.shape).astype(t.dtype) if "int" in t.dtype
                      else rng.uniform(-1, 1, t.shape).astype(t.dtype)) for t in manifest.inputs}
    ref_path = reference_onnx(name, CACHE / f"{name}-selected{suffix}")
    session = ort.InferenceSession(str(ref_path), providers=["CPUExecutionProvider"])
    # the reference file still has the inputs the build froze (silero's sr): give them their value
    frozen = {"sr": np.array(16000, np.int64)} if name == "silero-vad" else {}
    ort_feeds = {i.name: (feeds[i.name] if i.name in feeds else frozen[i.name]) for i in session.get_inputs()}
    want = session.run(None, ort_feeds)[0]
    agree = {}
    for label, path in (("bundle", selected), ("tvm bundle", tvm)):
        got = next(iter(BundleModel(path, log=lambda s: None).run(feeds).values()))
        agree[label] = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-12))
    try:  # OpenVINO in its own default precision (bfloat16 where the CPU has it) against fp32 on the same input
        import openvino as ov

        compiled = ov.Core().compile_model(str(ref_path), "CPU")
        got = np.asarray(next(iter(compiled.create_infer_request().infer(ort_feeds).values())))
        agree["openvino default"] = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-12))
    except Exception as e:  # noqa: BLE001 -- a model OpenVINO's frontend cannot read: its timing says so too
        log(f"{name}: OpenVINO's default run failed: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}")
    tmp = CACHE / f"{name}-feeds.npz"
    np.savez(tmp, **ort_feeds)
    def ort_alone() -> list[float]:
        done = subprocess.run([sys.executable, "-c", ORT_CHILD, str(ref_path), str(tmp), str(threads), str(runs)],
                              capture_output=True, text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    calls = {"onnxruntime": ort_alone, "bundle": lambda: measure_alone(selected, tmp, warmup=5, runs=runs),
             "tvm bundle": lambda: measure_alone(tvm, tmp, warmup=5, runs=runs)}
    ov, ov_said = openvino_calls([ref_path, CACHE / f"{name}-selected{suffix}" / ".build" / "1-import" / "model.onnx"], tmp,
                                 threads, runs)
    calls.update(ov)
    laps: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(rounds):
        for label, call in calls.items():
            laps[label] += call()
    med = {k: round(statistics.median(v), 3) for k, v in laps.items()}
    plan = json.loads((selected / "plan.json").read_text())
    chosen = [f"{s['segments'][0]}: {s['chosen']}" for s in plan.get("cpu_selection", {}).get("spans", [])]
    return {"bundle_ms": med["bundle"], "tvm_bundle_ms": med["tvm bundle"], "onnxruntime_ms": med["onnxruntime"],
            "bundle_over_ort": round(med["bundle"] / med["onnxruntime"], 3),
            "tvm_over_ort": round(med["tvm bundle"] / med["onnxruntime"], 3), **peers(med, med["bundle"]), **ov_said,
            "predicted_ms": plan["predicted"]["latency_ms"], "chosen": chosen,
            "max_error_of_scale": agree, "runs": runs * rounds, "threads": threads}


def host() -> str:
    from edgesdk.scheduling.selection import host_name

    return f"{host_name()}, {platform.system()} {platform.release()}"


def table(results: dict, names: list[str]) -> str:
    rows = ["| model | bundle (measured backends) | onnxruntime | OpenVINO fp32 | bundle / best of the two | "
            "OpenVINO default (precision) | max error of scale vs fp32: bundle / OpenVINO default | "
            "before: TVM (+ onnxruntime) | before / onnxruntime | chosen | "
            "build s: measured (its tune stage) / before | commit |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    def s(x) -> str:
        return f"{x:.1f}" if isinstance(x, float) else str(x)

    def ms(x: float) -> str:
        return f"{x:.2f} ms" if x >= 1 else f"{x:.3f} ms"

    for n in names:
        e = results["models"][n]
        b, t = e.get("build_selected", {}), e.get("build_tvm", {})
        ov = (f"{ms(e['openvino_ms'])}" if "openvino_ms" in e else "-")
        ov_default = (f"{ms(e['openvino_default_ms'])} ({e['openvino_default_precision']})" if "openvino_default_ms" in e
                      else e.get("openvino_error", "not measured")[:60])
        best = (f"**{e['bundle_over_best']:.2f}** ({e['best_peer']})" if "bundle_over_best" in e
                else f"**{e['bundle_over_ort']:.2f}** (onnxruntime)")
        err = e.get("max_error_of_scale") or {}
        errors = f"{err.get('bundle', float('nan')):.2g} / " + (f"{err['openvino default']:.2g}" if "openvino default" in err
                                                                else "-")
        rows.append(f"| {n} | {ms(e['bundle_ms'])} | {ms(e['onnxruntime_ms'])} | {ov} | {best} | {ov_default} | {errors} | "
                    f"{ms(e['tvm_bundle_ms'])} | {e['tvm_over_ort']:.2f} | {'; '.join(e['chosen'])} | "
                    f"{s(b.get('seconds', '-'))} s ({s(b.get('tune_s', '-'))} s) / {s(t.get('seconds', '-'))} s | "
                    f"{e.get('commit', '-')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
