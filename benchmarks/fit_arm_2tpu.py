"""Fit arm_2tpu's free cost parameters to Coral's published benchmark, then predict what was held out.

    .venv/bin/python benchmarks/fit_arm_2tpu.py [--out benchmarks/fit_arm_2tpu.json]

DESIGN §8: fit parameters on the published figures only and compare the rest with the predictions
afterwards. The model is `devices/cost.py` unchanged in form; `devices/fit.py` fits its two free
parameters per device, exactly (no iteration):

- Cortex-A53 (cpu): the effective float32 rate (at most the 24 GFLOP/s peak) and the per-op overhead,
  on Coral's Embedded CPU column. The prediction is the product's "all on the cpu" plan.
- Edge TPU: the effective int8 rate (at most the 4 TOPS peak) and the per-op overhead, on the Dev
  Board column. The prediction is the product's "Coral default" plan on a one-TPU variant of the
  target (the Dev Board has one Edge TPU: 8 MB of parameter cache, not two TPUs' 16 MB). The link
  figures stay as published; the CPU figures are the fitted ones (a CPU tail, if any, uses them).

Fitting set: MobileNet v1 224 and MobileNet v2 224 (two figures per device, two parameters: the fit is
exact when the optimum lies inside the bounds). Held out: ResNet-50 V1 299 (Embedded CPU 1763 ms, Dev
Board 56 ms), and Coral's reference single-TPU latency of MobileNet v2 on an aarch64 host (2.56 ms).
Inception v1, MobileNet v2 SSD and UNet Mv2 are in Coral's table but not in tf.keras.applications:
they are not built here.

Models: tf.keras.applications with weights=None (cost depends on shapes, not on weights), cached as
.keras under .cache/bench-fit/; each is built through the pipeline up to legalize for arm_2tpu (build
directories under .cache/bench-fit/build/, reused through the stage cache), and its Problem comes from
`stages.schedule.build_problem`, the schedule stage's own code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk")]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
CACHE = ROOT / ".cache" / "bench-fit"
SCRIPT = "benchmarks/fit_arm_2tpu.py"
CORAL = "Coral's published benchmark (coral.ai/docs/edgetpu/benchmarks, DESIGN §8)"

# name -> keras constructor, input size, Coral's row name
MODELS = {
    "MobileNet": ("MobileNet", 224, "MobileNet v1 224"),
    "MobileNetV2": ("MobileNetV2", 224, "MobileNet v2 224"),
    "ResNet50": ("ResNet50", 299, "ResNet-50 V1 299"),
}
# Coral's table (DESIGN §8), ms per inference: (Embedded CPU, Dev Board with Edge TPU)
PUBLISHED = {"MobileNet": (164.0, 2.4), "MobileNetV2": (122.0, 2.6), "ResNet50": (1763.0, 56.0)}
FIT_ON = ("MobileNet", "MobileNetV2")
HELD_OUT = ("ResNet50",)
REFERENCE = {"MobileNetV2": (2.56, "Coral's reference single-TPU latency, MobileNet v2 224 int8, aarch64 host "
                                   "(USB Accelerator; DESIGN §8)")}
NOT_BUILT = {"Inception v1 224": (392.0, 4.1), "MobileNet v2 SSD 224": (282.0, 14.0), "Unet Mv2 128": (190.7, 5.7)}


def keras_model(name: str) -> Path:
    import tensorflow as tf

    ctor, size, _ = MODELS[name]
    path = CACHE / f"{name}_{size}.keras"
    if not path.exists():
        tf.keras.utils.set_random_seed(0)
        model = getattr(tf.keras.applications, ctor)(input_shape=(size, size, 3), weights=None)
        CACHE.mkdir(parents=True, exist_ok=True)
        model.save(path)
    return path


def legalized(name: str):
    """The model after legalize for arm_2tpu, as the schedule stage reads it."""
    import onnx

    from edgesdk.pipeline import BuildOptions, build

    out = CACHE / "build" / name
    build(BuildOptions(model=keras_model(name), target="arm_2tpu", out=out, until="legalize"))
    return onnx.load(str(out / ".build" / "2-legalize" / "model.onnx"))


def one_tpu(target):
    """The target with a single Edge TPU: the Dev Board's configuration (and the reference figure's)."""
    from edgesdk.config import Target

    data = target.model_dump(mode="json")
    for dev in data["devices"]:
        if dev["kind"] == "edgetpu":
            dev["count"], dev["physical"] = 1, dev["physical"][:1]
    return Target.model_validate(data)


class Graph:
    """One legalized model's numbers: per-node flops, parameter and activation bytes, capabilities."""

    def __init__(self, name: str, model):
        from edgesdk.devices.cost import node_bytes, node_flops
        from edgesdk.ir import model as irm

        self.name, self.model = name, model
        self.shapes, self.consts = irm.static_shapes(model), irm.constant_names(model)
        g = model.graph
        # as build_problem computes them
        self.flops = [node_flops(n, self.shapes) for n in g.node]
        self.weights, self.acts = (list(x) for x in zip(*(node_bytes(n, self.shapes, self.consts) for n in g.node)))
        caps = [(irm.get_meta(n, irm.CAPABLE_KEY) or "cpu/onnxruntime").split(",") for n in g.node]
        self.tpu_weights = sum(w for w, c in zip(self.weights, caps) if "edgetpu" in c)
        self.ops = {}
        for n in g.node:
            self.ops[n.op_type] = self.ops.get(n.op_type, 0) + 1
        self.tpu_capable = sum("edgetpu" in c for c in caps)

    def problem(self, target):
        from edgesdk.stages.schedule import build_problem

        return build_problem(self.model, target, self.shapes, self.consts)[0]

    def nodes(self, indices) -> list[tuple[float, int, int]]:
        return [(self.flops[i], self.weights[i], self.acts[i]) for i in indices]

    # --- the two published figures, predicted through the product's plans and segment costs --------

    def cpu_ms(self, target) -> float:
        from edgesdk.scheduling import baselines, placement

        p = self.problem(target)
        return sum(placement.segment_ms(p, *s) for s in baselines.all_cpu(p))

    def tpu_ms(self, target) -> float:
        from edgesdk.scheduling import baselines, placement

        p = self.problem(one_tpu(target))
        return sum(placement.segment_ms(p, *s) for s in baselines.coral_default(p))

    def dp_ms(self, target) -> float:
        from edgesdk.scheduling import placement

        return placement.place(self.problem(target)).cost_ms

    # --- the same figures as observations of devices/fit.py ----------------------------------------

    def cpu_observation(self, target, measured: float):
        from edgesdk.devices import fit
        from edgesdk.scheduling import baselines

        p = self.problem(target)
        (start, stop, _), = baselines.all_cpu(p)
        return fit.observation(target, "cpu", self.name, measured, self.nodes(range(start, stop)),
                               fixed_ms=p.overhead_ms.get("cpu", 0.0))

    def tpu_observation(self, target, measured: float):
        """The TPU prefix's nodes are the fitted terms; its link transfers and any CPU tail (at the
        target's CPU figures) are fixed."""
        from edgesdk.devices import cost, fit
        from edgesdk.scheduling import baselines, placement

        one = one_tpu(target)
        p = self.problem(one)
        fixed, nodes = 0.0, []
        for start, stop, device in baselines.coral_default(p):
            seg = placement.segment_ms(p, start, stop, device)
            if device == "cpu":
                fixed += seg
            else:
                fixed += seg - sum(p.cost[k][device] for k in range(start, stop))  # link and invocation
                nodes += list(range(start, stop))
        return fit.observation(one, "edgetpu", self.name, measured, self.nodes(nodes), fixed_ms=fixed,
                               streamed_fraction=cost.streamed_fraction(one, self.tpu_weights))


def breakdown(graph: Graph, fitted, column: str) -> dict:
    """Where a fitted prediction's milliseconds go: the fitted terms (compute, per-op overhead) and the
    published ones (weights streamed over the link, transfers of the segment's inputs and outputs)."""
    from edgesdk.devices import cost, fit

    if column == "Embedded CPU":
        ob = graph.cpu_observation(fitted, 1.0)
        x, o = fit.target_parameters(fitted, "cpu")
        memory = sum(m for f, m in zip(ob.flops, ob.floor_ms) if f * x < m)
        return {"compute_ms": sum(f * x for f, m in zip(ob.flops, ob.floor_ms) if f * x >= m),
                "memory_bound_ms": memory, "overhead_ms": ob.ops * o, "other_ms": ob.fixed_ms}
    one = one_tpu(fitted)
    ob = graph.tpu_observation(fitted, 1.0)
    x, o = fit.target_parameters(one, "edgetpu")
    tpu = next(d for d in one.devices if d.kind == "edgetpu")
    share = cost.streamed_fraction(one, graph.tpu_weights)
    streamed = 1e3 * share * graph.tpu_weights / 4 / (tpu.link.bandwidth.value * 1e6)
    return {"compute_ms": sum(f * x for f in ob.flops), "overhead_ms": ob.ops * o, "streamed_share": share,
            "streamed_weights_ms": streamed, "link_io_and_cpu_ms": ob.fixed_ms - streamed}


def fit_target(graphs: dict[str, Graph], target):
    from edgesdk.devices import fit

    cpu_obs = [graphs[m].cpu_observation(target, PUBLISHED[m][0]) for m in FIT_ON]
    cpu_fit = fit.fit_roofline("cpu", cpu_obs, max_rate=target.host.peak_gflops["float32"].value * 1e9)
    peak_cpu = target.host.peak_gflops["float32"]
    cpu_source = (f"fitted to {CORAL}: MobileNet v1 224 and v2 224, Embedded CPU column (164, 122 ms); "
                  f"({SCRIPT})")
    with_cpu = fit.refit_target(target, "cpu", cpu_fit, cpu_source)
    # the TPU figures see the fitted CPU: a CPU tail of the Coral default plan runs at those figures
    tpu_obs = [graphs[m].tpu_observation(with_cpu, PUBLISHED[m][1]) for m in FIT_ON]
    tpu = next(d for d in target.devices if d.kind == "edgetpu")
    tpu_fit = fit.fit_roofline("edgetpu", tpu_obs, max_rate=tpu.peak_tops_int8.value * 1e12)
    tpu_source = (f"fitted to {CORAL}: MobileNet v1 224 and v2 224, Dev Board with Edge TPU column (2.4, 2.6 ms), "
                  f"USB link figures as published; ({SCRIPT})")
    fitted = fit.refit_target(with_cpu, "edgetpu", tpu_fit, tpu_source)
    return fitted, (cpu_fit, cpu_obs, peak_cpu.value * 1e9), (tpu_fit, tpu_obs, tpu.peak_tops_int8.value * 1e12)


def check_consistent(fit_result, observations) -> float:
    """The fit's own model and the product's plans agree (else the fit fitted something else)."""
    worst = 0.0
    for ob, product in observations:
        mine = ob.predict_ms(fit_result.ms_per_flop, fit_result.overhead_ms)
        worst = max(worst, abs(mine - product) / product)
    if worst > 1e-9:
        raise SystemExit(f"fit: the fit's model and the product's prediction differ by {worst:.2e} (relative)")
    return worst


def yaml_snippet(fitted, cpu_fit, cpu_peak: float, tpu_fit, tpu_peak: float) -> str:
    cpu, tpu = fitted.host, next(d for d in fitted.devices if d.kind == "edgetpu")
    q = lambda v: float(f"{v:.4g}")  # noqa: E731 - four significant digits in the file
    return f"""  # devices[0] (cpu): replaces peak_gflops.float32 and kernel_overhead
    peak_gflops:
      float32:
        value: {q(cpu_fit.rate / 1e9)}
        unit: GFLOP/s
        source: "effective rate, {cpu_fit.rate / cpu_peak:.1%} of the TRM peak of {cpu_peak / 1e9:g} GFLOP/s (4 flop/cycle x 4 cores x 1.5 GHz); {cpu.kernel_overhead.source}"
    kernel_overhead:
      value: {q(cpu_fit.overhead_us)}
      unit: us
      source: "{cpu.kernel_overhead.source}"
  # devices[1] (edgetpu): replaces peak_tops_int8 and kernel_overhead
    peak_tops_int8:
      value: {q(tpu_fit.rate / 1e12)}
      unit: TOP/s
      source: "effective rate, {tpu_fit.rate / tpu_peak:.1%} of the datasheet's {tpu_peak / 1e12:g} TOPS int8; {tpu.kernel_overhead.source}"
    kernel_overhead:
      value: {q(tpu_fit.overhead_us)}
      unit: us
      source: "{tpu.kernel_overhead.source}\""""


def markdown(result: dict) -> str:
    out = ["| device | parameter | published / estimate | fitted | bound hit |", "|---|---|---|---|---|"]
    for p in result["parameters"]:
        out.append(f"| {p['device']} | {p['name']} | {p['before']:g} {p['unit']} | {p['value']:.4g} {p['unit']} | "
                   f"{', '.join(p['at_bound']) or 'none'} |")
    out += ["", "| model | set | column | published ms | unfitted ms | error | fitted ms | error |",
            "|---|---|---|---|---|---|---|---|"]
    for r in result["comparisons"]:
        out.append(f"| {r['model']} | {r['set']} | {r['column']} | {r['published_ms']:g} | {r['unfitted_ms']:.2f} | "
                   f"{r['unfitted_error']:+.1%} | {r['fitted_ms']:.2f} | {r['fitted_error']:+.1%} |")
    for name, (c, t) in NOT_BUILT.items():
        out.append(f"| {name} | not built (not in tf.keras.applications) | | {c:g} / {t:g} | | | | |")
    out += ["", "Where the fitted milliseconds go (ms):", "",
            "| model | column | compute | memory-bound | per-op overhead | weights streamed over USB | link I/O |",
            "|---|---|---|---|---|---|---|"]
    for r in result["comparisons"]:
        b = r.get("fitted_breakdown")
        if b:
            out.append(f"| {r['model']} | {r['column']} | {b['compute_ms']:.2f} | {b.get('memory_bound_ms', 0):.2f} | "
                       f"{b['overhead_ms']:.2f} | {b.get('streamed_weights_ms', 0):.2f} | "
                       f"{b.get('link_io_and_cpu_ms', b.get('other_ms', 0)):.2f} |")
    out += ["", "| model | nodes (TPU-capable) | GFLOP | params M | DP latency on arm_2tpu, unfitted ms | fitted ms |",
            "|---|---|---|---|---|---|"]
    for m in result["models"]:
        out.append(f"| {m['model']} | {m['nodes']} ({m['tpu_capable']}) | {m['gflop']:.2f} | {m['params_m']:.2f} | "
                   f"{m['dp_unfitted_ms']:.2f} | {m['dp_fitted_ms']:.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "fit_arm_2tpu.json")
    args = ap.parse_args()
    from edgesdk.config import load_target

    t0 = time.perf_counter()
    target, _ = load_target("arm_2tpu")
    graphs = {}
    for name in MODELS:
        print(f"fit: building {name} up to legalize ...", file=sys.stderr, flush=True)
        graphs[name] = Graph(name, legalized(name))
    built_s = time.perf_counter() - t0

    t1 = time.perf_counter()
    fitted, (cpu_fit, cpu_obs, cpu_peak), (tpu_fit, tpu_obs, tpu_peak) = fit_target(graphs, target)
    fit_s = time.perf_counter() - t1
    consistency = max(
        check_consistent(cpu_fit, [(o, graphs[o.name].cpu_ms(fitted)) for o in cpu_obs]),
        # the TPU observations were made with the fitted CPU already in place
        check_consistent(tpu_fit, [(o, graphs[o.name].tpu_ms(fitted)) for o in tpu_obs]))

    comparisons = []
    for name, g in graphs.items():
        for column, published, predict in (("Embedded CPU", PUBLISHED[name][0], g.cpu_ms),
                                           ("Dev Board with Edge TPU", PUBLISHED[name][1], g.tpu_ms)):
            before, after = predict(target), predict(fitted)
            comparisons.append({"model": MODELS[name][2], "set": "fit" if name in FIT_ON else "held out",
                                "column": column, "published_ms": published,
                                "unfitted_ms": before, "unfitted_error": before / published - 1,
                                "fitted_ms": after, "fitted_error": after / published - 1,
                                "fitted_breakdown": breakdown(g, fitted, column)})
        if name in REFERENCE:
            published, what = REFERENCE[name]
            before, after = g.tpu_ms(target), g.tpu_ms(fitted)
            comparisons.append({"model": MODELS[name][2], "set": "held out (reference)", "column": what,
                                "published_ms": published, "unfitted_ms": before, "unfitted_error": before / published - 1,
                                "fitted_ms": after, "fitted_error": after / published - 1})
    models = [{"model": MODELS[n][2], "keras": MODELS[n][0], "input": MODELS[n][1], "nodes": len(g.flops),
               "tpu_capable": g.tpu_capable, "gflop": sum(g.flops) / 1e9, "params_m": sum(g.weights) / 4e6,
               "op_types": dict(sorted(g.ops.items())),
               "dp_unfitted_ms": g.dp_ms(target), "dp_fitted_ms": g.dp_ms(fitted)} for n, g in graphs.items()]
    cpu_dev, tpu_dev = target.host, next(d for d in target.devices if d.kind == "edgetpu")
    fcpu, ftpu = fitted.host, next(d for d in fitted.devices if d.kind == "edgetpu")
    parameters = [
        {"device": "cpu", "name": "effective float32 rate", "field": "peak_gflops.float32", "unit": "GFLOP/s",
         "before": cpu_dev.peak_gflops["float32"].value, "value": cpu_fit.rate / 1e9,
         "efficiency": cpu_fit.rate / cpu_peak, "at_bound": list(cpu_fit.at_bound),
         "source": fcpu.peak_gflops["float32"].source},
        {"device": "cpu", "name": "per-op overhead", "field": "kernel_overhead", "unit": "us",
         "before": cpu_dev.kernel_overhead.value, "value": cpu_fit.overhead_us, "at_bound": list(cpu_fit.at_bound),
         "source": fcpu.kernel_overhead.source},
        {"device": "edgetpu", "name": "effective int8 rate", "field": "peak_tops_int8", "unit": "TOP/s",
         "before": tpu_dev.peak_tops_int8.value, "value": tpu_fit.rate / 1e12,
         "efficiency": tpu_fit.rate / tpu_peak, "at_bound": list(tpu_fit.at_bound),
         "source": ftpu.peak_tops_int8.source},
        {"device": "edgetpu", "name": "per-op overhead", "field": "kernel_overhead", "unit": "us",
         "before": tpu_dev.kernel_overhead.value, "value": tpu_fit.overhead_us, "at_bound": list(tpu_fit.at_bound),
         "source": ftpu.kernel_overhead.source},
    ]
    snippet = yaml_snippet(fitted, cpu_fit, cpu_peak, tpu_fit, tpu_peak)
    result = {
        "fit_on": [MODELS[m][2] for m in FIT_ON], "held_out": [MODELS[m][2] for m in HELD_OUT],
        "not_built": {k: {"embedded_cpu_ms": c, "dev_board_ms": t, "why": "not in tf.keras.applications"}
                      for k, (c, t) in NOT_BUILT.items()},
        "parameters": parameters,
        "exact": {"cpu": cpu_fit.exact, "edgetpu": tpu_fit.exact},
        "fit_residuals": {"cpu": dict(zip(FIT_ON, cpu_fit.residuals)), "edgetpu": dict(zip(FIT_ON, tpu_fit.residuals))},
        "fixed_ms_in_tpu_figures": {o.name: o.fixed_ms for o in tpu_obs},
        "consistency_fit_vs_product": consistency,
        "comparisons": comparisons, "models": models, "yaml_snippet": snippet,
        "seconds": {"build": round(built_s, 1), "fit": round(fit_s, 3), "total": round(time.perf_counter() - t0, 1)},
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    print("\nYAML for targets/arm_2tpu.yaml (the lead decides):\n\n" + snippet)
    print(f"\nfit exact: cpu {cpu_fit.exact}, edgetpu {tpu_fit.exact}; fit vs product predictions agree to "
          f"{consistency:.1e}; {result['seconds']['total']} s in all ({result['seconds']['build']} s building)",
          file=sys.stderr)


if __name__ == "__main__":
    main()
