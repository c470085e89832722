"""Loop unrolling: a `Loop` with a small constant trip count becomes M copies of its body.

TensorFlow converters turn a recurrent layer (Keras' LSTM and GRU through tf2onnx) into a `Loop`
whose trip count is fixed by static shapes but whose outputs have no inferable shape: nothing after
it is static, and the import stage refuses the model. Unrolled, the copies are plain ops that shape
inference and constant folding resolve (the TensorList reads become Gathers at constant indices).

ONNX `Loop(M, cond, v_1..v_N)` with body `(i, cond_in, v_1..v_N) -> (cond_out, v'_1..v'_N, s_1..s_K)`
runs iteration i = 0, 1, ... while i < M and the condition is true: the condition is `cond` before
iteration 0 and `cond_out` of iteration i - 1 before iteration i. Its outputs are the final v_1..v_N
and, for each scan output s_k, the values of every iteration stacked on a new axis 0. Unrolled:

    v^(0) = initial values;  (c_i, v^(i+1), s^(i)) = body(i, true, v^(i))  for i = 0..M-1
    outputs = v^(M), Concat_i(Unsqueeze(s_k^(i), 0)) for each k

which is exact when M is a constant, `cond` is absent or constant true, and c_0..c_{M-2} are all
true (c_{M-1} decides nothing: the trip count ends the loop). `cond_out` proves true when it is
`cond_in` passed through or a constant true, or when it is computed only from the iteration number,
constants and loop-carried values that themselves start constant and are updated only from such
values (tf2onnx's `i < M and counter + 1 < M`): that closed slice of the body is evaluated
(ONNX's reference evaluator) for i = 0..M-2. A condition that reads data is an early exit: the
loop is kept.

Every copy gets fresh names (values, nodes, nested If/Loop bodies alike) so no two copies, nor a
copy and the rest of the model, share a name. M = 0 gives the initial values, and empty scan outputs
where their element shape is static. Loops nested in a body are unrolled before the loop around them.

Limits: M <= `MAX_TRIP_COUNT`, and M times the body's node count <= `MAX_UNROLLED_NODES` (an unrolled
model that big is better served by a runtime that runs loops).

Needs: nothing (the trip count is usually constant only after constant folding). Guarantees: the
same function, bit for bit (the same ops run on the same values). Counts: loops unrolled.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir import _cloner  # onnx_ir 1.1 clones a node with a value map only here (pinned in constraints.txt)

from .rule import Rule
from .values import constant

# Recurrent layers over sequences up to this length are unrolled (the captioner's decoder has 16 steps).
MAX_TRIP_COUNT = 64
# Nodes the copies of one body may add; beyond that the model grows more than a loop is worth.
MAX_UNROLLED_NODES = 20000

log = logging.getLogger(__name__)


def why_not(model: ir.Model, loop: ir.Node) -> str | None:
    """Why `loop` (a node of `model`) cannot be unrolled, or None where it can."""
    return _plan(loop, dict(model.opset_imports))[1]


def _plan(loop: ir.Node, opsets: dict[str, int]) -> tuple[int | None, str | None]:
    """(trip count, None) for a loop that can be unrolled, else (None, the reason)."""
    body = _body(loop)
    if body is None:
        return None, "the body is not a graph"
    carried = len(loop.inputs) - 2
    if carried < 0 or len(body.inputs) != carried + 2 or len(body.outputs) < carried + 1:
        return None, "the body's inputs and outputs do not match the loop's"
    trip = loop.inputs[0]
    if trip is None:
        return None, "there is no trip count (the loop runs until its condition is false)"
    m = constant(trip)
    if m is None:
        return None, f"the trip count {trip.name} is not a constant"
    if m.size != 1:
        return None, f"the trip count {trip.name} is not a scalar"
    m = int(m.reshape(-1)[0])
    if m < 0:
        return None, f"the trip count {m} is negative"
    if m > MAX_TRIP_COUNT:
        return None, f"the trip count {m} is above {MAX_TRIP_COUNT}"
    size = sum(1 for _ in ir.traversal.RecursiveGraphIterator(body))
    if m * size > MAX_UNROLLED_NODES:
        return None, f"{m} copies of a {size}-node body are above {MAX_UNROLLED_NODES} nodes"
    cond = loop.inputs[1]
    if cond is not None:
        c = constant(cond)
        if c is None:
            return None, f"the initial condition {cond.name} is not a constant"
        if c.size != 1:
            return None, f"the initial condition {cond.name} is not a scalar"
        if not bool(c.reshape(-1)[0]):
            m = 0  # the body never runs
    if any(v is None for v in loop.inputs[2:]):
        return None, "a loop-carried value has no initial value"
    if m == 0 and (why := _empty_scans(body, carried)[1]):
        return None, why
    return (m, None) if m < 2 else (m, _condition_holds(loop, body, m, opsets))


def _body(loop: ir.Node) -> ir.Graph | None:
    attr = loop.attributes.get("body")
    if attr is None or attr.is_ref() or attr.type != ir.AttributeType.GRAPH:
        return None
    return attr.as_graph()


def _graphs_in(graph: ir.Graph) -> set[ir.Graph]:
    """`graph` and every graph nested in it."""
    found = {graph}
    for node in ir.traversal.RecursiveGraphIterator(graph):
        for attr in node.attributes.values():
            if attr.is_ref():
                continue
            if attr.type == ir.AttributeType.GRAPH:
                found.add(attr.as_graph())
            elif attr.type == ir.AttributeType.GRAPHS:
                found.update(attr.as_graphs())
    return found


def _defined_in(value: ir.Value, graphs: set[ir.Graph]) -> bool:
    producer = value.producer()
    if producer is not None:
        return producer.graph in graphs
    return (value.is_graph_input() or value.is_initializer()) and value.graph in graphs


def _reads(node: ir.Node) -> list[ir.Value]:
    """The node's inputs and the values of enclosing graphs its subgraphs read."""
    values = [v for v in node.inputs if v is not None]
    inner: set[ir.Graph] = set()
    for attr in node.attributes.values():
        if not attr.is_ref() and attr.type == ir.AttributeType.GRAPH:
            inner |= _graphs_in(attr.as_graph())
        elif not attr.is_ref() and attr.type == ir.AttributeType.GRAPHS:
            for g in attr.as_graphs():
                inner |= _graphs_in(g)
    for g in inner:
        for n in g:
            values += [v for v in n.inputs if v is not None and not _defined_in(v, inner)]
    return values


def _condition_holds(loop: ir.Node, body: ir.Graph, m: int, opsets: dict[str, int]) -> str | None:
    """None where `cond_out` is true after iterations 0..m-2, else why that is not proven."""
    cond_out = body.outputs[0]
    if cond_out is body.inputs[1]:
        return None
    c = constant(cond_out)
    if c is not None:
        return None if c.size == 1 and bool(c.reshape(-1)[0]) else "the body's condition is a constant false"

    # The slice of the body the condition depends on: it must be closed over the iteration number,
    # constants and loop-carried values that start constant.
    carried_in = {v: j for j, v in enumerate(body.inputs[2:])}
    nodes: set[ir.Node] = set()
    carried: set[int] = set()
    constants: dict[ir.Value, np.ndarray] = {}
    stack, seen = [cond_out], set()
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        if value is body.inputs[0] or value is body.inputs[1]:
            continue  # the iteration number; cond_in, true by induction
        if value in carried_in:
            j = carried_in[value]
            start = loop.inputs[2 + j]
            if constant(start) is None:
                return (f"the condition depends on the loop-carried {value.name}, "
                        f"whose initial {start.name} is not a constant")
            carried.add(j)
            stack.append(body.outputs[1 + j])
            continue
        producer = value.producer()
        if producer is not None and producer.graph is body:
            nodes.add(producer)
            stack += _reads(producer)
            continue
        array = constant(value)
        if array is None:
            return f"the condition depends on {value.name}, which is neither constant nor loop-carried (an early exit)"
        constants[value] = array

    named = [body.inputs[0], body.inputs[1], *(body.inputs[2 + j] for j in carried), *constants]
    named += [v for n in nodes for v in [*n.inputs, *n.outputs] if v is not None]
    if any(not v.name for v in named):
        return "the condition reads a value without a name"
    order = sorted(carried)
    feeds = {body.inputs[2 + j].name: constant(loop.inputs[2 + j]) for j in order}
    try:
        session = _condition_model(body, [n for n in body if n in nodes], order, constants, opsets)
        for i in range(m - 1):
            feeds[body.inputs[0].name] = np.array(i, np.int64)
            cond, *updated = session.run(None, feeds)
            if np.asarray(cond).size != 1 or not bool(np.asarray(cond).reshape(-1)[0]):
                return f"the condition is false after iteration {i} of {m} (an early exit)"
            feeds.update(zip((body.inputs[2 + j].name for j in order), updated))
    except Exception as e:  # noqa: BLE001 - an unevaluable condition is an unproven one
        first = str(e).splitlines()[0][:120] if str(e) else ""
        return f"the condition could not be evaluated: {type(e).__name__}: {first}"
    return None


def _condition_model(body: ir.Graph, nodes: list[ir.Node], carried: list[int],
                     constants: dict[ir.Value, np.ndarray], opsets: dict[str, int]):
    """A reference-evaluator session computing (cond_out, v'_j for j in carried) from the
    iteration number and v_j (j in carried), named as in the body; cond_in is a constant true."""
    from onnx import helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    iteration, cond_in = body.inputs[0], body.inputs[1]
    inputs = [helper.make_tensor_value_info(iteration.name, onnx.TensorProto.INT64, [])]
    inputs += [helper.make_value_info(body.inputs[2 + j].name, ir.serde.serialize_type(body.inputs[2 + j].type))
               for j in carried]
    true = helper.make_node("Constant", [], [cond_in.name], value=numpy_helper.from_array(np.array(True)))
    # outputs under names of their own: a body output may be an input or a constant
    wanted = [body.outputs[0]] + [body.outputs[1 + j] for j in carried]
    outputs = [f"__condition_out{k}" for k in range(len(wanted))]
    copies = [helper.make_node("Identity", [v.name], [o]) for v, o in zip(wanted, outputs)]
    graph = helper.make_graph(
        [true, *(ir.serde.serialize_node(n) for n in nodes), *copies], "condition", inputs,
        [helper.make_value_info(o, onnx.TypeProto()) for o in outputs],
        [numpy_helper.from_array(a, v.name) for v, a in constants.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
    return ReferenceEvaluator(model)


def _empty_scans(body: ir.Graph, carried: int) -> tuple[list[np.ndarray], str | None]:
    """For M = 0: each scan output as an empty (0, *element shape) array, or why one cannot be."""
    arrays = []
    for s in body.outputs[1 + carried:]:
        shape = s.shape
        if s.type is None or shape is None or not all(isinstance(d, int) for d in shape.dims):
            return [], f"the trip count is 0 and the element shape of scan output {s.name} is not static"
        arrays.append(np.zeros((0, *shape.dims), s.type.dtype.numpy()))
    return arrays, None


class _Names:
    """Fresh names: a copy's value `x` of iteration k is `x__k`, suffixed further where that is taken."""

    def __init__(self, model: ir.Model):
        self.taken: set[str] = set()
        for graph in _graphs_in(model.graph):
            self.taken.update(v.name for v in [*graph.inputs, *graph.initializers.values()] if v.name)
            for node in graph:
                self.taken.update(v.name for v in node.outputs if v.name)
                if node.name:
                    self.taken.add(node.name)

    def fresh(self, base: str) -> str:
        name, n = base, 1
        while name in self.taken:
            name, n = f"{base}_{n}", n + 1
        self.taken.add(name)
        return name

    def rename(self, nodes: list[ir.Node], suffix: str) -> None:
        """Renames every node and value the copied `nodes` define, in nested graphs too.

        Renaming a value renames the tensor it holds, which the copy shares with the original and,
        through it, with the caller's proto: a node output's tensor (a folder's cache) is dropped,
        an initializer's is copied first."""
        for node in nodes:
            if node.name:
                node.name = self.fresh(node.name + suffix)
            for v in node.outputs:
                v.const_value = None
                v.name = self.fresh((v.name or "v") + suffix)
            for attr in node.attributes.values():
                if attr.is_ref() or attr.type not in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
                    continue
                for g in [attr.as_graph()] if attr.type == ir.AttributeType.GRAPH else attr.as_graphs():
                    for v in g.inputs:
                        v.name = self.fresh((v.name or "v") + suffix)
                    for v in list(g.initializers.values()):
                        v.const_value = ir.tensor(v.const_value.numpy())
                        v.name = self.fresh(v.name + suffix)
                    self.rename(list(g), suffix)


def _unroll(loop: ir.Node, m: int, names: _Names) -> None:
    graph, body = loop.graph, _body(loop)
    carried_count = len(loop.inputs) - 2
    label = loop.name or "loop"
    added: list[ir.Node] = []

    def emit(op_type: str, inputs: list[ir.Value], attributes: dict, base: str) -> ir.Value:
        name = names.fresh(base)
        added.append(ir.node(op_type, inputs, attributes, name=name, outputs=[ir.Value(name=name)]))
        return added[-1].outputs[0]

    def constant_node(array: np.ndarray, base: str) -> ir.Value:
        return emit("Constant", [], {"value": ir.tensor(array)}, base)

    # Body initializers are the same in every copy: one Constant each. A copy of the array, not the
    # tensor: a tensor read from the input proto is a view of it, and renaming the value that holds
    # it (as lifting and deduplicating do) would rename the caller's initializer.
    shared: dict[ir.Value, ir.Value] = {v: constant_node(v.const_value.numpy(), f"{v.name}__{label}")
                                        for v in body.initializers.values()}
    true = constant_node(np.array(True), f"{label}__cond")
    values = list(loop.inputs[2:])
    scans: list[list[ir.Value]] = [[] for _ in body.outputs[1 + carried_count:]]
    for k in range(m):
        value_map: dict[ir.Value, ir.Value | None] = {**shared, body.inputs[1]: true}
        value_map[body.inputs[0]] = constant_node(np.array(k, np.int64), f"{label}__iteration{k}")
        value_map.update(zip(body.inputs[2:], values))
        cloner = _cloner.Cloner(attr_map={}, value_map=value_map, metadata_props={}, allow_outer_scope_values=True)
        copies = [cloner.clone_node(node) for node in body]
        names.rename(copies, f"__{k}")
        added += copies
        results = [value_map.get(v, v) for v in body.outputs]
        values = results[1:1 + carried_count]
        for scan, v in zip(scans, results[1 + carried_count:]):
            scan.append(v)

    if m == 0:
        finals = values + [constant_node(a, f"{label}__empty_scan") for a in _empty_scans(body, carried_count)[0]]
    else:
        finals = values
        axis0 = constant_node(np.array([0], np.int64), f"{label}__axis0")  # an input since opset 13, the passes' oldest
        for s, scan in enumerate(scans):
            stacked = [emit("Unsqueeze", [v, axis0], {}, f"{label}__scan{s}_{k}") for k, v in enumerate(scan)]
            finals.append(emit("Concat", stacked, {"axis": 0}, f"{label}__scan{s}"))

    # Each used output of the loop is now an Identity of its value, under the loop output's name
    # (a graph output keeps its name; remove-identity takes the Identity away where it can).
    for out, final in zip(loop.outputs, finals):
        if not out.uses() and not out.is_graph_output():
            continue
        name = out.name
        out.name = names.fresh(f"{name}__rolled")
        copy = emit("Identity", [final], {}, f"{label}__out")
        copy.name, copy.type, copy.shape = name, out.type, out.shape
        ir.convenience.replace_all_uses_with(out, copy, replace_graph_outputs=True)
    graph.insert_before(loop, added)
    graph.remove(loop, safe=True)


def unroll_loops(model: ir.Model) -> int:
    names, opsets = _Names(model), dict(model.opset_imports)
    unrolled = 0

    def visit(graph: ir.Graph) -> None:
        nonlocal unrolled
        for node in list(graph):
            for attr in node.attributes.values():  # inner loops first
                if attr.is_ref():
                    continue
                if attr.type == ir.AttributeType.GRAPH:
                    visit(attr.as_graph())
                elif attr.type == ir.AttributeType.GRAPHS:
                    for g in attr.as_graphs():
                        visit(g)
            if node.op_type != "Loop" or node.domain not in ("", "ai.onnx"):
                continue
            m, why = _plan(node, opsets)
            if why is not None:
                log.debug("unroll-loops: %s not unrolled: %s", node.name, why)
                continue
            _unroll(node, m, names)
            unrolled += 1

    visit(model.graph)
    return unrolled


RULES: tuple[Rule, ...] = (Rule("unroll-loops", unroll_loops),)
