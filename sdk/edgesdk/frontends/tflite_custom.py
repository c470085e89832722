"""Handlers for TFLite custom ops that tf2onnx leaves unconverted.

A handler is data: the custom code it answers, and a rewrite that replaces each such node in
tf2onnx's graph by TensorFlow ops tf2onnx converts itself, so layout and padding follow tf2onnx's
own tested rules. The rewrites run inside tf2onnx, after its TFLite-to-TF mapping and before its
TF-to-ONNX mapping (`custom_rewriter`). Imported only by the converter child: it needs tf2onnx.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class CustomOp:
    """One custom op node of the flatbuffer: its code, first output tensor and raw custom options."""

    code: str
    output: str
    options: bytes


def conv_transpose_bias(g, node, op: CustomOp) -> None:
    """MediaPipe's Convolution2DTransposeBias (mediapipe/util/tflite/operations/transpose_conv_bias.cc):
    TFLite's TRANSPOSE_CONV plus a bias, y = conv2d_transpose(x, w) + b, with inputs (x NHWC,
    w OHWI, b [O]) and custom options a raw TfLiteTransposeConvParams {int32 padding (1 SAME,
    2 VALID), int32 stride_width, int32 stride_height}. Its output size per spatial axis is
    SAME: in * stride; VALID: in * stride + max(k - stride, 0).

    Rewritten as Conv2DBackpropInput(output_shape, w as HWOI, x) + BiasAdd: tf2onnx turns the
    first into ConvTranspose with explicit pads (total = stride * (in - 1) + k - out, split
    floor/ceil as TFLite's ComputePaddingHeightWidth does)."""
    from tf2onnx import utils

    if len(op.options) < 12:
        raise ValueError(f"custom options of {node.name} hold {len(op.options)} bytes, expected 12")
    padding, stride_w, stride_h = struct.unpack_from("<3i", op.options)
    if padding not in (1, 2) or stride_w < 1 or stride_h < 1:
        raise ValueError(f"custom options of {node.name}: padding {padding}, strides {stride_h}x{stride_w}")
    x, w, b = node.input[:3]
    n, h, wd, _ = g.get_shape(x)
    o, kh, kw, _ = g.get_shape(w)

    def size(i, k, s):
        return i * s if padding == 1 else i * s + max(k - s, 0)

    shape = [n if n and n > 0 else 1, size(h, kh, stride_h), size(wd, kw, stride_w), o]
    out, dtype = node.output[0], g.get_dtype(node.output[0])
    g.remove_node(node.name)
    sizes = g.make_const(utils.make_name(f"{node.name}/output_shape"), np.array(shape, np.int32))
    hwoi = g.make_node("Transpose", [w], attr={"perm": [1, 2, 0, 3]}, name=utils.make_name(f"{node.name}/weights"))
    conv = g.make_node("Conv2DBackpropInput", [sizes.output[0], hwoi.output[0], x],
                       attr={"strides": [1, stride_h, stride_w, 1], "padding": "SAME" if padding == 1 else "VALID",
                             "data_format": "NHWC", "dilations": [1, 1, 1, 1]},
                       name=utils.make_name(f"{node.name}/conv_transpose"), skip_conversion=False,
                       shapes=[[-1 if n is None or n < 0 else n] + shape[1:]], dtypes=[dtype])
    g.make_node("BiasAdd", [conv.output[0], b], attr={"data_format": "NHWC"}, outputs=[out],
                name=utils.make_name(f"{node.name}/bias"), skip_conversion=False,
                shapes=[g.get_shape(conv.output[0])], dtypes=[dtype])


# custom code -> (what it becomes, rewrite)
HANDLERS: dict[str, tuple[str, Callable]] = {
    "Convolution2DTransposeBias": ("ConvTranspose + bias", conv_transpose_bias),
}


def rewriter(custom_ops: list[CustomOp], done: dict[str, str], failed: dict[str, str]):
    """A tf2onnx custom rewriter applying HANDLERS to the custom op nodes of the graph, or None.
    tf2onnx names a TFLite op's node after the op's first output tensor (it renames the tensor
    itself when it is a graph output). `done[node]` gets the custom code of each node rewritten; a
    handler that refuses a node leaves it as it was and says why in `failed[node]`."""
    by_output = {op.output: op for op in custom_ops if op.code in HANDLERS}
    if not by_output:
        return None

    def rewrite(g, ops):
        for node in list(ops):
            op = by_output.get(node.name)
            if op is None or node.type != f"TFL_{op.code}":
                continue
            try:
                HANDLERS[op.code][1](g, node, op)
                done[node.name] = op.code
            except Exception as e:
                failed[node.name] = f"edgesdk's handler refused it: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        return g.get_nodes()

    return rewrite
