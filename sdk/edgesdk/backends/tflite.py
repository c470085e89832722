"""Edge TPU segments as TFLite: our own ONNX → TF lowering in NHWC, then full-int8 conversion.

An Edge TPU segment (an ONNX graph with static shapes and float32 inputs) is traced into one
`tf.function` by `LOWERINGS`, one lowering per ONNX op, and converted by
`tf.lite.TFLiteConverter.from_concrete_functions` to a full-int8 model (int8 weights per
channel, int8 activations calibrated on the given feeds, int8 inputs and outputs).

Layout. ONNX convolutions are NCHW, TFLite's are NHWC. Every ONNX tensor is held as a TF
tensor `t` with a permutation `p` such that

    onnx_tensor == transpose(t, p)          (p == (0, 3, 1, 2): t is the NHWC form of NCHW)

so an ONNX Transpose only changes `p` and emits nothing; ops that need a layout (Conv, pools,
Reshape, MatMul) ask for it with `_Ctx.layout`, which emits a TF transpose only when the
layout differs, and a reshape when only unit axes move. Elementwise ops bring constants to
the activation's layout (a constant is permuted at build time; an activation never is), and
axis attributes (Concat, Pad, Softmax, reductions) are mapped through `p`. A 4-D segment input
that feeds a layout-sensitive op is taken in NHWC; outputs keep whatever `p` they have and
report it in `TensorSpec.perm` (the runtime transposes on the host).

Heavy imports (TensorFlow, LiteRT) happen inside the functions that convert, so that
`lowering_reason` can be asked by legalize without loading TensorFlow.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import tempfile
import dataclasses
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import UserError
from ..runtime.manifest import QuantParams, TensorSpec

Shapes = dict[str, tuple[int, ...]]
NHWC = (0, 3, 1, 2)  # the `p` of an NCHW ONNX tensor held as NHWC


@dataclass(frozen=True)
class TfliteResult:
    inputs: tuple[TensorSpec, ...]  # ONNX order; key = signature key; perm; quant for int8
    outputs: tuple[TensorSpec, ...]
    op_counts: dict[str, int]  # TFLite builtin op histogram of the converted model
    ranges: dict[str, Any] = field(default_factory=dict)  # how activation ranges were chosen (int8 only)


CALIBRATION_METHODS = ("minmax", "percentile")
_HISTOGRAM_BINS = 2048


# ---------------------------------------------------------------------------------------------
# Public API


def lowering_reason(node: onnx.NodeProto, shapes: Shapes, constants: set[str]) -> str | None:
    """None when `node` can be lowered to the TF function, given the static `shapes` of its
    tensors and the names in `constants` (initializers and folded values); otherwise one
    lowercase sentence saying why not."""
    names = [n for n in node.input if n]
    if node.op_type == "Constant" or (names and all(n in constants for n in names)):
        return None  # folded at build time: it becomes a constant, not an op
    lowering = LOWERINGS.get(node.op_type)
    if lowering is None or (node.domain not in ("", "ai.onnx")):
        return f"{node.op_type} has no tflite lowering"
    for name in names:
        if name in constants:
            continue
        shape = shapes.get(name)
        if shape is None or any(not isinstance(d, (int, np.integer)) or d <= 0 for d in shape):
            return f"input {name} of {node.op_type} has no static shape"
    return lowering.check(node, shapes, constants)


def convert_int8(model: onnx.ModelProto, calibration: Iterable[dict[str, np.ndarray]], out_path: Path, *,
                 method: str = "minmax", percentile: float = 99.99) -> TfliteResult:
    """Write a full-int8 .tflite of `model` to `out_path` (atomically: a temporary file, then a
    rename). `model` is a segment with static shapes and float32 inputs; `calibration` yields
    feeds keyed by ONNX input names, in ONNX layout, that the activation ranges are taken from.

    `method` chooses each activation's range: "minmax", the smallest and largest value seen (the
    converter's own calibration); "percentile", the `percentile`-th and (100 - `percentile`)-th
    percentiles of the values seen (from a 2,048-bin histogram over the min-max range, rounded
    outwards to a bin edge), so that rare outliers do not widen the quantization step of
    everything else. Weights are per-channel in both.
    Raises UserError naming every node that cannot be lowered, or a feed that does not fit."""
    if method not in CALIBRATION_METHODS:
        raise UserError("compress.calib-method", f"calibration method '{method}' is not known",
                        f"choose one of {', '.join(CALIBRATION_METHODS)}")
    if not 50.0 < percentile <= 100.0:
        raise UserError("compress.calib-percentile", f"calibration percentile {percentile} is outside (50, 100]",
                        "99.99 keeps all but one value in 10,000 per tail; 100 is min-max")
    lowered = _lower(model)
    samples = [_to_tf_layout(lowered, feed) for feed in calibration]
    if not samples:
        raise UserError("compress.no-calibration", "int8 conversion needs at least one calibration sample",
                        "give calibration inputs (--calibration DIR) or let the build use random ones")
    model_bytes, ranges = _convert_int8(lowered, samples, method, percentile)
    result = _finish(lowered, model_bytes, Path(out_path))
    return dataclasses.replace(result, ranges=ranges)


def convert_float(model: onnx.ModelProto, out_path: Path) -> TfliteResult:
    """Write an fp32 .tflite of `model` (same lowering, no quantization): for testing the
    lowering itself against onnxruntime."""
    lowered = _lower(model)
    return _finish(lowered, _convert(lowered, None), Path(out_path))


# ---------------------------------------------------------------------------------------------
# Lowering machinery


@dataclass
class _Value:
    """An ONNX activation as a TF tensor: onnx == transpose(tf, perm)."""

    tf: Any
    perm: tuple[int, ...]
    nonneg: bool = False  # known >= 0 (after Relu & co.): lets max-pool pad with zeros


@dataclass(frozen=True)
class _Lowering:
    lower: Callable[["_Ctx", onnx.NodeProto], None]
    check: Callable[[onnx.NodeProto, Shapes, set[str]], str | None]


LOWERINGS: dict[str, _Lowering] = {}


def _ok(node: onnx.NodeProto, shapes: Shapes, constants: set[str]) -> str | None:
    return None


def _lowers(*op_types: str, check: Callable[[onnx.NodeProto, Shapes, set[str]], str | None] = _ok):
    def register(fn: Callable[["_Ctx", onnx.NodeProto], None]):
        for op in op_types:
            LOWERINGS[op] = _Lowering(fn, check)
        return fn

    return register


def _inv(p: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argsort(p))


def _identity(rank: int) -> tuple[int, ...]:
    return tuple(range(rank))


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            v = helper.get_attribute_value(a)
            return v.decode() if isinstance(v, bytes) else v
    return default


def _input(node: onnx.NodeProto, i: int) -> str:
    return node.input[i] if len(node.input) > i else ""


class _Ctx:
    """The state of one trace: ONNX name → `_Value` (activations) or np.ndarray (constants)."""

    def __init__(self, tf: Any, opset: int, consts: dict[str, np.ndarray]):
        self.tf = tf
        self.opset = opset
        self.consts = dict(consts)
        self.values: dict[str, _Value] = {}
        self.producer: dict[str, onnx.NodeProto] = {}  # ONNX tensor → the node that makes it
        self.uses: dict[str, int] = {}  # ONNX tensor → number of consumers (graph outputs count)

    def const(self, name: str) -> np.ndarray | None:
        return self.consts.get(name) if name else None

    def value(self, name: str) -> _Value:
        if name in self.values:
            return self.values[name]
        c = self.consts[name]
        return _Value(self.tf.constant(c), _identity(c.ndim))

    def item(self, name: str) -> _Value | np.ndarray:
        return self.values[name] if name in self.values else self.consts[name]

    def set(self, name: str, value: _Value | np.ndarray) -> None:
        if name:
            if isinstance(value, np.ndarray):
                self.consts[name] = value
            else:
                self.values[name] = value

    def shape(self, v: _Value | np.ndarray) -> tuple[int, ...]:
        """The ONNX shape of a value."""
        if isinstance(v, np.ndarray):
            return v.shape
        tf_shape = [int(d) for d in v.tf.shape]
        return tuple(tf_shape[i] for i in v.perm)

    def layout(self, v: _Value, perm: tuple[int, ...]) -> Any:
        """The TF tensor t with onnx == transpose(t, perm)."""
        if v.perm == tuple(perm):
            return v.tf
        # t' = transpose(onnx, inv(q)) = transpose(t, p[inv(q)])
        order = tuple(v.perm[i] for i in _inv(tuple(perm)))
        tf_shape = [int(d) for d in v.tf.shape]
        moved = [a for a in order if tf_shape[a] != 1]
        if moved == sorted(moved):  # only unit axes move: a reshape, not a data transpose
            return self.tf.reshape(v.tf, [tf_shape[a] for a in order])
        return self.tf.transpose(v.tf, order)

    def aligned(self, item: _Value | np.ndarray, perm: tuple[int, ...], dtype: Any = np.float32) -> Any:
        """`item` broadcast (ONNX rules) to rank len(perm) and laid out with `perm`."""
        rank = len(perm)
        if not isinstance(item, _Value):
            c = np.asarray(item, dtype)
            if c.ndim == 0:
                return c
            c = c.reshape((1,) * (rank - c.ndim) + c.shape)
            return np.ascontiguousarray(np.transpose(c, _inv(perm)))
        if len(item.perm) < rank:
            shape = self.shape(item)
            t = self.tf.reshape(self.layout(item, _identity(len(shape))), (1,) * (rank - len(shape)) + shape)
            item = _Value(t, _identity(rank))
        return self.layout(item, perm)


def _common_perm(cx: _Ctx, items: list[_Value | np.ndarray]) -> tuple[int, ...]:
    """The layout an elementwise op computes in: that of its first full-rank activation."""
    rank = max(len(cx.shape(i)) for i in items)
    for i in items:
        if isinstance(i, _Value) and len(i.perm) == rank:
            return i.perm
    return _identity(rank)


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
_lowers("Max")(_binary("maximum"))
_lowers("Min")(_binary("minimum"))


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
    else:
        y = x.tf
        if lo is not None:
            y = tf.math.maximum(y, np.float32(lo))
        if hi is not None:
            y = tf.math.minimum(y, np.float32(hi))
    cx.set(node.output[0], _Value(y, x.perm, x.nonneg or (lo is not None and lo >= 0)))


def _check_prelu(node, shapes, constants):
    return _need_const(node, constants, 1, "slope")


@_lowers("PRelu", check=_check_prelu)
def _prelu(cx: _Ctx, node: onnx.NodeProto) -> None:
    # relu(x) + slope * min(x, 0): RELU, MINIMUM, MUL, ADD, all Edge TPU ops (the
    # relu(x) - slope * relu(-x) form leaves a float NEG in the int8 model).
    tf = cx.tf
    x = cx.value(node.input[0])
    slope = cx.aligned(cx.const(node.input[1]), x.perm)
    cx.set(node.output[0], _Value(tf.nn.relu(x.tf) + slope * tf.math.minimum(x.tf, np.float32(0)), x.perm))


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
        # Pads must never win the max: zeros do that exactly after a ReLU; otherwise the
        # lowest float (PADV2; int8 quantization clamps it to -128).
        fill = 0.0 if x.nonneg else float(np.finfo(np.float32).min)
        t = tf.pad(t, [[0, 0], list(pads[0]), list(pads[1]), [0, 0]], constant_values=fill)
        padding = "VALID"
    cx.set(node.output[0], _Value(tf.nn.max_pool2d(t, kernel, strides, padding), NHWC, x.nonneg))


@_lowers("AveragePool", check=_check_pool)
def _average_pool(cx: _Ctx, node: onnx.NodeProto) -> None:
    tf = cx.tf
    x = cx.value(node.input[0])
    _, _, h, wd = cx.shape(x)
    kernel = tuple(_attr(node, "kernel_shape"))
    declared = _spatial(node, (h, wd), kernel)[2]
    strides, dilations, pads = _spatial(node, (h, wd), kernel, ceil=bool(_attr(node, "ceil_mode", 0)))
    include_pad = bool(_attr(node, "count_include_pad", 0))
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


def _perm_without(perm: tuple[int, ...], dropped: set[int]) -> tuple[int, ...]:
    """The `p` left when ONNX axes `dropped` (and their TF axes) are removed."""
    kept = [i for i in range(len(perm)) if i not in dropped]
    order = sorted(perm[i] for i in kept)
    return tuple(order.index(perm[i]) for i in kept)


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
    y = cx.tf.concat([cx.aligned(i, perm) for i in items], axis=perm[axis])
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
    y = cx.tf.pad(x.tf, tf_pads, constant_values=value)
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


# ---------------------------------------------------------------------------------------------
# Tracing and conversion

# Ops that want NHWC, and ops through which that wish reaches back to a segment input.
_LAYOUT_SENSITIVE = {"Conv", "ConvTranspose", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Resize"}
_LAYOUT_TRANSPARENT = {"Add", "Sub", "Mul", "Div", "Max", "Min", "Relu", "Sigmoid", "Tanh", "HardSigmoid",
                       "HardSwish", "Clip", "PRelu", "BatchNormalization", "Identity", "Dropout", "Pad", "Concat",
                       "Slice", "Split"}


def _input_perm(graph: onnx.GraphProto, name: str, rank: int) -> tuple[int, ...]:
    """NHWC for a 4-d input that reaches a layout-sensitive op through layout-transparent ones."""
    if rank != 4:
        return _identity(rank)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    todo, seen = [name], {name}
    while todo:
        for node in consumers.get(todo.pop(), []):
            if node.op_type in _LAYOUT_SENSITIVE:
                return NHWC
            if node.op_type in _LAYOUT_TRANSPARENT:
                for o in node.output:
                    if o and o not in seen:
                        seen.add(o)
                        todo.append(o)
    return _identity(rank)


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


def _signature_key(name: str, used: set[str]) -> str:
    key = re.sub(r"[^0-9A-Za-z_]", "_", name)
    if not key or not key[0].isalpha():
        key = "t_" + key
    key, base, n = key[:120], key[:120], 2
    while key in used:
        key, n = f"{base}_{n}", n + 1
    used.add(key)
    return key


@dataclass
class _Lowered:
    function: Any  # tf.function
    module: Any  # tf.Module holding it (the converter takes signatures from it)
    inputs: list[TensorSpec]
    outputs: list[TensorSpec] = field(default_factory=list)


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)


def _static_shapes(model: onnx.ModelProto) -> Shapes:
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    shapes: Shapes = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        t = vi.type.tensor_type
        if t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
            shapes[vi.name] = tuple(d.dim_value for d in t.shape.dim)
    for init in model.graph.initializer:
        shapes[init.name] = tuple(init.dims)
    return shapes


def _check_model(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Constants of the graph; raises UserError listing every input or node we cannot take."""
    graph = model.graph
    consts = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    problems = []
    for vi in graph.input:
        if vi.name in consts:
            continue
        t = vi.type.tensor_type
        if t.elem_type != onnx.TensorProto.FLOAT:
            problems.append(f"input {vi.name} is {onnx.TensorProto.DataType.Name(t.elem_type).lower()}, not float32")
        if not t.HasField("shape") or not all(d.HasField("dim_value") and d.dim_value > 0 for d in t.shape.dim):
            problems.append(f"input {vi.name} has no static shape")
    if problems:
        raise UserError("tflite.bad-input", f"the segment's inputs cannot be lowered to tflite: {problems[0]}",
                        "fix the input shapes (e.g. --input-shape x=1x3x224x224) and keep float32 inputs",
                        notes=problems)
    shapes = _static_shapes(model)
    names = set(consts)
    for node in graph.node:
        if reason := lowering_reason(node, shapes, names):
            problems.append(f"node {node.name or node.output[0]} ({node.op_type}): {reason}")
        elif node.op_type in ("Constant", "Shape") or (node.input and all(n in names for n in node.input if n)):
            names.update(o for o in node.output if o)
    if problems:
        raise UserError("tflite.unsupported-op", f"{len(problems)} node(s) of the segment cannot be lowered to tflite",
                        "place these nodes on the cpu (legalize does so when the target allows it)", notes=problems)
    return consts


def _lower(model: onnx.ModelProto) -> _Lowered:
    """Trace the segment into a tf.function whose signature keys name its ONNX tensors."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    consts = _check_model(model)
    graph = model.graph
    opset = _opset(model)
    used: set[str] = set()
    inputs = []
    for vi in graph.input:
        if vi.name in consts:
            continue
        shape = tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
        perm = _input_perm(graph, vi.name, len(shape))
        inputs.append(TensorSpec(vi.name, shape, "float32", key=_signature_key(vi.name, used),
                                 perm=None if perm == _identity(len(shape)) else perm))
    lowered = _Lowered(None, None, inputs)

    def body(*args: Any) -> dict[str, Any]:
        cx = _Ctx(tf, opset, consts)
        out_used: set[str] = set()
        for node in graph.node:
            cx.producer.update((o, node) for o in node.output if o)
            for n in node.input:
                cx.uses[n] = cx.uses.get(n, 0) + 1
        for vi in graph.output:
            cx.uses[vi.name] = cx.uses.get(vi.name, 0) + 1
        for spec, arg in zip(inputs, args):
            cx.set(spec.name, _Value(arg, spec.perm or _identity(len(spec.shape))))
        for node in graph.node:
            names = [n for n in node.input if n]
            if node.op_type != "Constant" and names and all(n in cx.consts for n in names):
                for name, v in zip(node.output, _fold(node, {n: cx.consts[n] for n in names}, opset)):
                    cx.set(name, v)
            else:
                LOWERINGS[node.op_type].lower(cx, node)
        result, specs = {}, []
        for vi in graph.output:
            if vi.name not in cx.values:
                raise UserError("tflite.constant-output", f"segment output {vi.name} is a constant",
                                "a constant output needs no accelerator: keep it out of the segment")
            v = cx.values[vi.name]
            key = _signature_key(vi.name, out_used)
            result[key] = tf.identity(v.tf, name=key)
            dtype = tf.as_dtype(v.tf.dtype).name
            specs.append(TensorSpec(vi.name, cx.shape(v), dtype, key=key,
                                    perm=None if v.perm == _identity(len(v.perm)) else v.perm))
        lowered.outputs = specs
        return result

    signature = [tf.TensorSpec([s.shape[i] for i in _inv(s.perm or _identity(len(s.shape)))], tf.float32,
                               name=s.key) for s in inputs]
    lowered.function = tf.function(body, input_signature=signature, autograph=False)
    lowered.module = tf.Module()
    lowered.module.f = lowered.function
    lowered.function.get_concrete_function()  # trace now: lowering errors surface here
    return lowered


def _to_tf_layout(lowered: _Lowered, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    sample = []
    for spec in lowered.inputs:
        if spec.name not in feed:
            raise UserError("compress.calibration-input", f"calibration sample lacks input {spec.name}",
                            "give every segment input in each calibration sample")
        x = np.asarray(feed[spec.name], np.float32)
        if x.shape != spec.shape:
            raise UserError("compress.calibration-shape",
                            f"calibration input {spec.name} has shape {x.shape}, the segment wants {spec.shape}",
                            "give calibration inputs in the model's own layout and shape")
        sample.append(np.ascontiguousarray(np.transpose(x, _inv(spec.perm)) if spec.perm else x))
    return sample


def _converter(lowered: _Lowered, samples: list[list[np.ndarray]] | None) -> Any:
    import tensorflow as tf

    # the converter's calibrator builds a tf.lite.Interpreter internally and TF warns about its
    # own deprecation on every conversion: noise for our users, who never see that interpreter
    warnings.filterwarnings("ignore", message=r"\s*Warning: tf.lite.Interpreter is deprecated")

    converter = tf.lite.TFLiteConverter.from_concrete_functions(
        [lowered.function.get_concrete_function()], lowered.module)
    if samples is not None:
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        # keyed by signature name: the converter's input order need not be ours
        keys = [spec.key for spec in lowered.inputs]
        converter.representative_dataset = lambda: (dict(zip(keys, sample)) for sample in samples)
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        converter.inference_input_type = tf.int8
        converter.inference_output_type = tf.int8
    return converter


def _convert(lowered: _Lowered, samples: list[list[np.ndarray]] | None) -> bytes:
    """The converter in one step: float when `samples` is None, else full int8 (min-max ranges)."""
    converter = _converter(lowered, samples)
    with _native_stderr_captured() as captured:
        try:
            return converter.convert()
        except Exception:
            sys.stderr.write(captured())  # the converter's own diagnostics belong with its error
            raise


def _convert_int8(lowered: _Lowered, samples: list[list[np.ndarray]], method: str,
                  percentile: float) -> tuple[bytes, dict[str, Any]]:
    """Full int8 in two steps, the converter's own: calibrate (a float model whose activation
    tensors carry the min and max seen), then quantize from those ranges. Between the two the
    percentile method narrows each range; with "minmax" the result is the converter's one-step
    conversion (tested)."""
    import tensorflow as tf
    from tensorflow.lite.python import lite
    from tensorflow.lite.tools import flatbuffer_utils

    converter = _converter(lowered, samples)
    converter._experimental_calibrate_only = True  # pylint: disable=protected-access
    with _native_stderr_captured() as captured:
        try:
            calibrated = converter.convert()
            ranges: dict[str, Any] = {"method": method}
            if method == "percentile":
                graph = flatbuffer_utils.convert_bytearray_to_object(calibrated)
                ranges.update(_narrow_to_percentile(graph, calibrated, lowered, samples, percentile))
                calibrated = bytes(flatbuffer_utils.convert_object_to_bytearray(graph))
            # the converter's own second step, with the arguments its one-step path passes
            quantized = lite._mlir_quantize(  # pylint: disable=protected-access
                calibrated, converter._experimental_disable_per_channel,  # pylint: disable=protected-access
                input_data_type=tf.int8, output_data_type=tf.int8)
            return lite._deduplicate_readonly_buffers(quantized), ranges  # pylint: disable=protected-access
        except Exception:
            sys.stderr.write(captured())
            raise


def _narrow_to_percentile(model: Any, calibrated: bytes, lowered: _Lowered, samples: list[list[np.ndarray]],
                          percentile: float) -> dict[str, Any]:
    """Replace the min/max of every calibrated activation in `model` (the flatbuffer's object form)
    by percentiles of the values the float model computes on `samples`."""
    from ai_edge_litert.interpreter import Interpreter

    graph = model.subgraphs[0]
    stats = {i: (float(t.quantization.min[0]), float(t.quantization.max[0])) for i, t in enumerate(graph.tensors)
             if t.quantization is not None and t.quantization.min is not None and len(t.quantization.min) == 1}
    with warnings.catch_warnings():  # "for debugging only": reading every activation is the point here
        warnings.simplefilter("ignore")
        interpreter = Interpreter(model_content=calibrated, experimental_preserve_all_tensors=True)
    runner = interpreter.get_signature_runner()
    keys = [spec.key for spec in lowered.inputs]
    hist = {i: np.zeros(_HISTOGRAM_BINS, np.int64) for i in stats}
    for sample in samples:
        runner(**dict(zip(keys, sample)))
        for i, (lo, hi) in stats.items():
            if hi > lo:
                hist[i] += np.histogram(interpreter.get_tensor(i), _HISTOGRAM_BINS, (lo, hi))[0]
    tail = (100.0 - percentile) / 100.0
    kept = []
    for i, (lo, hi) in stats.items():
        counts = hist[i]
        if hi <= lo or not counts.sum():
            continue
        cdf = np.cumsum(counts) / counts.sum()
        edges = np.linspace(lo, hi, _HISTOGRAM_BINS + 1)
        # outwards to bin edges: the first bin whose cumulative share passes the lower tail, the
        # last bin still holding values inside the upper one
        new_lo = float(edges[int(np.searchsorted(cdf, tail, side="right"))])
        new_hi = float(edges[int(np.searchsorted(cdf, 1.0 - tail, side="left")) + 1])
        new_lo, new_hi = max(new_lo, lo), min(new_hi, hi)
        if new_hi > new_lo:
            graph.tensors[i].quantization.min = [new_lo]
            graph.tensors[i].quantization.max = [new_hi]
            kept.append((new_hi - new_lo) / (hi - lo))
    return {"percentile": percentile, "tensors": len(stats), "narrowed": int(sum(k < 1.0 for k in kept)),
            "median_range_kept": round(float(np.median(kept)), 4) if kept else 1.0}


@contextlib.contextmanager
def _native_stderr_captured():
    """Capture what native code writes to fd 2 (the converter prints `fully_quantize: ...` on every
    conversion, which a `--quiet` build must not show). Yields a function returning the text."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lambda: (tmp.seek(0), tmp.read().decode(errors="replace"))[1]
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def operators(model: bytes) -> tuple[tuple[str, ...], ...]:
    """The operators of each subgraph of a .tflite flatbuffer (the main one first), in execution
    order: builtin operators by their schema name (CONV_2D, ...), custom ops by their custom code."""
    from ai_edge_litert import schema_py_generated as schema

    names = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
    m = schema.Model.GetRootAs(model, 0)
    codes = []
    for i in range(m.OperatorCodesLength()):
        c = m.OperatorCodes(i)
        code = max(c.BuiltinCode(), c.DeprecatedBuiltinCode())
        codes.append(c.CustomCode().decode() if code == schema.BuiltinOperator.CUSTOM else names[code])
    return tuple(tuple(codes[g.Operators(i).OpcodeIndex()] for i in range(g.OperatorsLength()))
                 for g in (m.Subgraphs(s) for s in range(m.SubgraphsLength())))


def op_counts(model: bytes) -> dict[str, int]:
    """Histogram of the operators of a .tflite flatbuffer, over all its subgraphs."""
    counts: dict[str, int] = {}
    for graph in operators(model):
        for name in graph:
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def _finish(lowered: _Lowered, model: bytes, out_path: Path) -> TfliteResult:
    from ai_edge_litert.interpreter import Interpreter

    runner = Interpreter(model_content=model).get_signature_runner()
    details = {"in": runner.get_input_details(), "out": runner.get_output_details()}

    def with_quant(specs: list[TensorSpec], side: str) -> tuple[TensorSpec, ...]:
        out = []
        for spec in specs:
            d = details[side][spec.key]
            scale, zero = d["quantization"]
            quant = QuantParams(float(scale), int(zero)) if d["dtype"] in (np.int8, np.uint8) else None
            out.append(TensorSpec(spec.name, spec.shape, spec.dtype, spec.key, spec.perm, quant))
        return tuple(out)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_path.parent, prefix=out_path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(model)
        os.replace(tmp, out_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return TfliteResult(with_quant(lowered.inputs, "in"), with_quant(lowered.outputs, "out"), op_counts(model))
