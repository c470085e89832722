"""A first cost model: a roofline per segment, from the target's published figures.

    t(segment) = overhead * nodes + max(flops / peak, bytes / bandwidth) + transfers

For an Edge TPU, weights beyond the on-chip parameter cache are streamed over the link on every
inference (Coral's compiler docs), and every tensor that enters or leaves the accelerator crosses
the link: t_link = latency + bytes / bandwidth. Every figure comes from the target file, which
names its source. This is the simple model of the end-to-end issue; the scheduling issue fits it.
"""

from __future__ import annotations

import math

import onnx

from ..config import CpuDevice, EdgeTpuDevice, GpuDevice, Target


def node_flops(node: onnx.NodeProto, shapes: dict[str, tuple[int, ...]]) -> float:
    """Multiply-accumulates counted as 2 flops; elementwise ops as one flop per output element."""
    out = shapes.get(node.output[0]) if node.output else None
    out_elems = math.prod(out) if out else 0
    if node.op_type in ("Conv", "ConvTranspose") and len(node.input) > 1 and node.input[1] in shapes:
        w = shapes[node.input[1]]  # (M, C/group, kh, kw)
        return 2.0 * out_elems * math.prod(w[1:])
    if node.op_type in ("Gemm", "MatMul") and node.input[0] in shapes:
        k = shapes[node.input[0]][-1]
        return 2.0 * out_elems * k
    return float(out_elems)


def tensor_bytes(shape: tuple[int, ...] | None, itemsize: int = 4) -> int:
    return itemsize * math.prod(shape) if shape else 0


def segment_ms(target: Target, device_id: str, *, flops: float, param_bytes: int, io_bytes: int,
               act_bytes: int, nodes: int) -> float:
    kind = device_id.split(":")[0]
    dev = next(d for d in target.devices if d.kind == kind)
    if isinstance(dev, CpuDevice):
        compute = flops / (dev.peak_gflops["float32"].value * 1e9)
        memory = (param_bytes + act_bytes) / (dev.memory_bandwidth.value * 1e9)
        return 1e3 * (max(compute, memory) + nodes * dev.kernel_overhead.value * 1e-6)
    if isinstance(dev, EdgeTpuDevice):
        compute = flops / (dev.peak_tops_int8.value * 1e12)
        # int8 weights: 1 byte each; what does not fit on chip streams over the link every time
        weights = param_bytes / 4
        streamed = max(0.0, weights - dev.on_chip_memory.value * 1e6)
        link = dev.link
        transfer = 2 * link.latency.value * 1e-6 + (io_bytes / 4 + streamed) / (link.bandwidth.value * 1e6)
        return 1e3 * (compute + transfer + nodes * dev.kernel_overhead.value * 1e-6)
    if isinstance(dev, GpuDevice):
        compute = flops / (dev.peak_tflops["float32"].value * 1e12)
        memory = (param_bytes + act_bytes) / (dev.memory_bandwidth.value * 1e9)
        link = dev.link
        transfer = 2 * link.latency.value * 1e-6 + io_bytes / (link.bandwidth.value * 1e6)
        return 1e3 * (max(compute, memory) + transfer + nodes * dev.kernel_overhead.value * 1e-6)
    raise ValueError(device_id)
