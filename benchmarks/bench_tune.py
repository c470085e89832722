"""MetaSchedule tuning (the tune stage): tuned latency beside untuned TVM, onnxruntime and LiteRT,
tuning wall time per model, and how much a database from other models speeds up a search.

    .venv/bin/python benchmarks/bench_tune.py [--trials 600] [--transfer-trials 96] [--runs 50] [--threads 2]

A rerun reuses the kept database and the cached builds (no trials); `--transfer-trials 0` then
measures the latencies again and keeps the transfer results of the last run.

1. Tuning: `edgesdk build MODEL --target <x86 for this host's CPU> --trials N --no-inter-op` for
   MobileNetV2, ResNet50, InceptionV3 (tf.keras.applications, weights=None) and the PP-OCRv4 text
   detector (pretrained, rapidocr-onnxruntime's wheel, 1x3x480x480), in that order, all into one
   tuning database (.cache/bench-tune/db, kept: a rerun reuses it and costs no trials), so that
   each model's search starts with a cost model trained on the models before it, as a user's
   database grows. Wall time per model, from the build's tune stage.
2. Latency of one inference, median of `--runs` after warm-up, `--threads` threads, in one run
   after all tuning: the tuned bundle, the untuned bundle (--trials 0, empty database: the default
   schedules), onnxruntime (all graph optimizations) on the imported ONNX model, LiteRT (fp32 TFLite
   from the Keras model; the detector has no TensorFlow model, so no LiteRT row).
3. Transfer: for the largest convolution task and the matmul task (where there is one) of
   MobileNetV2, ResNet50 and the detector, two searches of `--transfer-trials` candidates in
   batches of 8, each in a fresh database: without transfer (an empty database), and with transfer
   (the database holds the other models' records from step 1, none of this model's, and the cost
   model trains on them first). Reported: trials until the best latency found is within 5 % of
   the best either search found.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk"), str(ROOT / "benchmarks")]
import _results  # noqa: E402  (after the path above)
from edgesdk.pipeline import stage_dir  # noqa: E402  (after the path above)
CACHE = ROOT / ".cache" / "bench-tune"
MODELS = ("MobileNetV2", "ResNet50", "InceptionV3", "PP-OCRv4-det")
TRANSFER_MODELS = ("MobileNetV2", "ResNet50", "PP-OCRv4-det")


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def model_file(name: str) -> tuple[Path, list[str]]:
    if name == "PP-OCRv4-det":
        return ROOT / ".cache" / "models" / "ch_PP-OCRv4_det_infer.onnx", ["--input-shape", "x=1x3x480x480"]
    from bench_import import keras_app

    return keras_app(name)[0], []


def host_target() -> Path:
    """targets/x86.yaml with `mcpu` set to this host's CPU."""
    import yaml
    from tvm.target import codegen

    cpu = str(codegen.llvm_get_system_cpu())
    data = yaml.safe_load((ROOT / "targets/x86.yaml").read_text())
    data["name"] = "x86_host"
    data["devices"][0]["codegen"]["mcpu"] = "native"  # the host's name and its real features (backends/tvm.host_cpu)
    data["description"] = f"this benchmark host (llvm mcpu={cpu})"
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / "x86_host.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def build(model: Path, extra: list[str], target: Path, out: Path, db: Path, trials: int) -> dict:
    cmd = [str(ROOT / ".venv/bin/edgesdk"), "build", str(model), *extra, "--target", str(target), "-o", str(out),
           "--tuning-db", str(db), "--trials", str(trials), "--no-inter-op", "--json"]
    t0 = time.perf_counter()
    with open(out.parent / f"{out.name}.log", "w") as err:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    if done.returncode != 0:
        raise SystemExit(f"build of {model.name} failed, see {out.parent / f'{out.name}.log'}")
    summary = json.loads(done.stdout)
    tune = json.loads((stage_dir(out, "tune") / "tune.json").read_text())
    return {"wall_s": round(time.perf_counter() - t0, 1),
            "stages_s": {s["name"]: round(s["seconds"], 1) for s in summary["stages"]}, "tune": tune}


def litert_fn(keras_path: Path, threads: int):
    """fp32 TFLite of the Keras model (batch fixed to 1) on LiteRT's CPU interpreter."""
    import numpy as np
    import tensorflow as tf
    from ai_edge_litert.interpreter import Interpreter

    tfl = CACHE / f"{keras_path.stem}_fp32.tflite"
    if not tfl.exists():
        model = tf.keras.models.load_model(keras_path, compile=False)
        shape = [1, *model.inputs[0].shape[1:]]
        fn = tf.function(lambda x: model(x, training=False)).get_concrete_function(tf.TensorSpec(shape, tf.float32))
        tfl.write_bytes(tf.lite.TFLiteConverter.from_concrete_functions([fn], model).convert())
    interp = Interpreter(model_path=str(tfl), num_threads=threads)
    interp.allocate_tensors()
    inp = interp.get_input_details()[0]
    x = np.random.default_rng(0).uniform(-1, 1, inp["shape"]).astype(np.float32)

    def run():
        interp.set_tensor(inp["index"], x)
        interp.invoke()

    return run


def latencies(name: str, tuned: Path, untuned: Path, threads: int, runs: int) -> dict:
    import numpy as np
    import onnxruntime as ort

    from edgesdk.runtime import BundleModel

    from bench_e2e import median_ms

    row = {}
    t = BundleModel(tuned / "bundle", log=lambda s: None)
    u = BundleModel(untuned / "bundle", log=lambda s: None)
    feeds = {s.name: np.random.default_rng(0).uniform(-1, 1, s.shape).astype(s.dtype) for s in t.inputs}
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(str(stage_dir(untuned, "import") / "model.onnx"), opts,
                                providers=["CPUExecutionProvider"])
    out_t, out_r = t.run(feeds), sess.run(None, feeds)
    first = next(iter(out_t.values()))
    row["max_abs_vs_onnxruntime"] = float(np.max(np.abs(first - out_r[0])))
    row["tuned_ms"] = round(median_ms(lambda: t.run(feeds), runs), 3)
    row["untuned_ms"] = round(median_ms(lambda: u.run(feeds), runs), 3)
    row["onnxruntime_ms"] = round(median_ms(lambda: sess.run(None, feeds), runs), 3)
    if name != "PP-OCRv4-det":
        row["litert_fp32_ms"] = round(median_ms(litert_fn(model_file(name)[0], threads), runs), 3)
    return row


def transfer(name: str, kept: dict, target: Path, db_all: Path, trials: int) -> list[dict]:
    """Two searches per chosen task of `name`: an empty database / the other models' records."""
    import onnx

    from edgesdk.backends import tvm as tvm_backend
    from edgesdk.config import load_target

    tune = kept[name]["tune"]["kinds"]["cpu"]
    tasks = tune["per_task"]
    convs = [t for t in tasks if "conv2d" in t["name"] and t["untuned_ms"]]
    chosen = [max(convs, key=lambda t: t["untuned_ms"] * t["weight"])] if convs else []
    chosen += [t for t in tasks if "matmul" in t["name"] or "dense" in t["name"]][:1]
    own = {t["workload"] for t in tasks}
    codegen = load_target(str(target))[0].devices[0].codegen
    segment = stage_dir(kept[name]["out"], "schedule")
    models = [onnx.load(str(p)) for p in sorted(segment.glob("segments/*.onnx"))]
    rows = []
    for task in chosen:
        row = {"model": name, "task": task["name"]}
        for label, with_db in (("without", False), ("with", True)):
            db = CACHE / "transfer" / f"{name}-{task['name']}-{label}"
            shutil.rmtree(db, ignore_errors=True)
            if with_db:
                row["transfer_records"] = copy_database(db_all, db, exclude=own)
            curve: list[tuple[int, float]] = []

            def progress(p, curve=curve, task=task):
                if task["name"] in p.best_ms:
                    curve.append((p.measured, p.best_ms[task["name"]]))

            t0 = time.perf_counter()
            s = tvm_backend.tune_onnx(models, codegen, db, trials=trials, only_tasks=[task["name"]], batch=8,
                                      progress=progress, transfer=with_db, log=log)
            row[label] = {"curve": curve, "wall_s": round(time.perf_counter() - t0, 1),
                          "untuned_ms": s["per_task"][0]["untuned_ms"], "best_ms": s["per_task"][0]["best_ms"]}
            log(f"transfer {name} {task['name']} {label}: {row[label]['best_ms']} ms in {row[label]['wall_s']} s")
        best = min(b for label in ("without", "with") for _, b in row[label]["curve"])
        for label in ("without", "with"):
            row[label]["trials_to_5pct"] = next((n for n, b in row[label]["curve"] if b <= 1.05 * best), None)
        rows.append(row)
    return rows


def copy_database(src_kind_dir: Path, dst: Path, exclude: set[str]) -> int:
    """A new database with every record of `src` except those of the workloads in `exclude`."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.utils import shash2hex

    dst.mkdir(parents=True)
    shutil.copyfile(src_kind_dir / "target.json", dst / "target.json")
    old = ms.database.JSONDatabase(work_dir=str(src_kind_dir), allow_missing=False)
    new = ms.database.JSONDatabase(work_dir=str(dst), allow_missing=True)
    n = 0
    for r in old.get_all_tuning_records():
        if shash2hex(r.workload.mod) in exclude:
            continue
        new.commit_tuning_record(ms.database.TuningRecord(r.trace, new.commit_workload(r.workload.mod), r.run_secs,
                                                          r.target, r.args_info))
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=600)
    ap.add_argument("--transfer-trials", type=int, default=96)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=_results.path("tune"))
    args = ap.parse_args()
    for var in ("TVM_NUM_THREADS", "OMP_NUM_THREADS", "EDGESDK_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    target = host_target()
    db = CACHE / "db"
    result: dict = {"trials": args.trials, "threads": args.threads, "runs": args.runs, "models": {}}
    kept: dict = {}
    for name in MODELS:
        model, extra = model_file(name)
        log(f"tuning {name} ({args.trials} trials) ...")
        tuned = build(model, extra, target, CACHE / f"{name}-tuned", db, args.trials)
        log(f"  {tuned['wall_s']} s")
        log(f"building {name} untuned ...")
        shutil.rmtree(CACHE / "empty-db", ignore_errors=True)
        build(model, extra, target, CACHE / f"{name}-untuned", CACHE / "empty-db", 0)
        kept[name] = {**tuned, "out": CACHE / f"{name}-tuned"}
        cpu = tuned["tune"]["kinds"].get("cpu", {})
        result["models"][name] = {"tune_stage_s": tuned["stages_s"].get("tune"), "build_wall_s": tuned["wall_s"],
                                  **{k: cpu.get(k) for k in ("tasks", "searched", "reused", "trials", "stopped",
                                                             "wall_s", "transfer", "failures")},
                                  "per_task": cpu.get("per_task")}
    log("latency ...")
    for name in MODELS:
        result["models"][name]["latency"] = latencies(name, CACHE / f"{name}-tuned", CACHE / f"{name}-untuned",
                                                      args.threads, args.runs)
        log(f"  {name}: {result['models'][name]['latency']}")
    if args.transfer_trials:
        result["transfer"] = []
        for name in TRANSFER_MODELS:
            result["transfer"] += transfer(name, kept, target, db / "cpu", args.transfer_trials)
    elif args.out.exists():  # --transfer-trials 0: a rerun of the latencies keeps the last transfer run
        result["transfer"] = json.loads(args.out.read_text())["data"].get("transfer")
    result = json.loads(json.dumps(result, default=str))
    _results.write("tune", result, table(result), out=args.out, notes=notes(result))
    print(table(result))


def table(result: dict) -> str:
    """Latency of one inference: tuned against untuned, onnxruntime and LiteRT fp32."""
    rows = ["| model | tuned bundle ms | untuned bundle ms | tuned vs untuned | onnxruntime ms | tuned / onnxruntime | "
            "LiteRT fp32 ms | trials (searched / reused functions) | tune stage s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, m in result["models"].items():
        lat = m["latency"]
        litert = f"{lat['litert_fp32_ms']:.1f}" if lat.get("litert_fp32_ms") else "-"
        rows.append(f"| {name} | {lat['tuned_ms']:.2f} | {lat['untuned_ms']:.2f} | "
                    f"{lat['untuned_ms'] / lat['tuned_ms']:.2f}× | {lat['onnxruntime_ms']:.2f} | "
                    f"{lat['tuned_ms'] / lat['onnxruntime_ms']:.2f} | {litert} | {m['trials']} ({m['searched']} / "
                    f"{m['reused']}) | {m['tune_stage_s']} |")
    return "\n".join(rows)


def notes(result: dict) -> list[str]:
    """The transfer searches: trials to come within 5 % of the better search's best, without and with transfer."""
    def said(s: dict) -> str:
        return f"{s['trials_to_5pct'] if s['trials_to_5pct'] is not None else '—'} trials, best {s['best_ms']:.4g} ms, {s['wall_s']:.0f} s"

    return [f"transfer, {t['model']} {t['task']}: without {said(t['without'])}; with ({t['transfer_records']} records) "
            f"{said(t['with'])}" for t in result.get("transfer") or []]


if __name__ == "__main__":
    main()
