"""Unary regions: the subgraphs that compute y = f(x) elementwise from one tensor x, found so that a
function the accelerator lacks can be approximated as a whole.

An exporter rarely writes GELU as one node: tf2onnx gives x * 0.5 * (1 + Erf(x / sqrt 2)), Keras'
Mish is x * Tanh(Softplus(x)). Approximating only the node the device refuses (Erf, Softplus) would
work, but the whole chain from x is one unary function, and approximating it once costs fewer nodes
and one error instead of several. A node joins x's region when it is elementwise, its other inputs
are scalar constants (or values of the same region), and its output has x's shape: then its output
is a function of x alone, which `function` evaluates numerically on any grid. Each tensor of a region
that leaves it (consumed outside, or a graph output) is an exit; an exit whose function involves a
refused node is what gets approximated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
from onnx import helper

from ..ir import model as irm

UNARY = frozenset({
    "Abs", "Neg", "Exp", "Log", "Sqrt", "Reciprocal", "Sigmoid", "Tanh", "Erf", "Softplus", "Softsign", "Elu",
    "Selu", "Celu", "Relu", "LeakyRelu", "HardSigmoid", "HardSwish", "ThresholdedRelu", "Gelu", "Mish", "Sin",
    "Cos", "Atan", "Sinh", "Cosh", "Asinh", "Identity", "Clip",
})
BINARY = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"})


@dataclass(frozen=True)
class Region:
    input: str          # x
    output: str         # the exit y = f(x)
    nodes: tuple[int, ...]  # graph indices of the nodes computing y from x, in graph order
    refused: tuple[str, ...]  # names of the refused nodes among them

    def function(self, model: onnx.ModelProto) -> Callable[[np.ndarray], np.ndarray]:
        """f as a numpy function (float64 in and out), evaluated by onnxruntime on the region's nodes."""
        session = irm.onnxruntime_session(_submodel(model, self))

        def f(x: np.ndarray) -> np.ndarray:
            flat = np.asarray(x, np.float64).reshape(-1).astype(np.float32)
            (y,) = session.run(None, {"x": flat})
            return np.asarray(y, np.float64).reshape(np.shape(x))

        return f


def find(model: onnx.ModelProto, refused: set[str]) -> list[Region]:
    """The exits whose function involves a node named in `refused`, one Region each."""
    consts = irm.constant_names(model)
    shapes = irm.static_shapes(model)
    values = _scalar_constants(model)
    nodes = list(model.graph.node)
    root: dict[str, str] = {}      # tensor -> the x it is a function of
    member: dict[int, str] = {}    # node index -> x
    producer: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for out in node.output:
            producer[out] = i
        if not _elementwise(node, consts, values):
            continue
        ins = [t for t in node.input if t and t not in consts]
        roots = {root.get(t, t) for t in ins}
        if len(roots) != 1:
            continue
        x = roots.pop()
        if shapes.get(node.output[0]) is None or any(shapes.get(t) != shapes.get(x) for t in [*ins, node.output[0]]):
            continue
        root[node.output[0]] = x
        member[i] = x

    consumers: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for t in node.input:
            consumers.setdefault(t, []).append(i)
    graph_outputs = {o.name for o in model.graph.output}
    regions = []
    for i, x in member.items():
        out = nodes[i].output[0]
        leaves = out in graph_outputs or any(member.get(c) != x for c in consumers.get(out, []))
        if not leaves:
            continue
        body = _ancestors(i, x, nodes, member, producer)
        names = tuple(irm.node_name(nodes[j], j) for j in body if irm.node_name(nodes[j], j) in refused)
        if names:
            regions.append(Region(x, out, tuple(sorted(body)), names))
    return regions


def replace(model: onnx.ModelProto, region: Region, new_nodes: list[onnx.NodeProto],
            initializers: list[onnx.TensorProto], new_output: str) -> None:
    """Put `new_nodes` (computing `new_output` from region.input) right after the exit's producer and
    send every consumer of the exit to `new_output`; the region's own nodes are left for dead-code
    elimination (some may still feed other exits). A graph output keeps its name."""
    graph = model.graph
    exit_index = max(region.nodes)
    if region.output in {o.name for o in graph.output}:
        old = f"{region.output}__replaced"
        for node in graph.node:
            node.output[:] = [old if o == region.output else o for o in node.output]
            node.input[:] = [old if t == region.output else t for t in node.input]
        for node in new_nodes:
            node.output[:] = [region.output if o == new_output else o for o in node.output]
    else:
        for node in graph.node:
            node.input[:] = [new_output if t == region.output else t for t in node.input]
    for k, node in enumerate(new_nodes):
        graph.node.insert(exit_index + 1 + k, node)
    graph.initializer.extend(initializers)


def _elementwise(node: onnx.NodeProto, consts: set[str], values: dict[str, float]) -> bool:
    if node.domain not in ("", "ai.onnx") or len(node.output) != 1:
        return False
    if node.op_type in UNARY:
        # Clip's bounds must be scalar constants: then it is unary in x
        return all(t in values or not t for t in node.input[1:])
    if node.op_type in BINARY and len(node.input) == 2:
        return all(t in values or t not in consts for t in node.input)
    return False


def _scalar_constants(model: onnx.ModelProto) -> dict[str, float]:
    out = {}
    for t in model.graph.initializer:
        a = irm.array(t)
        if a.size == 1 and np.issubdtype(a.dtype, np.floating):
            out[t.name] = float(a.reshape(()))
    return out


def _ancestors(i: int, x: str, nodes, member, producer) -> set[int]:
    seen, todo = set(), [i]
    while todo:
        j = todo.pop()
        if j in seen:
            continue
        seen.add(j)
        for t in nodes[j].input:
            k = producer.get(t)
            if k is not None and member.get(k) == x and t != x:
                todo.append(k)
    return seen


def _submodel(model: onnx.ModelProto, region: Region) -> onnx.ModelProto:
    """The region's nodes on a 1-d input of any length; its scalar constants come along (they
    broadcast the same on any shape)."""
    nodes = [model.graph.node[j] for j in region.nodes]
    used = {t for n in nodes for t in n.input}
    inits = [t for t in model.graph.initializer if t.name in used]
    renamed = []
    for n in nodes:
        m = onnx.NodeProto()
        m.CopyFrom(n)
        m.input[:] = ["x" if t == region.input else t for t in m.input]
        renamed.append(m)
    graph = helper.make_graph(renamed, "region", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info(region.output, onnx.TensorProto.FLOAT, ["n"])], inits)
    sub = helper.make_model(graph, opset_imports=list(model.opset_import))
    sub.ir_version = irm.IR_VERSION
    return sub
