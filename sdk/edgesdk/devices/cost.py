"""A first cost model: a roofline per node, from the target's published figures.

    t(node on a device) = max(flops / peak, bytes / bandwidth) + overhead

A segment costs the sum of its nodes plus its transfers (`scheduling.placement.segment_ms`). For an
Edge TPU, weights beyond the on-chip parameter cache are streamed over the link on every inference
(Coral's compiler docs), and every tensor that enters or leaves the accelerator crosses the link:
t_link = latency + bytes / bandwidth. Every figure comes from the target file, which names its
source. This is the simple model of the end-to-end issue; the scheduling issue fits it.
"""

from __future__ import annotations

import math

import onnx

from ..config import CpuDevice, EdgeTpuDevice, GpuDevice, Target
from .terms import NodeTerms, terms_ms


def node_flops(node: onnx.NodeProto, shapes: dict[str, tuple[int, ...]]) -> float:
    """Multiply-accumulates counted as 2 flops; elementwise ops as one flop per output element."""
    out = shapes.get(node.output[0]) if node.output else None
    out_elems = math.prod(out) if out else 0
    if node.op_type == "Conv" and len(node.input) > 1 and node.input[1] in shapes:
        w = shapes[node.input[1]]  # (M, C/group, kh, kw)
        return 2.0 * out_elems * math.prod(w[1:])
    if node.op_type == "ConvTranspose" and len(node.input) > 1 and node.input[1] in shapes and node.input[0] in shapes:
        # (C, M/group, kh, kw): every input element is scattered into M/group * kh * kw outputs
        w = shapes[node.input[1]]
        return 2.0 * math.prod(shapes[node.input[0]]) * math.prod(w[1:])
    if node.op_type in ("Gemm", "MatMul") and node.input[0] in shapes:
        k = shapes[node.input[0]][-1]
        return 2.0 * out_elems * k
    return float(out_elems)


def tensor_bytes(shape: tuple[int, ...] | None, itemsize: int = 4) -> int:
    return itemsize * math.prod(shape) if shape else 0


def node_bytes(node: onnx.NodeProto, shapes: dict[str, tuple[int, ...]], constants: set[str]) -> tuple[int, int]:
    """(parameter bytes, activation bytes) a node reads and writes: its constant inputs are parameters;
    every other tensor it reads or writes is an activation, counted once per use."""
    params = sum(tensor_bytes(shapes.get(t)) for t in node.input if t in constants)
    acts = sum(tensor_bytes(shapes.get(t)) for t in [*node.input, *node.output] if t and t not in constants)
    return params, acts


# --- per node, for the placement DP -------------------------------------------------------------


def node_ms(target: Target, kind: str, *, flops: float, param_bytes: int, act_bytes: int,
            streamed_fraction: float = 0.0, grouped: bool = False, threads: int | None = None) -> float:
    """One node on one device kind: the roofline term plus the device's per-op overhead, i.e.
    `terms.terms_ms` of the node's `node_terms`."""
    return terms_ms(node_terms(target, kind, flops=flops, param_bytes=param_bytes, act_bytes=act_bytes,
                               streamed_fraction=streamed_fraction, grouped=grouped, threads=threads))


def node_terms(target: Target, kind: str, *, flops: float, param_bytes: int, act_bytes: int,
               streamed_fraction: float = 0.0, grouped: bool = False, threads: int | None = None) -> NodeTerms:
    """The terms of one node on one device kind (`terms.NodeTerms`).

    On a CPU, `threads` (default: all P cores) runs the node on fewer cores: the compute term scales
    by (1 + e (P - 1)) / (1 + e (threads - 1)) with the CPU's `parallel_efficiency` e (1 when absent:
    perfect scaling); the memory term does not (the bandwidth is shared), nor do the overheads.

    On a CPU, a convolution or matrix product (`is_mac_layer`) pays a `layer_overhead` on top of
    `kernel_overhead` (listed at 0 us when the CPU has none): a fixed cost per layer (its kernel's setup,
    operand packing, the fork and join of its threads) that elementwise ops, fused into the layer
    before them by CPU runtimes, do not pay.

    On an Edge TPU, compute is int8 at the peak rate; `streamed_fraction` of the node's int8 weights
    (1 byte per float32 parameter's 4) comes over the link on every inference because the model's
    weights do not all fit the on-chip cache (see `streamed_fraction`)."""
    dev = target.device(kind)
    if isinstance(dev, CpuDevice):
        peak = dev.peak_gflops.get("float32_grouped") if grouped else None
        rate = "peak_gflops.float32_grouped" if peak is not None else "peak_gflops.float32"
        compute = flops / ((peak or dev.peak_gflops["float32"]).value * 1e9)
        if threads is not None and threads < dev.cores:
            e = dev.parallel_efficiency.value if dev.parallel_efficiency is not None else 1.0
            compute *= (1 + e * (dev.cores - 1)) / (1 + e * (threads - 1))
        memory = (param_bytes + act_bytes) / (dev.memory_bandwidth.value * 1e9)
        overheads = [("kernel_overhead", dev.kernel_overhead.value)]
        if is_mac_layer(flops, act_bytes):
            overheads.append(("layer_overhead", dev.layer_overhead.value if dev.layer_overhead is not None else 0.0))
        return NodeTerms(flops, rate, compute, memory, 0.0, tuple(overheads))
    if isinstance(dev, EdgeTpuDevice):
        compute = flops / (dev.peak_tops_int8.value * 1e12)
        streamed = streamed_fraction * param_bytes / 4 / (dev.link.bandwidth.value * 1e6)
        return NodeTerms(flops, "peak_tops_int8", compute, 0.0, streamed, (("kernel_overhead", dev.kernel_overhead.value),))
    if isinstance(dev, GpuDevice):
        compute = flops / (dev.peak_tflops["float32"].value * 1e12)
        memory = (param_bytes + act_bytes) / (dev.memory_bandwidth.value * 1e9)
        return NodeTerms(flops, "peak_tflops.float32", compute, memory, 0.0,
                         (("kernel_overhead", dev.kernel_overhead.value),))
    raise ValueError(kind)


def is_mac_layer(flops: float, act_bytes: int) -> bool:
    """A convolution or a matrix product, told from the two numbers every cost function has: `node_flops`
    counts 2K flops per output element of a K-long multiply-accumulate and one flop per output element
    of any other op, and a node reads or writes at least its output (act_bytes / 4 float32 elements),
    so any other op does at most one flop per activation element. A convolution or matrix product does
    more (2K * out > in + out) unless it is degenerate: a strided 1x1 convolution to 1 or 2 channels
    would count as no layer. A CPU's `layer_overhead` is paid by these nodes."""
    return flops > act_bytes / 4


def is_grouped(node: onnx.NodeProto) -> bool:
    """A grouped or depthwise convolution: costed at the CPU's `float32_grouped` rate where given."""
    return node.op_type in ("Conv", "ConvTranspose") and any(
        a.name == "group" and a.i > 1 for a in node.attribute)


def streamed_fraction(target: Target, tpu_param_bytes: int) -> float:
    """The share of the Edge TPU weights that do not fit the on-chip cache when `tpu_param_bytes`
    (float32) of parameters run there: Coral's compiler caches as much as fits and streams the rest
    every inference. Spread evenly over the nodes, so the DP's cost stays a sum over nodes."""
    tpus = target.devices_of("edgetpu")
    if not tpus or tpu_param_bytes <= 0:
        return 0.0
    capacity = tpus[0].on_chip_memory.value * 1e6 * sum(d.count for d in tpus)
    int8 = tpu_param_bytes / 4
    return max(0.0, 1.0 - capacity / int8)


def link_ms_per_byte(target: Target, kind: str) -> tuple[float, float]:
    """(latency ms, ms per float32 byte) of the link between the host and an accelerator kind. An Edge
    TPU segment's inputs and outputs are int8: a quarter of the float32 bytes cross."""
    dev = target.device(kind)
    per_byte = 1e3 / (dev.link.bandwidth.value * 1e6)
    if isinstance(dev, EdgeTpuDevice):
        per_byte /= 4
    return dev.link.latency.value * 1e-3, per_byte
