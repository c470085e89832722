"""The per-op lowering table: one lowering per ONNX op, from ONNX (NCHW) to TF ops (NHWC).

`LOWERINGS` maps an ONNX op type to its `_Lowering`: `lower` emits the TF ops of one node into the
trace (`_Ctx`, layout.py), `check` says in one lowercase sentence why a node cannot be lowered
(None when it can). `lowering_reason` asks the table without loading TensorFlow, so legalize can
use it. Elementwise ops bring constants to the activation's layout (a constant is permuted at
build time; an activation never is), and axis attributes (Concat, Pad, Softmax, reductions) are
mapped through the activation's `p`.

In full int8, MAXIMUM, MINIMUM, CONCATENATION and PADV2 give their inputs their output's
quantization (int8_ops.py), and so do the ops joined to those inputs through other shared-quantization
ops (a RESHAPE, a STRIDED_SLICE, a MAX_POOL_2D of them): whatever else reads such a tensor sees it on
the output's grid, clipped or coarsened. So those ops are emitted only on inputs no other op reads
(`_private`); elsewhere Max, Min and Clip take forms made of ADD, SUB and RELU, which rescale, and
Concat and Pad read a copy of their own (`_own_copy`). PRelu is TFLite's PRELU, which has an input
and an output quantization of its own. docs/legalize.md ("int8: ops that share one quantization")
gives every lowering's ops and how each is kept from a shared range.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import onnx
from onnx import helper

from .layout import NHWC, _common_perm, _Ctx, _identity, _perm_without, _Value

Shapes = dict[str, tuple[int, ...]]


def lowering_reason(node: onnx.NodeProto, shapes: Shapes, constants: set[str]) -> str | None:
    """None when `node` can be lowered to the TF function for the Edge TPU, given the static `shapes`
    of its tensors and the names in `constants` (initializers and folded values); otherwise one
    lowercase sentence saying why not."""
    return _reason(node, shapes, constants, LOWERINGS)


def cpu_lowering_reason(node: onnx.NodeProto, shapes: Shapes, constants: set[str]) -> str | None:
    """As `lowering_reason`, for LiteRT on the CPU (the `litert` backends): the Edge TPU's lowerings,
    and where one refuses a node or there is none, the CPU's (`CPU_LOWERINGS`)."""
    return lowering_for(node, shapes, constants, cpu=True)[1]


def lowering_for(node: onnx.NodeProto, shapes: Shapes, constants: set[str], *, cpu: bool
                 ) -> tuple["_Lowering | None", str | None]:
    """The lowering that takes `node` (None where it folds to a constant) and None, or None and why
    no lowering does; `cpu` adds `CPU_LOWERINGS` behind the Edge TPU's."""
    reason = _reason(node, shapes, constants, LOWERINGS)
    if reason is None:
        return LOWERINGS.get(node.op_type), None
    if cpu and node.op_type in CPU_LOWERINGS:
        reason = _reason(node, shapes, constants, CPU_LOWERINGS)
        return (CPU_LOWERINGS[node.op_type], None) if reason is None else (None, reason)
    return None, reason


def _reason(node: onnx.NodeProto, shapes: Shapes, constants: set[str], table: dict) -> str | None:
    names = [n for n in node.input if n]
    if node.op_type == "Constant" or (names and all(n in constants for n in names)):
        return None  # folded at build time: it becomes a constant, not an op
    lowering = table.get(node.op_type)
    if lowering is None or (node.domain not in ("", "ai.onnx")):
        return f"{node.op_type} has no tflite lowering"
    for name in names:
        if name in constants:
            continue
        shape = shapes.get(name)
        if shape is None or any(not isinstance(d, (int, np.integer)) or d <= 0 for d in shape):
            return f"input {name} of {node.op_type} has no static shape"
    return lowering.check(node, shapes, constants)


@dataclass(frozen=True)
class _Lowering:
    lower: Callable[["_Ctx", onnx.NodeProto], None]
    check: Callable[[onnx.NodeProto, Shapes, set[str]], str | None]


LOWERINGS: dict[str, _Lowering] = {}  # the Edge TPU's ops (devices.edgetpu.OPS names the same)
# what LiteRT runs on the CPU where the Edge TPU has no op: a node the table above refuses or lacks
CPU_LOWERINGS: dict[str, _Lowering] = {}


def _ok(node: onnx.NodeProto, shapes: Shapes, constants: set[str]) -> str | None:
    return None


def _lowers(*op_types: str, check: Callable[[onnx.NodeProto, Shapes, set[str]], str | None] = _ok,
            cpu_only: bool = False):
    def register(fn: Callable[["_Ctx", onnx.NodeProto], None]):
        for op in op_types:
            (CPU_LOWERINGS if cpu_only else LOWERINGS)[op] = _Lowering(fn, check)
        return fn

    return register


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            v = helper.get_attribute_value(a)
            return v.decode() if isinstance(v, bytes) else v
    return default


def _input(node: onnx.NodeProto, i: int) -> str:
    return node.input[i] if len(node.input) > i else ""


def _spatial(node: onnx.NodeProto, in_hw: tuple[int, ...], kernel: tuple[int, ...], ceil: bool = False):
    """(strides, dilations, [(begin, end)] per spatial axis) with auto_pad resolved; with ceil
    mode, the end pad grows by what the last partial window needs."""
    n = len(kernel)
    strides = tuple(_attr(node, "strides", [1] * n))
    dilations = tuple(_attr(node, "dilations", [1] * n))
    auto_pad = _attr(node, "auto_pad", "NOTSET")
    pads = list(_attr(node, "pads", [0] * (2 * n)))
    out = []
    for i in range(n):
        k = (kernel[i] - 1) * dilations[i] + 1
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            total = max((math.ceil(in_hw[i] / strides[i]) - 1) * strides[i] + k - in_hw[i], 0)
            small, big = total // 2, total - total // 2
            b, e = (small, big) if auto_pad == "SAME_UPPER" else (big, small)
        elif auto_pad == "VALID":
            b, e = 0, 0
        else:
            b, e = pads[i], pads[i + n]
        if ceil:
            size = in_hw[i] + b + e - k
            o = -(-size // strides[i]) + 1
            if (o - 1) * strides[i] >= in_hw[i] + b:  # the last window must start inside
                o -= 1
            e += max((o - 1) * strides[i] + k - (in_hw[i] + b + e), 0)
        out.append((b, e))
    return strides, dilations, out


def _tf_padding(in_hw, kernel, strides, dilations, pads) -> str | None:
    """'VALID' or 'SAME' when TF's padding rule gives exactly these pads; None otherwise."""
    if all(b == 0 and e == 0 for b, e in pads):
        return "VALID"
    for size, k, s, d, (b, e) in zip(in_hw, kernel, strides, dilations, pads):
        k = (k - 1) * d + 1
        total = max((math.ceil(size / s) - 1) * s + k - size, 0)
        if (b, e) != (total // 2, total - total // 2):
            return None
    return "SAME"


# ---------------------------------------------------------------------------------------------
# Checks shared by several ops


def _rank(shapes: Shapes, name: str) -> int | None:
    s = shapes.get(name)
    return None if s is None else len(s)


def _need_const(node: onnx.NodeProto, constants: set[str], index: int, what: str) -> str | None:
    name = _input(node, index)
    if name and name not in constants:
        return f"{node.op_type} needs a constant {what}"
    return None


def _check_4d(node: onnx.NodeProto, shapes: Shapes) -> str | None:
    if _rank(shapes, node.input[0]) != 4:
        return f"{node.op_type} is lowered for 4-d nchw tensors only"
    return None


# ---------------------------------------------------------------------------------------------
# int8: tensors that share one quantization

# ONNX ops whose lowering emits only ops of int8_ops.SHARED_QUANTIZATION_OPS (or no op), and which of
# their inputs carry the tensor (None: all): in int8 those inputs and the outputs get one quantization.
_SAME_QUANTIZATION: dict[str, int | None] = {
    **dict.fromkeys(("Identity", "Dropout", "Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Split",
                     "MaxPool", "AveragePool", "GlobalMaxPool", "ReduceMax", "ReduceMin", "Resize", "Pad", "Clip"), 1),
    **dict.fromkeys(("Concat", "Max", "Min"), None),
}


def _private(cx: _Ctx, node: onnx.NodeProto, name: str) -> bool:
    """Whether activation `name`'s int8 quantization is `node`'s alone: no other node reads it, nor any
    tensor joined to it through `_SAME_QUANTIZATION` ops (what `name` is a reshape, slice or max-pool of,
    and those of it), and none of them is a segment output. Only then may `node` be an op that gives its
    inputs its output's range (int8_ops.OUTPUT_RANGE_TO_INPUTS): the converter carries that range to the
    whole group (measured through RESHAPE, STRIDED_SLICE and MAX_POOL_2D)."""
    seen, todo = {name}, [name]
    while todo:
        t = todo.pop()
        if t in cx.outputs:
            return False
        producer = cx.producer.get(t)
        for other in [producer, *cx.readers.get(t, [])]:
            if other is None or other is node:
                continue
            if other.op_type not in _SAME_QUANTIZATION:
                if other is not producer:
                    return False  # another op reads the group
                continue
            data = _SAME_QUANTIZATION[other.op_type]
            for u in [*other.input[:data], *other.output]:
                if u and u not in seen and u not in cx.consts:
                    seen.add(u)
                    todo.append(u)
    return True


def _own_copy(cx: _Ctx, t: Any) -> Any:
    """The values of TF tensor `t` in a tensor of their own: a 1x1 depthwise convolution by ones (exact:
    1.0 is 127 at the weight's per-channel scale 1/127), which the converter keeps where it folds x*1
    and x+0. A range the consumer sets on the copy stays there."""
    tf = cx.tf
    shape = [int(d) for d in t.shape]
    flat = t if len(shape) == 4 else tf.reshape(t, [1, 1, -1, shape[-1]])
    y = tf.nn.depthwise_conv2d(flat, np.ones((1, 1, shape[-1], 1), np.float32), (1, 1, 1, 1), "VALID")
    return y if len(shape) == 4 else tf.reshape(y, shape)


# ---------------------------------------------------------------------------------------------
# Lowerings: elementwise


def _binary(fn_name: str):
    def lower(cx: _Ctx, node: onnx.NodeProto) -> None:
        items = [cx.item(n) for n in node.input]
        perm = _common_perm(cx, items)
        if fn_name == "multiply" and (y := _scaled_product(cx, node)) is not None:
            cx.set(node.output[0], _Value(y, perm))
            return
        fn = getattr(cx.tf.math, fn_name)
        tensors = [cx.aligned(i, perm) for i in items]
        out = tensors[0]
        for t in tensors[1:]:
            out = fn(out, t)
        cx.set(node.output[0], _Value(out, perm))

    return lower


_lowers("Add")(_binary("add"))
_lowers("Sub")(_binary("subtract"))
_lowers("Mul")(_binary("multiply"))


def _extremum(maximum: bool):
    def lower(cx: _Ctx, node: onnx.NodeProto) -> None:
        tf = cx.tf
        items = [cx.item(n) for n in node.input]
        perm = _common_perm(cx, items)
        tensors = [cx.aligned(i, perm) for i in items]
        if all(_private(cx, node, n) for n in node.input if n in cx.values):
            out = functools.reduce(tf.math.maximum if maximum else tf.math.minimum, tensors)
        else:
            # max(a, b) = a + relu(b - a), min(a, b) = a - relu(a - b): SUB+RELU and ADD/SUB rescale, so
            # the output's range never reaches a or b (a MAXIMUM would clip them for their other readers)
            out = tensors[0]
            for t in tensors[1:]:
                out = out + tf.nn.relu(t - out) if maximum else out - tf.nn.relu(out - t)
        cx.set(node.output[0], _Value(out, perm))

    return lower


_lowers("Max")(_extremum(maximum=True))
_lowers("Min")(_extremum(maximum=False))


def _scaled_product(cx: _Ctx, node: onnx.NodeProto, reciprocal: bool = False) -> Any | None:
    """(a * c) * b for node = Mul(Mul(a, b), c) (or Div by c) with a scalar constant c and an
    inner Mul used only here; None when the node is not of that form.

    TFLite's optimizer rewrites (x * relu6(x + 3)) * (1/6), the written-out hard swish, into
    HARD_SWISH, which the Edge TPU lacks. The same product scaled first, (x / 6) * relu6(x + 3),
    is left alone, so the scale goes onto the factor that is not a clipped activation.
    """
    names = list(node.input)
    c = next((cx.const(n) for n in names if cx.const(n) is not None), None)
    inner = next((cx.producer.get(n) for n in names if n in cx.values), None)
    if c is None or c.size != 1 or len(names) != 2 or inner is None or inner.op_type != "Mul":
        return None
    if c.ndim > len(cx.values[inner.output[0]].perm):  # the constant would add axes
        return None
    if cx.uses.get(inner.output[0], 0) != 1 or any(n not in cx.values for n in inner.input):
        return None
    a, b = inner.input
    producer = cx.producer.get(a)
    if producer is not None and producer.op_type in ("Clip", "Relu"):
        a, b = b, a
    scale = np.float32(1.0 / float(c.reshape(())) if reciprocal else c.reshape(()))
    va, vb = cx.values[a], cx.values[b]
    perm = _common_perm(cx, [va, vb])
    return cx.tf.math.multiply(cx.aligned(va, perm) * scale, cx.aligned(vb, perm))


def _check_div(node, shapes, constants):
    return _need_const(node, constants, 1, "divisor (division by a tensor has no edge tpu op)")


@_lowers("Div", check=_check_div)
def _div(cx: _Ctx, node: onnx.NodeProto) -> None:
    x = cx.value(node.input[0])
    d = cx.const(node.input[1]).astype(np.float32)
    perm = _common_perm(cx, [x, d])
    if (y := _scaled_product(cx, node, reciprocal=True)) is not None:
        cx.set(node.output[0], _Value(y, perm))
        return
    reciprocal = np.asarray(1.0 / d, np.float32)
    cx.set(node.output[0], _Value(cx.tf.math.multiply(cx.aligned(x, perm), cx.aligned(reciprocal, perm)), perm))


def _unary(fn: Callable[[Any, Any, onnx.NodeProto], Any], nonneg: bool = False):
    def lower(cx: _Ctx, node: onnx.NodeProto) -> None:
        x = cx.value(node.input[0])
        cx.set(node.output[0], _Value(fn(cx.tf, x.tf, node), x.perm, nonneg or x.nonneg))

    return lower


_lowers("Relu")(_unary(lambda tf, x, n: tf.nn.relu(x), nonneg=True))
_lowers("Sigmoid")(_unary(lambda tf, x, n: tf.math.sigmoid(x), nonneg=True))
_lowers("Tanh")(_unary(lambda tf, x, n: tf.math.tanh(x)))


def _hard_sigmoid(tf: Any, x: Any, alpha: float, beta: float) -> Any:
    # min(relu(a*x + b), 1): MUL, ADD+RELU, MINIMUM. The relu6(6ax + 6b) / 6 form would let
    # TFLite fuse x * hard_sigmoid(x) into HARD_SWISH, which the Edge TPU does not take.
    return tf.math.minimum(tf.nn.relu(x * np.float32(alpha) + np.float32(beta)), np.float32(1.0))


_lowers("HardSigmoid")(_unary(lambda tf, x, n: _hard_sigmoid(tf, x, _attr(n, "alpha", 0.2), _attr(n, "beta", 0.5)),
                              nonneg=True))
# (x / 6) * relu6(x + 3): the written-out hard swish with the scale on x, which TFLite leaves alone
# (see `_scaled_product`). x * min(relu(x/6 + 1/2), 1) computes the same in float, but its int8
# MINIMUM/MUL chain came out of aarch64 LiteRT up to 20 LSB away from x86-64's on PP-OCRv4's
# recognizer (measured under qemu), where this form is bit-equal.
_lowers("HardSwish")(_unary(lambda tf, x, n: (x * np.float32(1.0 / 6.0)) * tf.nn.relu6(x + np.float32(3.0))))


def _clip_bounds(node: onnx.NodeProto) -> tuple[str | float | None, ...]:
    """(min, max) as attribute values (opset < 11) or input names (None: unbounded)."""
    if any(a.name in ("min", "max") for a in node.attribute):  # opset < 11
        return _attr(node, "min", None), _attr(node, "max", None)
    return _input(node, 1) or None, _input(node, 2) or None


def _check_clip(node, shapes, constants):
    return _need_const(node, constants, 1, "minimum") or _need_const(node, constants, 2, "maximum")


@_lowers("Clip", check=_check_clip)
def _clip(cx: _Ctx, node: onnx.NodeProto) -> None:
    tf = cx.tf
    x = cx.value(node.input[0])
    lo, hi = (float(cx.const(b).reshape(-1)[0]) if isinstance(b, str) else b for b in _clip_bounds(node))
    lo = None if lo is None or lo == -np.inf else lo
    hi = None if hi is None or hi == np.inf else hi
    if lo == 0.0 and hi == 6.0:
        y = tf.nn.relu6(x.tf)
    elif lo == 0.0 and hi is None:
        y = tf.nn.relu(x.tf)
    elif (lo, hi) == (-1.0, 1.0) or _private(cx, node, node.input[0]):
        # MAXIMUM and MINIMUM, where x is read by nothing else (the converter makes RELU_N1_TO_1 of [-1, 1])
        y = x.tf
        if lo is not None:
            y = tf.math.maximum(y, np.float32(lo))
        if hi is not None:
            y = tf.math.minimum(y, np.float32(hi))
    elif lo is not None:
        # relu(x - lo), at most hi - lo, plus lo: ADD+RELU, then a MINIMUM on that sum, which only it
        # reads, then ADD; x keeps its own range for its other readers
        y = tf.nn.relu(x.tf - np.float32(lo)) if lo else tf.nn.relu(x.tf)
        if hi is not None:
            y = tf.math.minimum(y, np.float32(hi - lo))
        y = y + np.float32(lo) if lo else y
    else:
        y = x.tf - tf.nn.relu(x.tf - np.float32(hi))  # min(x, hi): SUB+RELU, SUB
    cx.set(node.output[0], _Value(y, x.perm, x.nonneg or (lo is not None and lo >= 0)))


def _check_prelu(node, shapes, constants):
    return _need_const(node, constants, 1, "slope")


@_lowers("PRelu", check=_check_prelu)
def _prelu(cx: _Ctx, node: onnx.NodeProto) -> None:
    # TFLite's PRELU (an Edge TPU op, with an int8 quantization of its own for input and output): the
    # converter fuses relu(x) + (-slope) * relu(-x) into it where the slope has one axis fewer than x
    # (it broadcasts over the batch) and x at most 4. Elsewhere relu(x) + slope * (x - relu(x)): RELU,
    # SUB, MUL, ADD. Not relu(x) + slope * min(x, 0): MINIMUM gives x its output's range, clipping the
    # positive half of x, and with it relu(x).
    tf = cx.tf
    x = cx.value(node.input[0])
    rank = len(x.perm)
    slope = np.asarray(cx.aligned(cx.const(node.input[1]), x.perm), np.float32)
    slope = slope.reshape((1,) * rank) if slope.ndim == 0 else slope
    if 2 <= rank <= 4 and slope.shape[0] == 1:
        y = tf.nn.relu(x.tf) + (-slope.reshape(slope.shape[1:])) * tf.nn.relu(-x.tf)
    else:
        r = tf.nn.relu(x.tf)
        y = r + slope * (x.tf - r)
    cx.set(node.output[0], _Value(y, x.perm, x.nonneg))


def _check_bn(node, shapes, constants):
    if len([o for o in node.output if o]) > 1:
        return "batchnormalization in training mode (more than one output)"
    for i, what in enumerate(("scale", "bias", "mean", "variance"), start=1):
        if reason := _need_const(node, constants, i, what):
            return reason
    if (_rank(shapes, node.input[0]) or 0) < 2:
        return "batchnormalization needs a channel axis"
    return None


@_lowers("BatchNormalization", check=_check_bn)
def _batch_norm(cx: _Ctx, node: onnx.NodeProto) -> None:
    # y = (x - mean) / sqrt(var + eps) * scale + bias = x * a + b (inference form).
    scale, bias, mean, var = (cx.const(n).astype(np.float64) for n in node.input[1:5])
    a = scale / np.sqrt(var + _attr(node, "epsilon", 1e-5))
    b = bias - mean * a
    x = cx.value(node.input[0])
    channel = (-1,) + (1,) * (len(x.perm) - 2)
    y = cx.aligned(x, x.perm) * cx.aligned(a.astype(np.float32).reshape(channel), x.perm)
    y = y + cx.aligned(b.astype(np.float32).reshape(channel), x.perm)
    cx.set(node.output[0], _Value(y, x.perm))


# ---------------------------------------------------------------------------------------------
# Lowerings: convolutions and pools (NHWC)


def _check_conv(node, shapes, constants):
    if reason := _need_const(node, constants, 1, "weight") or _need_const(node, constants, 2, "bias"):
        return reason
    if reason := _check_4d(node, shapes):
        return reason
    w = shapes.get(node.input[1])
    strides = _attr(node, "strides", [1, 1])
    dilations = _attr(node, "dilations", [1, 1])
    if max(dilations) > 1 and max(strides) > 1:
        return f"{node.op_type.lower()} with both stride and dilation above 1"
    if node.op_type == "ConvTranspose":
        if _attr(node, "group", 1) != 1:
            return "grouped convtranspose"
        if max(dilations) > 1:
            return "dilated convtranspose"
    elif w is not None and w[1] * _attr(node, "group", 1) != shapes[node.input[0]][1]:
        return "conv weight does not match its input channels"
    return None


@_lowers("Conv", check=_check_conv)
def _conv(cx: _Ctx, node: onnx.NodeProto) -> None:
    tf = cx.tf
    x = cx.value(node.input[0])
    w = cx.const(node.input[1]).astype(np.float32)  # [M, C/g, kh, kw]
    bias = cx.const(_input(node, 2))
    _, c, h, wd = cx.shape(x)
    group = _attr(node, "group", 1)
    strides, dilations, pads = _spatial(node, (h, wd), w.shape[2:])
    t = cx.layout(x, NHWC)
    padding = _tf_padding((h, wd), w.shape[2:], strides, dilations, pads)
    if padding is None:
        t = tf.pad(t, [[0, 0], list(pads[0]), list(pads[1]), [0, 0]])
        padding = "VALID"
    if group == 1:
        y = tf.nn.conv2d(t, np.transpose(w, (2, 3, 1, 0)), strides, padding, dilations=dilations)
    elif group == c and w.shape[1] == 1:
        # Depthwise: ONNX output channel c*mult + k is TF's channel c*mult + k of filter [kh, kw, c, k].
        f = np.transpose(w.reshape(c, w.shape[0] // c, *w.shape[2:]), (2, 3, 0, 1))
        y = tf.nn.depthwise_conv2d(t, f, (1, *strides, 1), padding, dilations=dilations)
    else:
        # Grouped: one convolution per group, concatenated along channels.
        m = w.shape[0] // group
        parts = tf.split(t, group, axis=3)
        y = tf.concat([tf.nn.conv2d(parts[g], np.transpose(w[g * m:(g + 1) * m], (2, 3, 1, 0)), strides, padding,
                                    dilations=dilations) for g in range(group)], axis=3)
    if bias is not None:
        y = tf.nn.bias_add(y, bias.astype(np.float32))
    cx.set(node.output[0], _Value(y, NHWC))


@_lowers("ConvTranspose", check=_check_conv)
def _conv_transpose(cx: _Ctx, node: onnx.NodeProto) -> None:
    tf = cx.tf
    x = cx.value(node.input[0])
    w = cx.const(node.input[1]).astype(np.float32)  # [C, M, kh, kw]
    bias = cx.const(_input(node, 2))
    n, _, h, wd = cx.shape(x)
    kernel = w.shape[2:]
    strides = tuple(_attr(node, "strides", [1, 1]))
    out_pad = tuple(_attr(node, "output_padding", [0, 0]))
    full = [s * (i - 1) + k for s, i, k in zip(strides, (h, wd), kernel)]  # no padding at all
    output_shape = _attr(node, "output_shape")
    auto_pad = _attr(node, "auto_pad", "NOTSET")
    if output_shape is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        want = list(output_shape)[-2:] if output_shape is not None else [i * s for i, s in zip((h, wd), strides)]
        totals = [f + o - t for f, o, t in zip(full, out_pad, want)]
        upper = auto_pad == "SAME_UPPER"
        pads = [(t // 2, t - t // 2) if upper else (t - t // 2, t // 2) for t in totals]
    else:
        p = list(_attr(node, "pads", [0, 0, 0, 0]))
        pads = [(p[0], p[2]), (p[1], p[3])]
    y = tf.nn.conv2d_transpose(cx.layout(x, NHWC), np.transpose(w, (2, 3, 1, 0)),
                               [n, full[0], full[1], w.shape[1]], strides, "VALID")
    if any(out_pad):  # positions past the last input contribution hold only the bias
        y = tf.pad(y, [[0, 0], [0, out_pad[0]], [0, out_pad[1]], [0, 0]])
    if any(b or e for b, e in pads):
        y = y[:, pads[0][0]:full[0] + out_pad[0] - pads[0][1], pads[1][0]:full[1] + out_pad[1] - pads[1][1], :]
    if bias is not None:
        y = tf.nn.bias_add(y, bias.astype(np.float32))
    cx.set(node.output[0], _Value(y, NHWC))


def _check_pool(node, shapes, constants):
    if reason := _check_4d(node, shapes):
        return reason
    if len([o for o in node.output if o]) > 1:
        return f"{node.op_type.lower()} with an indices output"
    if max(_attr(node, "dilations", [1, 1])) > 1:
        return f"dilated {node.op_type.lower()}"
    return None


@_lowers("MaxPool", check=_check_pool)
def _max_pool(cx: _Ctx, node: onnx.NodeProto) -> None:
    tf = cx.tf
    x = cx.value(node.input[0])
    _, _, h, wd = cx.shape(x)
    kernel = tuple(_attr(node, "kernel_shape"))
    strides, dilations, pads = _spatial(node, (h, wd), kernel, ceil=bool(_attr(node, "ceil_mode", 0)))
    t = cx.layout(x, NHWC)
    padding = _tf_padding((h, wd), kernel, strides, dilations, pads)
    if padding is None:
        # Pads must never win the max: zeros do that exactly after a ReLU; otherwise the edge values
        # repeated (`_edge_padded`). A pad of the lowest float became the int8 range of the input
        # (PADV2 gives its input its output's range): every value collapsed to one step.
        if x.nonneg:
            t = tf.pad(t, [[0, 0], list(pads[0]), list(pads[1]), [0, 0]])
        else:
            t = _edge_padded(tf, t, pads)
        padding = "VALID"
    cx.set(node.output[0], _Value(tf.nn.max_pool2d(t, kernel, strides, padding), NHWC, x.nonneg))


def _edge_padded(tf: Any, t: Any, pads: list[tuple[int, int]]) -> Any:
    """NHWC `t` padded on H and W by repeating its first and last rows and columns (STRIDED_SLICE,
    CONCATENATION). For a max-pool this is exact: a window holding a pad also holds the edge value
    that pad repeats (windows are contiguous and each holds a value of `t`), and the values keep `t`'s
    range, so the int8 quantization they share with `t` stays `t`'s."""
    for axis, (b, e) in zip((1, 2), pads):
        if b or e:
            first, last = (t[:, :1], t[:, -1:]) if axis == 1 else (t[:, :, :1], t[:, :, -1:])
            t = tf.concat([first] * b + [t] + [last] * e, axis=axis)
    return t


@_lowers("AveragePool", check=_check_pool)
def _average_pool(cx: _Ctx, node: onnx.NodeProto) -> None:
    tf = cx.tf
    x = cx.value(node.input[0])
    _, _, h, wd = cx.shape(x)
    kernel = tuple(_attr(node, "kernel_shape"))
    declared = _spatial(node, (h, wd), kernel)[2]
    strides, dilations, pads = _spatial(node, (h, wd), kernel, ceil=bool(_attr(node, "ceil_mode", 0)))
    include_pad = bool(_attr(node, "count_include_pad", 0))
    kernel, pads = _clipped_windows((h, wd), kernel, strides, pads, declared)
    t = cx.layout(x, NHWC)
    padding = _tf_padding((h, wd), kernel, strides, dilations, pads)
    if padding == "VALID" or (padding == "SAME" and not include_pad):  # TF's SAME excludes pads
        cx.set(node.output[0], _Value(tf.nn.avg_pool2d(t, kernel, strides, padding), NHWC, x.nonneg))
        return
    # avg over a zero-padded input divides by k_h*k_w; ONNX divides by the number of window
    # cells inside the input (or inside input + declared pads): rescale by k_h*k_w / count.
    t = tf.pad(t, [[0, 0], list(pads[0]), list(pads[1]), [0, 0]])
    y = tf.nn.avg_pool2d(t, kernel, strides, "VALID")
    counts = []
    for size, k, s, (b, e), (db, de) in zip((h, wd), kernel, strides, pads, declared):
        lo, hi = (b - db, b + size + de) if include_pad else (b, b + size)
        out = (size + b + e - k) // s + 1
        counts.append(np.array([min(i * s + k, hi) - max(i * s, lo) for i in range(out)], np.float32))
    scale = (kernel[0] * kernel[1]) / np.outer(counts[0], counts[1])
    if not np.allclose(scale, 1.0):
        y = y * scale.astype(np.float32)[None, :, :, None]
    cx.set(node.output[0], _Value(y, NHWC, x.nonneg))


def _clipped_windows(in_hw, kernel, strides, pads, declared):
    """(kernel, pads) with an axis of one window that reaches past the input and its declared pads cut
    to end there: the cells past them count for nothing, and padding up to the window cost its whole
    size. PyTorch's AvgPool2d(1280, ceil_mode=True), which transformers' EfficientNet pools its 7x7
    features with, became a PAD to 1x1280x1280xC (TFLite: "Pad output size overflowed"; its calibrator
    then crashed the build)."""
    kernel, pads = list(kernel), list(pads)
    for i, (size, k, s, (b, e), (_, de)) in enumerate(zip(in_hw, kernel, strides, pads, declared)):
        if (size + b + e - k) // s + 1 == 1 and k > b + size + de:
            kernel[i], pads[i] = b + size + de, (b, de)
    return tuple(kernel), pads


def _global_pool(fn_name: str):
    def lower(cx: _Ctx, node: onnx.NodeProto) -> None:
        x = cx.value(node.input[0])
        axes = [x.perm[i] for i in range(2, len(x.perm))]
        y = getattr(cx.tf.math, fn_name)(x.tf, axis=axes, keepdims=True)
        cx.set(node.output[0], _Value(y, x.perm, x.nonneg))

    return lower


def _check_global(node, shapes, constants):
    return None if (_rank(shapes, node.input[0]) or 0) >= 3 else f"{node.op_type.lower()} needs spatial axes"


_lowers("GlobalAveragePool", check=_check_global)(_global_pool("reduce_mean"))
_lowers("GlobalMaxPool", check=_check_global)(_global_pool("reduce_max"))


def _check_resize(node, shapes, constants):
    if reason := _check_4d(node, shapes):
        return reason
    for i in range(1, len(node.input)):
        if reason := _need_const(node, constants, i, "roi, scales and sizes"):
            return reason
    mode = _attr(node, "mode", "nearest")
    coord = _attr(node, "coordinate_transformation_mode", "half_pixel")
    if (mode, coord) not in _RESIZE_FLAGS and (mode, coord, _attr(node, "nearest_mode", "round_prefer_floor")) \
            not in _RESIZE_FLAGS:
        return f"resize mode {mode} with {coord} coordinates has no tflite equivalent"
    if _attr(node, "antialias", 0) or _attr(node, "axes") is not None:
        return "resize with antialias or axes"
    return None


# (mode, coordinate transform[, nearest rounding]) → TF's (align_corners, half_pixel_centers)
_RESIZE_FLAGS = {
    ("nearest", "asymmetric", "floor"): (False, False),
    ("nearest", "align_corners", "round_prefer_ceil"): (True, False),
    ("nearest", "half_pixel", "round_prefer_ceil"): (False, True),
    ("linear", "asymmetric"): (False, False),
    ("linear", "align_corners"): (True, False),
    ("linear", "half_pixel"): (False, True),
    ("linear", "pytorch_half_pixel"): (False, True),
}


@_lowers("Resize", check=_check_resize)
def _resize(cx: _Ctx, node: onnx.NodeProto) -> None:
    tf = cx.tf
    x = cx.value(node.input[0])
    shape = cx.shape(x)
    if len(node.input) == 2:  # opset 10: (X, scales)
        scales, sizes = cx.const(node.input[1]), None
    else:
        scales, sizes = cx.const(_input(node, 2)), cx.const(_input(node, 3))
    if sizes is not None and sizes.size:
        size = [int(s) for s in sizes[2:]]
    else:
        size = [int(math.floor(d * s)) for d, s in zip(shape[2:], scales[2:])]
    mode = _attr(node, "mode", "nearest")
    coord = _attr(node, "coordinate_transformation_mode", "half_pixel")
    if mode == "nearest":
        flags = _RESIZE_FLAGS[(mode, coord, _attr(node, "nearest_mode", "round_prefer_floor"))]
        op = tf.raw_ops.ResizeNearestNeighbor
    else:
        flags = _RESIZE_FLAGS[(mode, coord)]
        op = tf.raw_ops.ResizeBilinear
    y = op(images=cx.layout(x, NHWC), size=size, align_corners=flags[0], half_pixel_centers=flags[1])
    cx.set(node.output[0], _Value(y, NHWC, x.nonneg))


# ---------------------------------------------------------------------------------------------
# Lowerings: matrix products


def _check_gemm(node, shapes, constants):
    if reason := _need_const(node, constants, 1, "second operand (a weight)") or _need_const(node, constants, 2, "c"):
        return reason
    if _rank(shapes, node.input[0]) != 2:
        return "gemm needs a 2-d first operand"
    return None


@_lowers("Gemm", check=_check_gemm)
def _gemm(cx: _Ctx, node: onnx.NodeProto) -> None:
    # y = alpha * A' B' + beta * C with constant B: a FULLY_CONNECTED with its bias.
    tf = cx.tf
    a = cx.value(node.input[0])
    if _attr(node, "transA", 0):
        a = _Value(a.tf, (a.perm[1], a.perm[0]))
    b = cx.const(node.input[1]).astype(np.float32)
    w = (b.T if _attr(node, "transB", 0) else b) * np.float32(_attr(node, "alpha", 1.0))
    y = tf.linalg.matmul(cx.layout(a, (0, 1)), w)
    c = cx.const(_input(node, 2))
    if c is not None:
        y = y + (np.float32(_attr(node, "beta", 1.0)) * c.astype(np.float32))
    cx.set(node.output[0], _Value(y, (0, 1)))


def _check_matmul(node, shapes, constants):
    if reason := _need_const(node, constants, 1, "second operand (a weight)"):
        return reason
    if _rank(shapes, node.input[1]) != 2 or (_rank(shapes, node.input[0]) or 0) < 2:
        return "matmul is lowered for an activation of rank >= 2 times a 2-d weight"
    return None


@_lowers("MatMul", check=_check_matmul)
def _matmul(cx: _Ctx, node: onnx.NodeProto) -> None:
    tf = cx.tf
    a = cx.value(node.input[0])
    w = cx.const(node.input[1]).astype(np.float32)
    shape = cx.shape(a)
    t = cx.layout(a, _identity(len(shape)))
    if len(shape) > 2:  # [..., K] @ [K, N] as one FULLY_CONNECTED over the flattened rows
        y = tf.reshape(tf.linalg.matmul(tf.reshape(t, [-1, shape[-1]]), w), (*shape[:-1], w.shape[1]))
    else:
        y = tf.linalg.matmul(t, w)
    cx.set(node.output[0], _Value(y, _identity(len(shape))))


# ---------------------------------------------------------------------------------------------
# Lowerings for LiteRT on the CPU only: ops TFLite has and the Edge TPU lacks (LayerNorm's Pow, Sqrt
# and Div by a tensor, attention's product of two activations)

_lowers("Div", cpu_only=True)(_binary("divide"))
_lowers("Sqrt", cpu_only=True)(_unary(lambda tf, x, n: tf.math.sqrt(x), nonneg=True))


def _check_pow(node, shapes, constants):
    exponent = _input(node, 1)
    if exponent not in constants or shapes.get(exponent, ()) not in ((), (1,)):
        return "Pow is lowered for a constant scalar exponent"
    return None


@_lowers("Pow", check=_check_pow, cpu_only=True)
def _pow(cx: _Ctx, node: onnx.NodeProto) -> None:
    x = cx.value(node.input[0])
    n = float(np.asarray(cx.const(node.input[1])).reshape(()))
    if n == 0.5:
        y = cx.tf.math.sqrt(x.tf)
    elif n in (2.0, 3.0, 4.0):  # products: SQUARE/POW have no int8 kernel in XNNPACK, MUL has
        y = x.tf
        for _ in range(int(n) - 1):
            y = cx.tf.math.multiply(y, x.tf)
    else:
        y = cx.tf.math.pow(x.tf, np.float32(n))
    cx.set(node.output[0], _Value(y, x.perm, x.nonneg or n in (0.5, 2.0, 4.0)))


def _check_batch_matmul(node, shapes, constants):
    if (_rank(shapes, node.input[0]) or 0) < 2 or (_rank(shapes, node.input[1]) or 0) < 2:
        return "matmul is lowered for operands of rank >= 2"
    return None


@_lowers("MatMul", check=_check_batch_matmul, cpu_only=True)
def _batch_matmul(cx: _Ctx, node: onnx.NodeProto) -> None:
    """[..., M, K] @ [..., K, N], batch dimensions broadcast (BATCH_MATMUL)."""
    a, b = (cx.value(n) if cx.const(n) is None else cx.const(n).astype(np.float32) for n in node.input[:2])
    ta = cx.layout(a, _identity(len(cx.shape(a)))) if isinstance(a, _Value) else a
    tb = cx.layout(b, _identity(len(cx.shape(b)))) if isinstance(b, _Value) else b
    y = cx.tf.linalg.matmul(ta, tb)
    cx.set(node.output[0], _Value(y, _identity(len(y.shape))))


# ---------------------------------------------------------------------------------------------
# Lowerings: shape and layout


@_lowers("Identity", "Dropout")
def _identity_op(cx: _Ctx, node: onnx.NodeProto) -> None:
    cx.set(node.output[0], cx.item(node.input[0]))


@_lowers("Constant")
def _constant(cx: _Ctx, node: onnx.NodeProto) -> None:
    cx.set(node.output[0], _fold(node, {}, cx.opset)[0])


@_lowers("Shape")
def _shape(cx: _Ctx, node: onnx.NodeProto) -> None:
    shape = cx.shape(cx.item(node.input[0]))
    start, end = _attr(node, "start", 0), _attr(node, "end", None)
    cx.set(node.output[0], np.array(shape[slice(start, end)], np.int64))


@_lowers("Transpose")
def _transpose(cx: _Ctx, node: onnx.NodeProto) -> None:
    # onnx_out = transpose(onnx_in, t) = transpose(tf, p[t]): a new p, no TF op.
    x = cx.value(node.input[0])
    t = _attr(node, "perm", list(reversed(range(len(x.perm)))))
    cx.set(node.output[0], _Value(x.tf, tuple(x.perm[i] for i in t), x.nonneg))


def _check_reshape(node, shapes, constants):
    return _need_const(node, constants, 1, "shape")


@_lowers("Reshape", check=_check_reshape)
def _reshape(cx: _Ctx, node: onnx.NodeProto) -> None:
    x = cx.value(node.input[0])
    shape = cx.shape(x)
    target = [int(d) for d in cx.const(node.input[1])]
    if not _attr(node, "allowzero", 0):
        target = [shape[i] if d == 0 else d for i, d in enumerate(target)]
    y = cx.tf.reshape(cx.layout(x, _identity(len(shape))), target)
    cx.set(node.output[0], _Value(y, _identity(len(target)), x.nonneg))


@_lowers("Flatten")
def _flatten(cx: _Ctx, node: onnx.NodeProto) -> None:
    x = cx.value(node.input[0])
    shape = cx.shape(x)
    axis = _attr(node, "axis", 1)
    axis = axis + len(shape) if axis < 0 else axis
    target = [int(np.prod(shape[:axis])), int(np.prod(shape[axis:]))]
    y = cx.tf.reshape(cx.layout(x, _identity(len(shape))), target)
    cx.set(node.output[0], _Value(y, (0, 1), x.nonneg))



def _axes(cx: _Ctx, node: onnx.NodeProto, rank: int, input_index: int = 1) -> list[int] | None:
    axes = _attr(node, "axes")
    if axes is None and _input(node, input_index):
        axes = [int(a) for a in cx.const(node.input[input_index])]
    return None if axes is None else sorted(a % rank for a in axes)


def _check_axes_input(node, shapes, constants):
    return _need_const(node, constants, 1, "axes")


@_lowers("Squeeze", check=_check_axes_input)
def _squeeze(cx: _Ctx, node: onnx.NodeProto) -> None:
    x = cx.value(node.input[0])
    shape = cx.shape(x)
    axes = _axes(cx, node, len(shape))
    dropped = set(axes if axes is not None else [i for i, d in enumerate(shape) if d == 1])
    tf_shape = [int(d) for d in x.tf.shape]
    kept_tf = sorted(x.perm[i] for i in range(len(shape)) if i not in dropped)
    y = cx.tf.reshape(x.tf, [tf_shape[a] for a in kept_tf])
    cx.set(node.output[0], _Value(y, _perm_without(x.perm, dropped), x.nonneg))


@_lowers("Unsqueeze", check=_check_axes_input)
def _unsqueeze(cx: _Ctx, node: onnx.NodeProto) -> None:
    x = cx.value(node.input[0])
    shape = cx.shape(x)
    rank = len(shape) + len(_attr(node, "axes", None) or cx.const(node.input[1]))
    axes = _axes(cx, node, rank)
    if x.perm == _identity(len(shape)):
        out = list(shape)
        for a in axes:
            out.insert(a, 1)
        cx.set(node.output[0], _Value(cx.tf.reshape(x.tf, out), _identity(rank), x.nonneg))
        return
    # New unit axes go last in TF; ONNX axis j maps to them, the others keep their TF axes.
    tf_shape = [int(d) for d in x.tf.shape]
    old = iter(x.perm)
    perm = tuple(len(shape) + axes.index(j) if j in axes else next(old) for j in range(rank))
    cx.set(node.output[0], _Value(cx.tf.reshape(x.tf, tf_shape + [1] * len(axes)), perm, x.nonneg))


@_lowers("Concat")
def _concat(cx: _Ctx, node: onnx.NodeProto) -> None:
    items = [cx.item(n) for n in node.input if n]
    perm = _common_perm(cx, items)
    axis = _attr(node, "axis") % len(perm)
    acts = [i for i in items if isinstance(i, _Value)]
    # CONCATENATION gives its inputs its output's range (the union of theirs): an input another op
    # also reads is concatenated as a copy of its own, so that op keeps the input's finer steps
    tensors = [_own_copy(cx, cx.aligned(i, perm)) if isinstance(i, _Value) and not _private(cx, node, n)
               else cx.aligned(i, perm) for n, i in zip([n for n in node.input if n], items)]
    y = cx.tf.concat(tensors, axis=perm[axis])
    cx.set(node.output[0], _Value(y, perm, all(a.nonneg for a in acts)))


def _check_pad(node, shapes, constants):
    if _attr(node, "mode", "constant") != "constant":
        return f"pad mode {_attr(node, 'mode')} (only constant padding is lowered)"
    for i in (1, 2, 3):
        if reason := _need_const(node, constants, i, "pads, value and axes"):
            return reason
    return None


@_lowers("Pad", check=_check_pad)
def _pad(cx: _Ctx, node: onnx.NodeProto) -> None:
    x = cx.value(node.input[0])
    rank = len(x.perm)
    pads = _attr(node, "pads") if _attr(node, "pads") is not None else [int(p) for p in cx.const(node.input[1])]
    value = cx.const(_input(node, 2))
    value = float(value.reshape(-1)[0]) if value is not None and value.size else float(_attr(node, "value", 0.0))
    axes = _axes(cx, node, rank, input_index=3) or list(range(rank))
    tf_pads = [[0, 0] for _ in range(rank)]
    for i, a in enumerate(axes):
        tf_pads[x.perm[a]] = [int(pads[i]), int(pads[i + len(axes)])]
    t = x.tf
    if value != 0.0 and not _private(cx, node, node.input[0]):
        t = _own_copy(cx, t)  # PADV2 gives its input its output's range, which holds `value`
    y = cx.tf.pad(t, tf_pads, constant_values=value)
    cx.set(node.output[0], _Value(y, x.perm, x.nonneg and value >= 0))


@_lowers("Softmax")
def _softmax(cx: _Ctx, node: onnx.NodeProto) -> None:
    tf = cx.tf
    x = cx.value(node.input[0])
    shape = cx.shape(x)
    rank = len(shape)
    axis = _attr(node, "axis", -1 if cx.opset >= 13 else 1) % rank
    if cx.opset < 13 and axis != rank - 1:
        # Before opset 13, Softmax works on the input coerced to 2-d at `axis`.
        t = tf.reshape(cx.layout(x, _identity(rank)), [int(np.prod(shape[:axis])), -1])
        y = tf.reshape(tf.nn.softmax(t, axis=-1), shape)
        cx.set(node.output[0], _Value(y, _identity(rank), True))
        return
    if x.perm[axis] != rank - 1 and axis == rank - 1:
        x = _Value(cx.layout(x, _identity(rank)), _identity(rank))
    cx.set(node.output[0], _Value(tf.nn.softmax(x.tf, axis=x.perm[axis]), x.perm, True))


def _reduce(fn_name: str):
    def lower(cx: _Ctx, node: onnx.NodeProto) -> None:
        x = cx.value(node.input[0])
        rank = len(x.perm)
        axes = _axes(cx, node, rank)
        if axes is None or not axes:
            if _attr(node, "noop_with_empty_axes", 0):
                cx.set(node.output[0], x)
                return
            axes = list(range(rank))
        keep = bool(_attr(node, "keepdims", 1))
        y = getattr(cx.tf.math, fn_name)(x.tf, axis=[x.perm[a] for a in axes], keepdims=keep)
        cx.set(node.output[0], _Value(y, x.perm if keep else _perm_without(x.perm, set(axes)), x.nonneg))

    return lower


_lowers("ReduceMean", check=_check_axes_input)(_reduce("reduce_mean"))
_lowers("ReduceSum", check=_check_axes_input)(_reduce("reduce_sum"))
_lowers("ReduceMax", check=_check_axes_input)(_reduce("reduce_max"))
_lowers("ReduceMin", check=_check_axes_input)(_reduce("reduce_min"))


def _check_slice(node, shapes, constants):
    for i in range(1, len(node.input)):
        if reason := _need_const(node, constants, i, "starts, ends, axes and steps"):
            return reason
    return None


@_lowers("Slice", check=_check_slice)
def _slice(cx: _Ctx, node: onnx.NodeProto) -> None:
    x = cx.value(node.input[0])
    shape = cx.shape(x)
    if _attr(node, "starts") is not None:  # opset < 10
        starts, ends, axes = _attr(node, "starts"), _attr(node, "ends"), _attr(node, "axes")
        steps = None
    else:
        starts, ends = cx.const(node.input[1]), cx.const(node.input[2])
        axes, steps = cx.const(_input(node, 3)), cx.const(_input(node, 4))
    axes = list(range(len(starts))) if axes is None else [int(a) % len(shape) for a in axes]
    steps = [1] * len(starts) if steps is None else [int(s) for s in steps]
    index = [slice(None)] * len(shape)
    for a, b, e, s in zip(axes, starts, ends, steps):
        b, e, s = slice(int(b), int(e), s).indices(shape[a])
        # A reverse slice that runs to the front has stop -1 in Python, "to the end" in TF.
        index[x.perm[a]] = slice(b, None if e < 0 else e, s)
    cx.set(node.output[0], _Value(x.tf[tuple(index)], x.perm, x.nonneg))


def _check_split(node, shapes, constants):
    return _need_const(node, constants, 1, "split")


@_lowers("Split", check=_check_split)
def _split(cx: _Ctx, node: onnx.NodeProto) -> None:
    x = cx.value(node.input[0])
    shape = cx.shape(x)
    axis = _attr(node, "axis", 0) % len(shape)
    sizes = _attr(node, "split")
    if sizes is None and _input(node, 1):
        sizes = [int(s) for s in cx.const(node.input[1])]
    n = len(node.output)
    if sizes is None:
        chunk = -(-shape[axis] // n)
        sizes = [min(chunk, shape[axis] - i * chunk) for i in range(n)]
    parts = cx.tf.split(x.tf, n if len(set(sizes)) == 1 else sizes, axis=x.perm[axis])
    for name, part in zip(node.output, parts):
        cx.set(name, _Value(part, x.perm, x.nonneg))



def _fold(node: onnx.NodeProto, inputs: dict[str, np.ndarray], opset: int) -> list[np.ndarray]:
    """Evaluate a node whose inputs are all constants (onnx.reference)."""
    from onnx.reference import ReferenceEvaluator

    names = [n for n in node.input if n]
    graph = helper.make_graph(
        [node], "fold",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(inputs[n].dtype), inputs[n].shape)
         for n in names],
        [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in node.output if o])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return [np.asarray(v) for v in ReferenceEvaluator(model).run(None, {n: inputs[n] for n in names})]
