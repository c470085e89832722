"""Import of every format users bring: correctness, node counts, import time, onnxruntime latency.

    .venv/bin/python benchmarks/bench_import.py [--runs 30] [--threads 2] [--only NAME ...] [--out benchmarks/results/import.json]

For each model, in one run:
1. `edgesdk build MODEL --until import` through the pipeline API (the same code as the CLI):
   import time (conversion included), node counts before and after the graph optimizations, the
   rules that fired.
2. Output of the imported graph (onnxruntime) against the original: Keras models against Keras,
   TFLite models against the LiteRT interpreter, ONNX models against onnxruntime on the original
   file, on seeded random inputs: max |a - b| / max |b| and ||a - b|| / ||b|| (worst output); and
   the optimized graph against the unoptimized one, both on onnxruntime (the error of our rewrites
   alone). int8 outputs: steps (LSBs) against LiteRT's default (XNNPACK) kernels and its builtin
   reference kernels, and the steps between those two.
3. onnxruntime latency (all graph optimizations on, the same thread count, median of N after
   warm-up, interleaved, thread spinning off) of the graph before our optimizations (the user's ONNX file, or the
   converter's output) and after them.

Keras models are `tf.keras.applications` architectures with `weights=None` and BatchNorm statistics
set by one training-mode pass (as `tests/model_zoo.py` does), saved as `.keras`. The int8 TFLite
models are MobileNetV2 (96, alpha 0.35) converted by TensorFlow to full int8, per-channel and
per-tensor, with 8 seeded random calibration images. The other models are the real pretrained
ones `make models` fetches from PyPI wheels.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk")]
import _results  # noqa: E402  (after the path above)
from edgesdk.pipeline import stage_dir  # noqa: E402  (after the path above)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
MODELS = ROOT / ".cache" / "models"
CACHE = ROOT / ".cache" / "bench-import"

KERAS_APPS = {  # name -> (constructor, input size)
    "MobileNetV2": ("MobileNetV2", 224),
    "ResNet50": ("ResNet50", 224),
    "InceptionV3": ("InceptionV3", 299),
    "NASNetMobile": ("NASNetMobile", 224),
    "DenseNet121": ("DenseNet121", 224),
    "EfficientNetB0": ("EfficientNetB0", 224),
}


def keras_app(name: str) -> tuple[Path, object]:
    import tensorflow as tf

    ctor, size = KERAS_APPS[name]
    path = CACHE / f"{name}.keras"
    if path.exists():
        return path, tf.keras.models.load_model(path, compile=False)
    tf.keras.utils.set_random_seed(0)
    model = getattr(tf.keras.applications, ctor)(input_shape=(size, size, 3), weights=None, classifier_activation=None)
    for layer in model.layers:
        if isinstance(layer, tf.keras.layers.BatchNormalization):
            layer.momentum = 0.0
    model(tf.random.stateless_uniform((8, size, size, 3), seed=(1, 2), minval=-1, maxval=1), training=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    model.save(path)
    return path, model


def int8_tflite(per_channel: bool) -> Path:
    import tensorflow as tf

    path = CACHE / f"mobilenet_v2_96_int8_{'per_channel' if per_channel else 'per_tensor'}.tflite"
    if path.exists():
        return path
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.applications.MobileNetV2(input_shape=(96, 96, 3), alpha=0.35, weights=None, classifier_activation=None)
    for layer in model.layers:
        if isinstance(layer, tf.keras.layers.BatchNormalization):
            layer.momentum = 0.0
    model(tf.random.stateless_uniform((8, 96, 96, 3), seed=(1, 2), minval=-1, maxval=1), training=True)
    # a fixed batch of 1; from_keras_model freezes the variables into constants
    fixed = tf.keras.Model(inp := tf.keras.Input((96, 96, 3), batch_size=1), model(inp))
    conv = tf.lite.TFLiteConverter.from_keras_model(fixed)
    conv.optimizations = [tf.lite.Optimize.DEFAULT]
    rng = np.random.default_rng(3)
    conv.representative_dataset = lambda: ([rng.uniform(-1, 1, (1, 96, 96, 3)).astype(np.float32)] for _ in range(8))
    conv.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    conv.inference_input_type = tf.int8
    conv.inference_output_type = tf.int8
    if not per_channel:
        conv._experimental_disable_per_channel = True
    CACHE.mkdir(parents=True, exist_ok=True)
    path.write_bytes(conv.convert())
    return path


def random_feeds(model, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs for a static-shape ONNX model (the imported one)."""
    from onnx import helper

    rng = np.random.default_rng(seed)
    init = {i.name for i in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in init:
            continue
        dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        if np.issubdtype(dtype, np.integer):
            info = np.iinfo(dtype)
            feeds[vi.name] = rng.integers(max(info.min, -128), min(info.max, 127), shape, endpoint=True).astype(dtype)
        else:
            feeds[vi.name] = rng.uniform(-1, 1, shape).astype(dtype)
    return feeds


def session(path_or_bytes, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    # Sessions are timed interleaved: a session whose threads spin-wait after its run steals the cores
    # from the next one (on 2 cores, the same file measured 2.3 ms or 6 ms by its place in the loop).
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(path_or_bytes, so, providers=["CPUExecutionProvider"])


def onnx_bytes(path: Path) -> bytes:
    import onnx

    m = onnx.load(str(path))
    m.ir_version = min(m.ir_version, 10)
    return m.SerializeToString()


def rel_err(got: list[np.ndarray], ref: list[np.ndarray]) -> float:
    """max |a - b| / max |b|, the worst output."""
    worst = 0.0
    for a, b in zip(got, ref):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape:
            a = a.reshape(b.shape)
        scale = max(float(np.abs(b).max()), 1e-30)
        worst = max(worst, float(np.abs(a - b).max()) / scale)
    return worst


def l2_rel_err(got: list[np.ndarray], ref: list[np.ndarray]) -> float:
    """||a - b||_2 / ||b||_2, the worst output: the norm-wise relative error of numerical analysis."""
    worst = 0.0
    for a, b in zip(got, ref):
        a, b = np.asarray(a, np.float64).reshape(-1), np.asarray(b, np.float64).reshape(-1)
        worst = max(worst, float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)))
    return worst


def reference(kind: str, source: Path, original_onnx: Path | None, feeds: dict[str, np.ndarray], keras_model=None,
              threads: int = 2, litert_kernels: str = "default") -> list[np.ndarray]:
    """litert_kernels: "default" (XNNPACK, what a user's interpreter runs) or "reference" (LiteRT's
    builtin reference kernels, no delegate)."""
    if kind == "keras":
        out = keras_model(*[feeds[k] for k in feeds], training=False)
        return [np.asarray(o) for o in (out if isinstance(out, (list, tuple)) else [out])]
    if kind == "tflite":
        from ai_edge_litert.interpreter import Interpreter, OpResolverType

        extra = {} if litert_kernels == "default" else {"experimental_op_resolver_type": OpResolverType.BUILTIN_REF}
        it = Interpreter(model_path=str(source), num_threads=threads, **extra)
        it.allocate_tensors()
        details = it.get_input_details()
        values = list(feeds.values())
        for d, v in zip(details, values):
            it.set_tensor(d["index"], v.reshape(d["shape"]).astype(d["dtype"]))
        it.invoke()
        return [it.get_tensor(d["index"]) for d in it.get_output_details()]
    sess = session(onnx_bytes(original_onnx), threads)
    return sess.run(None, feeds)


def median_pair_ms(a, b, feeds_a, feeds_b, runs: int) -> tuple[float, float]:
    for _ in range(3):
        a.run(None, feeds_a)
        b.run(None, feeds_b)
    ta, tb = [], []
    for _ in range(runs):
        for sess, feeds, acc in ((a, feeds_a, ta), (b, feeds_b, tb)):
            t0 = time.perf_counter()
            sess.run(None, feeds)
            acc.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ta), statistics.median(tb)


def measure(name: str, kind: str, source: Path, shapes: dict, runs: int, threads: int, keras_model=None,
            fixed: dict[str, np.ndarray] | None = None) -> dict:
    """`fixed`: inputs frozen with --input-value (they leave the imported graph's signature)."""
    import onnx

    from edgesdk.pipeline import BuildOptions, build

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        result = build(BuildOptions(model=source, target="x86", out=Path(tmp) / "out", input_shapes=shapes,
                                    input_values={k: tuple(np.asarray(v).reshape(-1).tolist())
                                                  for k, v in (fixed or {}).items()},
                                    until="import"))
        seconds = time.perf_counter() - t0
        rec = result.stages[0].record
        imported = stage_dir(Path(tmp) / "out", "import")
        optimized = imported / "model.onnx"
        original = imported / "converted.onnx" if (imported / "converted.onnx").exists() else source
        model = onnx.load(str(optimized))
        feeds = random_feeds(model)
        full = {**feeds, **(fixed or {})}
        after = session(onnx_bytes(optimized), threads)
        before_s = session(onnx_bytes(original), threads)
        got = after.run(None, feeds)
        ref = reference(kind, source, original, full, keras_model, threads)
        unoptimized = before_s.run(None, full)
        if kind == "tflite" and any(np.issubdtype(r.dtype, np.integer) for r in ref):
            def steps(a, b):
                return max(int(np.abs(np.asarray(x, np.int64) - np.asarray(y, np.int64).reshape(np.shape(x))).max())
                           for x, y in zip(a, b))

            exact = float(np.mean([np.mean(np.asarray(g) == np.asarray(r).reshape(np.shape(g))) for g, r in zip(got, ref)]))
            ref_kernels = reference(kind, source, original, full, threads=threads, litert_kernels="reference")
            # int8 is exact only against one kernel library's rounding: LiteRT's XNNPACK and its own
            # reference kernels disagree too, and the difference grows through the layers
            error = {"max_abs_int8_steps": steps(got, ref), "exact_fraction": round(exact, 4),
                     "steps_vs_litert_reference_kernels": steps(got, ref_kernels),
                     "litert_xnnpack_vs_reference_steps": steps(ref, ref_kernels),
                     "opt_max_abs_int8_steps": steps(got, unoptimized)}
        else:
            # against the original framework (the conversion and our rewrites), and against the
            # converter's own graph on onnxruntime (our rewrites alone)
            error = {"max_rel_error": rel_err(got, ref), "l2_rel_error": l2_rel_err(got, ref),
                     "opt_max_rel_error": rel_err(got, unoptimized)}
        t_before, t_after = median_pair_ms(before_s, after, full, feeds, runs)
    return {"model": name, "format": rec["format"], "converter": rec.get("converter"),
            "nodes_before": sum(rec["nodes_before"].values()), "nodes_after": sum(rec["nodes_after"].values()),
            "nodes_source": sum(rec["nodes_source"].values()),
            "rules": {k: v for k, v in rec["rules"].items() if v}, "import_s": round(seconds, 2),
            **error, "ort_ms_before": round(t_before, 3), "ort_ms_after": round(t_after, 3)}


def cases():
    yield from ((n, "keras") for n in KERAS_APPS)
    yield ("PP-OCRv4 det", "onnx")
    yield ("PP-OCRv4 rec", "onnx")
    yield ("PP-OCR cls", "onnx")
    yield ("silero-vad", "onnx")
    yield ("MediaPipe face detection (fp16)", "tflite")
    yield ("MobileNetV2 int8 per-channel", "tflite")
    yield ("MobileNetV2 int8 per-tensor", "tflite")


def run_case(name: str, kind: str, runs: int, threads: int) -> dict:
    if kind == "keras":
        path, model = keras_app(name)
        return measure(name, kind, path, {}, runs, threads, keras_model=model)
    if name == "PP-OCRv4 det":
        return measure(name, kind, MODELS / "ch_PP-OCRv4_det_infer.onnx", {"x": (1, 3, 640, 640)}, runs, threads)
    if name == "PP-OCRv4 rec":
        return measure(name, kind, MODELS / "ch_PP-OCRv4_rec_infer.onnx", {"x": (1, 3, 48, 320)}, runs, threads)
    if name == "PP-OCR cls":
        return measure(name, kind, MODELS / "ch_ppocr_mobile_v2.0_cls_infer.onnx", {"x": (1, 3, 48, 192)}, runs, threads)
    if name == "silero-vad":
        return measure(name, kind, MODELS / "silero_vad.onnx", {"input": (1, 512), "state": (2, 1, 128)}, runs,
                       threads, fixed={"sr": np.array(16000, np.int64)})
    if name.startswith("MediaPipe"):
        return measure(name, kind, MODELS / "face_detection_short_range.tflite", {}, runs, threads)
    return measure(name, kind, int8_tflite(per_channel="per-channel" in name), {}, runs, threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=None, help="model names to run (default: all)")
    ap.add_argument("--out", type=Path, default=_results.path("import"))
    args = ap.parse_args()
    rows = []
    for name, kind in cases():
        if args.only and name not in args.only:
            continue
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        try:
            row = run_case(name, kind, args.runs, args.threads)
        except Exception as e:  # a failing model is a result too: record it and go on
            row = {"model": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    _results.write("import", {"runs": args.runs, "threads": args.threads, "models": rows}, table(rows), out=args.out)
    print(table(rows))


def table(rows: list[dict]) -> str:
    out = ["| model | format | nodes before → after | import s | error vs original: max, L2 | error of the rewrites | "
           "ORT ms before | ORT ms after |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | failed: {r['error']} | | | | | | |")
            continue
        if "max_rel_error" in r:
            err = f"{r['max_rel_error']:.1e}, {r['l2_rel_error']:.1e}"
            opt = f"{r['opt_max_rel_error']:.1e}"
        else:
            err = (f"{r['max_abs_int8_steps']} step(s), {r['exact_fraction']:.1%} exact (LiteRT's own kernels "
                   f"differ by {r['litert_xnnpack_vs_reference_steps']})")
            opt = f"{r['opt_max_abs_int8_steps']} step(s)"
        out.append(f"| {r['model']} | {r['format']} | {r['nodes_before']} → {r['nodes_after']} | {r['import_s']:.1f} | "
                   f"{err} | {opt} | {r['ort_ms_before']:.2f} | {r['ort_ms_after']:.2f} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
