"""Legalization of a whole model for a target: the rewrites its accelerators need (exact rules, then
ReLU-sum approximations, then the graph optimizations again), and which devices can run each node after.

`legalize` is what the legalize stage runs; `analyze` is the same on a copy, for `edgesdk check`.
`options` is any object with the attributes read here and by `ir.calibration.load_calibration`:
max_abs_error, legalize_rewrites, allow_cpu_fallback, calib, calib_samples, calib_preprocess, seed.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import numpy as np
import onnx

from .. import passes
from ..backends import onnxruntime as ort_backend
from ..config import Target
from ..devices import registry
from ..devices.model import DeviceModel
from ..errors import UserError
from ..ir import model as irm
from ..ir.calibration import load_calibration
from . import exact, regions, relu_sum, support

RULES = {r.name: r for r in exact.RULES}
E2E_SAMPLES = 8  # calibration inputs the end-to-end deviations are measured on
# How far one approximation may move a model output, as a share of that output's range on the calibration
# inputs: above WARN_SHARE the build and `check` warn; above REFUSE_SHARE the build stops where its plan
# uses the approximation (`refuse_moved_outputs`). Measured on PP-OCRv4's recognizer for arm_2tpu (its
# LayerNorms' square roots, docs/legalize.md "How far an approximation moves the outputs"): 1.5-5.2 % each
# on its real calibration lines, up to 10.7 % on held-out lines while 99.4 % of its per-column best
# characters stay; held-out inputs move further than calibration ones, hence the refusal's margin.
WARN_SHARE = 0.01
REFUSE_SHARE = 0.10
# a device model's `rewrite_triggers` maps its rank refusal codes to the pseudo op exact.RANK; what makes
# a rule that removes no op type worth running is on the rule (ExactRule.triggers)
TRIGGERS = {r.name: set(r.triggers) for r in exact.RULES if r.triggers}

Log = Callable[[str], None]
# a fitted region: the region, its approximation, the function it approximates, its report entry
Fitted = tuple[regions.Region, relu_sum.Approximation, Any, dict]


def _quiet(message: str) -> None:
    pass


def legalize(model: onnx.ModelProto, target: Target, options: Any, inputs: list[dict], *,
             log: Log = _quiet, warn: Log = _quiet) -> dict:
    """The legalized model (`model`, each node marked `edgesdk.capable`), its support (`support`), the
    report (`legalize.json`: what was done, `before`/`after`, every refusal) and the nodes each device
    is preferred for (`preferred_device`). Nodes no device can run fail, all listed in one error."""
    result = _legalized(model, target, options, inputs, log, warn)
    refusals, impossible, counts = [], [], collections.Counter()
    for node, s in zip(result["model"].graph.node, result["support"]):
        refusals += [{"node": s.name, "op": s.op, **r} for r in s.refusals]
        if not s.capable:
            impossible.append(f"node '{s.name}' ({s.op}): no device of target '{target.name}' can run it")
        irm.set_meta(node, irm.CAPABLE_KEY, ",".join(s.capable))
        counts[s.capable[0] if s.capable else "none"] += 1
    if impossible:
        raise UserError("legalize.unsupported-op", f"{len(impossible)} node(s) cannot run on any device of the target",
                        "replace these ops before export, or choose a target whose devices support them",
                        notes=impossible)
    result["refusals"] = refusals
    result["preferred_device"] = dict(counts)
    return result


def annotated(model: onnx.ModelProto, target: Target) -> onnx.ModelProto:
    """A copy of `model` as it is, nothing rewritten, each node marked `edgesdk.capable` with the
    devices of `target` that run it (none: left unmarked, the CPU's onnxruntime): what a vendor's
    compiler alone gets to work with, for the schedule's baselines."""
    copy = irm.constants_first(_copy(model))
    for node, s in zip(copy.graph.node, support.Tables([d.kind for d in target.devices]).model(copy)):
        if s.capable:
            irm.set_meta(node, irm.CAPABLE_KEY, ",".join(s.capable))
    return copy


def analyze(model: onnx.ModelProto, target: Target, options: Any, inputs: list[dict], *,
            log: Log = _quiet, warn: Log = _quiet) -> dict:
    """`edgesdk check`: everything legalize would do and what it would leave, on a copy."""
    result = _legalized(_copy(model), target, options, inputs, log, warn)
    del result["model"], result["support"]
    result.pop("exact_model", None)
    return result


def _legalized(model: onnx.ModelProto, target: Target, options: Any, inputs: list[dict], log: Log,
               warn: Log) -> dict:
    """The rewritten model, what was done to it, and its final support: `support` (per node) and
    `after` (coverage and transitions)."""
    tables = support.Tables([d.kind for d in target.devices])
    result = _rewrite(model, target, options, inputs, tables, log, warn)
    result["model"] = irm.constants_first(result["model"])  # the host's constants before the rest
    result["support"] = tables.model(result["model"])
    result["after"] = support.summarize(result["model"], result["support"])
    return result


def _rewrite(model: onnx.ModelProto, target: Target, options: Any, inputs: list[dict], tables: support.Tables,
             log: Log, warn: Log) -> dict:
    """The rewritten model and the report of what was done, each step only where an accelerator refuses."""
    original = model
    nodes = tables.model(model)
    eps = options.max_abs_error or target.legalize.max_abs_error
    result = {"model": model, "before": support.summarize(model, nodes), "nodes": [_node_json(n) for n in nodes],
              "rewrites": {}, "approximations": [], "fallbacks": [], "max_abs_error": eps, "end_to_end": None,
              "optimized": None}
    models = registry.accelerators(tables.kinds)
    if not models or not options.legalize_rewrites:
        return result
    # 1. exact rewrites of the op types an accelerator refuses
    model, chosen, result["rewrites"] = _exact_rewrites(model, nodes, models, log)
    # 2. ReLU-sum approximations of the unary functions an accelerator lacks, on their calibration ranges
    exact_model = model
    model, feeds, approximated = _approximations(model, tables.model(model), models, options, inputs, eps, log, warn)
    result.update(approximated)
    if result["approximations"]:   # what `with_approximations` rebuilds a subset of them on
        result["exact_model"] = exact_model
    # 3. the import stage's graph optimizations, on what the rewrites left; how far the outputs moved
    if chosen or result["approximations"]:
        model, result["optimized"], result["end_to_end"] = _optimize(
            original, model, feeds, result["rewrites"], result["approximations"], options, inputs)
        together = result["end_to_end"]
        # each approximation alone was judged above; several can add up to more than any of them alone
        alone = [e["end_to_end"]["max_error_of_range"] for e in result["approximations"]]
        if together and len(alone) > 1 and together["max_error_of_range"] > max(WARN_SHARE, *alone):
            warn(f"the {len(result['approximations'])} approximations together move output '{together['output']}' by "
                 f"{together['outputs'][together['output']]['max_abs_error']:.3g}, "
                 f"{together['max_error_of_range']:.1%} of its range on {together['samples']} calibration sample(s) "
                 f"(more than {WARN_SHARE:.0%})")
    result["model"] = model
    return result


def _exact_rewrites(model: onnx.ModelProto, nodes: list[support.NodeSupport], models: list[DeviceModel],
                    log: Log) -> tuple[onnx.ModelProto, list[str], dict]:
    """Step 1: the exact rules an accelerator's refusals call for, applied: the model, rules chosen, rewrites."""
    accelerators = [m.kind for m in models]
    triggers = {code: trigger for m in models for code, trigger in m.rewrite_triggers.items()}
    # (a constant's refusal is no op type's: no rewrite cures it)
    refused_ops = {n.op for n in nodes for r in n.refusals if r["device"] in accelerators and r["code"] != support.CONSTANT}
    refused_ops |= {triggers[r["code"]] for n in nodes for r in n.refusals if r["code"] in triggers}
    chosen = [r.name for r in exact.RULES if (set(r.replaces) or set(r.triggers)) & refused_ops]
    if not chosen:
        return model, chosen, {}
    original = model
    model, counts = exact.apply(model, only=chosen)
    irm.check(model)  # a rule that breaks the graph is a bug, not the user's problem
    model = _infer(model)
    rewrites = {name: {"count": n, "exactness": RULES[name].exactness} for name, n in counts.items() if n}
    if not rewrites:
        model = original
    for name, r in rewrites.items():
        log(f"legalize: {name} x{r['count']} ({r['exactness']})")
    return model, chosen, rewrites


def _approximations(model: onnx.ModelProto, nodes: list[support.NodeSupport], models: list[DeviceModel],
                    options: Any, inputs: list[dict], eps: float, log: Log,
                    warn: Log) -> tuple[onnx.ModelProto, list[dict], dict]:
    """Step 2: ReLU sums in place of the refused unary regions: the model, calibration feeds, report keys."""
    accelerators = [m.kind for m in models]
    # refusals an approximation can cure: the op itself is missing (not a shape or type limit)
    approximable = frozenset(code for m in models for code in m.approximable)
    refused = {n.name for n in nodes for r in n.refusals if r["device"] in accelerators and r["code"] in approximable}
    found = regions.find(model, refused) if refused else []
    if not found:
        return model, [], {}
    feeds, calib = load_calibration(options, inputs)
    ranges = _ranges(model, feeds, sorted({r.input for r in found}))
    fitted, fallbacks = _fit(model, found, ranges, eps, options, warn)
    if fitted:
        model = _substitute(model, fitted, feeds[:E2E_SAMPLES], int8=any(m.int8 for m in models))
    approximations = [entry for *_, entry in fitted]
    for e in approximations:
        log(f"legalize: {', '.join(e['nodes'])} ({' -> '.join(e['ops'])}) ~ {len(e['knots'])} ReLUs on "
            f"[{e['range'][0]:.3g}, {e['range'][1]:.3g}], max error {e['grid_error']:.2e}"
            + (f", after int8 {e['int8_error']:.2e}" if "int8_error" in e else ""))
        e["verdict"] = _verdict(e["end_to_end"]["max_error_of_range"])
        if e["verdict"] != "ok":
            warn(_moved(e) + (f" (more than {WARN_SHARE:.0%}): a tighter legalize.max_abs_error, --max-abs-error or "
                              "--max-error-lsb keeps it closer" if e["verdict"] == "warning" else
                              f", more than {REFUSE_SHARE:.0%}: the build stops unless its plan leaves these nodes "
                              "exact (--no-rewrites, or a tighter legalize.max_abs_error, --max-abs-error or "
                              "--max-error-lsb)"))
    return model, feeds, {"approximations": approximations, "fallbacks": fallbacks, "calibration": calib,
                          "output_shares": {"warning": WARN_SHARE, "refused": REFUSE_SHARE}}


def _verdict(share: float) -> str:
    """What an approximation that moves an output by `share` of its range gets: ok, warning or refuse."""
    return "refuse" if share > REFUSE_SHARE else "warning" if share > WARN_SHARE else "ok"


def _moved(e: dict) -> str:
    """The approximation of report entry `e` and how far it moves the output it moves most."""
    d = e["end_to_end"]
    return (f"the approximation of {', '.join(e['nodes'])} ({' -> '.join(e['ops'])}) moves output '{d['output']}' "
            f"by {d['outputs'][d['output']]['max_abs_error']:.3g}, {d['max_error_of_range']:.1%} of its range on "
            f"{d['samples']} calibration sample(s)")


def refuse_moved_outputs(approximations: list[dict], model: onnx.ModelProto) -> None:
    """Raise UserError for the approximations (legalize's report entries) that move an output by more than
    REFUSE_SHARE of its range and that `model`, the plan's, still holds (their nodes carry the entry's
    `prefix`): where the plan left the function exact (on the CPU) or placed the model as imported, there
    is nothing to refuse."""
    names = [n.name for n in model.graph.node]
    used = [e for e in approximations
            if e.get("verdict") == "refuse" and any(n.startswith(e["prefix"]) for n in names)]
    if not used:
        return
    message = (_moved(used[0]) + f", more than the {REFUSE_SHARE:.0%} legalize allows" if len(used) == 1 else
               f"{len(used)} approximations move an output by more than {REFUSE_SHARE:.0%} of its range")
    raise UserError("legalize.approximation-moves-output", message,
                    "build with --no-rewrites (the functions stay exact, on the cpu), or bound the approximations "
                    "tighter: legalize.max_abs_error in the target, --max-abs-error, or --max-error-lsb",
                    notes=[_moved(e) for e in used] if len(used) > 1 else [])


def _fit(model: onnx.ModelProto, found: list[regions.Region], ranges: dict[str, tuple[float, float]], eps: float,
         options: Any, warn: Log) -> tuple[list[Fitted], list[dict]]:
    """Each region's ReLU sum within its bound (`_bound`) on its range, and the regions kept on the CPU
    (or an error)."""
    fitted, failures = [], []
    for region in found:
        lo, hi = ranges[region.input]
        f = region.function(model)
        ops = [model.graph.node[j].op_type for j in region.nodes]
        bound, why = _bound(options, eps, f, lo, hi)
        entry = {"output": region.output, "input": region.input, "nodes": list(region.refused), "ops": ops,
                 "range": [lo, hi], "range_from": "calibration data" if options.calib else
                 "synthetic calibration samples (uniform(-1, 1) inputs)", "bound": bound, "bound_from": why}
        try:
            approx = relu_sum.fit(f, lo, hi, bound)
        except relu_sum.ApproximationError as e:
            failures.append((region, entry, str(e)))
            continue
        entry.update(approx.to_json())
        fitted.append((region, approx, f, entry))
    if failures and not options.allow_cpu_fallback:
        raise UserError("legalize.approximation-bound",
                        f"{len(failures)} function(s) cannot be approximated within their bound on their range",
                        "raise legalize.max_abs_error in the target (or --max-abs-error, --max-error-lsb), or build "
                        "without --no-cpu-fallback: they then run exactly on the CPU",
                        notes=[f"{', '.join(r.refused)} ({' -> '.join(e['ops'])}) on [{e['range'][0]:.4g}, "
                               f"{e['range'][1]:.4g}], bound {e['bound']:.3g} ({e['bound_from']}): {why}"
                               for r, e, why in failures])
    fallbacks = []
    for region, entry, why in failures:
        fallbacks.append({**entry, "reason": why})
        warn(f"{', '.join(region.refused)}: kept on the CPU ({why})")
    return fitted, fallbacks


def _bound(options: Any, eps: float, f, lo: float, hi: float) -> tuple[float, str]:
    """A region's error bound and where it comes from: `max_error_lsb` int8 steps of its output (the
    range f takes on [lo, hi], over 255), the tighter of that and `--max-abs-error` where both are given;
    else `eps` (--max-abs-error or the target's legalize.max_abs_error)."""
    lsb = getattr(options, "max_error_lsb", None)
    if not lsb:
        source = "--max-abs-error" if getattr(options, "max_abs_error", None) else "the target's legalize.max_abs_error"
        return eps, source
    ys = f(np.linspace(lo, hi, 2049))
    step = float(np.ptp(ys)) / 255 or float(np.finfo(np.float32).eps)
    bound, why = lsb * step, f"{lsb:g} int8 steps of the output, {step:.3g} each"
    if getattr(options, "max_abs_error", None) and options.max_abs_error < bound:
        return options.max_abs_error, f"--max-abs-error, tighter than {why}"
    return bound, why


def _substitute(model: onnx.ModelProto, fitted: list[Fitted], sample: list[dict], *, int8: bool) -> onnx.ModelProto:
    """A copy of `model` with every approximation in place; each entry gets its int8 and end-to-end error."""
    if int8:  # an int8 device: the error after int8 too
        for (_, _, _, entry), err in zip(fitted, relu_sum.int8_errors([(a, f) for _, a, f, _ in fitted])):
            entry["int8_error"] = err
    # each approximation alone: how far it moves the model's outputs on calibration inputs
    exact_outputs = ort_backend.run_many(model, sample)
    for k, (region, approx, _, entry) in enumerate(fitted):
        single = _copy(model)
        _approximate(single, region, approx, k)
        entry["end_to_end"] = _deviation_of(exact_outputs, ort_backend.run_many(single, sample))
    model = _copy(model)
    # the last exit first: earlier exits rename their consumers, the later approximations included
    for k, (region, approx, _, entry) in enumerate(sorted(fitted, key=lambda t: -max(t[0].nodes))):
        _approximate(model, region, approx, k)
        entry["prefix"] = _prefix(k)   # its nodes' names start so
    return model


def _prefix(k: int) -> str:
    return f"relu_sum{k}_"


def with_approximations(exact_model: onnx.ModelProto, approximations: list[dict], keep: set[int],
                        target: Target) -> onnx.ModelProto:
    """The legalized model again with only the approximations numbered `keep` (positions in the report's
    list) in place, the others' regions left as exported, for the CPU: `exact_model` is the model after
    legalize's exact rewrites, before any approximation (the stage's `exact.onnx`); the ReLU sums are
    the report's (knots, weights, c0, c1), not fitted again. Then the graph optimizations, and each node
    marked with the devices that can run it, as `legalize` does."""
    refused = {n for e in approximations for n in e["nodes"]}
    found = {r.output: r for r in regions.find(exact_model, refused)}
    chosen = [(found[e["output"]], relu_sum.Approximation(
        e["lo"], e["hi"], tuple(e["knots"]), e["c0"], e["c1"], tuple(e["weights"]), e["grid_error"]), e["prefix"])
        for k, e in enumerate(approximations) if k in keep]
    model = _copy(exact_model)
    for region, approx, prefix in sorted(chosen, key=lambda t: -max(t[0].nodes)):
        _approximate(model, region, approx, int(prefix[len("relu_sum"):-1]))
    model, _ = passes.optimize(model)
    model = irm.constants_first(_infer(model))
    for node, s in zip(model.graph.node, support.Tables([d.kind for d in target.devices]).model(model)):
        irm.set_meta(node, irm.CAPABLE_KEY, ",".join(s.capable))
    return model


def _optimize(original: onnx.ModelProto, model: onnx.ModelProto, feeds: list[dict], rewrites: dict,
              approximations: list[dict], options: Any,
              inputs: list[dict]) -> tuple[onnx.ModelProto, dict, dict | None]:
    """Step 3: the graph optimized, the rules that fired, and how far inexact rewrites moved the outputs."""
    model, optimized = passes.optimize(model)
    fired = {k: v for k, v in optimized["rules"].items() if v}
    model = _infer(model)
    end_to_end = None
    if approximations or any(r["exactness"] != "exact" for r in rewrites.values()):
        feeds = feeds or load_calibration(options, inputs)[0]
        end_to_end = _deviation(original, model, feeds[:E2E_SAMPLES])
    return model, fired, end_to_end


def _approximate(model: onnx.ModelProto, region: regions.Region, approx: relu_sum.Approximation, k: int) -> None:
    """Put approximation number `k` in place of `region`'s exit, in `model`: two convolutions where its
    input's shape is static (`relu_sum.to_onnx_conv`, a fixed number of Edge TPU ops whatever the
    knots), else Add, Relu and Mul per knot (`relu_sum.to_onnx`)."""
    new_output = f"{region.output}__relu_sum"
    shape = irm.static_shapes(model).get(region.input)
    if shape is not None and all(d > 0 for d in shape):
        new_nodes, inits = relu_sum.to_onnx_conv(approx, region.input, new_output, _prefix(k), tuple(shape))
    else:
        new_nodes, inits = relu_sum.to_onnx(approx, region.input, new_output, _prefix(k))
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
    """Per output, the max abs difference over the samples and its share of the output's range (its
    largest value less its smallest over all samples; where that is 0, a scalar that never changes, its
    largest magnitude); over all outputs, the largest of each and the output with the largest share."""
    outputs = {}
    for name in reference[0] if reference else []:
        va = np.stack([r[name].astype(np.float64) for r in reference])
        vb = np.stack([o[name].astype(np.float64) for o in other])
        d = float(np.max(np.abs(va - vb)))
        span = float(np.ptp(va)) or float(np.max(np.abs(va))) or 1.0
        outputs[name] = {"max_abs_error": d, "range": span, "share": d / span}
    worst = max(outputs, key=lambda n: outputs[n]["share"], default=None)
    largest = max((o["max_abs_error"] for o in outputs.values()), default=0.0)
    return {"samples": len(reference), "max_abs_error": largest,
            "max_error_of_range": outputs[worst]["share"] if worst else 0.0, "output": worst, "outputs": outputs}
