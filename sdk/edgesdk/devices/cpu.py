"""The host CPU: a roofline with per-kernel and per-layer overheads, scaled to the threads a node gets.

Backends: TVM (LLVM) for every op its ONNX importer converts, onnxruntime for the other standard ops.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config import HOST, CpuDevice
from .cost import is_mac_layer
from .terms import NodeTerms


class CpuModel:
    kind = HOST
    schema = CpuDevice
    preference = 0  # the host is never an accelerator; it runs what none takes
    backends = ("tvm", "onnxruntime")
    rate_figure = ("peak_gflops", "float32", 1e9)
    fittable_overheads = {"node": "kernel_overhead", "layer": "layer_overhead"}
    reasons = {"cpu.tvm-unsupported": "TVM's ONNX importer has no converter for this op: onnxruntime runs it on the CPU"}
    unlowerable = {"tvm": ("cpu.tvm-unsupported", reasons["cpu.tvm-unsupported"])}
    approximable = frozenset()
    rewrite_triggers: dict[str, str] = {}
    int8 = False

    def refusal(self, node, shapes, consts, types) -> None:
        return None  # the host takes whatever one of its backends lowers

    def node_terms(self, dev: CpuDevice, *, flops: float, param_bytes: int, act_bytes: int,
                   streamed_fraction: float = 0.0, grouped: bool = False, threads: int | None = None,
                   backend: str | None = None) -> NodeTerms:
        """`threads` (default: all P cores) runs the node on fewer cores: the compute term scales by
        (1 + e (P - 1)) / (1 + e (threads - 1)) with the CPU's `parallel_efficiency` e (1 when absent:
        perfect scaling); the memory term does not (the bandwidth is shared), nor do the overheads.

        A convolution or matrix product (`cost.is_mac_layer`) pays a `layer_overhead` on top of
        `kernel_overhead` (listed at 0 us when the CPU has none): a fixed cost per layer (its kernel's
        setup, operand packing, the fork and join of its threads) that elementwise ops, fused into the
        layer before them by CPU runtimes, do not pay. A grouped convolution runs at `float32_grouped`
        where the target gives it.

        `backend` (the backend that compiles the node's segment) takes that backend's own figures where
        the CPU lists it under `backends`, figure by figure; the device's figures fill in the rest. Where
        the backend has a cache tier, a node whose bytes fit in `cache_capacity` moves them at
        `cache_bandwidth`."""
        own = dev.backends.get(backend) if backend is not None else None
        peaks = {**dev.peak_gflops, **own.peak_gflops} if own is not None else dev.peak_gflops
        bandwidth = (own.memory_bandwidth if own is not None else None) or dev.memory_bandwidth
        if own is not None and own.cache_bandwidth is not None \
                and param_bytes + act_bytes <= own.cache_capacity.value * 2**20:
            bandwidth = own.cache_bandwidth
        kernel = (own.kernel_overhead if own is not None else None) or dev.kernel_overhead
        layer = (own.layer_overhead if own is not None else None) or dev.layer_overhead
        peak = peaks.get("float32_grouped") if grouped else None
        rate = "peak_gflops.float32_grouped" if peak is not None else "peak_gflops.float32"
        compute = flops / ((peak or peaks["float32"]).value * 1e9)
        if threads is not None and threads < dev.cores:
            e = dev.parallel_efficiency.value if dev.parallel_efficiency is not None else 1.0
            compute *= (1 + e * (dev.cores - 1)) / (1 + e * (threads - 1))
        memory = (param_bytes + act_bytes) / (bandwidth.value * 1e9)
        overheads = [("kernel_overhead", kernel.value)]
        if is_mac_layer(flops, act_bytes):
            overheads.append(("layer_overhead", layer.value if layer is not None else 0.0))
        return NodeTerms(flops, rate, compute, memory, 0.0, tuple(overheads))

    def link(self, dev: CpuDevice) -> None:
        return None  # the host: tensors stay in its memory

    def streamed_fraction(self, specs: Sequence[CpuDevice], param_bytes: int) -> float:
        return 0.0


MODEL = CpuModel()
