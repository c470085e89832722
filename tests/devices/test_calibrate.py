"""calibrate: the fitter recovers the figures that generated its samples, the profiler gives every
node of a real run a time, and the errors are computed as defined; per backend, the fit to timed runs
recovers the figures that generated their totals, in the scheduler's own cost."""

from __future__ import annotations

import itertools
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from pydantic import ValidationError

from edgesdk.config import Target, load_target
from edgesdk.devices import cost
from edgesdk.devices.calibrate import (BOUND, CACHE_CAPACITIES_MB, TOLERANCE, CpuFit, OpSample, RunSample,
                                       backend_figures, cuts, evaluate, evaluate_backend, fit_backend, fit_cpu,
                                       measure_ops, predict_ms, predict_run_ms, run_sample)
from edgesdk.errors import UserError
from edgesdk.ir import model as irm

TRUE = {"peak_gflops": 180.0, "bandwidth_gbps": 25.0, "overhead_us": 4.0}


def synthetic(flops_bytes, figures=TRUE) -> list[OpSample]:
    return [OpSample("synthetic", f"n{i}", "Op", f, 0, b, predict_ms(f, b, *figures.values()))
            for i, (f, b) in enumerate(flops_bytes)]


def spread(seed: int, n: int = 60) -> list[tuple[float, int]]:
    """Ops from tiny (overhead-bound) to large, half of them with many flops per byte (compute-bound
    at 180 GFLOP/s and 25 GB/s: more than 7.2 flops per byte) and half with few (memory-bound)."""
    rng = np.random.default_rng(seed)
    size = 10 ** rng.uniform(2, 7, n)
    intensity = np.where(np.arange(n) % 2 == 0, 10 ** rng.uniform(1.5, 2.5, n), 10 ** rng.uniform(-1, 0.5, n))
    return [(float(s * k), int(s)) for s, k in zip(size, intensity)]


def test_fit_recovers_the_figures_that_generated_the_samples():
    fit = fit_cpu(synthetic(spread(0)))
    assert fit.peak_gflops == pytest.approx(TRUE["peak_gflops"], rel=1e-6)
    assert fit.bandwidth_gbps == pytest.approx(TRUE["bandwidth_gbps"], rel=1e-6)
    assert fit.overhead_us == pytest.approx(TRUE["overhead_us"], rel=1e-6)
    assert max(abs(r) for r in fit.residuals) < 1e-9
    assert fit.bound.count("compute") == 30 and fit.bound.count("memory") == 30
    assert fit.notes == ()


def test_fit_is_relative_small_ops_count_as_much_as_large_ones():
    # +-10% noise on ops spanning five decades: in log space every op is explained to about 10%,
    # the smallest (overhead-bound) as well as the largest; a loss in ms would fit the large ones and
    # leave the small ones off by their whole overhead
    base = synthetic(spread(1))
    noisy = [OpSample(s.model, s.node, s.op_type, s.flops, 0, s.act_bytes, s.ms * (1.1 if i % 3 else 0.9))
             for i, s in enumerate(base)]
    fit = fit_cpu(noisy)
    by_size = sorted(range(len(noisy)), key=lambda i: noisy[i].ms)
    for idx in (by_size[:10], by_size[-10:]):
        assert max(abs(fit.residuals[i]) for i in idx) < 0.2
    for key, got in (("peak_gflops", fit.peak_gflops), ("bandwidth_gbps", fit.bandwidth_gbps),
                     ("overhead_us", fit.overhead_us)):
        assert got == pytest.approx(TRUE[key], rel=0.15), key


def test_fit_says_when_no_sample_is_memory_bound():
    # every op does >= 100 flops per byte: the bandwidth only has a lower bound
    ops = [(f, int(f / 1000)) for f in np.logspace(3, 9, 40)]
    fit = fit_cpu(synthetic(ops))
    assert fit.peak_gflops == pytest.approx(TRUE["peak_gflops"], rel=1e-6)
    assert fit.overhead_us == pytest.approx(TRUE["overhead_us"], rel=1e-6)
    assert set(fit.bound) == {"compute"}
    assert fit.notes == ("no sample is memory-bound at the fit: bandwidth_gbps is a bound, not a measurement",)


def test_fit_refuses_too_few_samples():
    with pytest.raises(ValueError, match="at least 3"):
        fit_cpu(synthetic([(1e6, 100), (1e3, 1e5)]))


def test_prediction_is_the_schedulers_cpu_cost_with_the_fitted_figures():
    target, _ = load_target("x86")
    fit = CpuFit(123.0, 17.0, 6.5, (), ())
    figures = fit.figures("edgesdk calibrate on test-host, 2 threads")
    host = target.host
    peak = {**host.peak_gflops, **figures.pop("peak_gflops")}
    calibrated = target.model_copy(update={"devices": [host.model_copy(update={**figures, "peak_gflops": peak})]})
    assert calibrated.host.peak_gflops["int8"] == host.peak_gflops["int8"]  # not fitted, left as it was
    for flops, nbytes in ((2e6, 1_000), (1e3, 4e6), (0.0, 0)):
        want = cost.node_ms(calibrated, "cpu", flops=flops, param_bytes=nbytes // 2, act_bytes=nbytes - nbytes // 2)
        assert fit.predict_ms(flops, nbytes) == pytest.approx(want, rel=1e-12)



def test_a_per_layer_cost_of_the_input_target_is_dropped():
    # arm_2tpu's CPU carries a per-layer cost fitted to Coral's figures; a per-node fit replacing its
    # figures must not keep it, or every convolution would pay it on top of the fitted overhead
    target, _ = load_target("arm_2tpu")
    cpu = next(d for d in target.devices if d.kind == "cpu")
    assert cpu.layer_overhead is not None
    fit = CpuFit(123.0, 17.0, 6.5, (), ())
    figures = fit.figures("edgesdk calibrate on test-host, 2 threads")
    peak = {**cpu.peak_gflops, **figures.pop("peak_gflops")}
    refit = cpu.model_copy(update={**figures, "peak_gflops": peak})
    assert refit.layer_overhead is None
    base = target.model_copy(update={"devices": [refit, *[d for d in target.devices if d.kind != "cpu"]]})
    assert fit.predict_ms(2e6, 1000) == pytest.approx(
        cost.node_ms(base, "cpu", flops=2e6, param_bytes=500, act_bytes=500), rel=1e-9)


# --- measuring ---------------------------------------------------------------------------------


def conv_net() -> onnx.ModelProto:
    """conv 3x3 -> HardSwish (a function op onnxruntime inlines) -> depthwise conv -> add -> pool -> gemm.
    Node names are left empty, as many exporters leave them."""
    rng = np.random.default_rng(0)
    w = {
        "w1": rng.standard_normal((16, 3, 3, 3)).astype(np.float32),
        "b1": np.zeros(16, np.float32),
        "w2": rng.standard_normal((16, 1, 3, 3)).astype(np.float32),
        "wf": rng.standard_normal((16, 10)).astype(np.float32),
        "bf": np.zeros(10, np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("HardSwish", ["c1"], ["h1"]),
        helper.make_node("Conv", ["h1", "w2"], ["c2"], pads=[1, 1, 1, 1], group=16),
        helper.make_node("Add", ["c2", "h1"], ["s"]),
        helper.make_node("GlobalAveragePool", ["s"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "conv_net",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
                              [numpy_helper.from_array(a, k) for k, a in w.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = irm.IR_VERSION
    return onnx.shape_inference.infer_shapes(m, strict_mode=True)


def test_measure_ops_gives_every_node_a_time():
    m = conv_net()
    samples = measure_ops(m, threads=1, runs=3)
    assert [s.node for s in samples] == [irm.node_name(n, i) for i, n in enumerate(m.graph.node)]
    assert [s.op_type for s in samples] == [n.op_type for n in m.graph.node]
    assert all(s.ms > 0 for s in samples)
    assert {s.model for s in samples} == {"conv_net"}
    shapes = irm.static_shapes(m)
    assert [s.flops for s in samples] == [cost.node_flops(n, shapes) for n in m.graph.node]
    conv, hswish, dw, add = samples[:4]
    assert conv.flops == 2 * 16 * 32 * 32 * 3 * 3 * 3
    assert (conv.param_bytes, conv.act_bytes) == (4 * (16 * 3 * 9 + 16), 4 * (3 + 16) * 32 * 32)
    assert (hswish.param_bytes, hswish.act_bytes) == (0, 4 * 2 * 16 * 32 * 32)
    assert (dw.param_bytes, dw.act_bytes) == (4 * 16 * 9, 4 * 2 * 16 * 32 * 32)
    assert (add.param_bytes, add.act_bytes) == (0, 4 * 3 * 16 * 32 * 32)


def test_measure_ops_skips_constant_nodes_and_keeps_given_names():
    # onnxruntime turns a Constant node into an initializer: it runs no kernel and gets no sample
    nodes = [
        helper.make_node("Constant", [], ["k"], name="scale",
                         value=numpy_helper.from_array(np.full((1, 4), 2.0, np.float32))),
        helper.make_node("Mul", ["x", "k"], ["m"], name="twice"),
        helper.make_node("Relu", ["m"], ["y"], name="twice"),  # repeated name
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 4])])
    m = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    samples = measure_ops(m, threads=1, runs=2, name="const")
    assert [(s.node, s.op_type) for s in samples] == [("twice", "Mul"), ("twice", "Relu")]
    assert samples[0].act_bytes == 4 * (32 + 4 + 32)  # a Constant's output is an activation, as the scheduler counts it
    assert all(s.ms > 0 for s in samples)


def test_measure_ops_refuses_dynamic_shapes():
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(UserError) as e:
        measure_ops(m, threads=1, runs=1, name="dyn")
    assert e.value.code == "calibrate.dynamic-shape"
    assert e.value.notes[0] == "input 'x'"


def test_measure_ops_runs_a_model_whose_weights_stay_in_their_file(tmp_path, monkeypatch, weights_never_handed_over):
    """`edgesdk calibrate` measures the import stage's model, whose weights past 64 MiB stay in its `.data`
    file (mapped: an absolute location, which onnxruntime refuses in a model's bytes): the sessions get them
    as arrays, and onnxruntime's resolved graph keeps them beside it."""
    rng = np.random.default_rng(0)
    mlp = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "w0"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "w1"], ["y"])], "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 128])],
        [numpy_helper.from_array(rng.standard_normal((256, 128)).astype(np.float32), "w0"),
         numpy_helper.from_array(rng.standard_normal((128, 128)).astype(np.float32), "w1")]),
        opset_imports=[helper.make_opsetid("", 17)])
    monkeypatch.setattr(irm, "EXTERNAL_FROM", 1 << 16)  # the threshold lowered: a small model takes the path
    irm.save(irm.infer_shapes(mlp), tmp_path / "mlp.onnx")
    mapped = irm.read(tmp_path / "mlp.onnx")
    assert all(irm.is_mapped(t) for t in mapped.graph.initializer)
    samples = measure_ops(mapped, threads=1, runs=2, name="mlp")
    assert [(s.op_type, s.param_bytes) for s in samples] == [("MatMul", 256 * 128 * 4), ("Relu", 0),
                                                             ("MatMul", 128 * 128 * 4)]
    assert all(s.ms > 0 for s in samples)
    assert not weights_never_handed_over, weights_never_handed_over


# --- evaluating --------------------------------------------------------------------------------


def test_evaluate_computes_errors_per_op_per_type_and_per_model_total():
    # 1 GFLOP/s, 1 GB/s, 1 ms overhead: 1e6 flops or 1e6 bytes take 1 ms, plus 1 ms
    fit = CpuFit(1.0, 1.0, 1000.0, (), ())
    samples = [
        OpSample("m1", "a", "Conv", 1e6, 0, 0, 4.0),  # predicted 2: |2-4|/4 = 0.5
        OpSample("m1", "b", "Add", 0.0, 1_000_000, 1_000_000, 3.0),  # predicted 3: 0
        OpSample("m2", "c", "Conv", 3e6, 0, 1000, 5.0),  # predicted 4: 0.2
    ]
    report = evaluate(fit, samples)
    assert report["ops"] == {"ops": 3, "median_rel_error": pytest.approx(0.2), "max_rel_error": pytest.approx(0.5)}
    m1, m2 = report["models"]["m1"], report["models"]["m2"]
    assert (m1["measured_ms"], m1["predicted_ms"]) == (pytest.approx(7.0), pytest.approx(5.0))
    assert m1["total_rel_error"] == pytest.approx(2 / 7)
    assert (m1["median_rel_error"], m1["max_rel_error"]) == (pytest.approx(0.25), pytest.approx(0.5))
    assert m2["total_rel_error"] == pytest.approx(0.2) and m2["ops"] == 1
    assert report["op_types"]["Conv"] == {"ops": 2, "median_rel_error": pytest.approx(0.35),
                                          "max_rel_error": pytest.approx(0.5)}
    assert report["op_types"]["Add"]["max_rel_error"] == pytest.approx(0.0, abs=1e-12)
    assert report["worst_op"]["node"] == "a" and report["worst_op"]["predicted_ms"] == pytest.approx(2.0)


def test_measured_samples_fit_and_evaluate_end_to_end():
    # not a timing assertion: a fit on real, noisy times gives finite positive figures whose
    # residuals are the log-ratios evaluate sees
    samples = measure_ops(conv_net(), threads=1, runs=3)
    fit = fit_cpu(samples)
    assert all(math.isfinite(x) and x > 0 for x in (fit.peak_gflops, fit.bandwidth_gbps, fit.overhead_us))
    report = evaluate(fit, samples)
    errs = sorted(abs(math.exp(r) - 1) for r in fit.residuals)
    assert report["ops"]["max_rel_error"] == pytest.approx(errs[-1], rel=1e-9)


# --- per backend: runs of nodes ------------------------------------------------------------------

BASE = CpuFit(300.0, 70.0, 5.0, (), (), grouped_gflops=20.0)  # a per-op fit: where a backend's fit starts
LITERT = {"peak_gflops": 120.0, "grouped_gflops": 45.0, "bandwidth_gbps": 30.0, "overhead_us": 2.0}


def _figure(value: float, unit: str) -> dict:
    return {"value": value, "unit": unit, "source": "a test's own figure"}


def _target_with(backend: str, figures: dict) -> Target:
    """x86 with the per-op fit's figures on the CPU and `figures` for `backend`."""
    data = load_target("x86")[0].model_dump(mode="json")
    cpu = data["devices"][0]
    cpu["peak_gflops"] = {"float32": _figure(BASE.peak_gflops, "GFLOP/s"),
                          "float32_grouped": _figure(BASE.grouped_gflops, "GFLOP/s")}
    cpu["memory_bandwidth"] = _figure(BASE.bandwidth_gbps, "GB/s")
    cpu["kernel_overhead"] = _figure(BASE.overhead_us, "us")
    own = {"peak_gflops": {"float32": _figure(figures["peak_gflops"], "GFLOP/s")},
           "memory_bandwidth": _figure(figures["bandwidth_gbps"], "GB/s"),
           "kernel_overhead": _figure(figures["overhead_us"], "us")}
    if figures.get("grouped_gflops"):
        own["peak_gflops"]["float32_grouped"] = _figure(figures["grouped_gflops"], "GFLOP/s")
    if figures.get("cache_gbps"):
        own["cache_bandwidth"] = _figure(figures["cache_gbps"], "GB/s")
        own["cache_capacity"] = _figure(figures["cache_mb"], "MiB")
    cpu["backends"] = {backend: own}
    return Target.model_validate(data)


CUT = (30.0, 8.0)  # what cutting costs the synthetic backend: 30 us per cut-out run, its cut tensors at 8 GB/s


def timed_runs(seed: int, target: Target, backend: str, runs: int = 14, grouped: bool = True,
               cut: tuple[float, float] | None = CUT) -> list[RunSample]:
    """Runs of 3 to 12 nodes drawn from `spread` (a third of the compute-bound ones grouped convolutions
    when `grouped`), the first 3 whole models, the others cut out of one with 10 kB to 10 MB of cut
    tensors (`cut`: what cutting costs; None: nothing, and no run is cut out). A run's measured time is
    the scheduler's prediction with the target's figures of `backend`, plus its cut: what a noiseless
    timing of a backend with those figures would give."""
    rng = np.random.default_rng(seed)
    nodes = spread(seed, 120)
    out = []
    for j in range(runs):
        picked = rng.choice(len(nodes), size=int(rng.integers(3, 13)), replace=False)
        terms = [(nodes[k][0], 0, nodes[k][1], grouped and k % 6 == 0) for k in picked]
        whole = j < 3 or cut is None
        cut_bytes = 0 if whole else int(10 ** rng.uniform(4, 7))
        sample = run_sample(f"m{j % 3}", "whole" if whole else f"nodes {j}", backend, 1.0, terms, cut_bytes)
        extra = 0.0 if whole else cut[0] * 1e-3 + 1e3 * cut_bytes / (cut[1] * 1e9)
        out.append(RunSample(**{**sample.__dict__, "ms": predict_run_ms(target, sample, backend) + extra}))
    return out


def test_backend_fit_recovers_the_figures_that_generated_its_runs():
    target = _target_with("litert", LITERT)
    fit = fit_backend(timed_runs(0, target, "litert"), BASE)
    for key, want in LITERT.items():
        assert getattr(fit, key) == pytest.approx(want, rel=1e-6), key
    assert (fit.cut_overhead_us, fit.cut_gbps) == (pytest.approx(CUT[0], rel=1e-6), pytest.approx(CUT[1], rel=1e-6))
    assert max(abs(r) for r in fit.residuals) < 1e-9 and fit.notes == ()
    assert fit.loss == "log, runs" and set(fit.bound) <= {"compute", "memory", "overhead", "cut"}


def test_without_cut_out_runs_nothing_is_fitted_for_cuts():
    target = _target_with("litert", LITERT)
    fit = fit_backend(timed_runs(5, target, "litert", cut=None), BASE)
    assert fit.cut_overhead_us is None and fit.cut_gbps is None
    assert fit.peak_gflops == pytest.approx(LITERT["peak_gflops"], rel=1e-6)


def test_a_fitted_backend_in_a_target_predicts_what_the_fit_predicts():
    # the figures written for a backend, read back through the scheduler's cost, reproduce its runs
    runs = timed_runs(1, _target_with("litert", LITERT), "litert")
    fit = fit_backend(runs, BASE)
    data = _target_with("litert", LITERT).model_dump(mode="json")
    data["devices"][0]["backends"] = {"litert": backend_figures(fit, "edgesdk calibrate on test-host, 2 threads")}
    refitted = Target.model_validate(data)
    for r in runs:  # a cut-out run: its nodes as the scheduler costs them, plus what the fit says its cut costs
        assert predict_run_ms(refitted, r, "litert") + fit.cut_ms(r) == pytest.approx(r.ms, rel=1e-6)
        assert (fit.cut_ms(r) == 0.0) == (r.run == "whole")
    assert refitted.host.backends["litert"].layer_overhead is None


def test_without_grouped_convolutions_the_backend_keeps_the_cpus_grouped_rate():
    figures = {k: v for k, v in LITERT.items() if k != "grouped_gflops"}
    runs = timed_runs(2, _target_with("tvm", figures), "tvm", grouped=False)
    fit = fit_backend(runs, BASE)
    assert fit.grouped_gflops is None
    assert "float32_grouped" not in backend_figures(fit, "test source")["peak_gflops"]
    assert fit.peak_gflops == pytest.approx(figures["peak_gflops"], rel=1e-6)


def test_backend_fit_finds_a_cache_tier_and_its_capacity():
    """Runs whose nodes of at most 1 MiB moved their bytes 4x faster than the others (a backend whose
    kernels hand small tensors on in cache): the fit finds the capacity among CACHE_CAPACITIES_MB and
    both bandwidths, and the target it writes predicts the runs."""
    figures = {**LITERT, "cache_gbps": 4 * LITERT["bandwidth_gbps"], "cache_mb": 1}
    assert 1 in CACHE_CAPACITIES_MB
    runs = timed_runs(6, _target_with("litert", figures), "litert", runs=20)
    fit = fit_backend(runs, BASE)
    assert (fit.cache_mb, fit.cache_gbps) == (1, pytest.approx(figures["cache_gbps"], rel=1e-6))
    for key in ("peak_gflops", "bandwidth_gbps", "overhead_us"):
        assert getattr(fit, key) == pytest.approx(figures[key], rel=1e-6), key
    assert any("of at most 1 MiB move their bytes at the cache bandwidth" in n for n in fit.notes)
    written = backend_figures(fit, "test source")
    assert written["cache_capacity"].value == 1 and written["cache_capacity"].unit == "MiB"
    data = _target_with("litert", LITERT).model_dump(mode="json")
    data["devices"][0]["backends"] = {"litert": written}
    refitted = Target.model_validate(data)
    for r in runs:
        assert predict_run_ms(refitted, r, "litert") + fit.cut_ms(r) == pytest.approx(r.ms, rel=1e-6)
    # without the tier the same runs are explained worse: the tier is what the fit found, not noise
    one_tier = fit_backend([RunSample(**{**r.__dict__, "ms": predict_run_ms(_target_with("litert", LITERT), r, "litert")
                                         + fit.cut_ms(r)}) for r in runs], BASE)
    assert one_tier.cache_gbps is None and one_tier.cache_mb is None


def test_a_cache_tier_needs_both_figures():
    data = _target_with("litert", LITERT).model_dump(mode="json")
    data["devices"][0]["backends"]["litert"]["cache_bandwidth"] = _figure(100.0, "GB/s")
    with pytest.raises(ValidationError, match="cache_bandwidth and cache_capacity go together"):
        Target.model_validate(data)


def test_backend_fit_notes_a_figure_no_run_depends_on():
    # only compute-bound runs: the bandwidth stays the per-op fit's, and the note says so
    target = _target_with("onnxruntime", LITERT)
    runs = [run_sample("m", f"nodes {j}", "onnxruntime", 1.0, [(f * 1e6, 0, int(f * 10), False), (1e5, 0, 100, False)])
            for j, f in enumerate((1.0, 3.0, 10.0, 30.0, 100.0, 300.0))]
    runs = [RunSample(**{**r.__dict__, "ms": predict_run_ms(target, r, "onnxruntime")}) for r in runs]
    fit = fit_backend(runs, BASE)
    assert fit.bandwidth_gbps == pytest.approx(BASE.bandwidth_gbps, rel=1e-9)
    assert fit.notes == ("no run's time depends on bandwidth_gbps: it is left at its start",)
    assert fit.peak_gflops == pytest.approx(LITERT["peak_gflops"], rel=1e-6)


def test_backend_fit_stays_within_its_bounds_and_says_so():
    # runs 1000x slower than any per-op figure explains: the rate stops at BOUND and is noted
    target = _target_with("tvm", {"peak_gflops": BASE.peak_gflops / 1000, "bandwidth_gbps": BASE.bandwidth_gbps,
                                  "overhead_us": BASE.overhead_us})
    runs = timed_runs(3, target, "tvm", grouped=False)
    fit = fit_backend(runs, BASE)
    assert fit.peak_gflops == pytest.approx(BASE.peak_gflops / BOUND, rel=1e-6)
    assert any(n.startswith("peak_gflops is at its bound") for n in fit.notes)


def test_backend_fit_refuses_too_few_runs_and_mixed_backends():
    target = _target_with("litert", LITERT)
    runs = timed_runs(4, target, "litert")
    with pytest.raises(ValueError, match="fitting 6 figures needs at least 7 timed runs, got 6"):
        fit_backend(runs[:6], BASE)
    with pytest.raises(ValueError, match="several backends"):
        fit_backend([*runs[:3], RunSample(**{**runs[3].__dict__, "backend": "tvm"})], BASE)


def test_cuts_are_consecutive_runs_of_about_even_time():
    ms = [1.0] * 40 + [20.0] + [1.0] * 39
    parts = cuts(ms, 4)
    assert parts[0].start == 0 and parts[-1].stop == len(ms)
    assert all(a.stop == b.start for a, b in itertools.pairwise(parts))
    totals = [sum(ms[i] for i in r) for r in parts]
    assert len(parts) == 4 and max(totals) - min(totals) <= 20.0
    assert cuts(ms, 1) == [range(0, 80)] and cuts([5.0, 1.0], 4) == [range(0, 1), range(1, 2)] and cuts([], 3) == []


def test_evaluate_backend_reports_whole_models_against_the_tolerance():
    target = _target_with("litert", LITERT)
    terms = [(1e7, 0, 100_000, False), (1e4, 0, 400_000, False)]
    predicted = predict_run_ms(target, run_sample("a", "whole", "litert", 1.0, terms), "litert")
    shared = predict_run_ms(target, run_sample("a", "whole", "litert", 1.0, terms), None)
    samples = [run_sample("a", "whole", "litert", predicted / 1.2, terms),    # 20 % over: within
               run_sample("b", "whole", "litert", predicted / 1.3, terms),    # 30 % over: not within
               run_sample("a", "nodes 1-1", "litert", predicted, terms)]      # a cut: counted in runs only
    report = evaluate_backend(target, "litert", samples)
    a, b = report["models"]["a"], report["models"]["b"]
    assert set(report["models"]) == {"a", "b"} and report["tolerance"] == TOLERANCE
    assert a["rel_error"] == pytest.approx(0.2) and a["within_tolerance"]
    assert b["rel_error"] == pytest.approx(0.3) and not b["within_tolerance"]
    assert a["predicted_shared_ms"] == pytest.approx(shared) and shared != pytest.approx(predicted)
    assert report["runs"] == {"count": 3, "median_rel_error": pytest.approx(0.2), "max_rel_error": pytest.approx(0.3)}
    assert [(r["model"], r["run"], r["nodes"]) for r in report["per_run"]] == [("a", "whole", 2), ("b", "whole", 2),
                                                                                ("a", "nodes 1-1", 2)]
    assert report["per_run"][2]["rel_error"] == pytest.approx(0.0, abs=1e-12)
