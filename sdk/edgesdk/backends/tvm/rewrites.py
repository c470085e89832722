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

from ...ir.values import constant

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
