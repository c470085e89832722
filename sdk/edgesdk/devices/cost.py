"""A first cost model: a roofline per node, from the target's published figures.

    t(node on a device) = max(flops / peak, bytes / bandwidth) + overhead

A segment costs the sum of its nodes plus its transfers (`scheduling.placement.segment_ms`). For an
Edge TPU, weights beyond the on-chip parameter cache are streamed over the link on every inference
(Coral's compiler docs), and every tensor that enters or leaves the accelerator crosses the link:
t_link = latency + bytes / bandwidth. Every figure comes from the target file, which names its
source; `devices/fit.py` fits a device's free figures to published latencies (docs/cost-figures.md).
"""

from __future__ import annotations

import math

import onnx

from ..config import Target
from .registry import model
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
            streamed_fraction: float = 0.0, grouped: bool = False, threads: int | None = None,
            backend: str | None = None) -> float:
    """One node on one device kind: the roofline term plus the device's per-op overhead, i.e.
    `terms.terms_ms` of the node's `node_terms`."""
    return terms_ms(node_terms(target, kind, flops=flops, param_bytes=param_bytes, act_bytes=act_bytes,
                               streamed_fraction=streamed_fraction, grouped=grouped, threads=threads, backend=backend))


def node_terms(target: Target, kind: str, *, flops: float, param_bytes: int, act_bytes: int,
               streamed_fraction: float = 0.0, grouped: bool = False, threads: int | None = None,
               backend: str | None = None) -> NodeTerms:
    """The terms of one node on the target's device of `kind` (`terms.NodeTerms`), as the kind's device
    model gives them (`devices/<kind>.py`): `threads` matters on a CPU, `streamed_fraction` (see
    `streamed_fraction`) on an Edge TPU, `grouped` where the device has a grouped-convolution rate,
    `backend` on a CPU whose target lists figures of that backend (`CpuDevice.backends`). A model is
    given `backend` only when there is one, so a device model of an accelerator need not take it."""
    extra = {"backend": backend} if backend is not None else {}
    return model(kind).node_terms(target.device(kind), flops=flops, param_bytes=param_bytes, act_bytes=act_bytes,
                                  streamed_fraction=streamed_fraction, grouped=grouped, threads=threads, **extra)


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


def streamed_fraction(target: Target, tpu_param_bytes: int, kind: str = "edgetpu") -> float:
    """The share of the weights that cross the link on every inference when `tpu_param_bytes` (float32)
    of parameters run on the target's `kind` devices (the Edge TPU's: what does not fit the on-chip
    cache; `devices/edgetpu.py`)."""
    return model(kind).streamed_fraction(target.devices_of(kind), tpu_param_bytes)


def link_ms_per_byte(target: Target, kind: str) -> tuple[float, float]:
    """(latency ms, ms per float32 byte) of the link between the host and an accelerator kind, as the
    kind's device model gives it (an Edge TPU's inputs and outputs cross as int8)."""
    return model(kind).link(target.device(kind))
