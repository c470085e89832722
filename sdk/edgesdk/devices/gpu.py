"""An NVIDIA GPU: a float32 roofline plus a kernel launch, behind a PCIe link.

Backend: TVM (CUDA) for every op its ONNX importer converts.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config import GpuDevice
from .terms import NodeTerms


class GpuModel:
    kind = "gpu"
    schema = GpuDevice
    preference = 1
    backends = ("tvm",)
    rate_figure = ("peak_tflops", "float32", 1e12)
    fittable_overheads = {"node": "kernel_overhead"}
    reasons = {"gpu.tvm-unsupported": "TVM's ONNX importer has no converter for this op, so no GPU kernel is generated"}
    unlowerable = {"tvm": ("gpu.tvm-unsupported", reasons["gpu.tvm-unsupported"])}
    approximable = frozenset({"gpu.tvm-unsupported"})
    rewrite_triggers: dict[str, str] = {}
    int8 = False

    def refusal(self, node, shapes, consts, types) -> None:
        return None  # no limits of its own: what TVM's CUDA backend lowers, it runs

    def node_terms(self, dev: GpuDevice, *, flops: float, param_bytes: int, act_bytes: int,
                   streamed_fraction: float = 0.0, grouped: bool = False, threads: int | None = None) -> NodeTerms:
        compute = flops / (dev.peak_tflops["float32"].value * 1e12)
        memory = (param_bytes + act_bytes) / (dev.memory_bandwidth.value * 1e9)
        return NodeTerms(flops, "peak_tflops.float32", compute, memory, 0.0,
                         (("kernel_overhead", dev.kernel_overhead.value),))

    def link(self, dev: GpuDevice) -> tuple[float, float]:
        return dev.link.latency.value * 1e-3, 1e3 / (dev.link.bandwidth.value * 1e6)

    def streamed_fraction(self, specs: Sequence[GpuDevice], param_bytes: int) -> float:
        return 0.0  # the weights stay in the GPU's memory


MODEL = GpuModel()
