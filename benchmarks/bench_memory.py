"""Build memory against model size (issue 22): `edgesdk build` of Keras applications (`weights=None`)
of growing size, the resident memory of the whole process tree (the build and its converter and
compiler children) sampled every 0.2 s, its peak per stage.

    .venv/bin/python benchmarks/bench_memory.py [--models mobilenet_v2,resnet50,vgg16] [--target x86]
                                                [--out benchmarks/memory.json]

Each model is saved once as .keras under .cache/bench-memory/ and built from scratch (a fresh -o and
an empty --tuning-db, so every CPU backend is converted and timed; `--trials 0`: tuning search is not
what is measured). The base is the tree's peak building a model of
one 3x3 convolution (TensorFlow's converter, TVM and the runtime loaded, no weights to speak of).
Printed as a markdown table; written to --out.
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

from edgesdk.ir.memory import resident_bytes

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".cache" / "bench-memory"
MODELS = {"mobilenet_v2": "MobileNetV2", "resnet50": "ResNet50", "vgg16": "VGG16"}
STAGE = re.compile(r"^\[(\d)/6\] (\w+) (\.\.\.|done|cached)")


def tree_rss(root: int) -> int:
    """Resident bytes of `root` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        total += resident_bytes(pid)
    return total


def measured_build(model: Path, target: str, out: Path) -> dict:
    """Build `model`; the tree's peak per stage and overall, the stage times, the exit code."""
    db = out.with_name(out.name + "-tuning")  # an empty tuning database: nothing replayed from a timing cache
    for path in (out, db):
        shutil.rmtree(path, ignore_errors=True)
    cmd = [str(ROOT / ".venv" / "bin" / "edgesdk"), "build", str(model), "--target", target, "-o", str(out),
           "--trials", "0", "--tuning-db", str(db)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    state = {"stage": "start", "peaks": {}, "peak": 0, "done": False}

    def sample() -> None:
        while not state["done"]:
            rss = tree_rss(proc.pid)
            state["peak"] = max(state["peak"], rss)
            stage = state["stage"]
            state["peaks"][stage] = max(state["peaks"].get(stage, 0), rss)
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0, started, seconds, log = time.perf_counter(), {}, {}, []
    for line in proc.stderr:
        log.append(line.rstrip())
        m = STAGE.match(line)
        if m and m[3] == "...":
            state["stage"], started[m[2]] = m[2], time.perf_counter()
        elif m:
            seconds[m[2]] = round(time.perf_counter() - started.get(m[2], time.perf_counter()), 1)
            state["stage"] = "after"
    code = proc.wait()
    state["done"] = True
    sampler.join()
    return {"exit": code, "peak_bytes": state["peak"], "stage_peak_bytes": state["peaks"],
            "stage_seconds": seconds,
            "wall_s": round(time.perf_counter() - t0, 1), "errors": [x for x in log if x.startswith("error")][:3],
            "log_tail": log[-3:] if code else []}


def saved(name: str) -> Path:
    path = WORK / f"{name}.keras"
    if not path.exists():
        WORK.mkdir(parents=True, exist_ok=True)
        code = (f"import os; os.environ['TF_CPP_MIN_LOG_LEVEL']='2'; import keras; "
                f"keras.applications.{MODELS[name]}(weights=None).save({str(path)!r})")
        subprocess.run([sys.executable, "-c", code], check=True)
    return path


def tiny() -> Path:
    path = WORK / "tiny.keras"
    if not path.exists():
        WORK.mkdir(parents=True, exist_ok=True)
        code = ("import os; os.environ['TF_CPP_MIN_LOG_LEVEL']='2'; import keras; "
                "i = keras.Input((32, 32, 3), name='image'); "
                f"keras.Model(i, keras.layers.Conv2D(8, 3)(i)).save({str(path)!r})")
        subprocess.run([sys.executable, "-c", code], check=True)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--target", default="x86")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "memory.json")
    args = parser.parse_args()
    rows = {}
    for name in ["tiny", *args.models.split(",")]:
        model = tiny() if name == "tiny" else saved(name)
        size = model.stat().st_size
        print(f"bench-memory: {name} ({size / 2**20:.0f} MiB) for {args.target} ...", file=sys.stderr, flush=True)
        rows[name] = {"file_bytes": size, **measured_build(model, args.target, WORK / f"out-{name}-{args.target}")}
    base = rows["tiny"]["peak_bytes"]
    result = {"target": args.target, "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
              "base_bytes": base, "models": rows}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    stages = ["import", "legalize", "schedule", "tune", "compress", "package"]
    print(f"| model | file MiB | exit | peak GiB | (peak - base) / file | " + " | ".join(stages) + " |")
    print("|---|---:|---:|---:|---:|" + "---:|" * len(stages))
    for name, r in rows.items():
        ratio = (r["peak_bytes"] - base) / r["file_bytes"]
        cells = [f"{r['stage_peak_bytes'].get(s, 0) / 2**30:.2f} ({r['stage_seconds'].get(s, 0):.0f} s)" for s in stages]
        print(f"| {name} | {r['file_bytes'] / 2**20:.0f} | {r['exit']} | {r['peak_bytes'] / 2**30:.2f} | {ratio:.1f} | "
              + " | ".join(cells) + " |")
    return 0 if all(r["exit"] == 0 for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
