"""The zoo matrix: every zoo model (benchmarks/zoo_models.py) built for every target, as a user builds it.

    .venv/bin/python benchmarks/bench_zoo.py [--models a,b | --families keras,wheel] [--targets x86,arm_2tpu,rtx3090]
    .venv/bin/python benchmarks/bench_zoo.py --time [--models a,b]   # the x86 timings again, on a quiet host
    make zoo

Each model is made once (its own fresh process: PyTorch's exporter, TensorFlow's converter) with 32 real
calibration samples and 8 held-out ones written beside it; then each (model, target) cell in a fresh process
runs the command line a user runs, `edgesdk build MODEL --target targets/T.yaml -o OUT --calib DIR --json`,
then `edgesdk verify OUT/bundle` (the self-test; under qemu for aarch64; a CUDA bundle's self-test only where a
GPU is present, else it is recorded as not run). Each cell records:

- the outcome: built and verified, or the typed error's code and message, or an internal error (exit 3);
- the build's wall time and peak memory (the largest process the build ran, `ru_maxrss`);
- Edge TPU op and FLOP coverage before and after legalize; the plan's predicted latency and throughput against
  Coral's default partition, `--num_segments 2` and replication (arm_2tpu; simulated: no Edge TPU here);
- agreement with the fp32 model: x86, the bundle run on this host against onnxruntime on the imported fp32
  ONNX (a full-int8 TFLite model: LiteRT on its file, its own int8 arithmetic), on the 8 held-out samples (each
  output's cosine and largest error relative to its scale; top-1 where the output is a classifier's); arm_2tpu,
  the build's own accuracy report (int8 against fp32 on samples it held out of the calibration set, per output),
  and whether the target's accuracy gate passed.

- x86: the bundle's time against onnxruntime, as benchmarks/bench_cpu.py times them (each alone in a fresh
  process, in turn, 3 rounds of 20 inferences after 5, or of as many as take 0.5 s after 0.2 s for a faster
  model, 2 threads, the median; ZOO_TIME_ROUNDS=0 skips it):
  onnxruntime on the user's ONNX file, or on the import's ONNX for a Keras or TFLite model. Each runtime's
  spread (how far its round medians lay apart, of its median) is recorded: the bundle is slower than onnxruntime
  beyond the noise only where the ratio exceeds 1 by more than the larger spread. Timings on a shared 2-core
  host: run the zoo alone.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk"), str(ROOT / "benchmarks")]
import _results  # noqa: E402
import zoo_models  # noqa: E402
from edgesdk.ir.digest import file_sha256  # noqa: E402
from edgesdk.runtime.backends.ort_runner import WRONG_FUSIONS  # noqa: E402

WORK = ROOT / ".cache" / "zoo-runs"
TARGETS = ("x86", "arm_2tpu", "rtx3090")
CALIB, HELD_OUT = 32, 8
BUILD_TIMEOUT = int(os.environ.get("ZOO_BUILD_TIMEOUT", 1200))
EDGESDK = [sys.executable, "-m", "edgesdk"]
# the x86 bundle against onnxruntime (ZOO_TIME_ROUNDS=0: not timed)
TIME_ROUNDS = int(os.environ.get("ZOO_TIME_ROUNDS", 3))
TIME_RUNS, WARMUP, TIME_THREADS = 20, 5, 2
# a model faster than this per round takes more inferences, warm-up included: 20 inferences of silero-vad
# (0.1 ms) after 5 timed its thread pool and caches warming, and the bundle against onnxruntime moved from
# 0.7 to 1.3 between runs of the same two
MIN_ROUND_S, MIN_WARMUP_S = 0.5, 0.2


def prepare(name: str) -> dict:
    """Make the model's file and write its samples (.npz, by input name): calib/ and held-out/."""
    import numpy as np

    model = zoo_models.MODELS[name]
    t0 = time.perf_counter()
    path = model.make()
    work = WORK / name
    for sub, n, seed in (("calib", CALIB, 1), ("held-out", HELD_OUT, 2)):
        d = work / sub
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        for k, feed in enumerate(model.feeds(n, seed)):
            np.savez(d / f"{k:03d}.npz", **feed)
    made = {"file": str(path), "bytes": path.stat().st_size, "sha256": file_sha256(path),
            "make_s": round(time.perf_counter() - t0, 1)}
    if path.suffix == ".onnx":
        made.update(_fp32_spread(path, work / "held-out"))
    return made


def _fp32_spread(path: Path, held: Path) -> dict:
    """The fp32 model's outputs on the held-out samples: their largest magnitude and how much they differ from
    sample to sample, relative to it. Random weights can leave a network whose activations vanish (logits of
    1e-28, the same for every input): agreement with such a model proves nothing, and the table says so."""
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"], disabled_optimizers=WRONG_FUSIONS)
    names = {i.name for i in session.get_inputs()}
    if not names <= set(np.load(next(held.glob("*.npz"))).files):  # an input the build freezes (a sample rate)
        return {}
    outs = [session.run(None, {k: v for k, v in dict(np.load(f)).items() if k in names})
            for f in sorted(held.glob("*.npz"))]
    first = np.stack([np.asarray(o[0], np.float64) for o in outs])
    scale = float(np.abs(first).max())
    spread = float(first.std(axis=0).max() / scale) if scale > 0 else 0.0
    return {"fp32_scale": float(f"{scale:.3g}"), "fp32_spread": float(f"{spread:.3g}"),
            "degenerate": scale < 1e-6 or spread < 1e-3}


def cell(name: str, target: str, extra: tuple[str, ...] = ()) -> dict:
    model = zoo_models.MODELS[name]
    path = model.make()
    work = WORK / name
    out = work / f"out-{target}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [*EDGESDK, "build", str(path), "--target", str(ROOT / "targets" / f"{target}.yaml"), "-o", str(out),
           "--calib", str(work / "calib"), "--json", "--quiet", *model.args, *extra]
    row: dict = {"model": name, "family": model.family, "target": target}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        return {**row, "outcome": "timeout", "build_s": BUILD_TIMEOUT}
    row["build_s"] = round(time.perf_counter() - t0, 1)
    row["peak_mib"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
    row["exit"] = proc.returncode
    try:
        summary = json.loads(proc.stdout)
    except json.JSONDecodeError:
        summary = {}
    if proc.returncode != 0:
        error = summary.get("error") or {}
        tail = proc.stderr.strip().splitlines()[-3:]
        outcome = "internal error" if proc.returncode == 3 else "refused" if proc.returncode in (1, 2) else \
            f"crashed (signal {-proc.returncode})" if proc.returncode < 0 else f"exit {proc.returncode}"
        return {**row, "outcome": outcome, "code": error.get("code"),
                "message": (error.get("message") or " ".join(tail))[:400]}
    records = {s["name"]: s.get("record") or {} for s in summary.get("stages", [])}
    if (out / "bundle.tar.gz").is_file():  # which build a self-test run elsewhere (a GPU host) tested
        row["bundle_sha256"] = file_sha256(out / "bundle.tar.gz")
    row.update({**_coverage(records), **_plan(records), **_cpu_choice(records)})
    verify = subprocess.run([*EDGESDK, "verify", str(out / "bundle")], capture_output=True, text=True, timeout=1200)
    said = (verify.stdout + verify.stderr).strip().splitlines()
    if target == "rtx3090" and not _gpu():
        row["verified"] = "not run (no GPU)" if verify.returncode != 0 else True
    else:
        row["verified"] = verify.returncode == 0
        if verify.returncode != 0:
            row["verify_error"] = " ".join(said[-2:])[:300]
    if target == "x86":
        row["agreement"] = _x86_agreement(out, work / "held-out")
        if row["verified"] is True and TIME_ROUNDS:
            row["timing"] = _x86_timing(out, path, work / "held-out", row.get("latency_ms"))
    else:
        row["agreement"] = _reported_accuracy(records)
    row["outcome"] = "ok" if row["verified"] is not False else "verify failed"
    return row


def _gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and subprocess.run(["nvidia-smi"], capture_output=True).returncode == 0


def _coverage(records: dict) -> dict:
    legalize = records.get("legalize", {})
    got = {}
    for when in ("before", "after"):
        tpu = (legalize.get(when) or {}).get("coverage", {}).get("edgetpu")
        if tpu:
            got[f"tpu_ops_{when}"] = round(tpu["ops_fraction"], 4)
            got[f"tpu_flops_{when}"] = round(tpu["flops_fraction"], 4)
    return got


def _cpu_choice(records: dict) -> dict:
    """Per measured CPU span: the candidate chosen (its backend and precision), whether its lead was within the
    noise, and TVM's own showing: its best candidate (the whole span on TVM, or the plan's cut, TVM with
    onnxruntime for the ops TVM lacks) over the best of the other backends, as the tune stage measured them.
    Where the plan cut the span into several segments, what the cut itself is worth: its time over the best
    whole-span candidate's."""
    sel = (records.get("tune") or {}).get("cpu_selection") or {}
    if not sel.get("measured_on"):
        return {}
    spans = []
    for span in sel.get("spans", []):
        times = {n: c["ms"] for n, c in (span.get("candidates") or {}).items() if "ms" in c}
        tvm = [t for n, t in times.items() if n in ("tvm", "planned")]
        peers = [t for n, t in times.items() if n not in ("tvm", "planned")]
        whole = [t for n, t in times.items() if n != "planned"]
        cut = len(span.get("segments") or ()) > 1 and "planned" in times and whole
        spans.append({"nodes": span.get("nodes"), "chosen": span["chosen"],
                      **({"tvm_over_best_peer": round(min(tvm) / min(peers), 3)} if tvm and peers else {}),
                      **({"cut_over_best_whole": round(times["planned"] / min(whole), 3)} if cut else {}),
                      **({"within_noise": True} if span.get("within_noise") else {})})
    return {"cpu_spans": spans, "cpu_precision": sel.get("precision", "fp32")}


def _plan(records: dict) -> dict:
    schedule = records.get("schedule", {})
    predicted = schedule.get("predicted") or {}
    base = schedule.get("baselines") or {}
    pick = {label: v for label, v in base.items() if "as imported" in label}

    def first(prefix):
        return next((v for k, v in pick.items() if k.startswith(prefix)), None)
    got = {"latency_ms": predicted.get("latency_ms"), "throughput_fps": predicted.get("throughput_fps"),
           "placement": (schedule.get("placement") or {}).get("by_device")
           if isinstance(schedule.get("placement"), dict) and "by_device" in schedule["placement"]
           else schedule.get("placement")}
    for key, prefix in (("coral_default", "coral default"), ("coral_segments2", "coral --num_segments 2"),
                        ("coral_replication", "coral replication")):
        v = first(prefix)
        if v:
            got[f"{key}_ms"], got[f"{key}_fps"] = v.get("latency_ms"), v.get("throughput_fps")
    return got


def _reported_accuracy(records: dict) -> dict:
    """The build's own accuracy report: each output's figures (int8 against fp32 on samples held out of the
    calibration set), and what the accuracy remedy kept in float on the CPU to meet the gate."""
    acc = records.get("package", {}).get("accuracy") or {}
    outputs = {name: {k: o[k] for k in ("cosine", "mean_error", "max_error", "top1") if o.get(k) is not None}
               for name, o in (acc.get("parts") or {}).items()}
    got = {"samples": (next(iter((acc.get("parts") or {}).values()), {}) or {}).get("samples"), "outputs": outputs}
    if (acc.get("gate") or {}).get("unjudged"):  # parts fp32 decides nothing on: the gate had no say
        got["unjudged"] = sorted(acc["gate"]["unjudged"])
    remedy = acc.get("remedy")
    if remedy:
        first = (remedy.get("rounds") or [{}])[0]
        got["remedy"] = {"rounds": len(remedy.get("rounds") or []), "kept_on_cpu": len(remedy.get("segments") or []),
                         "passed": (remedy.get("after") or {}).get("passed"),
                         "all_int8": {name: {k: o[k] for k in ("cosine", "mean_error") if k in o}
                                      for name, o in (first.get("parts_before") or {}).items()}}
    return got


def _x86_agreement(out: Path, held: Path) -> dict:
    """The bundle against the model's own answer on the held-out samples: onnxruntime on the imported graph, or for
    a quantized TFLite model (the import kept its file), LiteRT on the file: its int8 arithmetic is LiteRT's, and
    onnxruntime's kernels for the converted QDQ graph round otherwise."""
    import numpy as np
    import onnxruntime as ort

    import edgesdk
    from edgesdk.backends.tflite import own

    reference = ort.InferenceSession(str(out / ".build" / "1-import" / "model.onnx"), providers=["CPUExecutionProvider"],
                                     disabled_optimizers=WRONG_FUSIONS)  # the model's own answer
    names = [i.name for i in reference.get_inputs()]
    output_names = [o.name for o in reference.get_outputs()]
    source = out / ".build" / "1-import" / "source.tflite"
    feeds = [dict(np.load(f)) for f in sorted(held.glob("*.npz"))]
    given = [{k: v for k, v in feed.items() if k in names} for feed in feeds]
    # LiteRT opens the file once for every sample; None where its signature is not the samples' (ORT decides)
    litert = own.outputs(source, given, output_names) if source.is_file() else None
    got_all, want_all = {}, {}
    with edgesdk.Bundle.open(out / "bundle") as bundle:
        for i, feed in enumerate(feeds):
            got = bundle.run({k: v for k, v in feed.items() if k in bundle.inputs})
            want = litert[i] if litert else dict(zip(output_names, reference.run(None, given[i])))
            for k, w in want.items():
                if k in got:
                    got_all.setdefault(k, []).append(np.asarray(got[k], np.float64).ravel())
                    want_all.setdefault(k, []).append(np.asarray(w, np.float64).ravel())
    outputs = {}
    for k in want_all:
        g, w = np.stack(got_all[k]), np.stack(want_all[k])
        cos = float(np.dot(g.ravel(), w.ravel()) / max(np.linalg.norm(g) * np.linalg.norm(w), 1e-30))
        o = {"cosine": round(cos, 6), "max_rel_error": float(f"{np.abs(g - w).max() / max(np.abs(w).max(), 1e-30):.3g}")}
        if w.shape[1] > 1 and w.shape[1] <= 10000:
            o["top1"] = float(np.mean(g.argmax(1) == w.argmax(1)))
        outputs[k] = o
    return {"samples": len(feeds), "outputs": outputs,
            **({"reference": "LiteRT on the model's TFLite file"} if litert else {})}




def _counts(ms: float | None) -> tuple[int, int]:
    """Warm-up and timed inferences per round for a model of about `ms` (the plan's measured latency): WARMUP
    and TIME_RUNS, or as many as MIN_WARMUP_S and MIN_ROUND_S take."""
    if not ms or ms <= 0:
        return WARMUP, TIME_RUNS
    return max(WARMUP, math.ceil(MIN_WARMUP_S * 1e3 / ms)), max(TIME_RUNS, math.ceil(MIN_ROUND_S * 1e3 / ms))


def _x86_timing(out: Path, source: Path, held: Path, ms: float | None = None) -> dict:
    """The bundle against onnxruntime and OpenVINO (float32, and its default precision: bfloat16 on a CPU with
    AVX512_BF16 or AMX) as benchmarks/bench_cpu.py times them: each alone in a fresh process of its own, in
    turn, TIME_ROUNDS rounds of TIME_RUNS inferences after WARMUP (more for a model faster than `_counts`
    allows), on a held-out sample; 2 threads each; the median of every inference. onnxruntime runs the user's
    file where it is an ONNX file that takes the sample, else the import's ONNX (a Keras or TFLite model
    converted by tf2onnx, or an input frozen); OpenVINO the same file where its frontend reads it, else the
    import's ONNX. The bundle's ratio to the faster of onnxruntime and OpenVINO float32 is `bundle_over_best`."""
    import statistics

    import numpy as np
    import onnxruntime as ort

    from bench_cpu import ORT_CHILD, openvino_calls, peers  # the same children as bench_cpu's
    from edgesdk.runtime.manifest import Manifest
    from edgesdk.timing import measure_alone

    feed = dict(np.load(sorted(held.glob("*.npz"))[0]))
    reference = out / ".build" / "1-import" / "model.onnx"
    if source.suffix == ".onnx":
        names = {i.name for i in ort.InferenceSession(str(source), providers=["CPUExecutionProvider"]).get_inputs()}
        reference = source if names <= set(feed) else reference
    bundle = out / "bundle"
    wanted = {t.name for t in Manifest.load(bundle).inputs}
    feeds = out / "timing-feeds.npz"
    np.savez(feeds, **feed)
    bundle_feeds = out / "timing-bundle-feeds.npz"
    np.savez(bundle_feeds, **{k: v for k, v in feed.items() if k in wanted})
    env = {**os.environ, "EDGESDK_NUM_THREADS": str(TIME_THREADS), "TVM_NUM_THREADS": str(TIME_THREADS)}
    os.environ.update(EDGESDK_NUM_THREADS=str(TIME_THREADS), TVM_NUM_THREADS=str(TIME_THREADS))

    warmup, runs = _counts(ms)

    def ort_alone() -> list[float]:
        done = subprocess.run([sys.executable, "-c", ORT_CHILD, str(reference),
                               str(feeds), str(TIME_THREADS), str(runs), str(warmup)],
                              capture_output=True, text=True, check=True, env=env)
        return json.loads(done.stdout.strip().splitlines()[-1])

    calls = {"onnxruntime": ort_alone,
             "bundle": lambda: measure_alone(bundle, bundle_feeds, warmup=warmup, runs=runs)}
    ov, ov_said = openvino_calls(list(dict.fromkeys([reference, out / ".build" / "1-import" / "model.onnx"])), feeds,
                                 TIME_THREADS, runs, warmup)
    calls.update(ov)
    laps: dict[str, list[float]] = {k: [] for k in calls}
    rounds: dict[str, list[float]] = {k: [] for k in calls}  # each round's median
    dropped: dict[str, str] = {}  # an OpenVINO peer that fails (its bf16 default on a quantized model): left out
    for _ in range(TIME_ROUNDS):
        for label, call in calls.items():
            if label in dropped:
                continue
            try:
                got = call()
                laps[label] += got
                rounds[label].append(statistics.median(got))
            except (subprocess.CalledProcessError, RuntimeError) as e:
                said = ((getattr(e, "stderr", None) or str(e)).strip().splitlines() or ["?"])[-1][:300]
                if label in ("bundle", "onnxruntime"):
                    return {"error": said}
                dropped[label] = said
    med = {k: statistics.median(v) for k, v in laps.items() if k not in dropped}
    if dropped:
        ov_said = {**ov_said, "peer_errors": dropped}
    # how far a runtime's round medians lay apart, of its median: the noise a ratio is read against
    spread = {k: round((max(rounds[k]) - min(rounds[k])) / med[k], 3) for k in med}
    over = med["bundle"] / med["onnxruntime"]
    return {"bundle_ms": round(med["bundle"], 3), "onnxruntime_ms": round(med["onnxruntime"], 3),
            "bundle_over_ort": round(over, 3), "spread": spread,
            "slower_beyond_noise": over - 1 > max(spread["bundle"], spread["onnxruntime"]),
            **peers(med, med["bundle"]), **ov_said,
            "onnxruntime_on": "the model file" if reference == source else "the imported ONNX",
            "runs": runs * TIME_ROUNDS, "warmup": warmup, "threads": TIME_THREADS,
            "host": {"cpu": _results.host_cpu(), "isa": _results.host_isa()}}


def _child(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=BUILD_TIMEOUT + 1800)
    if proc.returncode != 0:
        return {"harness_error": (proc.stderr.strip().splitlines() or ["?"])[-1][:400]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="")
    p.add_argument("--families", default=",".join(zoo_models.FAMILIES))
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--prepare", metavar="MODEL", help=argparse.SUPPRESS)
    p.add_argument("--cell", nargs=2, metavar=("MODEL", "TARGET"), help=argparse.SUPPRESS)
    p.add_argument("--render", action="store_true", help="write results/zoo.json's table again from its data")
    p.add_argument("--time", action="store_true",
                   help="time the x86 bundles the zoo built (kept in .cache/zoo-runs) against onnxruntime again, "
                        "without building; a model whose bundle is gone is built again")
    p.add_argument("--time-cell", metavar="MODEL", help=argparse.SUPPRESS)
    p.add_argument("--gpu-selftests", nargs="+", type=Path, metavar="JSONL",
                   help="the self-tests benchmarks/gpu/zoo_selftest.sh ran on a GPU host, into the rtx3090 rows of the "
                        "bundles they tested (a result for another build of the bundle is refused)")
    args = p.parse_args()
    if args.gpu_selftests:
        return _gpu_selftests(args.gpu_selftests)
    if args.render:
        old = _results.load("zoo")
        data = old["data"]
        for name, m in data["models"].items():  # made before the spread was measured
            if str(m.get("file", "")).endswith(".onnx") and "fp32_spread" not in m and (ROOT / m["file"]).exists():
                m.update(_fp32_spread(ROOT / m["file"], WORK / name / "held-out"))
        _write({(r["model"], r["target"]): r for r in data["rows"]}, data["models"], data["wall_s"], old["command"])
        return 0
    if args.prepare:
        print(json.dumps(prepare(args.prepare)))
        return 0
    if args.cell:
        print(json.dumps(cell(*args.cell), default=str))
        return 0
    if args.time_cell:
        out = WORK / args.time_cell / "out-x86"
        predicted = json.loads((out / "bundle" / "plan.json").read_text()).get("predicted", {}).get("latency_ms")
        print(json.dumps(_x86_timing(out, zoo_models.MODELS[args.time_cell].make(), WORK / args.time_cell / "held-out",
                                     predicted)))
        return 0
    families = args.families.split(",")
    names = args.models.split(",") if args.models else [m.name for m in zoo_models.MODELS.values()
                                                          if m.family in families]
    old = _results.load("zoo")
    rows = {(r["model"], r["target"]): r for r in (old or {}).get("data", {}).get("rows", [])}
    made = (old or {}).get("data", {}).get("models", {})
    t_all = time.perf_counter()
    for name in names:
        old_row = rows.get((name, "x86")) or {}
        if args.time and old_row.get("verified") is True and (WORK / name / "out-x86" / "bundle").is_dir():
            # the timing it replaces is kept beside it (without its own former one): a second look, not a retake
            before = {k: v for k, v in (old_row.get("timing") or {}).items() if k != "timing_before"}
            rows[(name, "x86")] = {**old_row, "timing": {**_child(["--time-cell", name]), "commit": _results.commit()[:12],
                                                         "timing_before": before}}
            print(f"{name}: x86 timed: {rows[(name, 'x86')]['timing']}", file=sys.stderr, flush=True)
            _write(rows, made, time.perf_counter() - t_all)
            continue
        print(f"{name}: making ...", file=sys.stderr, flush=True)
        made[name] = {**_child(["--prepare", name]), "family": zoo_models.MODELS[name].family}
        if "harness_error" in made[name]:
            print(f"  could not make it: {made[name]['harness_error']}", file=sys.stderr, flush=True)
            for target in args.targets.split(","):
                rows[(name, target)] = {"model": name, "family": made[name]["family"], "target": target,
                                        "outcome": "not made", "message": made[name]["harness_error"]}
            continue
        for target in ["x86"] if args.time else args.targets.split(","):
            row = _child(["--cell", name, target])
            row = {"model": name, "family": zoo_models.MODELS[name].family, "target": target, **row,
                   "commit": _results.commit()[:12]}
            if "harness_error" in row:
                row["outcome"] = "harness error"
            rows[(name, target)] = row
            print(f"  {target}: {row.get('outcome')} {row.get('build_s', '')} s {row.get('code') or ''} "
                  f"{(row.get('message') or '')[:160]}", file=sys.stderr, flush=True)
        _write(rows, made, time.perf_counter() - t_all)  # after each model: a long run stopped keeps what it measured
    _write(rows, made, time.perf_counter() - t_all)
    return 0


def _gpu_selftests(files: list[Path]) -> int:
    """Each GPU self-test into its rtx3090 row, where the bundle it ran is the row's (by the archive's sha256)."""
    old = _results.load("zoo")
    data = old["data"]
    rows = {(r["model"], r["target"]): r for r in data["rows"]}
    stale = []
    for path in files:
        for line in path.read_text().splitlines():
            got = json.loads(line)
            row = rows.get((got["model"], "rtx3090"))
            if row is None or row.get("bundle_sha256") != got.get("bundle_sha256"):
                stale.append(got["model"])
                continue
            row["gpu_selftest"] = {k: got[k] for k in ("gpu", "passed", "seconds", "load_seconds", "outputs", "segments",
                                                       "stream", "notes", "error", "not_run") if k in got}
            if got["passed"] is None:  # not run there: a runtime the GPU host lacks
                continue
            row["verified"] = bool(got["passed"])
            row["outcome"] = "ok" if got["passed"] else "verify failed"
            if not got["passed"]:
                row["verify_error"] = f"self-test on {got['gpu']}: " + (got.get("error") or "outputs differ")[:300]
    if stale:
        print(f"not the bundles the rows were built with (build them again, pack, run): {', '.join(stale)}",
              file=sys.stderr)
    _write(rows, data["models"], data["wall_s"], old["command"])
    return 1 if stale else 0


def _write(rows: dict, made: dict, wall_s: float, command: str | None = None) -> None:
    # paths as the repository's own (`.cache/zoo/...`): a results file names no machine's directories
    rows = json.loads(json.dumps(rows if isinstance(rows, list) else list(rows.values()), default=str)
                      .replace(str(ROOT) + "/", ""))
    made = json.loads(json.dumps(made, default=str).replace(str(ROOT) + "/", ""))
    rows = {(r["model"], r["target"]): r for r in rows}
    every = sorted(rows.values(), key=lambda r: (zoo_models.FAMILIES.index(r["family"]) if r["family"] in
                                                zoo_models.FAMILIES else 9, r["model"], r["target"]))
    _results.write("zoo", {"rows": every, "models": made, "wall_s": round(wall_s)}, table(every, made),
                   notes=rates(every) + NOTES, command=command)


NOTES = ["arm_2tpu: Edge TPU figures are the cost model's predictions (no Edge TPU here; simulated), int8 "
         "numerics real (LiteRT's CPU interpreter runs the Edge TPU segments); the aarch64 self-test runs under "
         "qemu-user",
         "rtx3090: the CUDA code is compiled here (no GPU); a bundle marked ✔ GPU passed its self-test on a GPU host "
         "(benchmarks/gpu/zoo_pack.py, zoo_selftest.sh), a plain ✔ passed `edgesdk verify` without its self-test",
         "agreement: x86, the bundle against onnxruntime on the imported fp32 model (a full-int8 TFLite: LiteRT on "
         "its file, the model's own int8 arithmetic); arm_2tpu, the build's own "
         "int8-against-fp32 report on samples held out of the calibration set",
         "random weights: keras classifiers' softmax heads are scaled until fp32 is sure of most photo crops "
         "(zoo_models._sharpen): unscaled, every class is near 0.001 and the accuracy gate has nothing to judge "
         "(it says NOT JUDGED)",
         "a full-int8 TFLite's Coral default is our partition of the model as imported (its Q/DQ nodes on the "
         "CPU); Coral's own compiler takes such a file whole, as float-of-quantized lets edgesdk do"]


CLASSIFIER_TASKS = ("logits", "text direction")


def _mark(r: dict) -> str:
    outcome = r.get("outcome")
    if outcome == "ok":
        return "✔ GPU" if (r.get("gpu_selftest") or {}).get("passed") else "✔"
    if outcome in ("refused", "internal error"):
        return f"✘ `{r.get('code') or 'exit ' + str(r.get('exit'))}`"
    return f"✘ {outcome}"


def _agree(r: dict) -> str:
    outputs = (r.get("agreement") or {}).get("outputs") or {}
    if not outputs:
        return ""
    worst = min(outputs.values(), key=lambda o: o.get("cosine", 1.0))
    text = f"cos {worst.get('cosine', float('nan')):.4f}"
    model = zoo_models.MODELS.get(r["model"])
    # top-1 where the output is a classifier's (x86's figure is taken for every output; the build's own report
    # gives it where its accuracy views say the output is one)
    if "top1" in worst and (r["target"] != "x86" or (model is not None and model.task in CLASSIFIER_TASKS)):
        text += f", top-1 {100 * worst['top1']:.0f} %"
    if (r.get("agreement") or {}).get("unjudged"):
        text += f"; NOT JUDGED: {', '.join(r['agreement']['unjudged'])} (fp32 decides nothing)"
    remedy = (r.get("agreement") or {}).get("remedy")
    if remedy:
        int8 = min((o.get("cosine", 1.0) for o in remedy["all_int8"].values()), default=float("nan"))
        text += f"; all int8: cos {int8:.3f}, {remedy['kept_on_cpu']} nodes kept in float on the cpu"
    return text


def rates(rows: list[dict]) -> list[str]:
    """The share built and verified, per target and per family in each target: the lines under the table."""
    lines = []
    for t in TARGETS:
        cells = [r for r in rows if r["target"] == t]
        if not cells:
            continue
        ok = sum(r.get("outcome") == "ok" for r in cells)
        refused = sum(r.get("outcome") == "refused" for r in cells)
        internal = sum(r.get("outcome") == "internal error" for r in cells)
        families = sorted({r["family"] for r in cells}, key=lambda f: zoo_models.FAMILIES.index(f)
                          if f in zoo_models.FAMILIES else 9)
        by_family = ", ".join(f"{f} {sum(r.get('outcome') == 'ok' for r in cells if r['family'] == f)}/"
                              f"{sum(r['family'] == f for r in cells)}" for f in families)
        lines.append(f"{t}: {ok}/{len(cells)} built and verified ({100 * ok / len(cells):.0f} %), {refused} refused "
                     f"with a typed error, {internal} internal errors, {len(cells) - ok - refused - internal} other; "
                     f"by family: {by_family}")
    on_gpu = [r for r in rows if r["target"] == "rtx3090" and "gpu_selftest" in r]
    if on_gpu:
        gpus = sorted({r["gpu_selftest"]["gpu"] for r in on_gpu})
        ran = [r for r in on_gpu if r["gpu_selftest"]["passed"] is not None]
        failed = [r["model"] for r in ran if not r["gpu_selftest"]["passed"]]
        skipped = [f"{r['model']} ({r['gpu_selftest']['not_run']})" for r in on_gpu if r not in ran]
        lines.append(f"rtx3090 self-test on a GPU ({'; '.join(gpus)}; the runtime compiles the CUDA kernels for the GPU "
                     f"it loads on): {len(ran)} of {sum(r['target'] == 'rtx3090' for r in rows)} bundles run there "
                     f"(✔ GPU), {len(ran) - len(failed)} passed" + (f"; failed: {', '.join(failed)}" if failed else "")
                     + (f"; not run there: {', '.join(skipped)}" if skipped else ""))
    arm = [r for r in rows if r["target"] == "arm_2tpu" and r.get("outcome") == "ok"]
    capable = [r for r in arm if r.get("tpu_ops_after", 0) >= 0.999]
    idle = [r["model"] for r in capable if not any(k.startswith("edgetpu") for k in (r.get("placement") or {}))]
    worse = [r["model"] for r in arm if r.get("latency_ms") and r.get("coral_default_ms")
             and r["latency_ms"] > r["coral_default_ms"] * 1.0001]
    if arm:
        lines.append(f"arm_2tpu goals: of {len(capable)} built models whose every op the Edge TPU runs after legalize, "
                     f"{len(capable) - len(idle)} land on an Edge TPU" + (f" ({', '.join(idle)}: the accuracy remedy "
                                                                        "kept every node in float on the CPU)" if idle else "")
                     + f"; predicted latency worse than Coral's default on the model as imported: {len(worse)}"
                     + (f" ({', '.join(worse)})" if worse else ""))
    x86 = [r for r in rows if r["target"] == "x86" and "bundle_over_ort" in (r.get("timing") or {})]
    for host in dict.fromkeys(map(_host, x86)):  # a ratio is read on its own host: each host's figures apart
        timed = [r["timing"] for r in x86 if _host(r) == host]
        noisy = [f"{r['model']} {r['timing']['bundle_over_ort']:.2f} (spread "
                 f"{max(r['timing']['spread']['bundle'], r['timing']['spread']['onnxruntime']):.2f})"
                 for r in x86 if _host(r) == host and r["timing"].get("slower_beyond_noise")]
        ratios = sorted(t["bundle_over_ort"] for t in timed)
        lines.append(f"x86 against onnxruntime on {host}: {len(timed)} models timed; bundle / onnxruntime "
                     f"{_spread(ratios)}; slower by more than 10 %: {sum(x > 1.1 for x in ratios)}"
                     + (f"; slower by more than the larger of the two runtimes' spread between rounds: "
                        f"{', '.join(noisy) or 'none'} (of {sum('spread' in t for t in timed)} with spreads)"
                        if any("spread" in t for t in timed) else ""))
        best = sorted(t["bundle_over_best"] for t in timed if "openvino_ms" in t)
        if best:
            lines.append(f"x86 against the best of onnxruntime and OpenVINO fp32 on {host}: {len(best)} models timed "
                         f"with both; bundle / best {_spread(best)}; at most 1.0: {sum(x <= 1.0 for x in best)}, at most "
                         f"0.85: {sum(x <= 0.85 for x in best)}")
    chosen = [s for r in rows if r["target"] == "x86" for s in r.get("cpu_spans") or ()]
    if chosen:
        won = collections.Counter(s["chosen"] for s in chosen)
        ratios = sorted(s["tvm_over_best_peer"] for s in chosen if "tvm_over_best_peer" in s)
        lines.append(f"x86 CPU spans measured: {len(chosen)}; chosen: " + ", ".join(f"{name} {n}" for name, n in won.most_common())
                     + f" ('planned': the schedule's cut, TVM with onnxruntime for the ops TVM lacks); within the noise: "
                       f"{sum(bool(s.get('within_noise')) for s in chosen)}"
                     + (f"; TVM's best over the best other backend: {_spread(ratios)}, TVM fastest on "
                        f"{sum(x < 1 for x in ratios)}" if ratios else ""))
        cuts = sorted(s["cut_over_best_whole"] for s in chosen if "cut_over_best_whole" in s)
        if cuts:
            lines.append(f"x86 spans the schedule cut into several segments: {len(cuts)}; the cut over the best whole-span "
                         f"candidate {_spread(cuts)}, the cut fastest on {sum(x < 1 for x in cuts)}")
    return lines


def _host(row: dict) -> str:
    """The host an x86 row was timed on, as the notes name it."""
    host = row["timing"].get("host")
    return f"{host['cpu']} ({', '.join(host['isa']) or 'no AVX2'})" if host else "a host not recorded"


def _spread(ratios: list[float]) -> str:
    """Sorted ratios as their median and range."""
    return f"median {ratios[len(ratios) // 2]:.2f}, from {ratios[0]:.2f} to {ratios[-1]:.2f}"


def _ms(v) -> str:
    return "?" if v is None else f"{v:.3g}"


def table(rows: list[dict], made: dict | None = None) -> str:
    by_model: dict[str, dict] = {}
    for r in rows:
        by_model.setdefault(r["model"], {"family": r["family"]})[r["target"]] = r
    targets = [t for t in TARGETS if any(t in v for v in by_model.values())]
    lines = ["| family | model | " + " | ".join(targets) + " | x86 bundle / best of onnxruntime and OpenVINO fp32 "
             "(ms: bundle / onnxruntime, OpenVINO) | arm_2tpu: TPU ops "
             "before → after legalize; predicted ms (Coral default) |", "|---|---|" + "---|" * len(targets) + "---|---|"]
    for name, v in by_model.items():
        if (made or {}).get(name, {}).get("degenerate"):
            name = f"{name} (degenerate: fp32 outputs {made[name]['fp32_scale']:.2g}, alike for every input)"
        cells = []
        for t in targets:
            r = v.get(t)
            cells.append("" if r is None else f"{_mark(r)} {r.get('build_s', '')} s {_agree(r)}".strip())
        arm = v.get("arm_2tpu") or {}
        tpu = ""
        if "tpu_ops_before" in arm:
            tpu = (f"{100 * arm['tpu_ops_before']:.0f} % → {100 * arm.get('tpu_ops_after', 0):.0f} %; "
                   f"{_ms(arm.get('latency_ms'))} ({_ms(arm.get('coral_default_ms'))})")
        timing = (v.get("x86") or {}).get("timing") or {}
        timed = ("" if not timing else f"timing failed: {timing['error']}" if "error" in timing else
                 f"**{timing['bundle_over_best']:.2f}** ({_ms(timing['bundle_ms'])} / {_ms(timing['onnxruntime_ms'])}, "
                 f"{_ms(timing['openvino_ms'])})" if "openvino_ms" in timing else
                 f"**{timing['bundle_over_ort']:.2f}** ({_ms(timing['bundle_ms'])} / {_ms(timing['onnxruntime_ms'])}, "
                 "OpenVINO not timed)")
        lines.append(f"| {v['family']} | {name} | " + " | ".join(cells) + f" | {timed} | {tpu} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
