"""The Coral Edge TPU's operator support, as data.

`OPS` maps each ONNX op that an Edge TPU segment may hold to the TFLite builtin ops our
lowering (`backends.tflite`) turns it into, and a check encoding Coral's published limits
("Supported operations", coral.ai/docs/edgetpu/models-intro) that matter for it. Limits every
op shares: static shapes; int8 only (the segment is quantized as a whole, so float tensors are
fine here); and only the 3 innermost dimensions of a tensor may exceed 1, which — our layout
changes only permute axes — means at most 3 dimensions larger than 1 in the ONNX tensor too.

Every refusal is a `Refusal(code, reason)`: a stable code (`edgetpu.rank`, ...) and one lowercase
sentence, after the statuses Coral's compiler prints per op ("Operation is working on an
unsupported data type", "Tensor has unsupported rank (up to 3 innermost dimensions mapped)", ...).
`REASONS` lists every code with Coral's wording where Coral has one.

This says what the Edge TPU accepts; whether our lowering can produce it is asked separately
(`backends.tflite.lowering_reason`); legalize combines both.

`MODEL` is the Edge TPU's device model (`devices/model.py`): int8 compute at the peak rate, no
memory roofline, weights beyond the on-chip cache streamed over the link; backend: TFLite (then
`edgetpu_compiler` where it is installed).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import onnx
from onnx import helper

from ..config import EdgeTpuDevice
from .model import Cache, Refusal
from .terms import NodeTerms

Shapes = dict[str, tuple[int, ...]]


Check = Callable[[onnx.NodeProto, Shapes, set[str]], "Refusal | None"]

# code -> what it means (Coral's compiler status where there is one)
REASONS: dict[str, str] = {
    "edgetpu.unsupported-op": "Operation not supported (not in Coral's list of supported operations)",
    "edgetpu.data-type": "Operation is working on an unsupported data type (only int8-quantizable float32)",
    "edgetpu.dynamic-shape": "Attempting to use a delegate that only supports static-sized tensors",
    "edgetpu.rank": "Tensor has unsupported rank (up to 3 innermost dimensions mapped)",
    "edgetpu.dilation": "Operation is otherwise supported: x and y dilation differ",
    "edgetpu.batch-axis": "Operation is otherwise supported: it works on the batch dimension",
    "edgetpu.channel-multiple": "Operation is otherwise supported: a z-reduction needs a multiple of 4 channels",
    "edgetpu.constant-input": "Operation is otherwise supported: a constant input where Coral allows none",
    "edgetpu.size": "Operation is otherwise supported: the tensor is larger than the op allows",
    "edgetpu.fc-output": "Operation is otherwise supported: a fully-connected output must be 1-d",
    "edgetpu.tensor-divisor": "Operation is otherwise supported: division by a tensor",
    "edgetpu.no-lowering": "Supported by the Edge TPU, but edgesdk's TFLite lowering cannot express this form",
    "edgetpu.recurrent": "A recurrent cell (LSTM, GRU, RNN, a Loop not unrolled): full int8 cannot quantize it; CPU",
}


def _ok(node: onnx.NodeProto, shapes: Shapes, constants: set[str]) -> Refusal | None:
    return None


@dataclass(frozen=True)
class OpRule:
    tflite_ops: tuple[str, ...]  # what the lowering emits for it (empty: folded, or a layout change)
    check: Check = _ok  # Coral's limits beyond the shared ones: a reason, or None


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _axes(node: onnx.NodeProto, shapes: Shapes) -> list[int] | None:
    rank = len(shapes.get(node.input[0], ()))
    axes = _attr(node, "axes")
    return None if axes is None or not rank else [a % rank for a in axes]


def _conv(node, shapes, constants):
    dilations = _attr(node, "dilations", [1, 1])
    if len(set(dilations)) > 1:
        return Refusal("edgetpu.dilation", "the edge tpu needs the same dilation in x and y")
    return None


def _no_batch_axis(what: str) -> Check:
    def check(node, shapes, constants):
        axes = _axes(node, shapes)
        if axes is None and len(node.input) > 1 and node.input[1]:
            return None  # axes given as a tensor: the lowering's check sees that it is constant
        if axes is None or 0 in axes:
            return Refusal("edgetpu.batch-axis", f"{what} cannot work on the batch dimension on the edge tpu")
        return None

    return check


def _mean(node, shapes, constants):
    if reason := _no_batch_axis("mean")(node, shapes, constants):
        return reason
    shape = shapes.get(node.input[0], ())
    axes = sorted(_axes(node, shapes) or [])
    # Coral: "if a z-reduction, the z-dimension must be a multiple of 4" (z: the innermost TFLite axis,
    # the channels). Which ONNX axis becomes z depends on the layout the lowering picks; the axes tell
    # the usual cases apart: [2, 3] and [1, 2] are the spatial means of NCHW and NHWC (no z), a lone 1
    # or 3 is the channel axis of NCHW or NHWC, and [1, 2, 3] includes it either way.
    if len(shape) == 4 and axes not in ([2, 3], [1, 2]) and (1 in axes or 3 in axes):
        z = 1 if 1 in axes and 2 not in axes else 3
        if shape[z] % 4:
            return Refusal("edgetpu.channel-multiple", "a mean over channels needs a multiple of 4 channels on the edge tpu")
    return None


def _concat(node, shapes, constants):
    # Coral: a compile-time constant input is allowed only as the second of exactly 2 inputs, all zeros.
    if any(n in constants for n in node.input) and len(node.input) != 2:
        return Refusal("edgetpu.constant-input", "an edge tpu concatenation with a constant input must have exactly 2 inputs")
    return None


def _pad(node, shapes, constants):
    pads = _attr(node, "pads")
    rank = len(shapes.get(node.input[0], ()))
    if pads is not None and rank and (pads[0] or pads[rank]):
        return Refusal("edgetpu.batch-axis", "the edge tpu does not pad the batch dimension")
    return None


def _softmax(node, shapes, constants):
    shape = shapes.get(node.input[0], ())
    size = 1
    for d in shape:
        size *= d
    if sum(d > 1 for d in shape) > 1 or size > 16000:
        return Refusal("edgetpu.size", "the edge tpu's softmax takes a 1-d input of at most 16,000 elements")
    return None


def _fully_connected(node, shapes, constants):
    out = shapes.get(node.output[0], ())
    if sum(d > 1 for d in out) > 1:
        return Refusal("edgetpu.fc-output", "an edge tpu fully-connected output must be one-dimensional")
    return None


def _div(node, shapes, constants):
    if node.input[1] not in constants:
        return Refusal("edgetpu.tensor-divisor", "the edge tpu has no division by a tensor")
    return None


ELEMENTWISE = ("ADD", "SUB", "MUL", "MAXIMUM", "MINIMUM")

# Recurrent ONNX ops: a Keras LSTM given to the converter with full int8 crashes it (TF 2.21), and
# our lowering has no recurrent cell; a Loop whose trip count is constant is unrolled at import
# (passes/loops.py) and never reaches here.
RECURRENT = ("LSTM", "GRU", "RNN", "Loop", "Scan")

OPS: dict[str, OpRule] = {
    "Conv": OpRule(("CONV_2D", "DEPTHWISE_CONV_2D", "PAD", "SPLIT", "CONCATENATION"), _conv),
    "ConvTranspose": OpRule(("TRANSPOSE_CONV", "PAD", "STRIDED_SLICE", "ADD")),
    "BatchNormalization": OpRule(("MUL", "ADD")),
    "Relu": OpRule(("RELU",)),
    "Clip": OpRule(("RELU6", "RELU", "RELU_N1_TO_1", "MAXIMUM", "MINIMUM", "ADD", "SUB")),
    "PRelu": OpRule(("PRELU", "RELU", "SUB", "MUL", "ADD")),
    "HardSigmoid": OpRule(("MUL", "ADD", "RELU", "MINIMUM")),
    "HardSwish": OpRule(("MUL", "ADD", "RELU", "MINIMUM")),
    "Sigmoid": OpRule(("LOGISTIC",)),
    "Tanh": OpRule(("TANH",)),
    "Add": OpRule(ELEMENTWISE),
    "Sub": OpRule(ELEMENTWISE),
    "Mul": OpRule(ELEMENTWISE),
    "Div": OpRule(("MUL",), _div),
    "Max": OpRule(("MAXIMUM", "SUB", "RELU", "ADD")),
    "Min": OpRule(("MINIMUM", "SUB", "RELU")),
    "MaxPool": OpRule(("MAX_POOL_2D", "PAD", "STRIDED_SLICE", "CONCATENATION")),
    "AveragePool": OpRule(("AVERAGE_POOL_2D", "PAD", "MUL")),
    "GlobalAveragePool": OpRule(("MEAN",)),
    "GlobalMaxPool": OpRule(("REDUCE_MAX",)),
    "ReduceMean": OpRule(("MEAN",), _mean),
    "ReduceSum": OpRule(("SUM",), _no_batch_axis("sum")),
    "ReduceMax": OpRule(("REDUCE_MAX",), _no_batch_axis("reducemax")),
    "ReduceMin": OpRule(("REDUCE_MIN",), _no_batch_axis("reducemin")),
    "Gemm": OpRule(("FULLY_CONNECTED", "ADD"), _fully_connected),
    "MatMul": OpRule(("FULLY_CONNECTED", "RESHAPE"), _fully_connected),
    "Reshape": OpRule(("RESHAPE",)),
    "Flatten": OpRule(("RESHAPE",)),
    "Squeeze": OpRule(("RESHAPE",)),
    "Unsqueeze": OpRule(("RESHAPE",)),
    "Concat": OpRule(("CONCATENATION", "DEPTHWISE_CONV_2D", "RESHAPE"), _concat),
    "Pad": OpRule(("PAD", "PADV2", "DEPTHWISE_CONV_2D", "RESHAPE"), _pad),
    "Softmax": OpRule(("SOFTMAX", "RESHAPE"), _softmax),
    "Resize": OpRule(("RESIZE_NEAREST_NEIGHBOR", "RESIZE_BILINEAR")),
    "Slice": OpRule(("STRIDED_SLICE",)),
    "Split": OpRule(("SPLIT", "SPLIT_V")),
    # Layout and bookkeeping: no op of their own (a layout change may add a RESHAPE or TRANSPOSE).
    "Transpose": OpRule(("TRANSPOSE", "RESHAPE")),
    "Identity": OpRule(()),
    "Dropout": OpRule(()),
    "Constant": OpRule(()),
    "Shape": OpRule(()),
}


def unsupported_reason(node: onnx.NodeProto, shapes: Shapes, constants: set[str]) -> Refusal | None:
    """None when the Edge TPU takes `node` (by Coral's published limits), else why not.

    `shapes` holds static shapes of the node's tensors; `constants` the names that are
    initializers or folded constants. A node whose inputs are all constants folds away.
    """
    names = [n for n in node.input if n]
    if node.op_type == "Constant" or (names and all(n in constants for n in names)):
        return None
    if node.op_type in RECURRENT and node.domain in ("", "ai.onnx"):
        return Refusal("edgetpu.recurrent", f"{node.op_type} is recurrent: TensorFlow's full-int8 converter cannot "
                       "quantize a recurrent cell, so it stays on the cpu (import unrolls a Loop with a constant "
                       "trip count into ops the edge tpu takes; an exported LSTM, GRU or RNN node is not unrolled)")
    rule = OPS.get(node.op_type)
    if rule is None or node.domain not in ("", "ai.onnx"):
        return Refusal("edgetpu.unsupported-op", f"{node.op_type} is not an edge tpu operation")
    for name in [*names, *(o for o in node.output if o)]:
        if name in constants:
            continue
        shape = shapes.get(name)
        if shape is None or any(not isinstance(d, numbers.Integral) or d <= 0 for d in shape):
            return Refusal("edgetpu.dynamic-shape", f"tensor {name} has no static shape (the edge tpu needs static shapes)")
        if sum(d > 1 for d in shape) > 3:
            return Refusal("edgetpu.rank", f"tensor {name} {list(shape)} has more than 3 dimensions larger than 1")
    return rule.check(node, shapes, constants)


# --- the device model -----------------------------------------------------------------------------


class EdgeTpuModel:
    kind = "edgetpu"
    schema = EdgeTpuDevice
    preference = 0
    backends = ("tflite",)
    rate_figure = ("peak_tops_int8", None, 1e12)
    fittable_overheads = {"node": "kernel_overhead"}
    reasons = REASONS
    unlowerable = {"tflite": ("edgetpu.no-lowering", None)}
    approximable = frozenset({"edgetpu.unsupported-op", "edgetpu.no-lowering"})
    rewrite_triggers = {"edgetpu.rank": "<rank>"}  # fold-rank-for-elementwise can cure it
    int8 = True

    def refusal(self, node: onnx.NodeProto, shapes: Shapes, consts: set[str], types) -> Refusal | None:
        """A tensor that is not float32 (only float32 is quantized to int8), then Coral's limits."""
        floats = [t for t in list(node.input) + list(node.output)
                  if t and t not in consts and types.get(t, onnx.TensorProto.FLOAT) != onnx.TensorProto.FLOAT]
        if floats:
            return Refusal("edgetpu.data-type", f"tensor '{floats[0]}' is not float32, and only float32 tensors "
                                                "are quantized to the edge tpu's int8")
        return unsupported_reason(node, shapes, consts)

    def node_terms(self, dev: EdgeTpuDevice, *, flops: float, param_bytes: int, act_bytes: int,
                   streamed_fraction: float = 0.0, grouped: bool = False, threads: int | None = None) -> NodeTerms:
        """Compute is int8 at the peak rate; `streamed_fraction` of the node's int8 weights (1 byte per
        float32 parameter's 4) comes over the link on every inference because the model's weights do
        not all fit the on-chip cache (`streamed_fraction`)."""
        compute = flops / (dev.peak_tops_int8.value * 1e12)
        streamed = streamed_fraction * param_bytes / 4 / (dev.link.bandwidth.value * 1e6)
        return NodeTerms(flops, "peak_tops_int8", compute, 0.0, streamed, (("kernel_overhead", dev.kernel_overhead.value),))

    def link(self, dev: EdgeTpuDevice) -> tuple[float, float]:
        """An Edge TPU segment's inputs and outputs are int8: a quarter of the float32 bytes cross."""
        per_byte = 1e3 / (dev.link.bandwidth.value * 1e6)
        per_byte /= 4
        return dev.link.latency.value * 1e-3, per_byte

    def cache(self, dev: EdgeTpuDevice) -> Cache:
        """One Edge TPU's parameter cache: the target's `on_chip_memory` of int8 weights (4 float32 bytes
        per cached byte), the documented figure. Coral's compiler says what it really had (used +
        remaining, in its log); the package stage records that beside this."""
        return Cache(dev.on_chip_memory.value * 1e6 * 4, 0.25,
                     f"on_chip_memory {dev.on_chip_memory.value:g} {dev.on_chip_memory.unit} ({dev.on_chip_memory.source})")

    def streamed_fraction(self, specs: Sequence[EdgeTpuDevice], param_bytes: int) -> float:
        """The share of the Edge TPU weights that do not fit the on-chip cache when `param_bytes` (float32)
        of parameters run there: Coral's compiler caches as much as fits and streams the rest every
        inference. Spread evenly over the nodes, so the DP's cost stays a sum over nodes."""
        if not specs or param_bytes <= 0:
            return 0.0
        capacity = specs[0].on_chip_memory.value * 1e6 * sum(d.count for d in specs)
        int8 = param_bytes / 4
        return max(0.0, 1.0 - capacity / int8)


MODEL = EdgeTpuModel()
