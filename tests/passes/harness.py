"""What every rule test does: build a small model inline, optimize it, check that the result is a
valid model with the same signature, count the rewrites, and compare outputs with the original
under onnxruntime with its own graph optimizations off (so the comparison sees our rewrites only).

Tolerances (numpy's assert_allclose: |got - want| <= atol + rtol * |want|):
- EXACT: rewrites that move no arithmetic (no-ops, layout, reshapes, CSE): the outputs are
  bit-identical in principle; rtol 1e-6 only absorbs onnxruntime picking another kernel for a
  differently shaped (e.g. now contiguous) operand.
- REASSOCIATED: rewrites that fold constants into weights or combine constants (BN folding,
  Conv*s, chains): float products and sums are evaluated in another order, which moves results by
  a few ulp of the values summed (2^-24 ~ 6e-8 each for float32): rtol 1e-5, atol 1e-6.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from edgesdk.passes import optimize

EXACT = {"rtol": 1e-6, "atol": 0.0}
REASSOCIATED = {"rtol": 1e-5, "atol": 1e-6}

FLOAT = TensorProto.FLOAT


def model(nodes, inputs: dict, outputs, initializers: dict | None = None, opset: int = 17,
          input_type: int = FLOAT, output_types: dict | None = None, input_types: dict | None = None) -> onnx.ModelProto:
    """A checked model with shapes inferred. `inputs`: name -> shape; `outputs`: names (or name ->
    shape where inference cannot tell); element types `input_type` unless `input_types`/`output_types`
    name another."""
    output_types, input_types = output_types or {}, input_types or {}
    outputs = outputs if isinstance(outputs, dict) else dict.fromkeys(outputs)
    graph = helper.make_graph(
        nodes, "test",
        [helper.make_tensor_value_info(name, input_types.get(name, input_type), shape)
         for name, shape in inputs.items()],
        [helper.make_tensor_value_info(name, output_types.get(name, input_type), shape)
         for name, shape in outputs.items()],
        [numpy_helper.from_array(np.asarray(a), name) for name, a in (initializers or {}).items()],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    m = onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=True)
    onnx.checker.check_model(m, full_check=True)
    return m


def signature(m: onnx.ModelProto) -> list:
    def describe(vi):
        t = vi.type.tensor_type
        return vi.name, t.elem_type, tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim)

    return [[describe(v) for v in m.graph.input], [describe(v) for v in m.graph.output]]


def optimized(m: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
    """optimize(), plus what every result must satisfy."""
    original = m.SerializeToString()
    out, record = optimize(m)
    assert m.SerializeToString() == original, "optimize() changed its input"
    assert "rule_errors" not in record, record["rule_errors"]
    assert out.ir_version <= 10
    onnx.checker.check_model(out, full_check=True)
    onnx.shape_inference.infer_shapes(out, strict_mode=True)
    assert signature(out) == signature(m)
    assert sum(record["nodes_after"].values()) <= sum(record["nodes_before"].values())
    assert record["nodes_after"] == dict(sorted(all_ops(out.graph).items()))
    return out, record


def ops(m: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in m.graph.node)


def all_ops(g: onnx.GraphProto) -> collections.Counter:
    """Op counts with the nodes of If/Loop/Scan bodies, as the optimizer's record counts them."""
    counts = collections.Counter(n.op_type for n in g.node)
    for n in g.node:
        for a in n.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                counts += all_ops(sub)
    return counts


def random_feeds(m: onnx.ModelProto, seed: int = 0, fixed: dict | None = None) -> dict[str, np.ndarray]:
    """Random inputs (normal floats, integers in [-50, 50)), except the ones `fixed` gives."""
    fixed = fixed or {}
    rng = np.random.default_rng(seed)
    inits = {i.name for i in m.graph.initializer}
    feeds = {}
    for vi in m.graph.input:
        if vi.name in inits:
            continue
        t = vi.type.tensor_type
        shape = [d.dim_value for d in t.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
        if vi.name in fixed:
            feeds[vi.name] = fixed[vi.name]
        elif np.issubdtype(dtype, np.integer):
            feeds[vi.name] = rng.integers(-50, 50, shape).astype(dtype)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype) * 2
    return feeds


def run(m: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    proto = onnx.ModelProto.FromString(m.SerializeToString())
    proto.ir_version = min(proto.ir_version, 10)
    session = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def assert_same(original: onnx.ModelProto, rewritten: onnx.ModelProto, *, rtol: float, atol: float,
                seed: int = 0, feeds: dict | None = None) -> None:
    feeds = feeds if feeds is not None else random_feeds(original, seed)
    want, got = run(original, feeds), run(rewritten, feeds)
    for w, g, vi in zip(want, got, original.graph.output):
        assert g.dtype == w.dtype and g.shape == w.shape, (vi.name, g.dtype, g.shape, w.dtype, w.shape)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=vi.name)


def check_fires(m: onnx.ModelProto, rule: str, times: int = 1, *, gone: tuple = (), tolerance=EXACT) -> onnx.ModelProto:
    """The rule fires `times` times, the ops in `gone` vanish, and the outputs stay the same."""
    out, record = optimized(m)
    assert record["rules"][rule] == times, {k: v for k, v in record["rules"].items() if v}
    for op in gone:
        assert ops(out)[op] == 0, (op, ops(out))
    assert_same(m, out, **tolerance)
    return out


def check_does_not_fire(m: onnx.ModelProto, rule: str, *, kept: tuple = (), tolerance=EXACT) -> onnx.ModelProto:
    """The rule does not fire, the ops in `kept` are all still there, and the outputs stay the same."""
    out, record = optimized(m)
    assert record["rules"][rule] == 0, {k: v for k, v in record["rules"].items() if v}
    for op in kept:
        assert ops(out)[op] == ops(m)[op], (op, ops(out), ops(m))
    assert_same(m, out, **tolerance)
    return out


def const(name: str, array) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(array), name))


def f32(*values) -> np.ndarray:
    return np.array(values if len(values) != 1 else values[0], np.float32)


node = helper.make_node
