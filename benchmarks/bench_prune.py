"""Whole models pruned: the pruned bundle against the dense bundle and onnxruntime, with fidelity.

    .venv/bin/python benchmarks/bench_prune.py [--models ResNet-18,MobileNetV2,ResNet50] [--batches 1,16]
                                               [--methods 1:4,2:4] [--plans 0.5,1] [--runs 10] [--rounds 3]
                                               [--no-build]

For each model (random weights: ResNet-18 built in Keras by tests/model_zoo.py, MobileNetV2 and ResNet50 from
tf.keras.applications, weights=None) and batch size, builds for `targets/x86.yaml` with `mcpu` set to this
host's CPU (`x86_host`, as bench_tune.py: the kernels use the vector width onnxruntime uses here) into
.cache/bench-prune (one tuning database, --trials 0, 8 synthetic calibration samples):
  - dense: the default build (each CPU span on the backend the tune stage measured fastest);
  - pruned, per method: `--prune METHOD` (all but the first and last layers), the same measured choice, each
    pruned convolution on the sparse kernel only where it was timed faster than the dense one;
  - per-layer plans, per fraction F of `--plans`: `--prune-plan auto --prune METHODS --latency-budget B`, where
    B = dense - F * (dense - fastest): dense the dense build's CPU time as its tune stage measured it (the
    fastest candidate), fastest the fastest plan's TVM segments as a first auto build (`--cpu-backends
    planned`, an unbounded budget) timed them (F = 1: the fastest plan, each layer on its fastest option).
Then, interleaved (`--rounds` rounds, each runtime in a process of its own, `--runs` inferences after 3
warm-up ones; the median of all): onnxruntime (all graph optimizations, 2 threads) on the dense ONNX file a
user has, and every bundle (`BundleModel.run`). The pruned bundle's fidelity to the dense model (the build's
record, on its calibration samples), its sparse kernels and the tune stage's candidate times come from the
manifest. Writes benchmarks/results/prune.json (each build replacing its row) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk"), str(ROOT / "benchmarks")]
import _results  # noqa: E402  (after the path above)
CACHE = ROOT / ".cache" / "bench-prune"
THREADS = 2
from bench_cpu import ORT_CHILD  # noqa: E402  (after the path above)


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def model_file(name: str, batch: int) -> tuple[Path, list[str]]:
    """The model file and the build arguments that give it `batch`."""
    if name == "ResNet-18":
        from tests import model_zoo

        return model_zoo.resnet18(224, batch), []
    from bench_import import keras_app

    return keras_app(name)[0], ["--batch", str(batch)]


def build(model: Path, args: list[str], out: Path, extra: list[str]) -> dict:
    from bench_tune import host_target

    cmd = [sys.executable, "-m", "edgesdk.cli", "build", str(model), *args, "--target", str(host_target()), "-o", str(out),
           "--tuning-db", str(CACHE / "db"), "--calib-samples", "8", "--json", *extra]
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(out.parent / f"{out.name}.log", "w") as err:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT / "sdk")})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: see {out.parent / f'{out.name}.log'}")
    return {"seconds": round(time.perf_counter() - t0, 1)}


def reference(model: Path, out: Path) -> Path:
    return model if model.suffix == ".onnx" else out / ".build" / "1-import" / "converted.onnx"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="ResNet-18,MobileNetV2,ResNet50")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--methods", default="1:4,2:4")
    ap.add_argument("--plans", default="", help="fractions of the predicted saving for --prune-plan auto budgets")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--out", default=str(_results.path("prune")),
                    help="the results file: this run's rows replace those of the same model, batch and variant")
    args = ap.parse_args()
    os.environ["TVM_NUM_THREADS"] = os.environ["EDGESDK_NUM_THREADS"] = str(THREADS)
    from edgesdk.runtime import BundleModel
    from edgesdk.runtime.manifest import Manifest
    from edgesdk.scheduling import selection
    from edgesdk.timing import measure_alone

    results: dict = {"host": selection.host_name(), "threads": THREADS, "rows": []}
    # the newest figure of every build: this run's rows replace theirs (model, batch, variant), the others stay
    kept = json.loads(Path(args.out).read_text())["data"]["rows"] if Path(args.out).exists() else []
    commit = _results.commit()[:7]
    for name in args.models.split(","):
        for batch in [int(b) for b in args.batches.split(",")]:
            model, margs = model_file(name, batch)
            variants = {"dense": []} | {m: ["--prune", m] for m in args.methods.split(",")}
            dirs = {v: CACHE / f"{name}-b{batch}-{v.replace(':', '_')}" for v in variants}
            builds = {}
            for v, extra in variants.items():
                if not args.no_build:
                    log(f"{name} b{batch}: building {v}")
                    builds[v] = build(model, margs, dirs[v], extra)
            if args.plans:
                probe = CACHE / f"{name}-b{batch}-plan-probe"
                auto = ["--prune-plan", "auto", "--prune", args.methods]
                if not args.no_build:
                    log(f"{name} b{batch}: measuring the per-layer options (an auto plan, unbounded budget)")
                    build(model, margs, probe, [*auto, "--latency-budget", "1e9", "--cpu-backends", "planned"])
                first = json.loads((probe / ".build" / "4-tune" / "prune_plan.json").read_text())
                spans = json.loads((dirs["dense"] / "bundle" / "plan.json").read_text())["cpu_selection"]["spans"]
                dense_ms = sum(min(c["ms"] for c in s["candidates"].values() if "ms" in c) for s in spans)
                if first["fastest_ms"] >= dense_ms:
                    log(f"{name} b{batch}: the fastest plan ({first['fastest_ms']:.1f} ms) is no faster than the "
                        f"dense build ({dense_ms:.1f} ms): no per-layer plan to build")
                for f in args.plans.split(",") if first["fastest_ms"] < dense_ms else []:
                    v = f"plan@{f}"
                    budget = dense_ms - float(f) * (dense_ms - first["fastest_ms"])
                    variants[v] = [*auto, "--latency-budget", f"{budget:.4f}"]
                    dirs[v] = CACHE / f"{name}-b{batch}-plan-{f}"
                    if not args.no_build:
                        log(f"{name} b{batch}: building {v} (budget {budget:.3f} ms)")
                        builds[v] = build(model, margs, dirs[v], variants[v])
            ref = reference(model, dirs["dense"])
            manifest = Manifest.load(dirs["dense"] / "bundle")
            rng = np.random.default_rng(0)
            feeds = {t.name: rng.uniform(-1, 1, t.shape).astype(t.dtype) for t in manifest.inputs}
            npz = CACHE / f"{name}-b{batch}-feeds.npz"
            np.savez(npz, **feeds)

            def ort_alone() -> list[float]:
                done = subprocess.run([sys.executable, "-c", ORT_CHILD, str(ref), str(npz), str(THREADS),
                                       str(args.runs)], capture_output=True, text=True, check=True)
                return json.loads(done.stdout.strip().splitlines()[-1])

            calls = {"onnxruntime": ort_alone}
            for v in variants:
                calls[v] = lambda v=v: measure_alone(dirs[v] / "bundle", npz, warmup=3, runs=args.runs)
            laps: dict[str, list[float]] = {k: [] for k in calls}
            for _ in range(args.rounds):
                for label, call in calls.items():
                    laps[label] += call()
            med = {k: round(statistics.median(v), 3) for k, v in laps.items()}
            dense_out = next(iter(BundleModel(dirs["dense"] / "bundle", log=lambda s: None).run(feeds).values()))
            for v in variants:
                m = Manifest.load(dirs[v] / "bundle")
                plan = json.loads((dirs[v] / "bundle" / "plan.json").read_text())
                spans = plan.get("cpu_selection", {}).get("spans", [])
                row = {"model": name, "batch": batch, "variant": v, "ms": med[v], "onnxruntime_ms": med["onnxruntime"],
                       "over_ort": round(med[v] / med["onnxruntime"], 3),
                       "dense_over_this": round(med["dense"] / med[v], 3),
                       "chosen": [s["chosen"] for s in spans],
                       "candidates_ms": [{k: c.get("ms") for k, c in s.get("candidates", {}).items()} for s in spans],
                       "build": builds.get(v, {})}
                if m.pruning.get("plan", {}).get("source") == "auto":
                    planned = json.loads((dirs[v] / ".build" / "4-tune" / "prune_plan.json").read_text())
                    row["plan"] = {k: planned.get(k) for k in ("budget_ms", "dense_ms", "predicted_ms", "fastest_ms",
                                                               "measured_ms", "loss", "scale", "dense_best")}
                    row["plan"]["layers"] = {k: sum(x == k for x in planned["layers"].values())
                                             for k in ["dense", *args.methods.split(",")]}
                if m.pruning:
                    row["pruning"] = {k: m.pruning[k] for k in ("method", "layers", "sparsity", "sparse_kernels")}
                    row["fidelity"] = next(iter(m.pruning["fidelity"]["end_to_end"].values()))
                    choices = [c for t in m.tuning.get("segments", {}).values() for c in t.get("sparse_choices", [])]
                    row["sparse_choices"] = {"sparse": sum(c["kernel"] == "sparse" for c in choices),
                                             "dense": sum(c["kernel"] == "dense" for c in choices)}
                    got = next(iter(BundleModel(dirs[v] / "bundle", log=lambda s: None).run(feeds).values()))
                    row["cosine_to_dense_bundle_here"] = float(np.dot(got.ravel(), dense_out.ravel()) / (
                        np.linalg.norm(got) * np.linalg.norm(dense_out)))
                row["commit"] = commit
                results["rows"].append(row)
                log(f"{name} b{batch} {v}: {med[v]:.2f} ms (onnxruntime {med['onnxruntime']:.2f} ms)")
            mine = {(r["model"], r["batch"], r["variant"]) for r in results["rows"]}
            merged = {**results, "rows": [r for r in kept if (r["model"], r["batch"], r["variant"]) not in mine]
                      + results["rows"]}
            _results.write("prune", merged, table(merged), out=Path(args.out))
    print(table(merged))


def table(results: dict) -> str:
    lines = [f"Host: {results['host']}, {results['threads']} threads.", "",
             "| model | batch | variant | bundle ms | onnxruntime ms (dense) | **bundle / ort** | dense bundle / this | "
             "chosen (tune stage: candidates ms) | sparse kernels (kept dense) | fidelity: cosine / top-1 | commit |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        cands = "; ".join(", ".join(f"{k} {v:.1f}" for k, v in c.items() if v is not None) for c in r["candidates_ms"])
        sk = (f"{r['sparse_choices']['sparse']} ({r['sparse_choices']['dense']})" if "sparse_choices" in r else "-")
        fid = (f"{r['fidelity']['cosine']:.4f} / {r['fidelity']['top1_agreement']:.3f}" if "fidelity" in r else "-")
        lines.append(f"| {r['model']} | {r['batch']} | {r['variant']} | {r['ms']:.2f} | {r['onnxruntime_ms']:.2f} | "
                     f"**{r['over_ort']:.2f}** | {r['dense_over_this']:.2f} | {', '.join(r['chosen'])} ({cands}) | "
                     f"{sk} | {fid} | {r.get('commit', '-')} |")
    plans = [r for r in results["rows"] if "plan" in r]
    if plans:
        lines += ["", "Per-layer plans (`--prune-plan auto`): the budget, the plan's predicted CPU time, the tune "
                  "stage's measurement of the candidate it chose, and the bundle's time here:", "",
                  "| model | batch | variant | budget ms | predicted ms | tune measured ms | bundle ms | layers per "
                  "option | summed loss | fidelity: cosine / top-1 |", "|---|---|---|---|---|---|---|---|---|---|"]

        def ms(v):
            return f"{v:.2f}" if v is not None else "-"

        for r in plans:
            p = r["plan"]
            fid = (f"{r['fidelity']['cosine']:.4f} / {r['fidelity']['top1_agreement']:.3f}" if "fidelity" in r else "-")
            per = ", ".join(f"{k} {n}" for k, n in p["layers"].items())
            lines.append(f"| {r['model']} | {r['batch']} | {r['variant']} | {ms(p['budget_ms'])} | {ms(p['predicted_ms'])} "
                         f"| {ms(p['measured_ms'])} | {r['ms']:.2f} | {per} | {ms(p['loss'])} | {fid} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
