"""The cost formula exists once (`devices/terms.py`): the scheduler's `node_ms`, calibration's
`predict_ms` and the fit's `node_terms` derive from `terms_ms`. Frozen copies of the three formulas as
they stood before give the same numbers: `node_ms` and `predict_ms` bit for bit (they reach plan.json
and the placement DP's choices), the fit's terms to the last bit or two (the floor is now taken as
1e3 * (bytes / bandwidth) rather than 1e3 * bytes / bandwidth)."""

from __future__ import annotations

import itertools
import math

import pytest

from edgesdk.config import CpuDevice, EdgeTpuDevice, GpuDevice, Target, load_target
from edgesdk.devices import calibrate, fit
from edgesdk.devices.cost import is_mac_layer, node_ms
from edgesdk.devices.terms import NodeTerms, terms_ms


# --- the formulas as they were (devices/cost.py, devices/calibrate.py, devices/fit.py at c4e5e36) -------


def _old_node_ms(target, kind, *, flops, param_bytes, act_bytes, streamed_fraction=0.0, grouped=False,
                 threads=None):
    dev = next(d for d in target.devices if d.kind == kind)
    if isinstance(dev, CpuDevice):
        peak = dev.peak_gflops.get("float32_grouped") if grouped else None
        compute = flops / ((peak or dev.peak_gflops["float32"]).value * 1e9)
        if threads is not None and threads < dev.cores:
            e = dev.parallel_efficiency.value if dev.parallel_efficiency is not None else 1.0
            compute *= (1 + e * (dev.cores - 1)) / (1 + e * (threads - 1))
        memory = (param_bytes + act_bytes) / (dev.memory_bandwidth.value * 1e9)
        overhead = dev.kernel_overhead.value
        if dev.layer_overhead is not None and is_mac_layer(flops, act_bytes):
            overhead += dev.layer_overhead.value
        return 1e3 * (max(compute, memory) + overhead * 1e-6)
    if isinstance(dev, EdgeTpuDevice):
        compute = flops / (dev.peak_tops_int8.value * 1e12)
        streamed = streamed_fraction * param_bytes / 4 / (dev.link.bandwidth.value * 1e6)
        return 1e3 * (compute + streamed + dev.kernel_overhead.value * 1e-6)
    if isinstance(dev, GpuDevice):
        compute = flops / (dev.peak_tflops["float32"].value * 1e12)
        memory = (param_bytes + act_bytes) / (dev.memory_bandwidth.value * 1e9)
        return 1e3 * (max(compute, memory) + dev.kernel_overhead.value * 1e-6)
    raise ValueError(kind)


def _old_predict_ms(flops, nbytes, peak_gflops, bandwidth_gbps, overhead_us):
    return 1e3 * (max(flops / (peak_gflops * 1e9), nbytes / (bandwidth_gbps * 1e9)) + overhead_us * 1e-6)


def _old_fit_terms(target, kind, *, flops, param_bytes, act_bytes, streamed_fraction=0.0, grouped=False,
                   overhead="node"):
    dev = next(d for d in target.devices if d.kind == kind)
    if isinstance(dev, (CpuDevice, GpuDevice)):
        memory = 1e3 * (param_bytes + act_bytes) / (dev.memory_bandwidth.value * 1e9)
        fixed, pays = 0.0, True
        if isinstance(dev, CpuDevice):
            layer = is_mac_layer(flops, act_bytes)
            if overhead == "layer":
                fixed, pays = dev.kernel_overhead.value * 1e-3, layer
            elif dev.layer_overhead is not None and layer:
                fixed = dev.layer_overhead.value * 1e-3
            grouped_rate = dev.peak_gflops.get("float32_grouped") if grouped else None
            if grouped_rate is not None:
                return 0.0, 0.0, fixed + max(1e3 * flops / (grouped_rate.value * 1e9), memory), pays
        return flops, memory, fixed, pays
    if isinstance(dev, EdgeTpuDevice):
        return flops, 0.0, 1e3 * streamed_fraction * param_bytes / 4 / (dev.link.bandwidth.value * 1e6), True
    raise ValueError(kind)


# --- the grid -------------------------------------------------------------------------------------------


def _variant(name: str, **cpu) -> Target:
    data = load_target(name)[0].model_dump(mode="json")
    data["devices"][0].update(cpu)
    return Target.model_validate(data)


def _figure(value, unit):
    return {"value": value, "unit": unit, "source": "test"}


def _targets() -> list[Target]:
    arm, gpu, x86 = (load_target(n)[0] for n in ("arm_2tpu", "rtx3090", "x86"))
    grouped = arm.model_dump(mode="json")["devices"][0]["peak_gflops"]
    grouped["float32_grouped"] = _figure(1.7, "GFLOP/s")
    return [arm, gpu, x86,
            _variant("arm_2tpu", layer_overhead=None),
            _variant("arm_2tpu", peak_gflops=grouped, parallel_efficiency=_figure(0.83, "1")),
            _variant("x86", layer_overhead=_figure(3.3, "us"), parallel_efficiency=_figure(0.61, "1"))]


TARGETS = _targets()
FLOPS = (0.0, 1.0, 97.0, 12_345.0, 3.7e6, 2.9e9)
PARAMS = (0, 4, 1_000, 3_456_788)
ACTS = (0, 8, 12_348, 9_000_004)
STREAMED = (0.0, 0.37, 1.0)


def _grid(target: Target):
    for d in target.devices:
        threads = (None, *sorted({1, 2, d.cores})) if d.kind == "cpu" else (None,)
        for f, p, a, s, g, t in itertools.product(FLOPS, PARAMS, ACTS, STREAMED, (False, True), threads):
            yield d.kind, dict(flops=f, param_bytes=p, act_bytes=a, streamed_fraction=s, grouped=g, threads=t)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_node_ms_is_the_old_formula_bit_for_bit(target):
    n = 0
    for kind, kw in _grid(target):
        new, old = node_ms(target, kind, **kw), _old_node_ms(target, kind, **kw)
        assert new.hex() == old.hex(), (kind, kw, new, old)
        n += 1
    assert n > 1000


def test_predict_ms_is_the_old_formula_bit_for_bit():
    for f, b, peak, bw, o in itertools.product(FLOPS, (0.0, 8.0, 4.4e5, 1.2e8), (0.5, 8.744, 97.3),
                                              (3.1, 12.8, 59.7), (0.0, 1.7, 20.0, 867.0)):
        assert calibrate.predict_ms(f, b, peak, bw, o).hex() == _old_predict_ms(f, b, peak, bw, o).hex()


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_the_fit_sees_the_old_terms(target):
    for kind, kw in _grid(target):
        if kw.pop("threads") is not None or kind == "gpu" and kw["grouped"]:
            continue
        for overhead in ("node", "layer") if kind == "cpu" else ("node",):
            new = fit.node_terms(target, kind, overhead=overhead, **kw)
            old = _old_fit_terms(target, kind, overhead=overhead, **kw)
            assert new[3] == old[3] and new[0] == old[0], (kind, kw, overhead)
            assert all(math.isclose(a, b, rel_tol=4e-16, abs_tol=0.0) for a, b in zip(new[1:3], old[1:3])), \
                (kind, kw, overhead, new, old)


def test_terms_add_up_in_order():
    t = NodeTerms(1e6, "peak_gflops.float32", compute=2e-4, memory=3e-4, link=1e-5,
                  overheads=(("kernel_overhead", 20.0), ("layer_overhead", 867.0)))
    assert terms_ms(t) == 1e3 * (3e-4 + 1e-5 + (20.0 + 867.0) * 1e-6)
    assert terms_ms(NodeTerms(0.0, "peak_tops_int8", 0.0)) == 0.0
