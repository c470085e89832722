"""The least-squares fit of a device's rate and one overhead (devices/fit.py), on synthetic latencies
that `cost.node_ms` itself generates from known parameters: the per-node `kernel_overhead`, or a CPU's
per-layer `layer_overhead` (paid by convolutions and matrix products only)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from edgesdk.config import Target, load_target
from edgesdk.devices.cost import is_mac_layer, node_ms
from edgesdk.devices.fit import Fit, fit_roofline, observation, refit_target, target_parameters


def _plain(target):
    """arm_2tpu without its fitted CPU layer_overhead: every node pays kernel_overhead alone."""
    data = target.model_dump(mode="json")
    data["devices"][0]["layer_overhead"] = None
    return Target.model_validate(data)


ARM = _plain(load_target("arm_2tpu")[0])
CPU_PEAK = 24e9     # the A53's float32 peak (TRM), the fit's upper bound on the rate
TPU_PEAK = 4e12


def _truth(kind: str, rate: float, overhead_us: float, overhead: str = "node", target=ARM):
    return refit_target(target, kind, Fit(kind, 1e3 / rate, overhead_us * 1e-3, (), (), overhead), "synthetic truth")


def _nodes(seed: int, count: int) -> list[tuple[float, int, int]]:
    """(flops, param_bytes, act_bytes): convolutions (compute-bound on the A53) mixed with
    elementwise ops (memory-bound at any rate up to the peak), like a CNN's."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        if i % 3 == 2:
            elems = int(rng.integers(10_000, 400_000))
            out.append((float(elems), 0, 8 * elems))
        else:
            out.append((float(rng.integers(10**6, 10**8)), int(rng.integers(1_000, 2_000_000)),
                        int(rng.integers(10_000, 1_000_000))))
    return out


def _observations(target, kind, models, *, streamed=0.0, fixed=0.0, overhead="node", start=None):
    """Each synthetic model's total as node_ms predicts it on `target`: the figure a fit must recover,
    observed on `start` (the target the fit begins from: its fitted figures do not matter)."""
    obs = []
    for name, nodes in models.items():
        total = fixed + sum(node_ms(target, kind, flops=f, param_bytes=p, act_bytes=a, streamed_fraction=streamed)
                            for f, p, a in nodes)
        obs.append(observation(start or ARM, kind, name, total, nodes, streamed_fraction=streamed, fixed_ms=fixed,
                               overhead=overhead))
    return obs


MODELS = {"a": _nodes(1, 30), "b": _nodes(2, 90), "c": _nodes(3, 55)}


@pytest.mark.parametrize("kind", ["cpu", "edgetpu"])
def test_observation_reproduces_node_ms(kind):
    # the fit's terms must stay the form of cost.node_ms: at the target's own figures they agree
    nodes = MODELS["b"]
    obs = observation(ARM, kind, "b", 1.0, nodes, streamed_fraction=0.3, fixed_ms=0.25)
    direct = 0.25 + sum(node_ms(ARM, kind, flops=f, param_bytes=p, act_bytes=a, streamed_fraction=0.3)
                        for f, p, a in nodes)
    assert math.isclose(obs.predict_ms(*target_parameters(ARM, kind)), direct, rel_tol=1e-12)
    if kind == "cpu":  # both sides of the roofline occur, or this test would not cover the max()
        x, _ = target_parameters(ARM, kind)
        bound = [f * x >= m for f, m in zip(obs.flops, obs.floor_ms)]
        assert any(bound) and not all(bound)


@pytest.mark.parametrize("models", [("a", "b"), ("a", "b", "c")])
def test_recovers_cpu_rate_and_overhead(models):
    truth = _truth("cpu", 7.3e9, 37.5)
    obs = _observations(truth, "cpu", {m: MODELS[m] for m in models})
    fit = fit_roofline("cpu", obs, max_rate=CPU_PEAK)
    assert abs(fit.rate - 7.3e9) <= 1e-9 * 7.3e9
    assert abs(fit.overhead_us - 37.5) <= 1e-9 * 37.5
    assert fit.exact and fit.at_bound == ()
    assert max(abs(r) for r in fit.residuals) < 1e-12
    # the memory floor matters at the true rate: a fit that ignored it would be off
    x = 1e3 / 7.3e9
    assert any(f * x < m for o in obs for f, m in zip(o.flops, o.floor_ms))


def test_recovers_edgetpu_rate_and_overhead_with_streamed_weights_and_link():
    truth = _truth("edgetpu", 0.61e12, 9.0)
    obs = _observations(truth, "edgetpu", {"a": MODELS["a"], "b": MODELS["b"]}, streamed=0.4, fixed=0.66)
    fit = fit_roofline("edgetpu", obs, max_rate=TPU_PEAK)
    assert abs(fit.rate - 0.61e12) <= 1e-9 * 0.61e12
    assert abs(fit.overhead_us - 9.0) <= 1e-9 * 9.0
    assert fit.exact


def test_refit_target_writes_the_fit_with_its_source():
    fit = Fit("cpu", 1e3 / 6.5e9, 0.042, (0.0, 0.0), ())
    fitted = refit_target(ARM, "cpu", fit, "fitted to test data")
    x, o = target_parameters(fitted, "cpu")
    assert math.isclose(x, 1e3 / 6.5e9, rel_tol=1e-15) and math.isclose(o, 0.042, rel_tol=1e-15)
    assert fitted.host.peak_gflops["float32"].value == pytest.approx(6.5)
    assert fitted.host.kernel_overhead.source == "fitted to test data"
    # the other device and the other figures are untouched
    assert fitted.devices[1] == ARM.devices[1]
    assert fitted.host.peak_gflops["int8"] == ARM.host.peak_gflops["int8"]


def test_rate_above_the_peak_is_clipped_to_efficiency_one():
    # data made at 30 GFLOP/s, above the 24 GFLOP/s peak: the fit stops at the peak, does not fit exactly
    truth = _truth("cpu", 30e9, 20.0)
    obs = _observations(truth, "cpu", {"a": MODELS["a"], "b": MODELS["b"]})
    fit = fit_roofline("cpu", obs, max_rate=CPU_PEAK)
    assert fit.rate == pytest.approx(CPU_PEAK, rel=1e-12)
    assert "rate = max_rate (efficiency 1)" in fit.at_bound
    assert not fit.exact and fit.overhead_us >= 0
    _assert_no_feasible_point_is_better(fit, obs, CPU_PEAK)


def test_negative_overhead_is_clipped_to_zero():
    # 20 us per node, then 50 us per node taken off: a negative overhead, which the fit refuses
    truth = _truth("cpu", 5e9, 20.0)
    obs = [observation(ARM, "cpu", o.name, o.measured_ms - 0.05 * o.ops, MODELS[o.name])
           for o in _observations(truth, "cpu", {"a": MODELS["a"], "b": MODELS["b"]})]
    fit = fit_roofline("cpu", obs, max_rate=CPU_PEAK)
    assert fit.overhead_us == 0.0 and "overhead = min" in fit.at_bound
    assert 0 < fit.rate <= CPU_PEAK and not fit.exact
    _assert_no_feasible_point_is_better(fit, obs, CPU_PEAK)
    with pytest.raises(ValueError, match="kernel_overhead of cpu at 0 us"):
        refit_target(ARM, "cpu", fit, "a zero is no figure")


@pytest.mark.parametrize("scales", [(0.95, 1.02, 1.04), (1.10, 0.93, 1.02), (0.93, 1.10, 1.02), (1.05, 1.0, 0.95)])
def test_inconsistent_figures_get_the_least_squares_optimum(scales):
    # three figures no (rate, overhead) reproduces: the fit is no worse than any feasible point of a
    # grid around it, whether the optimum is interior or on a bound
    truth = _truth("cpu", 6e9, 30.0)
    noisy = [observation(ARM, "cpu", o.name, o.measured_ms * s, MODELS[o.name])
             for o, s in zip(_observations(truth, "cpu", MODELS), scales)]
    fit = fit_roofline("cpu", noisy, max_rate=CPU_PEAK)
    assert not fit.exact
    if scales == (0.95, 1.02, 1.04):
        assert fit.at_bound == ()
    _assert_no_feasible_point_is_better(fit, noisy, CPU_PEAK)


def _assert_no_feasible_point_is_better(fit, obs, peak):
    def sse(x, o):
        return sum((ob.predict_ms(x, o) / ob.measured_ms - 1) ** 2 for ob in obs)

    best = sse(fit.ms_per_flop, fit.overhead_ms)
    for sx, so in itertools.product(np.linspace(0.5, 1.5, 41), np.linspace(0.0, 2.0, 41)):
        x = max(fit.ms_per_flop * sx, 1e3 / peak)
        o = max(fit.overhead_ms, 0.05) * so
        assert best <= sse(x, o) * (1 + 1e-12), (sx, so)


def test_too_few_figures_are_refused():
    obs = _observations(_truth("cpu", 7e9, 20.0), "cpu", {"a": MODELS["a"]})
    with pytest.raises(ValueError, match=r"needs at least 2 published figures, got 1 \(a\)"):
        fit_roofline("cpu", obs, max_rate=CPU_PEAK)
    with pytest.raises(ValueError, match="got 0"):
        fit_roofline("cpu", [], max_rate=CPU_PEAK)


def test_proportional_figures_are_refused():
    # the same model twice, at twice the size: flops and op counts are proportional, the two
    # parameters cannot be told apart
    nodes = MODELS["a"]
    obs = _observations(_truth("cpu", 7e9, 20.0), "cpu", {"a": nodes, "aa": nodes + nodes})
    with pytest.raises(ValueError, match="cannot separate the rate of cpu from its per-op overhead"):
        fit_roofline("cpu", obs, max_rate=CPU_PEAK)


def test_bad_bounds_are_refused():
    obs = _observations(_truth("cpu", 7e9, 20.0), "cpu", {"a": MODELS["a"], "b": MODELS["b"]})
    with pytest.raises(ValueError, match="empty or negative bounds"):
        fit_roofline("cpu", obs, max_rate=CPU_PEAK, min_rate=CPU_PEAK)
    with pytest.raises(ValueError, match="empty or negative bounds"):
        fit_roofline("cpu", obs, max_rate=CPU_PEAK, min_overhead_us=-1.0)


# --- the per-layer overhead of a CPU -----------------------------------------------------------------


def test_synthetic_models_have_layers_and_other_nodes():
    # the layer fits below need both kinds of node, or they would not test the split
    for nodes in MODELS.values():
        layers = [is_mac_layer(f, a) for f, _, a in nodes]
        assert 0 < sum(layers) < len(layers)


@pytest.mark.parametrize("overhead", ["node", "layer"])
def test_observation_reproduces_node_ms_with_a_layer_overhead(overhead):
    # on a target with both overheads, either one may be the fitted one; the other is a fixed term
    target = _truth("cpu", 6.1e9, 430.0, "layer")
    assert target.host.kernel_overhead.value == 20.0 and target.host.layer_overhead.value == 430.0
    nodes = MODELS["c"]
    obs = observation(target, "cpu", "c", 1.0, nodes, fixed_ms=0.5, overhead=overhead)
    direct = 0.5 + sum(node_ms(target, "cpu", flops=f, param_bytes=p, act_bytes=a) for f, p, a in nodes)
    assert math.isclose(obs.predict_ms(*target_parameters(target, "cpu", overhead)), direct, rel_tol=1e-12)
    layers = sum(is_mac_layer(f, a) for f, _, a in nodes)
    assert obs.ops == (layers if overhead == "layer" else len(nodes))


@pytest.mark.parametrize("models", [("a", "b"), ("a", "b", "c")])
def test_recovers_cpu_rate_and_layer_overhead(models):
    truth = _truth("cpu", 8.1e9, 870.0, "layer")
    obs = _observations(truth, "cpu", {m: MODELS[m] for m in models}, overhead="layer")
    fit = fit_roofline("cpu", obs, max_rate=CPU_PEAK)
    assert fit.overhead == "layer" and fit.exact and fit.at_bound == ()
    assert abs(fit.rate - 8.1e9) <= 1e-9 * 8.1e9
    assert abs(fit.overhead_us - 870.0) <= 1e-9 * 870.0
    # the per-node kernel_overhead stayed a fixed term at the target's 20 us
    assert all(o.fixed_ms >= len(MODELS[o.name]) * 0.020 * (1 - 1e-12) for o in obs)


def test_a_per_node_fit_of_per_layer_data_is_not_exact():
    # the two forms differ where models differ in their share of layers: "e" is "a" with 60 more
    # elementwise nodes, which pay the per-node overhead but not the per-layer one
    elementwise = [n for n in _nodes(5, 180) if not is_mac_layer(n[0], n[2])]
    models = {"a": MODELS["a"], "b": MODELS["b"], "e": MODELS["a"] + elementwise}
    truth = _truth("cpu", 8.1e9, 870.0, "layer")
    obs = _observations(truth, "cpu", models, start=truth)
    fit = fit_roofline("cpu", [observation(ARM, "cpu", o.name, o.measured_ms, models[o.name]) for o in obs],
                       max_rate=CPU_PEAK)
    assert fit.overhead == "node" and not fit.exact
    assert max(abs(r) for r in fit.residuals) > 5e-3  # the per-layer form below: < 1e-12
    layer = fit_roofline("cpu", _observations(truth, "cpu", models, overhead="layer"), max_rate=CPU_PEAK)
    assert layer.exact


def test_layer_rate_above_the_peak_is_clipped():
    truth = _truth("cpu", 30e9, 500.0, "layer")
    obs = _observations(truth, "cpu", {"a": MODELS["a"], "b": MODELS["b"]}, overhead="layer")
    fit = fit_roofline("cpu", obs, max_rate=CPU_PEAK)
    assert fit.rate == pytest.approx(CPU_PEAK, rel=1e-12) and "rate = max_rate (efficiency 1)" in fit.at_bound
    assert fit.overhead_us >= 0 and not fit.exact


def test_refit_target_writes_the_layer_overhead_with_its_source():
    fit = Fit("cpu", 1e3 / 8.7e9, 0.867, (0.0, 0.0), (), "layer")
    fitted = refit_target(ARM, "cpu", fit, "fitted to test data")
    assert ARM.host.layer_overhead is None
    assert fitted.host.layer_overhead.value == pytest.approx(867.0) and fitted.host.layer_overhead.unit == "us"
    assert fitted.host.layer_overhead.source == "fitted to test data"
    assert fitted.host.peak_gflops["float32"].value == pytest.approx(8.7)
    assert fitted.host.kernel_overhead == ARM.host.kernel_overhead  # the per-node figure is untouched
    assert fitted.devices[1] == ARM.devices[1]


def test_layer_overhead_is_a_cpu_figure():
    with pytest.raises(ValueError, match="the edgetpu device has no 'layer' overhead"):
        observation(ARM, "edgetpu", "a", 1.0, MODELS["a"], overhead="layer")
    with pytest.raises(ValueError, match="has no 'layer' overhead"):
        refit_target(ARM, "edgetpu", Fit("edgetpu", 1e-9, 0.01, (), (), "layer"), "x")
    mixed = [observation(ARM, "cpu", "a", 1.0, MODELS["a"]),
             observation(ARM, "cpu", "b", 1.0, MODELS["b"], overhead="layer")]
    with pytest.raises(ValueError, match="free different overheads"):
        fit_roofline("cpu", mixed, max_rate=CPU_PEAK)


def test_grouped_convolutions_at_their_own_rate_are_a_fixed_term():
    # a target with a float32_grouped rate: grouped nodes keep it, the fit recovers the dense rate
    data = _truth("cpu", 7.0e9, 40.0).model_dump(mode="json")
    data["devices"][0]["peak_gflops"]["float32_grouped"] = {"value": 1.5, "unit": "GFLOP/s", "source": "test"}
    truth = Target.model_validate(data)
    models = {k: [(f, p, a, i % 4 == 1) for i, (f, p, a) in enumerate(v)] for k, v in MODELS.items()}
    obs = []
    for name, nodes in models.items():
        total = sum(node_ms(truth, "cpu", flops=f, param_bytes=p, act_bytes=a, grouped=g) for f, p, a, g in nodes)
        obs.append(observation(truth, "cpu", name, total, nodes))
    assert math.isclose(obs[0].predict_ms(*target_parameters(truth, "cpu")), obs[0].measured_ms, rel_tol=1e-12)
    fit = fit_roofline("cpu", obs, max_rate=CPU_PEAK)
    assert fit.exact and abs(fit.rate - 7.0e9) <= 1e-9 * 7.0e9 and abs(fit.overhead_us - 40.0) <= 1e-9 * 40.0
