"""Legalize for the Edge TPU: coverage and transitions before and after, approximation errors,
end-to-end deviation, and the arm_2tpu latency the cost model predicts with and without legalize.

    .venv/bin/python benchmarks/bench_legalize.py [--only NAME ...] [--out benchmarks/results/legalize.json]

Models (Keras, `weights=None`, BatchNorm statistics set by one training-mode pass, saved as `.keras`
under .cache/bench-legalize and imported through tf2onnx like a user's file):
- EfficientNetB0 224 (Swish = x * sigmoid(x)),
- a transformer encoder (2 blocks, sequence 32, width 64, 4 heads, GELU feed-forward of 128),
- MobileNetV3Small 224 (HardSwish),
- a small CNN with Softplus and Mish activations.

For each: `edgesdk check --target arm_2tpu` (the analysis, on the synthetic calibration samples the
build uses), then the build up to the schedule stage twice, with legalize's rewrites and without
(`--no-rewrites`), reading the plan's predicted latency (the cost model of `devices/cost.py`), and
Coral's default rule on the model as imported (the plan's baseline: what `edgetpu_compiler` alone does).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk")]
import _results  # noqa: E402  (after the path above)
from edgesdk.pipeline import stage_dir  # noqa: E402  (after the path above)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
CACHE = ROOT / ".cache" / "bench-legalize"


def _settle_batchnorm(model, shape) -> None:
    import tensorflow as tf

    for layer in model.layers:
        if isinstance(layer, tf.keras.layers.BatchNormalization):
            layer.momentum = 0.0
    model(tf.random.stateless_uniform((4, *shape), seed=(1, 2), minval=-1, maxval=1), training=True)


def efficientnet():
    import tensorflow as tf

    m = tf.keras.applications.EfficientNetB0(input_shape=(224, 224, 3), weights=None, classifier_activation=None)
    _settle_batchnorm(m, (224, 224, 3))
    return m


def mobilenet_v3():
    import tensorflow as tf

    m = tf.keras.applications.MobileNetV3Small(input_shape=(224, 224, 3), weights=None, classifier_activation=None,
                                               include_preprocessing=False)
    _settle_batchnorm(m, (224, 224, 3))
    return m


def encoder():
    import tensorflow as tf

    k = tf.keras.layers
    x = inp = tf.keras.Input((32, 64), batch_size=1)
    for _ in range(2):
        a = k.MultiHeadAttention(num_heads=4, key_dim=16)(x, x)
        x = k.LayerNormalization()(x + a)
        f = k.Dense(64)(k.Dense(128, activation="gelu")(x))
        x = k.LayerNormalization()(x + f)
    return tf.keras.Model(inp, k.Dense(10)(k.GlobalAveragePooling1D()(x)))


def softplus_mish_cnn():
    import tensorflow as tf

    k = tf.keras.layers
    x = inp = tf.keras.Input((64, 64, 3), batch_size=1)
    for width, act in ((16, "softplus"), (32, "mish"), (64, "softplus"), (64, "mish")):
        x = k.Conv2D(width, 3, strides=2, padding="same")(x)
        x = k.BatchNormalization()(x)
        x = k.Activation(act)(x)
    m = tf.keras.Model(inp, k.Dense(10)(k.GlobalAveragePooling2D()(x)))
    _settle_batchnorm(m, (64, 64, 3))
    return m


MODELS = {"EfficientNetB0": efficientnet, "Transformer encoder (GELU)": encoder,
          "MobileNetV3Small": mobilenet_v3, "CNN with Softplus and Mish": softplus_mish_cnn}


def saved(name: str) -> Path:
    import tensorflow as tf

    path = CACHE / (name.split(" (")[0].replace(" ", "_") + ".keras")
    if not path.exists():
        tf.keras.utils.set_random_seed(0)
        CACHE.mkdir(parents=True, exist_ok=True)
        MODELS[name]().save(path)
    return path


CORAL_ALONE = "coral default (first unsupported op onwards on the cpu), model as imported (no legalize rewrites)"


def predicted_ms(model: Path, tmp: Path, rewrites: bool) -> tuple[float, dict, float]:
    """The plan's predicted latency and placement, and Coral's default rule on the model as imported."""
    from edgesdk.pipeline import BuildOptions, build

    out = tmp / ("with" if rewrites else "without")
    build(BuildOptions(model=model, target="arm_2tpu", out=out, until="schedule", legalize_rewrites=rewrites))
    plan = json.loads((stage_dir(out, "schedule") / "plan.json").read_text())
    return plan["predicted"]["latency_ms"], plan["placement"], plan["baselines"][CORAL_ALONE]["latency_ms"]


def measure(name: str) -> dict:
    from edgesdk.pipeline import BuildOptions, check

    path = saved(name)
    t0 = time.perf_counter()
    report = check(BuildOptions(model=path, target="arm_2tpu", out=Path(".")))
    seconds = time.perf_counter() - t0
    approx = report["approximations"]
    row = {"model": name, "check_s": round(seconds, 1),
           "coverage_before": report["before"]["coverage"].get("edgetpu"),
           "coverage_after": report["after"]["coverage"].get("edgetpu"),
           "transitions_before": report["before"]["transitions"], "transitions_after": report["after"]["transitions"],
           "rewrites": {k: v["count"] for k, v in report["rewrites"].items()},
           "approximations": len(approx), "knots": [len(a["knots"]) for a in approx],
           "worst_grid_error": max((a["grid_error"] for a in approx), default=None),
           "worst_int8_error": max((a.get("int8_error", 0.0) for a in approx), default=None),
           "end_to_end": report["end_to_end"], "max_abs_error": report["max_abs_error"],
           "fallbacks": len(report["fallbacks"])}
    with tempfile.TemporaryDirectory() as tmp:
        row["predicted_ms_without"], row["placement_without"], _ = predicted_ms(path, Path(tmp), False)
        row["predicted_ms_with"], row["placement_with"], row["coral_alone_ms"] = predicted_ms(path, Path(tmp), True)
    return row


def table(rows: list[dict]) -> str:
    out = ["| model | Edge TPU ops before → after | Edge TPU FLOPs before → after | transitions before → after | "
           "approximations (ReLUs each) | worst error: grid, int8 | end-to-end deviation (of range) | "
           "predicted arm_2tpu ms without → with legalize | Coral's default on the model as imported ms "
           "(with legalize over it) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | failed: {r['error']} | | | | | | | |")
            continue
        b, a = r["coverage_before"], r["coverage_after"]
        e2e = r["end_to_end"]
        errs = (f"{r['worst_grid_error']:.1e}, {r['worst_int8_error']:.1e}" if r["approximations"] else "—")
        out.append(
            f"| {r['model']} | {b['ops']}/{b['of_ops']} ({b['ops_fraction']:.0%}) → {a['ops']}/{a['of_ops']} "
            f"({a['ops_fraction']:.0%}) | {b['flops_fraction']:.1%} → {a['flops_fraction']:.1%} | "
            f"{r['transitions_before']} → {r['transitions_after']} | {r['approximations']} "
            f"({', '.join(map(str, sorted(set(r['knots'])))) or '—'}) | {errs} | "
            + (f"{e2e['max_abs_error']:.2e} ({e2e['max_error_of_range']:.2%})" if e2e
               else "0 (exact rewrites only)" if r["rewrites"] else "— (nothing to rewrite)")
            + f" | {r['predicted_ms_without']:.2f} → {r['predicted_ms_with']:.2f} "
            f"({r['predicted_ms_without'] / r['predicted_ms_with']:.2f}×) | {r['coral_alone_ms']:.2f} "
            f"({r['coral_alone_ms'] / r['predicted_ms_with']:.2f}×) |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--out", type=Path, default=_results.path("legalize"))
    args = ap.parse_args()
    rows = []
    for name in MODELS:
        if args.only and name not in args.only:
            continue
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        try:
            row = measure(name)
        except Exception as e:  # a failing model is a result too
            row = {"model": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(json.dumps(row, default=float), file=sys.stderr, flush=True)
        rows.append(row)
    _results.write("legalize", json.loads(json.dumps({"models": rows}, default=float)), table(rows), out=args.out)
    print(table(rows))


if __name__ == "__main__":
    main()
