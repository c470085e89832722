"""The device registry: one model per kind, looked up by kind, ordered host first then by preference;
a dummy kind registered for one test leaves nothing behind; the fit's tables are views of it."""

from __future__ import annotations

import pytest

from edgesdk.config import HOST, CpuDevice, EdgeTpuDevice, GpuDevice, load_target
from edgesdk.devices import cpu, edgetpu, fit, gpu, registry
from edgesdk.devices.cost import link_ms_per_byte, node_ms, streamed_fraction
from edgesdk.devices.terms import NodeTerms, terms_ms
from edgesdk.errors import UsageError


class FakeAccelerator:
    """A dummy kind: no hardware, every node 1 ms plus a 5 us launch, a free link."""

    kind = "fakeacc"
    schema = EdgeTpuDevice
    preference = 0  # ties with the Edge TPU: the kind's name breaks it
    backends = ("onnxruntime",)
    rate_figure = ("peak_tops_int8", None, 1e12)
    fittable_overheads = {"node": "kernel_overhead", "launch": "launch_overhead"}

    def node_terms(self, spec, *, flops, param_bytes, act_bytes, streamed_fraction=0.0, grouped=False, threads=None):
        return NodeTerms(flops, "peak_tops_int8", 1e-3, overheads=(("kernel_overhead", 5.0),))

    def link(self, spec):
        return 0.0, 0.0

    def streamed_fraction(self, specs, param_bytes):
        return 0.0


def test_the_shipped_kinds_in_order():
    assert [m.kind for m in registry.models()] == [HOST, "edgetpu", "gpu"]
    assert registry.model("cpu") is cpu.MODEL and registry.model("edgetpu") is edgetpu.MODEL
    assert registry.model("gpu") is gpu.MODEL
    assert [(m.schema, m.backends) for m in registry.models()] == [
        (CpuDevice, ("tvm", "onnxruntime")), (EdgeTpuDevice, ("tflite",)), (GpuDevice, ("tvm",))]
    assert [m.kind for m in registry.accelerators(["gpu", "cpu", "edgetpu"])] == ["edgetpu", "gpu"]


def test_an_unknown_kind_is_named():
    with pytest.raises(UsageError) as e:
        registry.model("npu")
    assert e.value.code == "device.unknown-kind" and e.value.message == "no device model of kind 'npu'"
    assert e.value.hint == "known kinds: cpu, edgetpu, gpu"


def test_a_kind_registers_once():
    with pytest.raises(ValueError, match="kind 'edgetpu' is already registered"):
        registry.register(edgetpu.MODEL)


def test_a_registered_dummy_is_used_and_removed():
    arm, _ = load_target("arm_2tpu")
    # a target entry of the dummy's kind, sharing the Edge TPU's schema for this test
    target = arm.model_copy(update={"devices": [*arm.devices, arm.devices[1].model_copy(update={"kind": "fakeacc"})]})
    with registry.registered(FakeAccelerator()) as fake:
        assert [m.kind for m in registry.models()] == ["cpu", "edgetpu", "fakeacc", "gpu"]
        assert registry.model("fakeacc") is fake
        assert node_ms(target, "fakeacc", flops=1e9, param_bytes=4, act_bytes=4) == terms_ms(
            NodeTerms(1e9, "peak_tops_int8", 1e-3, overheads=(("kernel_overhead", 5.0),)))
        assert link_ms_per_byte(target, "fakeacc") == (0.0, 0.0)
        assert streamed_fraction(target, 10**9, kind="fakeacc") == 0.0
        assert fit.RATE_FIELD["fakeacc"] == ("peak_tops_int8", None, 1e12)
        assert fit.OVERHEADS["node"] == ("kernel_overhead", ("cpu", "edgetpu", "fakeacc", "gpu"))
        assert fit.OVERHEADS["launch"] == ("launch_overhead", ("fakeacc",))
    assert [m.kind for m in registry.models()] == ["cpu", "edgetpu", "gpu"]
    assert "fakeacc" not in fit.RATE_FIELD and "launch" not in fit.OVERHEADS


def test_the_fit_tables_are_the_models():
    assert dict(fit.RATE_FIELD) == {"cpu": ("peak_gflops", "float32", 1e9), "edgetpu": ("peak_tops_int8", None, 1e12),
                                    "gpu": ("peak_tflops", "float32", 1e12)}
    assert dict(fit.OVERHEADS) == {"node": ("kernel_overhead", ("cpu", "edgetpu", "gpu")),
                                   "layer": ("layer_overhead", ("cpu",))}


def test_every_schema_has_a_model_of_its_kind():
    from edgesdk.config.target import DEVICE_KINDS, DEVICE_SCHEMAS

    assert [(registry.model(k).kind, registry.model(k).schema) for k in DEVICE_KINDS] == list(
        zip(DEVICE_KINDS, DEVICE_SCHEMAS))
