"""Graph rewrites the TVM backend applies to a segment before TVM imports it, where TVM's code for an
op is wrong on a device.

Integer powers on CUDA. TVM compiles a library's CUDA source with NVRTC and `--use_fast_math`
always (TVM 0.27, `tvm.support.nvcc`), which turns `powf` into `__powf`, computed as
exp2(y * log2(x)): NaN for every negative x, whatever y. Layer normalization written out as
ONNX ops, `Pow(x - mean, 2)`, is then NaN everywhere: PP-OCRv4's recognizer, built for the
rtx3090 target, returned all-NaN outputs on an H200 until its five such `Pow`s were compiled as
`x * x`. A `Pow` whose exponent is a constant 2, 3 or 4 becomes that many `Mul`s, which is exact
in any case (correctly rounded products, as `powf` for these exponents) and needs no math library.
Other exponents are left: a non-integer power of a negative number is NaN anyway.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from ...ir import model as irm
from ...ir.values import constant
from .tiling import largest_divisor

INTEGER_POWERS = (2, 3, 4)


def integer_powers_as_products(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """`model` with each `Pow(x, c)`, c a constant scalar 2, 3 or 4 and x floating point, as products
    of x; and how many were rewritten (the model is returned unchanged when none is)."""
    graph_model = ir.serde.deserialize_model(model)
    graph = graph_model.graph
    rewritten = 0
    for node in list(graph):  # top-level graph: segments handed to TVM have no subgraphs
        if node.op_type != "Pow" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        x, exponent = node.inputs
        power = _integer_power(constant(exponent))
        if power is None or x is None or x.dtype is None or not x.dtype.is_floating_point():
            continue
        out = node.outputs[0]
        square = ir.node("Mul", [x, x], name=_named(node, "square"))
        if power == 2:
            last = square
        elif power == 3:
            last = ir.node("Mul", [square.outputs[0], x], name=_named(node, "cube"))
        else:
            last = ir.node("Mul", [square.outputs[0], square.outputs[0]], name=_named(node, "fourth"))
        new_nodes = [square] if last is square else [square, last]
        graph.insert_before(node, new_nodes)
        last.outputs[0].shape, last.outputs[0].type = out.shape, out.type
        if out.is_graph_output():  # the segment's output keeps its name
            name, out.name = out.name, f"{out.name}__pow"
            graph.outputs[graph.outputs.index(out)] = last.outputs[0]
            last.outputs[0].name = name
        ir.convenience.replace_all_uses_with(out, last.outputs[0])
        graph.remove(node, safe=True)
        rewritten += 1
    if not rewritten:
        return model, 0
    RemoveUnusedNodesPass()(graph_model)
    return ir.serde.serialize_model(graph_model), rewritten


def _named(node: ir.Node, part: str) -> str | None:
    return f"{node.name}_{part}" if node.name else None  # unnamed nodes get onnx_ir's unique names


def _integer_power(value: np.ndarray | None) -> int | None:
    if value is None or value.size != 1 or value.dtype.kind not in "fiu":
        return None
    power = float(value.reshape(()))
    return int(power) if power in INTEGER_POWERS else None


# --- narrow output rows on the CPU ---------------------------------------------------------------

# A channels-last convolution's default CPU schedule blocks the pixels of an output row in registers,
# as many as the largest divisor of the row's width up to schedules._PIXEL_BLOCK: a prime width (71,
# 17, 37) leaves one pixel per block, no weight reuse, and the convolution runs 5-7x below its rate
# (InceptionV3's 3x3 convolution to 71x71x192: 41 ms, 34 GFLOP/s, against 194 GFLOP/s for its
# 147-wide neighbour). Such a convolution computes a slightly wider row instead, padded on the right,
# and a Slice keeps the columns the model asked for.
GOOD_BLOCK = 4  # a width whose best pixel block is at least this needs no widening
WIDEN_AT_MOST = 8  # columns added at most (beyond that the width is left as it is)


def narrow_rows_widened(model: onnx.ModelProto, pixel_block: int) -> tuple[onnx.ModelProto, int]:
    """`model` with each 2-D Conv whose output width has no divisor from GOOD_BLOCK to `pixel_block`
    computing the smallest wider row that has one (its right padding grown), then sliced back to its
    width; and how many were widened (the model itself when none is). Exact: the kept columns read the
    same inputs and weights; the added ones read zero padding and are dropped."""
    inferred = onnx.shape_inference.infer_shapes(irm.weightless(model)[0])  # (its weights: graph inputs)
    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else 0 for d in v.type.tensor_type.shape.dim]
              for v in (*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input)}
    nodes, constants = [], []
    for node in model.graph.node:
        conv = node.op_type == "Conv" and node.domain in ("", "ai.onnx")
        shape = shapes.get(node.output[0], []) if conv and len(shapes.get(node.input[0], [])) == 4 else []
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute} if len(shape) == 4 else {}
        # a 2-D convolution with explicit padding only (SAME_* would need its pads written out first)
        two_d = len(shape) == 4 and shape[3] > 0 and len(attrs.get("pads", [0] * 4)) == 4
        wider = (_wider(shape[3], pixel_block) if two_d and attrs.get("auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET")
                 else None)
        if wider is None:
            nodes.append(node)
            continue
        width = shape[3]
        pads = list(attrs.get("pads", [0, 0, 0, 0]))
        pads[3] += (wider - width) * list(attrs.get("strides", [1, 1]))[1]
        wide = onnx.helper.make_node("Conv", list(node.input), [f"{node.output[0]}__wide"], name=node.name,
                                     **{**attrs, "pads": pads})
        name = f"{node.name or node.output[0]}__narrow"
        bounds = [onnx.helper.make_tensor(f"{name}_{k}", onnx.TensorProto.INT64, [1], [v])
                  for k, v in (("starts", 0), ("ends", width), ("axes", 3))]
        constants += bounds
        nodes += [wide, onnx.helper.make_node("Slice", [wide.output[0], *(t.name for t in bounds)],
                                              [node.output[0]], name=name)]
    if not constants:
        return model, 0
    widened = onnx.ModelProto()
    widened.CopyFrom(model)
    del widened.graph.node[:]
    widened.graph.node.extend(nodes)
    widened.graph.initializer.extend(constants)
    return widened, len(constants) // 3


def _wider(width: int, pixel_block: int) -> int | None:
    """The smallest width from `width` up (at most WIDEN_AT_MOST more) whose best pixel block is at least
    GOOD_BLOCK; None when `width` itself is good or no width in reach is."""
    if width < GOOD_BLOCK or largest_divisor(width, pixel_block) >= GOOD_BLOCK:
        return None
    return next((w for w in range(width + 1, width + WIDEN_AT_MOST + 1)
                 if largest_divisor(w, pixel_block) >= GOOD_BLOCK), None)
