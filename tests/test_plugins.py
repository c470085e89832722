"""One file suffices to add a device kind and a backend: this test file alone registers a
fake accelerator kind (its target entry, its device model) and a fake backend (its compiler, its
lowering check), writes a target file that uses the kind, and builds a real model with them: legalize
asks the kind's model, the schedule places the model's work on it, the package stage has the fake
backend compile it, and the bundle verifies and matches onnxruntime. Nothing of edgesdk is edited.

TEST DOUBLES: "fakeacc" stands for an accelerator we do not have; its backend writes the segment's ONNX
graph, which the bundle runs with the onnxruntime runner (`runner="onnxruntime"`).
"""

from __future__ import annotations

import json
from typing import Literal

import numpy as np
import onnxruntime as ort
import yaml

from edgesdk import backends, config
from edgesdk.backends import Backend, Compiled
from edgesdk.config import Figure, Link
from edgesdk.devices import registry
from edgesdk.devices.model import Refusal
from edgesdk.devices.terms import NodeTerms
from edgesdk.ir import model as irm
from edgesdk.runtime.manifest import TensorSpec
from tests.numeric import assert_close
from tests.test_interrupted_build import tiny_model
from tests.model_zoo import ROOT

TAKES = {"MatMul", "Gemm", "Relu", "Add"}


class FakeAccDevice(config.target._Strict):
    """The fake kind's entry in a target file."""

    kind: Literal["fakeacc"]
    name: str
    count: int = 1
    physical: list[str]
    peak_gflops: Figure
    kernel_overhead: Figure
    link: Link

    def logical_ids(self) -> list[str]:
        return [f"fakeacc:{i}" for i in range(self.count)]


class FakeAccModel:
    kind = "fakeacc"
    schema = FakeAccDevice
    preference = 5
    backends = ("fake",)
    rate_figure = ("peak_gflops", None, 1e9)
    fittable_overheads = {"node": "kernel_overhead"}
    reasons = {"fakeacc.unsupported-op": "the fake accelerator runs matrix products, additions and ReLU only"}
    unlowerable: dict = {}
    approximable = frozenset()
    rewrite_triggers: dict = {}
    int8 = False

    def refusal(self, node, shapes, consts, types):
        return None if node.op_type in TAKES else Refusal("fakeacc.unsupported-op", self.reasons["fakeacc.unsupported-op"])

    def node_terms(self, dev, *, flops, param_bytes, act_bytes, streamed_fraction=0.0, grouped=False, threads=None):
        return NodeTerms(flops, "peak_gflops", flops / (dev.peak_gflops.value * 1e9), 0.0, 0.0,
                         (("kernel_overhead", dev.kernel_overhead.value),))

    def link(self, dev):
        return dev.link.latency.value * 1e-3, 1e3 / (dev.link.bandwidth.value * 1e6)

    def streamed_fraction(self, specs, param_bytes):
        return 0.0


compiled_segments: list[str] = []


def compile_fake(job) -> Compiled:
    """The fake backend's compiler: the segment's graph as it is."""
    compiled_segments.append(job.segment.id)
    artifact = f"segments/{job.segment.id}.fake.onnx"
    irm.save(job.model, job.segments_dir.parent / artifact)
    shapes, types = irm.static_shapes(job.model), irm.elem_types(job.model)
    spec = lambda n: TensorSpec(n, shapes[n], irm.dtype_name(types[n]))  # noqa: E731
    return Compiled(artifact, tuple(map(spec, job.segment.inputs)), tuple(map(spec, job.segment.outputs)))


def fake_lowering(node, shapes, consts) -> str | None:
    return None if node.op_type in TAKES else f"the fake backend has no kernel for {node.op_type}"


FAKE_BACKEND = Backend("fake", runner="onnxruntime", rank=9, runtime_dists=("onnxruntime",),
                       compiler=f"{__name__}:compile_fake", lowering=f"{__name__}:fake_lowering")


def _target(path):
    data = yaml.safe_load((ROOT / "targets" / "x86.yaml").read_text())
    data["name"] = "x86_fakeacc"
    fig = lambda v, unit: {"value": v, "unit": unit, "source": "test double"}  # noqa: E731
    data["devices"].append({"kind": "fakeacc", "name": "fake accelerator", "physical": ["fake:0"],
                            "peak_gflops": fig(1e5, "GFLOP/s"), "kernel_overhead": fig(0.1, "us"),
                            "link": {"name": "fake", "bandwidth": fig(1e5, "MB/s"), "latency": fig(0.1, "us")}})
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_device_kind_and_a_backend_from_this_file_alone(tmp_path):
    from edgesdk.pipeline import BuildOptions, build
    from edgesdk.runtime import BundleModel
    from edgesdk.verify import verify

    schema_before = json.dumps(config.target_schema(), sort_keys=True)
    config.register_device_schema(FakeAccDevice)
    try:
        with registry.registered(FakeAccModel()), backends.registered(FAKE_BACKEND):
            model = tiny_model(tmp_path / "m.onnx", 0)
            result = build(BuildOptions(model=model, target=str(_target(tmp_path / "t.yaml")), out=tmp_path / "out",
                                        tuning_db=tmp_path / "db"))
            plan = json.loads((tmp_path / "out" / ".build" / "3-schedule" / "plan.json").read_text())
            manifest = json.loads((result.bundle / "manifest.json").read_text())
            assert [(s["device"], s["backend"]) for s in plan["segments"]] == [("fakeacc:0", "fake")]
            assert [(s["device"], s["backend"], s["artifact"]) for s in manifest["segments"]] == \
                [("fakeacc:0", "onnxruntime", "segments/s0.fake.onnx")]
            assert manifest["device_map"] == {"cpu": "cpu", "fakeacc:0": "fake:0"}
            assert compiled_segments == ["s0"]
            assert verify(result.bundle).selftest == "passed"
            x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
            got = BundleModel(result.bundle, log=lambda s: None).run({"x": x})["y"]
            want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
            assert_close(got, want)
    finally:
        config.unregister_device_schema("fakeacc")
    # nothing leaks into later tests: the kind, its schema and the backend are gone
    assert json.dumps(config.target_schema(), sort_keys=True) == schema_before
    assert "fakeacc" not in [m.kind for m in registry.models()] and "fake" not in [b.name for b in backends.backends()]
