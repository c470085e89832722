"""Pooling windows cut to the input they can read.

PyTorch's `AvgPool2d(k, ceil_mode=True)` with k far larger than its input (transformers' EfficientNet pools
its 7x7 features with k = 1280 or 2560) exports an AveragePool whose one window reaches k - 7 cells past the
input: ONNX counts only the cells inside the input and its declared pads (`count_include_pad` or not), so
the answer is the mean of the 7x7 cells, but a backend that pads to the window first pads to k x k: TVM's
CPU kernels then allocated 2560 x 2560 per channel and died with std::bad_alloc, and TFLite's Pad overflowed.
`clip-pool-window` gives such an axis the window it reads: along an axis with one output window, a kernel
longer than the padded input becomes the padded input's length, and its stride 1. The same cells are read and counted, so the
rewrite is exact (MaxPool too: cells past the input never take part).

Needs: the input's static shape; dilations of 1; `auto_pad` NOTSET. Guarantees: the same output shape.
"""

from __future__ import annotations

import onnx_ir as ir

from .rule import Rule
from .values import static_shape

POOLS = frozenset({"AveragePool", "MaxPool"})


def clip_pool_windows(model: ir.Model) -> int:
    """The rewrite of the module docstring over every graph; how many pools it changed."""
    fired = 0
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type not in POOLS or node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
            continue
        shape = static_shape(node.inputs[0])
        attrs = node.attributes
        kernel = list(attrs.get_ints("kernel_shape", ()))
        if shape is None or not kernel or attrs.get_string("auto_pad", "NOTSET") != "NOTSET" \
                or any(d != 1 for d in attrs.get_ints("dilations", ())):
            continue
        n = len(kernel)
        strides = list(attrs.get_ints("strides", [1] * n))
        pads = list(attrs.get_ints("pads", [0] * 2 * n))
        ceil = attrs.get_int("ceil_mode", 0)
        clipped, steps = list(kernel), list(strides)
        for i, (size, k, s) in enumerate(zip(shape[-n:], kernel, strides)):
            padded = size + pads[i] + pads[i + n]
            span = padded - k
            windows = (-(-span // s) if ceil else span // s) + 1
            if windows == 1 and k > padded:
                # the one window's stride moves it nowhere: 1, or TVM's ceil_mode padding still takes
                # stride - 1 cells past the input (2559 for EfficientNet's, std::bad_alloc again)
                clipped[i], steps[i] = padded, 1
        if clipped != kernel:
            attrs["kernel_shape"] = ir.AttrInt64s("kernel_shape", clipped)
            attrs["strides"] = ir.AttrInt64s("strides", steps)
            fired += 1
    return fired


RULES = (Rule("clip-pool-window", clip_pool_windows),)
