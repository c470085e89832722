"""Constant affine maps after convolutions as BatchNormalization, so onnxruntime's NCHWc layout keeps them.

onnxruntime's x86 kernels run convolutions in a blocked layout (NCHWc: channels in blocks of 8 or 16,
MLAS's `NchwcTransformer`, part of `ORT_ENABLE_ALL`). Its transformer carries that layout through the
ops it knows (Conv, pools, activations, Add of two blocked tensors of one shape, Concat, nearest Resize,
and BatchNormalization, which becomes a depthwise 1x1 NCHWc convolution), and puts a `ReorderOutput`
before every other consumer and a `ReorderInput` after it. A `Mul` or `Add` by a constant (a scalar
broadcast over the tensor) is not among them: PP-LCNetV3's "learnable affine blocks" (y = a*act(x) + b,
a and b scalars, after every activation of PP-OCRv4's detector and recognizer backbones) each cost two
reorders and two elementwise passes, 13 % of the detector's onnxruntime time, on this project's hosts.

The same map as a `BatchNormalization` (scale s, bias b, mean 0, variance 1, epsilon 0) stays blocked:
onnxruntime turns it into an NCHWc convolution (s / sqrt(1 + 0) = s and b - 0 * s = b, both exact) that
fuses a following activation, or folds it into the producing Conv where nothing lies between.

Rewritten: a chain of `Mul`, `Add` and `Sub` (x - c) nodes, each by a constant that is one number per
channel of axis 1 (a scalar, or C values) of a 4-D float32 tensor of static shape that the chain does
not enlarge, whose every intermediate value has one consumer and is no graph output, and which starts
after a convolution (a Conv, seen through the activations and BatchNormalizations onnxruntime fuses or
keeps blocked) — a `Mul` after anything else (attention's scale after a MatMul, which onnxruntime
fuses into the MatMul) is left as it is. The chain becomes one BatchNormalization whose scale and bias
compose the chain's constants in float64, rounded once to float32.

Exactness: a chain of one Mul and one Add, in that order, is the same arithmetic (onnxruntime may
fuse it into one multiply-add, which rounds once instead of twice); longer chains and Add-before-Mul
are reassociated: a few ulp of the values involved, as the import stage's `passes.elementwise`.

Only the `onnxruntime` backend's segments get this: LiteRT and TVM lower Mul and Add by constants well
and lack a need for BatchNormalization.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ...ir.values import per_channel

# ops between a Conv and the affine map that onnxruntime keeps in the blocked layout (fused into the
# Conv or run blocked), so the map after them would be blocked too
_BLOCKED = frozenset({"Relu", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "LeakyRelu", "Clip", "BatchNormalization"})
_AFFINE = frozenset({"Mul", "Add", "Sub"})
MIN_OPSET = 9  # BatchNormalization without `spatial` and with its four inputs


@dataclass(frozen=True)
class Rewritten:
    maps: int  # chains replaced, each by one BatchNormalization
    nodes: int  # Mul/Add/Sub nodes removed


def affine_as_batchnorm(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Rewritten]:
    """`model` with each chain described above replaced by one BatchNormalization (a new model; the
    argument is not changed), and how many."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < MIN_OPSET:
        return model, Rewritten(0, 0)
    from ...ir import model as irm

    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    shapes, types = irm.static_shapes(out), irm.elem_types(out)
    consts = {i.name: i for i in g.initializer}
    graph_inputs = {i.name for i in g.input}
    graph_outputs = {o.name for o in g.output}
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}  # a node once per input it reads the tensor at
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def operand(node: onnx.NodeProto) -> tuple[str, np.ndarray] | None:
        """(the tensor, the per-channel constant as (C,) float64) of an affine node, else None."""
        if node.op_type not in _AFFINE or len(node.input) != 2:
            return None
        order = (0, 1) if node.op_type == "Sub" else (0, 1, 1, 0)  # x - c only; Mul and Add either way
        for xi, ci in zip(order[::2], order[1::2]):
            x, c = node.input[xi], node.input[ci]
            shape = shapes.get(x)
            if (c not in consts or c in graph_inputs or x in consts or shape is None or len(shape) != 4
                    or types.get(x) != TensorProto.FLOAT or consts[c].data_type != TensorProto.FLOAT
                    or shapes.get(node.output[0]) != shape):
                continue
            value = per_channel(irm.array(consts[c]), shape)
            if value is not None:
                return x, value.astype(np.float64)
        return None

    def after_conv(name: str) -> bool:
        seen = 0
        while (p := producer.get(name)) is not None and seen < 8:
            if p.op_type == "Conv":
                return True
            if p.op_type not in _BLOCKED:
                return False
            name, seen = p.input[0], seen + 1
        return False

    replaced: dict[int, onnx.NodeProto] = {}  # id of a chain's last node -> its BatchNormalization
    removed: set[int] = set()
    maps = nodes = 0
    for node in g.node:
        if id(node) in removed or (first := operand(node)) is None:
            continue
        x, _ = first
        if not after_conv(x):  # also skips a chain's later nodes: an affine producer is no convolution
            continue
        scale = np.ones(shapes[x][1])
        bias = np.zeros(shapes[x][1])
        chain: list[onnx.NodeProto] = []
        current = node
        while True:
            step = operand(current)
            if step is None or (chain and step[0] != chain[-1].output[0]):
                break
            c = step[1]
            if current.op_type == "Mul":
                scale, bias = scale * c, bias * c
            elif current.op_type == "Add":
                bias = bias + c
            else:
                bias = bias - c
            chain.append(current)
            y = current.output[0]
            nexts = consumers.get(y, [])
            if y in graph_outputs or len(nexts) != 1:
                break
            current = nexts[0]
        scale32, bias32 = scale.astype(np.float32), bias.astype(np.float32)
        if not (np.all(np.isfinite(scale32)) and np.all(np.isfinite(bias32))):
            continue
        maps += 1
        nodes += len(chain)
        stem = f"{chain[-1].name or chain[-1].output[0]}.as_batchnorm"
        channels = shapes[x][1]
        params = [(f"{stem}.scale", scale32), (f"{stem}.bias", bias32),
                  (f"{stem}.mean", np.zeros(channels, np.float32)), (f"{stem}.var", np.ones(channels, np.float32))]
        for name, value in params:
            g.initializer.append(numpy_helper.from_array(value, name))
        bn = helper.make_node("BatchNormalization", [x] + [name for name, _ in params], [chain[-1].output[0]],
                              name=stem, epsilon=0.0)
        bn.metadata_props.extend(chain[-1].metadata_props)
        replaced[id(chain[-1])] = bn
        removed.update(id(n) for n in chain)
    if not maps:
        return model, Rewritten(0, 0)
    kept = [replaced.get(id(n), n) for n in g.node if id(n) not in removed or id(n) in replaced]
    del g.node[:]
    g.node.extend(kept)
    still_used = {i for n in g.node for i in n.input} | graph_outputs | graph_inputs
    initializers = [i for i in g.initializer if i.name in still_used]
    del g.initializer[:]
    g.initializer.extend(initializers)
    known = {o for n in g.node for o in n.output}
    value_info = [v for v in g.value_info if v.name in known]
    del g.value_info[:]
    g.value_info.extend(value_info)
    return out, Rewritten(maps, nodes)

