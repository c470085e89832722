"""Fit arm_2tpu's free cost parameters to Coral's published benchmark, then predict what was held out.

    .venv/bin/python benchmarks/fit_arm_2tpu.py [--out benchmarks/results/fit-arm2tpu.json]

Fit parameters on the published figures only, compare the rest with the predictions
afterwards, never adjust a parameter toward a result. The model is `devices/cost.py` (node_ms); two
parameters per device are fitted by `devices/fit.py`, exactly (no iteration); every other figure
keeps its published value or its stated estimate.

- Cortex-A53 (cpu), Coral's Embedded CPU column, predicted as the product's all-CPU plan: per node
  max(flops / R, bytes / 12.8 GB/s) + kernel_overhead (20 us, an estimate, not fitted), and per
  convolution or matrix product a `layer_overhead` (cost.is_mac_layer). Fitted: R (peak_gflops.float32,
  an effective rate at most the TRM's 24 GFLOP/s) and layer_overhead.
- Edge TPU, Coral's Dev Board column, predicted as the product's Coral-default plan on a one-TPU
  variant of the target: per node flops / R + kernel_overhead, the int8 weights beyond the 8 MB
  cache streamed over the link every inference, the inputs and outputs over the link. The Dev Board's
  Edge TPU is on its SoM's PCIe Gen2 x1 (500 MB/s), not on USB: the variant has that link. Fitted: R
  (peak_tops_int8, at most the datasheet's 4 TOPS) and kernel_overhead; the target keeps its own
  USB 3 link figures.

Sets, chosen before any prediction was made: fitted on MobileNet v1 224, MobileNet v2 224 and
Inception v1 224 (depthwise-heavy and dense convolution stacks whose weights fit the Edge TPU's
cache); held out ResNet-50 V1 299 (its weights stream over the link: it tests the published link and
cache figures), UNet Mv2 128 (transposed convolutions, a 128x128 decoder), and Coral's reference
single-TPU latency of MobileNet v2 over USB on x86-64, aarch64 and Raspberry Pi 4 hosts (predicted
with the target's own USB link). Leave-one-out over the five models gives a second estimate of the
prediction error. The CPU's model form was chosen among four by the same leave-one-out errors; the
comparison is in the output. MobileNet v2 SSD 224 is not built: its Dev Board figure includes the
TFLite_Detection_PostProcess op (non-maximum suppression) on the CPU, which the cost model has no
term for.

Models, with weights=None (cost depends on shapes, not on weights), cached as .keras under
.cache/bench-fit/: MobileNet, MobileNetV2 and ResNet50 from tf.keras.applications; Inception v1 as
TF-slim's inception_v1 (the architecture of Coral's model) and the TensorFlow segmentation tutorial's
U-Net (MobileNetV2 encoder, pix2pix decoder), both written here. Each is built through the pipeline up
to legalize for arm_2tpu (build directories under .cache/bench-fit/build/, reused through the stage
cache), and its Problem comes from `scheduling.graph.build_problem`, the schedule stage's own code.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk")]
import _results  # noqa: E402  (after the path above)
from edgesdk.pipeline import stage_dir  # noqa: E402  (after the path above)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
CACHE = ROOT / ".cache" / "bench-fit"
SCRIPT = "benchmarks/fit_arm_2tpu.py"
CORAL = "Coral's published benchmark (coral.ai/docs/edgetpu/benchmarks)"

# name -> input size, Coral's row name
MODELS = {
    "MobileNet": (224, "MobileNet v1 224"),
    "MobileNetV2": (224, "MobileNet v2 224"),
    "InceptionV1": (224, "Inception v1 224"),
    "ResNet50": (299, "ResNet-50 V1 299"),
    "UNetMv2": (128, "UNet Mv2 128"),
}
# Coral's table, ms per inference: (Embedded CPU, Dev Board with Edge TPU)
PUBLISHED = {"MobileNet": (164.0, 2.4), "MobileNetV2": (122.0, 2.6), "InceptionV1": (392.0, 4.1),
             "ResNet50": (1763.0, 56.0), "UNetMv2": (190.7, 5.7)}
FIT_ON = ("MobileNet", "MobileNetV2", "InceptionV1")
HELD_OUT = ("ResNet50", "UNetMv2")
# Coral's reference single-TPU latency of MobileNet v2 224 int8 on the USB Accelerator
REFERENCE = {"x86-64 host": 2.29, "aarch64 host": 2.56, "Raspberry Pi 4": 4.55}
NOT_BUILT = {"MobileNet v2 SSD 224": (282.0, 14.0, "its Dev Board figure includes TFLite_Detection_PostProcess "
                                                   "(non-maximum suppression) on the CPU, an op the cost model has "
                                                   "no term for")}
CPU_OVERHEAD = "layer"   # the chosen CPU form: rate + per-layer overhead (see cpu_forms)
# The Dev Board's Edge TPU: the Coral Accelerator Module connects "over a PCIe Gen2 x1 or USB 2.0
# interface" (its datasheet), and the Dev Board's SoM uses PCIe (its Mendel kernel carries the PCIe
# apex/gasket driver: google-coral/edgetpu#223). PCIe 2.0: 5 GT/s with 8b/10b coding.
DEV_BOARD_LINK = {
    "name": "PCIe Gen2 x1 (Coral Dev Board SoM)",
    "bandwidth": {"value": 500.0, "unit": "MB/s",
                  "source": "Coral Accelerator Module datasheet (coral.ai/static/files/"
                            "Coral-Accelerator-Module-datasheet.pdf): PCIe Gen2 x1; PCIe 2.0 base spec: 5 GT/s, "
                            "8b/10b = 500 MB/s per direction"},
}


# --- the models ----------------------------------------------------------------------------------


def inception_v1(size: int = 224, classes: int = 1001):
    """TF-slim's inception_v1, the architecture of Coral's Inception v1 224: conv + BN + ReLU units, the
    third branch of a Mixed block 3x3 as slim has it (the GoogLeNet paper's is 5x5), a 2x2 max pool
    before Mixed_5b, 1x1-conv logits."""
    import tensorflow as tf

    layers = tf.keras.layers

    def unit(x, filters, k, stride=1):
        x = layers.Conv2D(filters, k, strides=stride, padding="same", use_bias=False)(x)
        return layers.ReLU()(layers.BatchNormalization(epsilon=1e-3)(x))

    def mixed(x, b0, b1, b2, b3):
        return layers.Concatenate()([unit(x, b0, 1), unit(unit(x, b1[0], 1), b1[1], 3),
                                     unit(unit(x, b2[0], 1), b2[1], 3),
                                     unit(layers.MaxPool2D(3, 1, padding="same")(x), b3, 1)])

    inputs = layers.Input((size, size, 3))
    x = unit(inputs, 64, 7, 2)
    x = layers.MaxPool2D(3, 2, padding="same")(x)
    x = unit(unit(x, 64, 1), 192, 3)
    x = layers.MaxPool2D(3, 2, padding="same")(x)
    x = mixed(x, 64, (96, 128), (16, 32), 32)                                   # Mixed_3b
    x = mixed(x, 128, (128, 192), (32, 96), 64)                                 # Mixed_3c
    x = layers.MaxPool2D(3, 2, padding="same")(x)
    for block in ((192, (96, 208), (16, 48), 64), (160, (112, 224), (24, 64), 64),  # Mixed_4b..4f
                  (128, (128, 256), (24, 64), 64), (112, (144, 288), (32, 64), 64),
                  (256, (160, 320), (32, 128), 128)):
        x = mixed(x, *block)
    x = layers.MaxPool2D(2, 2, padding="same")(x)
    x = mixed(x, 256, (160, 320), (32, 128), 128)                               # Mixed_5b
    x = mixed(x, 384, (192, 384), (48, 128), 128)                               # Mixed_5c
    x = layers.GlobalAveragePooling2D(keepdims=True)(x)
    x = layers.Conv2D(classes, 1)(x)
    return tf.keras.Model(inputs, layers.Softmax()(layers.Flatten()(x)), name="inception_v1")


def unet_mv2(size: int = 128, classes: int = 3):
    """The TensorFlow image-segmentation tutorial's U-Net: a MobileNetV2 encoder (block_1/3/6/13
    expand activations and block_16's projection as skips) and pix2pix upsample blocks (3x3 stride-2
    Conv2DTranspose, BN, ReLU) of 512, 256, 128 and 64 filters, then a stride-2 Conv2DTranspose to
    `classes`."""
    import tensorflow as tf

    layers = tf.keras.layers
    base = tf.keras.applications.MobileNetV2(input_shape=(size, size, 3), include_top=False, weights=None)
    names = ["block_1_expand_relu", "block_3_expand_relu", "block_6_expand_relu", "block_13_expand_relu",
             "block_16_project"]
    down = tf.keras.Model(base.input, [base.get_layer(n).output for n in names])
    inputs = layers.Input((size, size, 3))
    *skips, x = down(inputs)
    for filters, skip in zip((512, 256, 128, 64), reversed(skips)):
        x = layers.Conv2DTranspose(filters, 3, strides=2, padding="same", use_bias=False)(x)
        x = layers.ReLU()(layers.BatchNormalization()(x))
        x = layers.Concatenate()([x, skip])
    x = layers.Conv2DTranspose(classes, 3, strides=2, padding="same")(x)
    return tf.keras.Model(inputs, x, name="unet_mv2")


def keras_model(name: str) -> Path:
    import tensorflow as tf

    size, _ = MODELS[name]
    path = CACHE / f"{name}_{size}.keras"
    if not path.exists():
        tf.keras.utils.set_random_seed(0)
        written = {"InceptionV1": inception_v1, "UNetMv2": unet_mv2}
        model = (written[name](size) if name in written else
                 getattr(tf.keras.applications, name)(input_shape=(size, size, 3), weights=None))
        CACHE.mkdir(parents=True, exist_ok=True)
        model.save(path)
    return path


def legalized(name: str):
    """The model after legalize for arm_2tpu, as the schedule stage reads it."""
    import onnx

    from edgesdk.pipeline import BuildOptions, build

    out = CACHE / "build" / name
    build(BuildOptions(model=keras_model(name), target="arm_2tpu", out=out, until="legalize"))
    return onnx.load(str(stage_dir(out, "legalize") / "model.onnx"))


# --- targets ---------------------------------------------------------------------------------------


# The published peaks: the fits' upper bounds on the rates. The target file's rate fields hold the
# fitted effective rates (as `edgesdk calibrate` writes them), so the peaks are kept here.
PEAKS = {"cpu": (24.0, "Arm Cortex-A53 TRM: 64-bit NEON, one 2-lane fp32 FMA per cycle per core "
                       "(4 flop/cycle x 4 cores x 1.5 GHz)"),
         "edgetpu": (4.0, "Coral Edge TPU datasheet: 4 TOPS int8")}


def base_target(target):
    """The target a fit starts from, whatever the file holds: the rate fields at the published peaks
    and no CPU layer_overhead (the fitted fields are replaced; the other figures are the file's
    published figures and estimates)."""
    from edgesdk.config import Target

    data = target.model_dump(mode="json")
    for dev in data["devices"]:
        if dev["kind"] == "cpu":
            dev["layer_overhead"] = None
            dev["peak_gflops"]["float32"].update(value=PEAKS["cpu"][0], source=PEAKS["cpu"][1])
        if dev["kind"] == "edgetpu":
            dev["peak_tops_int8"].update(value=PEAKS["edgetpu"][0], source=PEAKS["edgetpu"][1])
    return Target.model_validate(data)


def one_tpu(target, link: dict | None = None):
    """The target with a single Edge TPU (the Dev Board's configuration, and the reference figures'),
    on `link` where given (its latency stays the target's)."""
    from edgesdk.config import Target

    data = target.model_dump(mode="json")
    for dev in data["devices"]:
        if dev["kind"] == "edgetpu":
            dev["count"], dev["physical"] = 1, dev["physical"][:1]
            if link:
                dev["link"] = {**dev["link"], **link}
    return Target.model_validate(data)


def dev_board(target):
    return one_tpu(target, DEV_BOARD_LINK)


# --- one model's numbers ---------------------------------------------------------------------------


class Graph:
    """One legalized model's numbers: per-node flops, parameter and activation bytes, capabilities."""

    def __init__(self, name: str, model):
        from edgesdk.devices.cost import is_grouped, is_mac_layer, node_bytes, node_flops
        from edgesdk.ir import model as irm

        self.name, self.model = name, model
        self.shapes, self.consts = irm.static_shapes(model), irm.constant_names(model)
        g = model.graph
        # as build_problem computes them
        self.flops = [node_flops(n, self.shapes) for n in g.node]
        self.weights, self.acts = (list(x) for x in zip(*(node_bytes(n, self.shapes, self.consts) for n in g.node)))
        self.grouped = [is_grouped(n) for n in g.node]
        self.layers = sum(is_mac_layer(f, a) for f, a in zip(self.flops, self.acts))
        caps = [(irm.get_meta(n, irm.CAPABLE_KEY) or "cpu/onnxruntime").split(",") for n in g.node]
        self.tpu_weights = sum(w for w, c in zip(self.weights, caps) if "edgetpu" in c)
        self.tpu_capable = sum("edgetpu" in c for c in caps)
        self.ops: dict[str, int] = {}
        for n in g.node:
            self.ops[n.op_type] = self.ops.get(n.op_type, 0) + 1

    def problem(self, target):
        from edgesdk.scheduling.graph import build_problem

        return build_problem(self.model, target, self.shapes, self.consts)[0]

    def nodes(self, indices) -> list[tuple[float, int, int, bool]]:
        return [(self.flops[i], self.weights[i], self.acts[i], self.grouped[i]) for i in indices]

    # --- the published figures, predicted through the product's plans and segment costs ----------

    def cpu_ms(self, target) -> float:
        from edgesdk.scheduling import baselines, placement

        p = self.problem(target)
        return sum(placement.segment_ms(p, *s) for s in baselines.all_cpu(p))

    def tpu_ms(self, target) -> float:
        """Coral's default plan on `target` as given (one_tpu / dev_board make the one-TPU variants)."""
        from edgesdk.scheduling import baselines, placement

        p = self.problem(target)
        return sum(placement.segment_ms(p, *s) for s in baselines.coral_default(p))

    def dp_ms(self, target) -> float:
        from edgesdk.scheduling import placement

        return placement.place(self.problem(target)).cost_ms

    # --- the same figures as observations of devices/fit.py ---------------------------------------

    def cpu_observation(self, target, measured: float, overhead: str = CPU_OVERHEAD):
        from edgesdk.devices import fit
        from edgesdk.scheduling import baselines

        p = self.problem(target)
        (start, stop, _), = baselines.all_cpu(p)
        return fit.observation(target, "cpu", self.name, measured, self.nodes(range(start, stop)),
                               fixed_ms=p.overhead_ms.get("cpu", 0.0), overhead=overhead)

    def tpu_observation(self, board, measured: float):
        """On the one-TPU `board`: the TPU prefix's nodes are the fitted terms; its link transfers and
        any CPU tail (at the target's CPU figures) are fixed."""
        from edgesdk.devices import cost, fit
        from edgesdk.scheduling import baselines, placement

        p = self.problem(board)
        fixed, nodes = 0.0, []
        for start, stop, device in baselines.coral_default(p):
            seg = placement.segment_ms(p, start, stop, device)
            if device == "cpu":
                fixed += seg
            else:
                fixed += seg - sum(p.cost[k][device] for k in range(start, stop))  # link and invocation
                nodes += list(range(start, stop))
        return fit.observation(board, "edgetpu", self.name, measured, self.nodes(nodes), fixed_ms=fixed,
                               streamed_fraction=cost.streamed_fraction(board, self.tpu_weights))


# --- fitting ---------------------------------------------------------------------------------------


def fit_cpu(graphs, target, names, overhead: str = CPU_OVERHEAD):
    from edgesdk.devices import fit

    obs = [graphs[m].cpu_observation(target, PUBLISHED[m][0], overhead) for m in names]
    return fit.fit_roofline("cpu", obs, max_rate=target.host.peak_gflops["float32"].value * 1e9), obs


def fit_tpu(graphs, target, names):
    from edgesdk.devices import fit

    board = dev_board(target)
    obs = [graphs[m].tpu_observation(board, PUBLISHED[m][1]) for m in names]
    tpu = next(d for d in target.devices if d.kind == "edgetpu")
    return fit.fit_roofline("edgetpu", obs, max_rate=tpu.peak_tops_int8.value * 1e12), obs


def listing(names) -> str:
    return ", ".join(MODELS[m][1] for m in names)


def fit_target(graphs, target):
    """Both devices fitted on FIT_ON: the CPU first, since a CPU tail of the TPU plan would run on it."""
    from edgesdk.devices import fit

    cpu_fit, cpu_obs = fit_cpu(graphs, target, FIT_ON)
    held = f"{listing(HELD_OUT)} held out (benchmarks/RESULTS.md)"
    figures = ", ".join(f"{PUBLISHED[m][0]:g}" for m in FIT_ON)
    cpu_source = (f"fitted by {SCRIPT} (rate and {fit.OVERHEADS[CPU_OVERHEAD][0]} together) to {CORAL}, "
                  f"Embedded CPU column: {listing(FIT_ON)} ({figures} ms); {held}")
    with_cpu = fit.refit_target(target, "cpu", cpu_fit, cpu_source)
    tpu_fit, tpu_obs = fit_tpu(graphs, with_cpu, FIT_ON)
    figures = ", ".join(f"{PUBLISHED[m][1]:g}" for m in FIT_ON)
    tpu_source = (f"fitted by {SCRIPT} (rate and kernel_overhead together) to {CORAL}, Dev Board with Edge TPU "
                  f"column: {listing(FIT_ON)} ({figures} ms), the Dev Board's Edge TPU on PCIe Gen2 x1 (500 MB/s, "
                  f"Coral Accelerator Module datasheet); {held}")
    fitted = fit.refit_target(with_cpu, "edgetpu", tpu_fit, tpu_source)
    return fitted, with_cpu, (cpu_fit, cpu_obs), (tpu_fit, tpu_obs)


def check_consistent(fit_result, observations) -> float:
    """The fit's own model and the product's plans agree (else the fit fitted something else)."""
    worst = 0.0
    for ob, product in observations:
        mine = ob.predict_ms(fit_result.ms_per_flop, fit_result.overhead_ms)
        worst = max(worst, abs(mine - product) / product)
    if worst > 1e-9:
        raise SystemExit(f"fit: the fit's model and the product's prediction differ by {worst:.2e} (relative)")
    return worst


def leave_one_out(graphs, target, with_cpu) -> list[dict]:
    """Per device and model: fitted on the other four models, the left-out one predicted. The TPU's
    observations see `with_cpu` (the CPU fitted on FIT_ON; it matters only for a CPU tail, which none
    of these models has) and its published TPU figures (the rate's bound)."""
    rows = []
    for left in MODELS:
        others = [m for m in MODELS if m != left]
        fcpu, _ = fit_cpu(graphs, target, others)
        ob = graphs[left].cpu_observation(target, PUBLISHED[left][0])
        rows.append(_loo_row(left, "Embedded CPU", fcpu, ob))
        ftpu, _ = fit_tpu(graphs, with_cpu, others)
        ob = graphs[left].tpu_observation(dev_board(with_cpu), PUBLISHED[left][1])
        rows.append(_loo_row(left, "Dev Board with Edge TPU", ftpu, ob))
    return rows


def _loo_row(left, column, fit_result, ob) -> dict:
    predicted = ob.predict_ms(fit_result.ms_per_flop, fit_result.overhead_ms)
    return {"model": MODELS[left][1], "column": column, "published_ms": ob.measured_ms, "predicted_ms": predicted,
            "error": predicted / ob.measured_ms - 1, "rate": fit_result.rate, "overhead_us": fit_result.overhead_us,
            "at_bound": list(fit_result.at_bound)}


# --- the CPU model forms compared ------------------------------------------------------------------


def cpu_forms(graphs, target) -> list[dict]:
    """Candidate CPU forms, each fitted on FIT_ON (held-out errors) and leave-one-out over all five
    models. The forms of devices/fit.py (one rate, one overhead) are fitted exactly by it; the others,
    for this comparison only, by bounded least squares (scipy, several starts; relative residuals)."""
    import numpy as np

    peak = target.host.peak_gflops["float32"].value * 1e9
    node_us = target.host.kernel_overhead.value
    obs_node = {m: graphs[m].cpu_observation(target, PUBLISHED[m][0], "node") for m in MODELS}
    obs_layer = {m: graphs[m].cpu_observation(target, PUBLISHED[m][0], "layer") for m in MODELS}
    floors = {m: np.array(obs_node[m].floor_ms) for m in MODELS}
    flops = {m: np.array(graphs[m].flops) for m in MODELS}
    grouped = {m: np.array(graphs[m].grouped) for m in MODELS}
    nodes = {m: len(graphs[m].flops) for m in MODELS}
    layers = {m: graphs[m].layers for m in MODELS}

    def exact(overhead):
        def run(names):
            from edgesdk.devices import fit

            obs = obs_node if overhead == "node" else obs_layer
            f = fit.fit_roofline("cpu", [obs[m] for m in names], max_rate=peak)
            return ({"rate_gflops": f.rate / 1e9, f"{overhead}_overhead_us": f.overhead_us},
                    lambda m: obs[m].predict_ms(f.ms_per_flop, f.overhead_ms))
        return run

    def bounded(predict, names_of, x0s, lower):
        def run(names):
            from scipy.optimize import least_squares

            def residuals(u):
                return [predict(m, u) / PUBLISHED[m][0] - 1 for m in names]
            best = min((least_squares(residuals, x0, bounds=(lower, np.inf), x_scale="jac") for x0 in x0s),
                       key=lambda r: r.cost)
            # u holds ms per GFLOP (named *_gflops: reported as GFLOP/s) and ms (named *_us)
            readable = {n: 1e3 / v if n.endswith("_gflops") else v * 1e3 for n, v in zip(names_of, best.x)}
            return readable, (lambda m: predict(m, best.x))
        return run

    def grouped_rates(free_overhead):
        # u = (ms per dense GFLOP, ms per grouped GFLOP[, ms per node])
        def predict(m, u):
            x = np.where(grouped[m], u[1], u[0]) * 1e-9
            over = u[2] if free_overhead else node_us * 1e-3
            return float(np.maximum(flops[m] * x, floors[m]).sum() + nodes[m] * over)
        return predict

    def layer_and_node(m, u):
        # u = (ms per GFLOP, ms per layer, ms per node)
        return float(np.maximum(flops[m] * u[0] * 1e-9, floors[m]).sum() + layers[m] * u[1] + nodes[m] * u[2])

    x_peak = 1e12 / peak  # ms per GFLOP at the peak
    forms = [
        ("rate + per-node overhead (the first fit's form)", exact("node")),
        ("rate + per-layer overhead (applied)", exact("layer")),
        ("dense rate + grouped rate + per-node overhead",
         bounded(grouped_rates(True), ("dense_rate_gflops", "grouped_rate_gflops", "node_overhead_us"),
                 [np.array([x_peak * a, x_peak * b, c]) for a in (1.5, 3) for b in (3, 20) for c in (0.01, 0.3)],
                 [x_peak, x_peak, 0.0])),
        (f"dense rate + grouped rate, {node_us:g} us per node (no fitted overhead)",
         bounded(grouped_rates(False), ("dense_rate_gflops", "grouped_rate_gflops"),
                 [np.array([x_peak * a, x_peak * b]) for a in (1.5, 3) for b in (3, 20)], [x_peak, x_peak])),
        ("rate + per-layer overhead + per-node overhead",
         bounded(layer_and_node, ("rate_gflops", "layer_overhead_us", "node_overhead_us"),
                 [np.array([x_peak * a, b, c]) for a in (1.5, 3) for b in (0.1, 1.0) for c in (0.0, 0.3)],
                 [x_peak, 0.0, 0.0])),
    ]
    out = []
    for label, run in forms:
        params, predict = run(FIT_ON)
        held = {MODELS[m][1]: predict(m) / PUBLISHED[m][0] - 1 for m in HELD_OUT}
        fitted = {MODELS[m][1]: predict(m) / PUBLISHED[m][0] - 1 for m in FIT_ON}
        loo = {}
        for left in MODELS:
            _, p = run([m for m in MODELS if m != left])
            loo[MODELS[left][1]] = p(left) / PUBLISHED[left][0] - 1
        errors = list(loo.values())
        out.append({"form": label, "parameters": {k: float(v) for k, v in params.items()}, "fit_residuals": fitted,
                    "held_out_errors": held, "loo_errors": loo,
                    "loo_rms": math.sqrt(sum(e * e for e in errors) / len(errors)),
                    "loo_max": max(abs(e) for e in errors)})
    return out


# --- reporting -------------------------------------------------------------------------------------


def breakdown(graph: Graph, fitted, column: str) -> dict:
    """Where a fitted prediction's milliseconds go: the fitted terms and the published ones."""
    from edgesdk.devices import cost, fit

    if column == "Embedded CPU":
        ob = graph.cpu_observation(fitted, 1.0, "layer")
        x, o = fit.target_parameters(fitted, "cpu", "layer")
        compute_bound = [f * x >= m for f, m in zip(ob.flops, ob.floor_ms)]
        return {"compute_ms": sum(f * x for (f, m), c in zip(zip(ob.flops, ob.floor_ms), compute_bound) if c),
                "memory_bound_ms": sum(m for (f, m), c in zip(zip(ob.flops, ob.floor_ms), compute_bound) if not c),
                "layer_overhead_ms": ob.ops * o, "node_overhead_ms": ob.fixed_ms}
    board = dev_board(fitted)
    ob = graph.tpu_observation(board, 1.0)
    x, o = fit.target_parameters(board, "edgetpu")
    tpu = next(d for d in board.devices if d.kind == "edgetpu")
    share = cost.streamed_fraction(board, graph.tpu_weights)
    streamed = 1e3 * share * graph.tpu_weights / 4 / (tpu.link.bandwidth.value * 1e6)
    return {"compute_ms": sum(f * x for f in ob.flops), "overhead_ms": ob.ops * o, "streamed_share": share,
            "streamed_weights_ms": streamed, "link_io_and_cpu_ms": ob.fixed_ms - streamed}


def fitted_fields(fitted, cpu_peak: float, tpu_peak: float) -> dict[tuple[str, str], tuple[float, str, str]]:
    """(device kind, field) -> (value to 4 digits, unit, source): what targets/arm_2tpu.yaml holds after
    this fit. The rate fields are called peaks in the schema; their sources say they are effective rates."""
    cpu, tpu = fitted.host, next(d for d in fitted.devices if d.kind == "edgetpu")
    q = lambda v: float(f"{v:.4g}")  # noqa: E731 - four significant digits in the file
    rate, trate = cpu.peak_gflops["float32"], tpu.peak_tops_int8
    return {
        ("cpu", "peak_gflops.float32"): (
            q(rate.value), "GFLOP/s", f"effective rate, {rate.value * 1e9 / cpu_peak:.1%} of the {cpu_peak / 1e9:g} "
            f"GFLOP/s peak ({PEAKS['cpu'][1]}); {rate.source}"),
        ("cpu", "kernel_overhead"): (
            q(cpu.kernel_overhead.value), "us", "estimate, not fitted: fitted beside layer_overhead, Coral's Embedded "
            f"CPU figures put a per-node cost at 0 ({SCRIPT}, CPU model forms); kept as the dispatch of one op"),
        ("cpu", "layer_overhead"): (
            q(cpu.layer_overhead.value), "us", f"{cpu.layer_overhead.source}; paid by each convolution and matrix "
            "product (devices/cost.py, is_mac_layer)"),
        ("edgetpu", "peak_tops_int8"): (
            q(trate.value), "TOP/s", f"effective rate, {trate.value * 1e12 / tpu_peak:.1%} of the {tpu_peak / 1e12:g} "
            f"TOP/s peak ({PEAKS['edgetpu'][1]}); {trate.source}"),
        ("edgetpu", "kernel_overhead"): (q(tpu.kernel_overhead.value), "us", tpu.kernel_overhead.source),
    }


def yaml_snippet(fields) -> str:
    out = []
    for kind in ("cpu", "edgetpu"):
        out.append(f"  # the {kind} device")
        for (k, field), (value, unit, source) in fields.items():
            if k != kind:
                continue
            if "." in field:
                outer, inner = field.split(".")
                out += [f"    {outer}:", f"      {inner}:", f"        value: {value}", f"        unit: {unit}",
                        f'        source: "{source}"']
            else:
                out += [f"    {field}:", f"      value: {value}", f"      unit: {unit}", f'      source: "{source}"']
    return "\n".join(out)


def file_agrees(loaded, fields) -> dict[str, bool]:
    """Whether targets/arm_2tpu.yaml holds this fit's figures, values and sources."""
    out = {}
    for (kind, field), (value, unit, source) in fields.items():
        dev = next(d for d in loaded.devices if d.kind == kind)
        outer, _, inner = field.partition(".")
        figure = getattr(dev, outer)
        figure = figure.get(inner) if inner else figure
        out[f"{kind} {field}"] = (figure is not None
                                  and (figure.value, figure.unit, figure.source) == (value, unit, source))
    return out


def table(result: dict) -> str:
    """Coral's published latencies against the fitted cost model's, fitted and held out."""
    return markdown(result).split("\n\n")[1]


def notes(result: dict) -> list[str]:
    """The fitted figures, and the leave-one-out errors: a second estimate of the error."""
    loo = {(r["model"], r["column"]): r["error"] for r in result["leave_one_out"]}
    cpu = ", ".join(f"{m} {e:+.1%}" for (m, c), e in loo.items() if c == "Embedded CPU")
    tpu = ", ".join(f"{m} {e:+.1%}" for (m, c), e in loo.items() if c != "Embedded CPU")
    return ["fitted: " + "; ".join(f"{p['device']} {p['name']} (`{p['field']}`) {p['value']:.4g} {p['unit']}"
                                   for p in result["parameters"]),
            f"leave-one-out (fitted on the other four models): CPU {cpu}; Edge TPU {tpu}"]


def markdown(result: dict) -> str:
    out = ["| device | parameter | field | fitted | bound hit |", "|---|---|---|---|---|"]
    for p in result["parameters"]:
        out.append(f"| {p['device']} | {p['name']} | `{p['field']}` | {p['value']:.4g} {p['unit']} | "
                   f"{', '.join(p['at_bound']) or 'none'} |")
    out += ["", "| model | column | published ms | predicted ms | error | set |", "|---|---|---|---|---|---|"]
    for r in result["comparisons"]:
        out.append(f"| {r['model']} | {r['column']} | {r['published_ms']:g} | {r['predicted_ms']:.2f} | "
                   f"{r['error']:+.1%} | {r['set']} |")
    for name, v in result["not_built"].items():
        out.append(f"| {name} | both | {v['embedded_cpu_ms']:g} / {v['dev_board_ms']:g} | | | not built |")
    out += ["", "Leave-one-out (fitted on the other four models, the same form):", "",
            "| model | Embedded CPU: published, predicted, error | Dev Board: published, predicted, error |",
            "|---|---|---|"]
    loo = {(r["model"], r["column"]): r for r in result["leave_one_out"]}
    for _, row in MODELS.values():
        c, t = loo[(row, "Embedded CPU")], loo[(row, "Dev Board with Edge TPU")]
        out.append(f"| {row} | {c['published_ms']:g}, {c['predicted_ms']:.1f}, {c['error']:+.1%} | "
                   f"{t['published_ms']:g}, {t['predicted_ms']:.2f}, {t['error']:+.1%} |")
    out += ["", "CPU model forms (fit on the fitting set; leave-one-out over all five):", "",
            "| form | fitting-set residuals | held out: ResNet-50, UNet | LOO RMS | LOO max |", "|---|---|---|---|---|"]
    for f in result["cpu_forms"]:
        out.append(f"| {f['form']} | {', '.join(f'{v:+.1%}' for v in f['fit_residuals'].values())} | "
                   f"{', '.join(f'{v:+.1%}' for v in f['held_out_errors'].values())} | {f['loo_rms']:.1%} | "
                   f"{f['loo_max']:.1%} |")
    out += ["", "Where the predicted milliseconds go (ms):", "",
            "| model | column | compute | memory-bound | overhead (layer / node) | weights streamed | link I/O |",
            "|---|---|---|---|---|---|---|"]
    for r in result["comparisons"]:
        b = r.get("breakdown")
        if not b:
            continue
        if r["column"] == "Embedded CPU":
            out.append(f"| {r['model']} | CPU | {b['compute_ms']:.1f} | {b['memory_bound_ms']:.1f} | "
                       f"{b['layer_overhead_ms']:.1f} / {b['node_overhead_ms']:.1f} | | |")
        else:
            out.append(f"| {r['model']} | Edge TPU | {b['compute_ms']:.2f} | | {b['overhead_ms']:.2f} (per node) | "
                       f"{b['streamed_weights_ms']:.2f} | {b['link_io_and_cpu_ms']:.2f} |")
    out += ["", "| model | nodes (layers, TPU-capable) | GFLOP | params M | arm_2tpu: ARM only ms | DP ms |",
            "|---|---|---|---|---|---|"]
    for m in result["models"]:
        out.append(f"| {m['model']} | {m['nodes']} ({m['layers']}, {m['tpu_capable']}) | {m['gflop']:.2f} | "
                   f"{m['params_m']:.2f} | {m['arm_only_ms']:.1f} | {m['dp_ms']:.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=_results.path("fit-arm2tpu"))
    args = ap.parse_args()
    from edgesdk.config import load_target

    t0 = time.perf_counter()
    loaded, _ = load_target("arm_2tpu")
    target = base_target(loaded)
    graphs = {}
    for name in MODELS:
        print(f"fit: building {name} up to legalize ...", file=sys.stderr, flush=True)
        graphs[name] = Graph(name, legalized(name))
    built_s = time.perf_counter() - t0

    t1 = time.perf_counter()
    fitted, with_cpu, (cpu_fit, cpu_obs), (tpu_fit, tpu_obs) = fit_target(graphs, target)
    fit_s = time.perf_counter() - t1
    board = dev_board(fitted)
    consistency = max(
        check_consistent(cpu_fit, [(o, graphs[o.name].cpu_ms(fitted)) for o in cpu_obs]),
        # the TPU observations were made with the fitted CPU already in place
        check_consistent(tpu_fit, [(o, graphs[o.name].tpu_ms(board)) for o in tpu_obs]))

    comparisons = []
    for name, g in graphs.items():
        role = "fitted" if name in FIT_ON else "held out"
        for column, published, predicted in (("Embedded CPU", PUBLISHED[name][0], g.cpu_ms(fitted)),
                                             ("Dev Board with Edge TPU", PUBLISHED[name][1], g.tpu_ms(board))):
            comparisons.append({"model": MODELS[name][1], "set": role, "column": column, "published_ms": published,
                                "predicted_ms": predicted, "error": predicted / published - 1,
                                "breakdown": breakdown(g, fitted, column)})
    usb = graphs["MobileNetV2"].tpu_ms(one_tpu(fitted))
    for host, published in REFERENCE.items():
        comparisons.append({"model": MODELS["MobileNetV2"][1], "set": "held out",
                            "column": f"USB Accelerator, {host} (Coral's reference)", "published_ms": published,
                            "predicted_ms": usb, "error": usb / published - 1})

    loo = leave_one_out(graphs, target, with_cpu)
    forms = cpu_forms(graphs, target)
    models = []
    for n, g in graphs.items():
        models.append({"model": MODELS[n][1], "input": MODELS[n][0], "nodes": len(g.flops), "layers": g.layers,
                       "tpu_capable": g.tpu_capable, "gflop": sum(g.flops) / 1e9, "params_m": sum(g.weights) / 4e6,
                       "grouped_gflop": sum(f for f, gr in zip(g.flops, g.grouped) if gr) / 1e9,
                       "op_types": dict(sorted(g.ops.items())), "arm_only_ms": g.cpu_ms(fitted),
                       "dp_ms": g.dp_ms(fitted)})
    cpu, tpu = fitted.host, next(d for d in fitted.devices if d.kind == "edgetpu")
    cpu_peak = target.host.peak_gflops["float32"].value * 1e9
    tpu_peak = next(d for d in target.devices if d.kind == "edgetpu").peak_tops_int8.value * 1e12
    parameters = [
        {"device": "cpu", "name": "effective float32 rate", "field": "peak_gflops.float32", "unit": "GFLOP/s",
         "value": cpu_fit.rate / 1e9, "efficiency": cpu_fit.rate / cpu_peak, "at_bound": list(cpu_fit.at_bound),
         "source": cpu.peak_gflops["float32"].source},
        {"device": "cpu", "name": "per-layer overhead", "field": "layer_overhead", "unit": "us",
         "value": cpu_fit.overhead_us, "at_bound": list(cpu_fit.at_bound), "source": cpu.layer_overhead.source},
        {"device": "edgetpu", "name": "effective int8 rate", "field": "peak_tops_int8", "unit": "TOP/s",
         "value": tpu_fit.rate / 1e12, "efficiency": tpu_fit.rate / tpu_peak, "at_bound": list(tpu_fit.at_bound),
         "source": tpu.peak_tops_int8.source},
        {"device": "edgetpu", "name": "per-node overhead", "field": "kernel_overhead", "unit": "us",
         "value": tpu_fit.overhead_us, "at_bound": list(tpu_fit.at_bound), "source": tpu.kernel_overhead.source},
    ]
    fields = fitted_fields(fitted, cpu_peak, tpu_peak)
    snippet, agrees = yaml_snippet(fields), file_agrees(loaded, fields)
    result = {
        "fit_on": [MODELS[m][1] for m in FIT_ON], "held_out": [MODELS[m][1] for m in HELD_OUT] + [
            f"MobileNet v2 224, USB Accelerator, {h}" for h in REFERENCE],
        "not_built": {k: {"embedded_cpu_ms": c, "dev_board_ms": t, "why": why} for k, (c, t, why) in NOT_BUILT.items()},
        "fixed_figures": {"cpu kernel_overhead us": target.host.kernel_overhead.value,
                          "cpu memory_bandwidth GB/s": target.host.memory_bandwidth.value,
                          "edgetpu on_chip_memory MB": tpu.on_chip_memory.value,
                          "dev board link": {**DEV_BOARD_LINK, "latency_us": tpu.link.latency.value},
                          "target link (USB, the reference figures)": {"MB/s": tpu.link.bandwidth.value,
                                                                        "latency_us": tpu.link.latency.value}},
        "parameters": parameters,
        "fit_residuals": {"cpu": dict(zip(FIT_ON, cpu_fit.residuals)), "edgetpu": dict(zip(FIT_ON, tpu_fit.residuals))},
        "fixed_ms_in_tpu_figures": {o.name: o.fixed_ms for o in tpu_obs},
        "consistency_fit_vs_product": consistency,
        "comparisons": comparisons, "leave_one_out": loo, "cpu_forms": forms, "models": models,
        "yaml_snippet": snippet, "target_file_holds_this_fit": agrees,
        "seconds": {"build": round(built_s, 1), "fit": round(fit_s, 3), "total": round(time.perf_counter() - t0, 1)},
    }
    _results.write("fit-arm2tpu", result, table(result), out=args.out, notes=notes(result))
    print(markdown(result))
    print("\nThe fitted figures for targets/arm_2tpu.yaml:\n\n" + snippet)
    print(f"\ntargets/arm_2tpu.yaml holds this fit: {agrees}; fit vs product predictions agree to "
          f"{consistency:.1e}; {result['seconds']['total']} s in all ({result['seconds']['build']} s building)",
          file=sys.stderr)


if __name__ == "__main__":
    main()
