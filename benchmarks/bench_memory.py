"""Build memory against model size: `edgesdk build` of Keras applications (`weights=None`)
of growing size and of an ONNX model past protobuf's 2 GB (a wide MLP, random weights as external
data), the resident memory of the whole process tree (the build and its converter and compiler
children) sampled every 0.2 s, its peak per stage, beside the build's own estimate (`stages/memory.py`).

    .venv/bin/python benchmarks/bench_memory.py [--models mobilenet_v2,resnet50,vgg16,mlp2g,vgg16.savedmodel] [--targets x86]
                                                [--low-memory both|on|off] [--out benchmarks/results/build-memory.json]
                                                [--plot PNG]

A Keras application may also be given as a TensorFlow SavedModel (`vgg16.savedmodel`) or an fp32 TFLite
file (`vgg16.tflite`). Each model is saved once under .cache/bench-memory/ and built from scratch (a fresh -o and an empty
--tuning-db, so every CPU backend is converted and timed; `--trials 0`: tuning search is not what is
measured). The base is the tree's peak building a model of one 3x3 convolution (TensorFlow's
converter, TVM and the runtime loaded, no weights to speak of). A build the estimate refuses
(`build.out-of-memory`) is recorded as refused, with its estimate. Each build measured replaces that
build's row (target, mode, model) in benchmarks/results/build-memory.json (--out), with the base of its own
run and the commit; the other rows stay, so the file holds the newest figure of every build. Printed as a
markdown table, and plotted (peak against weights, the 4x line) to --plot; benchmarks/report.py draws
benchmarks/results/build-memory.png from the results file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import _results

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "build-memory"
WORK = ROOT / ".cache" / "bench-memory"
MODELS = {"mobilenet_v2": "MobileNetV2", "resnet50": "ResNet50", "vgg16": "VGG16"}
MLP_WIDTH, MLP_LAYERS = 8192, 9  # 9 x 8192 x 8192 float32: 2.25 GiB of weights, past protobuf's 2 GB
ESTIMATE = re.compile(r"build: memory: about ([\d.]+) (GiB|MiB) at its peak")
STAGE = re.compile(r"^\[(\d)/6\] (\w+) (\.\.\.|done|cached)")


def tree_rss(root: int) -> tuple[int, int]:
    """Resident bytes of `root` and every process below it, and the same less the pages of files mapped
    (a mapped weight's file, the libraries), which the kernel can drop and read again: one walk, one
    read of each process's statm."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    page = os.sysconf("SC_PAGE_SIZE")
    total = anonymous = 0
    todo = [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/statm") as f:
                resident, shared = (int(x) * page for x in f.read().split()[1:3])
        except (OSError, ValueError):  # gone meanwhile
            continue
        total, anonymous = total + resident, anonymous + resident - shared
    return total, anonymous


def measured_build(model: Path, target: str, out: Path, low_memory: bool = False) -> dict:
    """Build `model`; the tree's peak per stage and overall, the stage times, the exit code."""
    db = out.with_name(out.name + "-tuning")  # an empty tuning database: nothing replayed from a timing cache
    for path in (out, db):
        shutil.rmtree(path, ignore_errors=True)
    cmd = [str(ROOT / ".venv" / "bin" / "edgesdk"), "build", str(model), "--target", target, "-o", str(out),
           "--trials", "0", "--tuning-db", str(db)] + (["--low-memory"] if low_memory else [])
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    state = {"stage": "start", "peaks": {}, "peak": 0, "anonymous": 0, "done": False, "line": "", "peak_line": ""}

    def sample() -> None:
        while not state["done"]:
            rss, anonymous = tree_rss(proc.pid)
            if rss > state["peak"]:  # the build's last log line when the peak was sampled: what held it
                state["peak"], state["peak_line"] = rss, state["line"]
            state["anonymous"] = max(state["anonymous"], anonymous)
            stage = state["stage"]
            state["peaks"][stage] = max(state["peaks"].get(stage, 0), rss)
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0, started, seconds, log = time.perf_counter(), {}, {}, []
    for line in proc.stderr:
        line = line.replace(str(ROOT), "<repo>")  # no machine's paths in the recorded lines
        log.append(line.rstrip())
        state["line"] = line.strip()
        m = STAGE.match(line)
        if m and m[3] == "...":
            state["stage"], started[m[2]] = m[2], time.perf_counter()
        elif m:
            seconds[m[2]] = round(time.perf_counter() - started.get(m[2], time.perf_counter()), 1)
            state["stage"] = "after"
    code = proc.wait()
    state["done"] = True
    sampler.join()
    # the estimate after import (every compiler the target may run), then after schedule (the plan's devices)
    said = [m for x in log if (m := ESTIMATE.search(x))]
    estimates = [float(m[1]) * (2**30 if m[2] == "GiB" else 2**20) for m in said]
    estimate = estimates[-1] if estimates else None
    shutil.rmtree(out, ignore_errors=True)  # VGG16's -o alone holds GBs: gone once measured
    shutil.rmtree(db, ignore_errors=True)
    return {"exit": code, "peak_bytes": state["peak"], "peak_anonymous_bytes": state["anonymous"],
            "stage_peak_bytes": state["peaks"], "peak_after_line": state["peak_line"],
            "estimate_bytes": estimate, "estimate_before_plan_bytes": estimates[0] if estimates else None,
            "refused": any("build.out-of-memory" in x or "needs about" in x
                                                       and "available" in x for x in log if x.startswith("error")),
            "stage_seconds": seconds,
            "wall_s": round(time.perf_counter() - t0, 1), "errors": [x for x in log if x.startswith("error")][:3],
            "log_tail": log[-3:] if code else []}


def _made(path: Path, code: str) -> Path:
    """`path`, made once by running `code` (which writes it) in a Python of its own."""
    if not path.exists():
        WORK.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-c", code], check=True)
    return path


KERAS = "import os; os.environ['TF_CPP_MIN_LOG_LEVEL']='2'; import keras; "


def saved(name: str) -> Path:
    path = WORK / f"{name}.keras"
    return _made(path, KERAS + f"keras.applications.{MODELS[name]}(weights=None).save({str(path)!r})")


def exported(name: str, fmt: str) -> Path:
    """The Keras application `name` in another format a user brings: a TensorFlow SavedModel (Keras's
    `export`) or an fp32 .tflite (TensorFlow's converter)."""
    build = f"import tensorflow as tf; m = keras.applications.{MODELS[name]}(weights=None); "
    if fmt == "savedmodel":
        path = WORK / f"{name}_savedmodel"
        return _made(path, KERAS + build + f"m.export({str(path)!r})")
    if fmt == "tflite":
        path = WORK / f"{name}.tflite"
        return _made(path, KERAS + build + f"open({str(path)!r}, 'wb').write(tf.lite.TFLiteConverter.from_keras_model(m).convert())")
    raise SystemExit(f"bench-memory: format {fmt!r} is not known (savedmodel, tflite)")


def model_for(name: str) -> Path:
    """A --models entry: tiny, mlp2g, a Keras application, or one in another format (vgg16.savedmodel)."""
    if name == "tiny":
        return tiny()
    if name == "mlp2g":
        return mlp2g()
    base, _, fmt = name.partition(".")
    return exported(base, fmt) if fmt else saved(base)


def tiny() -> Path:
    path = WORK / "tiny.keras"
    return _made(path, KERAS + "i = keras.Input((32, 32, 3), name='image'); "
                 f"keras.Model(i, keras.layers.Conv2D(8, 3)(i)).save({str(path)!r})")


def mlp2g() -> Path:
    """A wide MLP past protobuf's 2 GB: MatMul + Add (+ Relu) x MLP_LAYERS, its weights as external data."""
    path = WORK / "mlp2g.onnx"
    return _made(path, f"""
import numpy as np, onnx
from onnx import helper as h, numpy_helper as nh, TensorProto as T
n, layers = {MLP_WIDTH}, {MLP_LAYERS}
rng = np.random.default_rng(0)
nodes, inits, x = [], [], "x"
for i in range(layers):
    inits.append(nh.from_array(rng.standard_normal((n, n), dtype=np.float32) / np.float32(np.sqrt(n)), f"w{{i}}"))
    inits.append(nh.from_array((rng.standard_normal(n) * 0.1).astype(np.float32), f"b{{i}}"))
    nodes += [h.make_node("MatMul", [x, f"w{{i}}"], [f"m{{i}}"]), h.make_node("Add", [f"m{{i}}", f"b{{i}}"], [f"a{{i}}"])]
    x = f"a{{i}}"
    if i < layers - 1:
        nodes.append(h.make_node("Relu", [x], [f"r{{i}}"]))
        x = f"r{{i}}"
g = h.make_graph(nodes, "mlp2g", [h.make_tensor_value_info("x", T.FLOAT, [1, n])],
                 [h.make_tensor_value_info(x, T.FLOAT, [1, n])], initializer=inits)
m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)], ir_version=10)
onnx.save(m, {str(path)!r}, save_as_external_data=True, all_tensors_to_one_file=True, location="mlp2g.onnx.data")
""")


def weight_bytes(model: Path) -> int:
    """The model's weights: an ONNX file's initializers (external data included); a SavedModel's variables;
    a Keras or TFLite file's size."""
    if model.is_dir():
        return sum(p.stat().st_size for p in (model / "variables").iterdir())
    if model.suffix != ".onnx":
        return model.stat().st_size
    return model.stat().st_size + sum(p.stat().st_size for p in model.parent.glob(model.name + ".data"))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    gib = 2**30
    top = 0.0
    for key, runs in result["runs"].items():
        base = runs["tiny"]["peak_bytes"]
        pts = sorted((r["weight_bytes"] / gib, (r["estimate_bytes"] if r["refused"] else r["peak_bytes"]) / gib,
                      r["refused"]) for name, r in runs.items() if name != "tiny")
        line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)[0]
        for x, y, refused in pts:
            if refused:
                ax.plot([x], [y], marker="x", markersize=11, color=line.get_color())
        top = max(top, max((p[0] for p in pts), default=0))
    base = min(r["tiny"]["peak_bytes"] for r in result["runs"].values()) / gib
    xs = [0, top * 1.05]
    ax.plot(xs, [base + 4 * x for x in xs], "k--", label=f"goal: base {base:.2f} GiB + 4 x weights")
    ax.axhline(24, color="grey", linestyle=":", label="this machine's 24 GB")
    ax.set_xlabel("weights (GiB)")
    ax.set_ylabel("peak resident memory of the build (GiB)")
    ax.set_title("edgesdk build: peak memory against model size (x: refused, at its estimate)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(result: dict) -> str:
    """One row per build: its peak, the estimate the build logged and (peak - base) / weights, where the base
    is the one-convolution build of the same run."""
    rows = ["| build | model | weights MiB | result | peak GiB | of it anonymous | estimate GiB | "
            "(peak - base) / weights | peak during | wall s | commit |", "|---|---|---:|---|---:|---:|---:|---:|---|---:|---|"]
    for key, runs in result["runs"].items():
        for name, r in runs.items():
            if name == "tiny":
                continue
            base = r.get("base_bytes", runs["tiny"]["peak_bytes"])
            ratio = (r["peak_bytes"] - base) / r["weight_bytes"]
            during = max(r["stage_peak_bytes"].items(), key=lambda kv: kv[1])[0] if r["stage_peak_bytes"] else "-"
            est = f"{r['estimate_bytes'] / 2**30:.2f}" if r["estimate_bytes"] else "-"
            anonymous = f"{r['peak_anonymous_bytes'] / 2**30:.2f}" if r.get("peak_anonymous_bytes") else "-"
            outcome = "refused" if r["refused"] else "built" if r["exit"] == 0 else f"exit {r['exit']}"
            rows.append(f"| {key} | {name} | {r['weight_bytes'] / 2**20:.0f} | {outcome} | "
                        f"{r['peak_bytes'] / 2**30:.2f} | {anonymous} | {est} | "
                        f"{'under the base' if ratio < 0 else f'{ratio:.1f}'} | {during} | {r.get('wall_s', '-')} | "
                        f"{r.get('commit', '-')} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join([*MODELS, "mlp2g"]))
    parser.add_argument("--targets", default="x86")
    parser.add_argument("--low-memory", default="both", choices=("both", "on", "off"))
    parser.add_argument("--out", type=Path, default=_results.path(QUESTION))
    parser.add_argument("--plot", type=Path, default=None, help="where to plot them (none unless given)")
    args = parser.parse_args()
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.low_memory]
    # the newest figure of every build: this run's builds replace theirs, the others stay
    result = json.loads(args.out.read_text())["data"] if args.out.exists() else {"runs": {}}
    result["host"] = {"machine": platform.machine(), "cpus": os.cpu_count(), "cpu": _cpu_name()}
    commit = _results.commit()[:7]
    for target in args.targets.split(","):
        for low in modes:
            key = f"{target}{' --low-memory' if low else ''}"
            rows = result["runs"].setdefault(key, {})
            for name in ["tiny", *args.models.split(",")]:
                model = model_for(name)
                size = weight_bytes(model)
                # the same weights in another format: counted as the Keras file holds them (Keras's SavedModel
                # export writes each variable twice, under two paths of its object graph)
                weights = weight_bytes(saved(name.partition(".")[0])) if "." in name else size
                print(f"bench-memory: {name} ({weights / 2**20:.0f} MiB) for {key} ...", file=sys.stderr, flush=True)
                rows[name] = {"file_bytes": size, "weight_bytes": weights,
                              **measured_build(model, target, WORK / f"out-{name}-{target}", low),
                              "base_bytes": rows["tiny"]["peak_bytes"] if name != "tiny" else None, "commit": commit}
                _results.write(QUESTION, result, table(result), out=args.out)  # each build kept as it finishes
    if args.plot:
        plot(result, args.plot)
    print(table(result))
    measured = [result["runs"][f"{t}{' --low-memory' if low else ''}"] for t in args.targets.split(",") for low in modes]
    return 0 if all(r["exit"] == 0 or r["refused"] for rows in measured for r in rows.values()) else 1


def _cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
