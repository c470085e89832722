"""legalize: make the graph fit the target's accelerators, then say which devices can run every node.

Needs: the imported model (static shapes); calibration data (`--calib`), or the synthetic samples
the compress stage also uses.
Guarantees: `model.onnx` whose every node carries `edgesdk.capable` (device kinds, most preferred
first, and the CPU backend: `cpu/tvm` or `cpu/onnxruntime`); `legalize.json` with every refusal
(device, reason code, sentence), every rewrite and every approximation. A node that no device can
run fails the build, all such nodes listed in one error.

Steps, each only where an accelerator of the target refuses something (the support tables decide,
`legalization.support`):
1. exact rewrites (`legalization.exact`) of the op types an accelerator refuses: zero error, or the
   float rounding each rule states;
2. ReLU-sum approximations (`legalization.relu_sum`) of the unary functions an accelerator lacks,
   each whole unary region from its input (`legalization.regions`), fitted on the range the
   calibration data shows, within `legalize.max_abs_error` of the target (or `--max-abs-error`).
   A function that cannot meet the bound fails the build naming its nodes, or with
   `--allow-cpu-fallback` stays as it was (on the CPU);
3. the graph optimizations of the import stage (`edgesdk.passes`), on the rewritten graph.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import onnx

from ... import passes
from ...backends import onnxruntime as ort_backend
from ...devices import registry
from ...errors import UserError
from ...ir import model as irm
from ...ir.calibration import load_calibration
from ...ir.digest import tree_sha256
from ...legalization import exact, regions, relu_sum, support

OPTIONS = ("max_abs_error", "allow_cpu_fallback", "legalize_rewrites", "calib", "calib_samples", "calib_preprocess", "seed")
READS = ("import",)  # the earlier stages whose outputs it reads (its cache key covers them)

RULES = {r.name: r for r in exact.RULES}
E2E_SAMPLES = 8  # calibration inputs the end-to-end deviations are measured on
# a device model's `rewrite_triggers` maps its rank refusal codes to the pseudo op exact.RANK; what makes
# a rule that removes no op type worth running is on the rule (ExactRule.triggers)
TRIGGERS = {r.name: set(r.triggers) for r in exact.RULES if r.triggers}



def cache_inputs(options, target) -> dict:
    return {"calib_sha256": tree_sha256(Path(options.calib)) if options.calib else None}


def run(artifact: Path, ctx) -> dict:
    model = onnx.load(str(artifact / "model.onnx"))
    io = json.loads((artifact / "import.json").read_text())
    result = legalize(model, ctx, io["inputs"])
    model, nodes = result.pop("model"), result.pop("support")
    refusals, impossible, counts = [], [], collections.Counter()
    for node, s in zip(model.graph.node, nodes):
        refusals += [{"node": s.name, "op": s.op, **r} for r in s.refusals]
        if not s.capable:
            impossible.append(f"node '{s.name}' ({s.op}): no device of target '{ctx.target.name}' can run it")
        irm.set_meta(node, irm.CAPABLE_KEY, ",".join(s.capable))
        counts[s.capable[0] if s.capable else "none"] += 1
    if impossible:
        raise UserError("legalize.unsupported-op", f"{len(impossible)} node(s) cannot run on any device of the target",
                        "replace these ops before export, or choose a target whose devices support them",
                        notes=impossible)

    irm.save(model, ctx.out / "model.onnx")
    after = result["after"]
    report = {**result, "refusals": refusals}
    (ctx.out / "legalize.json").write_text(json.dumps(report, indent=2, default=float) + "\n")
    by_reason = collections.Counter((r["device"], r["op"], r["code"]) for r in refusals)
    for (dev, op, code), n in sorted(by_reason.items()):
        ctx.log(f"legalize: {n} x {op} cannot run on {dev} ({code})")
    return {"preferred_device": dict(counts), "refusals": len(refusals),
            "refused_ops": {f"{d}:{op}": n for (d, op, _), n in sorted(by_reason.items())},
            "before": result["before"], "after": after, "rewrites": result["rewrites"],
            "approximations": result["approximations"], "fallbacks": result["fallbacks"],
            "max_abs_error": result["max_abs_error"], "end_to_end": result["end_to_end"],
            "optimized": result["optimized"]}


def analyze(model: onnx.ModelProto, ctx, inputs: list[dict]) -> dict:
    """`edgesdk check`: everything legalize would do and what it would leave, on a copy."""
    result = legalize(_copy(model), ctx, inputs)
    del result["model"], result["support"]
    return result


def legalize(model: onnx.ModelProto, ctx, inputs: list[dict]) -> dict:
    """The rewritten model, what was done to it, and its final support: `support` (per node) and
    `after` (coverage and transitions)."""
    tables = support.Tables([d.kind for d in ctx.target.devices])
    result = _rewrite(model, ctx, inputs, tables)
    result["support"] = tables.model(result["model"])
    result["after"] = support.summarize(result["model"], result["support"])
    return result


def _rewrite(model: onnx.ModelProto, ctx, inputs: list[dict], tables: support.Tables) -> dict:
    kinds = tables.kinds
    original = model
    nodes = tables.model(model)
    before = support.summarize(model, nodes)
    eps = ctx.options.max_abs_error or ctx.target.legalize.max_abs_error
    result = {"model": model, "before": before, "nodes": [_node_json(n) for n in nodes], "rewrites": {},
              "approximations": [], "fallbacks": [], "max_abs_error": eps, "end_to_end": None, "optimized": None}
    models = registry.accelerators(kinds)
    accelerators = [m.kind for m in models]
    if not accelerators or not ctx.options.legalize_rewrites:
        return result
    triggers = {code: trigger for m in models for code, trigger in m.rewrite_triggers.items()}
    # refusals an approximation can cure: the op itself is missing (not a shape or type limit)
    approximable = frozenset(code for m in models for code in m.approximable)

    # 1. exact rewrites of the op types an accelerator refuses
    refused_ops = {n.op for n in nodes for r in n.refusals if r["device"] in accelerators}
    refused_ops |= {triggers[r["code"]] for n in nodes for r in n.refusals if r["code"] in triggers}
    chosen = [r.name for r in exact.RULES if (set(r.replaces) or set(r.triggers)) & refused_ops]
    if chosen:
        model, counts = exact.apply(model, only=chosen)
        onnx.checker.check_model(model)  # a rule that breaks the graph is a bug, not the user's problem
        model = _infer(model)
        result["rewrites"] = {name: {"count": n, "exactness": RULES[name].exactness}
                              for name, n in counts.items() if n}
        if not result["rewrites"]:
            model = original
        for name, r in result["rewrites"].items():
            ctx.log(f"legalize: {name} x{r['count']} ({r['exactness']})")

    # 2. ReLU-sum approximations of the unary functions an accelerator lacks
    nodes = tables.model(model)
    refused = {n.name for n in nodes for r in n.refusals if r["device"] in accelerators and r["code"] in approximable}
    found = regions.find(model, refused) if refused else []
    feeds = []
    if found:
        feeds, calib = load_calibration(ctx.options, inputs)
        result["calibration"] = calib
        ranges = _ranges(model, feeds, sorted({r.input for r in found}))
        fitted, failures = [], []
        for region in found:
            lo, hi = ranges[region.input]
            f = region.function(model)
            ops = [model.graph.node[j].op_type for j in region.nodes]
            entry = {"output": region.output, "input": region.input, "nodes": list(region.refused), "ops": ops,
                     "range": [lo, hi], "range_from": "calibration data" if ctx.options.calib else
                     "synthetic calibration samples (uniform(-1, 1) inputs)"}
            try:
                approx = relu_sum.fit(f, lo, hi, eps)
            except relu_sum.ApproximationError as e:
                failures.append((region, entry, str(e)))
                continue
            entry.update(approx.to_json())
            fitted.append((region, approx, f, entry))
        if failures and not ctx.options.allow_cpu_fallback:
            raise UserError("legalize.approximation-bound",
                            f"{len(failures)} function(s) cannot be approximated within {eps:g} on their range",
                            "raise legalize.max_abs_error in the target (or --max-abs-error), or keep them on the "
                            "CPU with --allow-cpu-fallback",
                            notes=[f"{', '.join(r.refused)} ({' -> '.join(e['ops'])}) on [{e['range'][0]:.4g}, "
                                   f"{e['range'][1]:.4g}]: {why}" for r, e, why in failures])
        for region, entry, why in failures:
            result["fallbacks"].append({**entry, "reason": why})
            ctx.warn(f"{', '.join(region.refused)}: kept on the CPU ({why})")
        if fitted and any(m.int8 for m in models):  # an int8 device: the error after int8 too
            for (_, _, _, entry), err in zip(fitted, relu_sum.int8_errors([(a, f) for _, a, f, _ in fitted])):
                entry["int8_error"] = err
        if fitted:
            # each approximation alone: how far it moves the model's outputs on calibration inputs
            sample = feeds[:E2E_SAMPLES]
            exact_outputs = ort_backend.run_many(model, sample)
            for k, (region, approx, _, entry) in enumerate(fitted):
                single = _copy(model)
                _approximate(single, region, approx, k)
                entry["end_to_end"] = _deviation_of(exact_outputs, ort_backend.run_many(single, sample))
            model = _copy(model)
            # the last exit first: earlier exits rename their consumers, the later approximations included
            for k, (region, approx, _, entry) in enumerate(sorted(fitted, key=lambda t: -max(t[0].nodes))):
                _approximate(model, region, approx, k)
        result["approximations"] = [entry for *_, entry in fitted]
        for e in result["approximations"]:
            ctx.log(f"legalize: {', '.join(e['nodes'])} ({' -> '.join(e['ops'])}) ~ {len(e['knots'])} ReLUs on "
                    f"[{e['range'][0]:.3g}, {e['range'][1]:.3g}], max error {e['grid_error']:.2e}"
                    + (f", after int8 {e['int8_error']:.2e}" if "int8_error" in e else ""))

    # 3. the import stage's graph optimizations, on what the rewrites left
    if chosen or result["approximations"]:
        model, optimized = passes.optimize(model)
        result["optimized"] = {k: v for k, v in optimized["rules"].items() if v}
        model = _infer(model)
        if result["approximations"] or any(r["exactness"] != "exact" for r in result["rewrites"].values()):
            feeds = feeds or load_calibration(ctx.options, inputs)[0]
            result["end_to_end"] = _deviation(original, model, feeds[:E2E_SAMPLES])
    result["model"] = model
    return result


def _approximate(model: onnx.ModelProto, region: regions.Region, approx: relu_sum.Approximation, k: int) -> None:
    """Put approximation number `k` in place of `region`'s exit, in `model`."""
    new_output = f"{region.output}__relu_sum"
    new_nodes, inits = relu_sum.to_onnx(approx, region.input, new_output, f"relu_sum{k}_")
    regions.replace(model, region, new_nodes, inits, new_output)


def _node_json(n: support.NodeSupport) -> dict:
    return {"node": n.name, "op": n.op, "devices": n.capable, "refusals": n.refusals, "flops": n.flops}


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    return m


def _infer(model: onnx.ModelProto) -> onnx.ModelProto:
    del model.graph.value_info[:]
    return irm.infer_shapes(model)


def _ranges(model: onnx.ModelProto, feeds: list[dict], names: list[str]) -> dict[str, tuple[float, float]]:
    """Min and max of each named tensor over the calibration feeds (a constant tensor gets +-1 around it)."""
    lo = {n: np.inf for n in names}
    hi = {n: -np.inf for n in names}
    for values in ort_backend.run_many(model, feeds, names):
        for n in names:
            lo[n] = min(lo[n], float(np.min(values[n])))
            hi[n] = max(hi[n], float(np.max(values[n])))
    return {n: (lo[n], hi[n]) if hi[n] > lo[n] else (lo[n] - 1.0, hi[n] + 1.0) for n in names}


def _deviation(a: onnx.ModelProto, b: onnx.ModelProto, feeds: list[dict]) -> dict:
    """How far the legalized model's outputs move, on calibration inputs."""
    return _deviation_of(ort_backend.run_many(a, feeds), ort_backend.run_many(b, feeds))


def _deviation_of(reference: list[dict], other: list[dict]) -> dict:
    """Max abs difference over all outputs and samples, and the same relative to each output's range."""
    worst_abs, worst_rel = 0.0, 0.0
    for ra, rb in zip(reference, other):
        for name, va in ra.items():
            d = float(np.max(np.abs(va.astype(np.float64) - rb[name].astype(np.float64))))
            worst_abs = max(worst_abs, d)
            worst_rel = max(worst_rel, d / max(float(np.ptp(va)), 1e-12))
    return {"samples": len(reference), "max_abs_error": worst_abs, "max_error_of_range": worst_rel}
