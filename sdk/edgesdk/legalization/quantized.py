"""A quantized model (QDQ: a full-int8 TFLite file through tf2onnx, an onnxruntime-quantized ONNX) as the
float model it was quantized from, for an accelerator that quantizes its segments itself.

Such a model computes in float between DequantizeLinear and QuantizeLinear nodes: every weight is an int8
constant behind a DequantizeLinear, every activation passes through a QuantizeLinear -> DequantizeLinear
pair (its rounding to the int8 grid). Neither runs on the Edge TPU (a constant's node runs on the CPU, an
int8 tensor is not one the Edge TPU's converter takes), so each convolution sat alone between CPU nodes:
14 % of a MobileNetV2's ops on the Edge TPU. `float_of_quantized` rewrites

    DequantizeLinear(constant q, scale, zero point)  -> the float constant (q - zero point) * scale
    DequantizeLinear(QuantizeLinear(x, s, z), s, z)  -> x
    DequantizeLinear(move(QuantizeLinear(x, s, z)), s, z) -> move(x)   (a Squeeze, Reshape, Transpose of
                                                                         int8 values, s one scale)

and the compress stage quantizes the result again as any float model, each tensor a removed pair rounded
on the pair's own grid (`ir.grids`), the rest calibrated: the model's int8 tensors keep the steps they were
quantized to, so its int8 bundle answers as the model did, not as a re-calibration would. The first is exact
(the value the node computes, per tensor or per axis). The second drops the pair's rounding to the grid,
at most half a step s/2 per element, and its clipping to [s (-128 - z), s (127 - z)] (for uint8, [0, 255]);
legalize measures the outputs' deviation end to end. A pair whose two nodes disagree on scale or zero
point, or a Q whose int8 output is read by anything but such a DequantizeLinear, is left alone, as is a
DequantizeLinear of a graph input (a model taking int8 data) and a QuantizeLinear of an output.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir

from ..ir.grids import GRIDS, grids
from ..ir.values import constant
from ..passes.rule import Rule

STANDARD = ("", "ai.onnx")
# ops that move int8 elements without computing: a pair around them is the pair before them
MOVES = frozenset({"Squeeze", "Unsqueeze", "Reshape", "Flatten", "Transpose"})


def float_of_quantized(model: ir.Model) -> int:
    """The two rewrites of the module docstring, over the main graph; how many nodes they removed."""
    graph = model.graph
    outputs = set(graph.outputs)
    fired = 0
    removed: set[ir.Node] = set()
    kept = grids(model)
    _keep_ends(graph, kept)
    for node in list(graph):
        if node in removed or node.domain not in STANDARD or node.op_type != "DequantizeLinear" or node.outputs[0] in outputs:
            continue
        folded = _dequantized(node)
        if folded is not None:
            value = ir.Value(name=f"{node.outputs[0].name}__float", shape=ir.Shape(folded.shape),
                             type=ir.TensorType(ir.DataType.FLOAT), const_value=ir.tensor(folded))
            graph.register_initializer(value)
            ir.convenience.replace_all_uses_with(node.outputs[0], value)
            graph.remove(node, safe=True)
            fired += 1
            continue
        moves, q = _moved(node)
        if moves:  # DQ(move(Q(x))) of one per-tensor grid: move(x), the move now of float values
            if not _same_grid(q, node) or constant(node.inputs[1]).size != 1:
                continue
            ir.convenience.replace_all_uses_with(node.outputs[0], moves[0].outputs[0])
            moves[-1].replace_input_with(0, q.inputs[0])
            for m in moves:
                m.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
            _keep(kept, q, [q.inputs[0], *(m.outputs[0] for m in moves)])
            graph.remove(node, safe=True)
            graph.remove(q, safe=True)
            fired += 2
            continue
        if q is None or q.outputs[0] in outputs:
            continue
        readers = [use.node for use in q.outputs[0].uses()]
        if not all(r.op_type == "DequantizeLinear" and r.domain in STANDARD and _same_grid(q, r)
                   and r.outputs[0] not in outputs for r in readers):
            continue
        x = q.inputs[0]
        _keep(kept, q, [x])
        for r in readers:
            ir.convenience.replace_all_uses_with(r.outputs[0], x)
            graph.remove(r, safe=True)
        graph.remove(q, safe=True)
        removed.update(readers)
        fired += 1 + len(readers)
    if kept:
        model.metadata_props[GRIDS] = json.dumps(kept, sort_keys=True)
    return fired


def _keep_ends(graph: ir.Graph, kept: dict) -> None:
    """Record the grids of the model's own int8 ends, which stay: a DequantizeLinear of an int8 input (or of
    its moves) gives values on its grid (and so do the moves after it), a QuantizeLinear of an output rounds
    its input (and the moves before it) to its own."""
    inputs, outputs = set(graph.inputs), set(graph.outputs)
    for node in graph:
        if node.domain not in STANDARD:
            continue
        if node.op_type == "DequantizeLinear" and _source(node.inputs[0]) in inputs:
            values, v = [node.outputs[0]], node.outputs[0]
            while len(v.uses()) == 1 and (reader := v.uses()[0].node).op_type in MOVES and reader.domain in STANDARD:
                v = reader.outputs[0]
                values.append(v)
            _keep(kept, node, values)
        elif node.op_type == "QuantizeLinear" and node.outputs[0] in outputs:
            values, v = [node.inputs[0]], node.inputs[0]
            while (p := v.producer()) is not None and p.op_type in MOVES and p.domain in STANDARD \
                    and len(v.uses()) == 1 and p.inputs[0] is not None:
                v = p.inputs[0]
                values.append(v)
            _keep(kept, node, values)


def _source(value: ir.Value | None) -> ir.Value | None:
    """The value `value` moves (through MOVES, as tf2onnx transposes an int8 input), or itself."""
    while value is not None and (p := value.producer()) is not None and p.op_type in MOVES and p.domain in STANDARD:
        value = p.inputs[0]
    return value


def _keep(kept: dict, q: ir.Node, values: list[ir.Value]) -> None:
    """Record the per-tensor grid of QuantizeLinear (or DequantizeLinear) `q` as the range of `values` (a
    per-axis grid, which no activation's range can hold, is not kept)."""
    scale = constant(q.inputs[1])
    zero = constant(q.inputs[2]) if len(q.inputs) > 2 and q.inputs[2] is not None else None
    if scale is None or scale.size != 1 or (zero is not None and zero.size != 1):
        return
    # a QuantizeLinear without a zero point quantizes to uint8 (the spec's default)
    dtype = np.dtype(zero.dtype) if zero is not None else np.dtype(np.uint8)
    if dtype not in (np.dtype(np.int8), np.dtype(np.uint8)):
        return
    s, z, info = float(scale.reshape(())), int(zero.reshape(())) if zero is not None else 0, np.iinfo(dtype)
    for v in values:
        if v.name:
            kept[v.name] = [s * (info.min - z), s * (info.max - z)]


def _moved(dq: ir.Node) -> tuple[list[ir.Node], ir.Node | None]:
    """The QuantizeLinear `dq` reads, through int8 moves (a Squeeze tf2onnx writes between a pair: their
    nodes from `dq` back, each read by the next alone), and those moves; ([], None) where there is none."""
    moves = []
    value = dq.inputs[0]
    while value is not None and (producer := value.producer()) is not None and producer.domain in STANDARD:
        if producer.op_type == "QuantizeLinear":
            return (moves, producer) if not moves or len(value.uses()) == 1 else ([], None)
        if producer.op_type not in MOVES or len(value.uses()) != 1 or value in producer.graph.outputs:
            break
        moves.append(producer)
        value = producer.inputs[0]
    return [], None


def _dequantized(node: ir.Node) -> np.ndarray | None:
    """What a DequantizeLinear of constants computes, as float32; None where an input is not a constant or
    the node is one this does not evaluate (blocked quantization, a float8 or int4 type)."""
    q = constant(node.inputs[0])
    scale = constant(node.inputs[1]) if len(node.inputs) > 1 else None
    zero = constant(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] is not None else np.zeros((), np.int32)
    if q is None or scale is None or zero is None or q.dtype not in (np.int8, np.uint8, np.int32) \
            or node.attributes.get_int("block_size", 0):
        return None
    axis = node.attributes.get_int("axis", 1)
    if scale.ndim == 1 and q.ndim:  # per axis: scale and zero point along `axis`
        shape = [1] * q.ndim
        shape[axis % q.ndim] = scale.size
        scale, zero = scale.reshape(shape), np.broadcast_to(zero, scale.shape).reshape(shape)
    # as the spec computes it: (q - zero point) in int32, times the scale, in float32
    return ((q.astype(np.int32) - zero.astype(np.int32)).astype(np.float32) * scale.astype(np.float32)).astype(np.float32)


def _same_grid(q: ir.Node, dq: ir.Node) -> bool:
    """Whether the QuantizeLinear and the DequantizeLinear reading it use one scale and zero point."""
    if q.attributes.get_int("axis", 1) != dq.attributes.get_int("axis", 1):
        return False
    for i in (1, 2):
        a = constant(q.inputs[i]) if len(q.inputs) > i and q.inputs[i] is not None else None
        b = constant(dq.inputs[i]) if len(dq.inputs) > i and dq.inputs[i] is not None else None
        if i == 1 and (a is None or b is None):
            return False
        if (a is None) != (b is None) or (a is not None and not np.array_equal(a, b)):
            return False
    return True


RULE = Rule("float-of-quantized", float_of_quantized)
