"""Loop unrolling: a Loop with a small constant trip count becomes copies of its body that compute
what onnxruntime computes for the Loop, and a Loop that may exit early or has no constant trip count
stays (with the reason the rule gives).

Tolerance: the unrolled copies run the same ops on the same values, but the rules after unrolling
fold the first iteration's constant operands and combine constant chains, which reassociates float
math: REASSOCIATED (rtol 1e-5, atol 1e-6). The Keras end-to-end test compares with Keras within 1e-5.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from edgesdk.passes import loops, optimize
from tests.passes.harness import (REASSOCIATED, all_ops, assert_same, check_does_not_fire, const, f32, model,
                                  node, random_feeds, run, signature)

X = {"x": [2, 3]}
Y = {"y": [2, 3]}
STATE = helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, 3])


def body(nodes, outputs, carried=(STATE,), initializers=()) -> onnx.GraphProto:
    """A Loop body (i, cond_in, *carried) -> outputs; `outputs` are value infos, cond first."""
    inputs = [helper.make_tensor_value_info("i", TensorProto.INT64, []),
              helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []), *carried]
    return helper.make_graph(nodes, "body", inputs, outputs, list(initializers))


def out(name, shape=(2, 3), elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, list(shape))


COND = helper.make_tensor_value_info("cond_in", TensorProto.BOOL, [])
TRIP = {"m": np.array(4, np.int64)}


def unrolled(m: onnx.ModelProto, times: int = 1, feeds: dict | None = None) -> onnx.ModelProto:
    """What harness.optimized checks, less its node count (unrolling adds nodes): the rule fires
    `times` times, no Loop is left anywhere, and the outputs equal onnxruntime's on the Loop."""
    original = m.SerializeToString()
    result, record = optimize(m)
    assert m.SerializeToString() == original, "optimize() changed its input"
    assert "rule_errors" not in record, record["rule_errors"]
    assert record["rules"]["unroll-loops"] == times, {k: v for k, v in record["rules"].items() if v}
    onnx.checker.check_model(result, full_check=True)
    assert signature(result) == signature(m)
    assert all_ops(result.graph)["Loop"] == 0
    assert_same(m, result, **REASSOCIATED, feeds=feeds)
    return result


def reason(m: onnx.ModelProto) -> str | None:
    graph = ir.serde.deserialize_model(m)
    (loop,) = [n for n in graph.graph if n.op_type == "Loop"]
    return loops.why_not(graph, loop)


def names(g: onnx.GraphProto) -> list[str]:
    """Every value name a graph and its subgraphs define."""
    found = [v.name for v in [*g.input, *g.initializer]] + [o for n in g.node for o in n.output if o]
    for n in g.node:
        for a in n.attribute:
            for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                found += names(sub)
    return found


def test_loop_carried_state_is_threaded_through_the_copies():
    # s <- tanh(1.5 s + 0.1), four times; 1.5 is a body initializer, 0.1 a body Constant
    b = body([const("bias", f32(0.1)), node("Mul", ["s", "scale"], ["t"]), node("Add", ["t", "bias"], ["u"]),
              node("Tanh", ["u"], ["s_next"])], [COND, out("s_next")],
             initializers=[helper.make_tensor("scale", TensorProto.FLOAT, [], [1.5])])
    m = model([node("Loop", ["m", "", "x"], ["y"], body=b)], X, Y, TRIP)
    result = unrolled(m)
    assert all_ops(result.graph)["Tanh"] == 4


def test_scan_outputs_are_stacked_on_a_new_axis():
    # scan outputs: s * 2 and a [3]-vector per iteration, stacked to [4, 2, 3] and [4, 3]
    b = body([const("two", f32(2.0)), node("Mul", ["s", "two"], ["s_next"]), node("ReduceMax", ["s_next"], ["row"],
                                                                                   axes=[0], keepdims=0)],
             [COND, out("s_next"), out("s_next"), out("row", (3,))])  # the carried value is also scanned
    m = model([node("Loop", ["m", "", "x"], ["y", "stack", "rows"], body=b)], X,
              {"y": [2, 3], "stack": [4, 2, 3], "rows": [4, 3]}, TRIP)
    result = unrolled(m)
    ops = all_ops(result.graph)
    assert ops["Concat"] == 2 and ops["Unsqueeze"] == 8
    shapes = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in result.graph.output}
    assert shapes == {"y": [2, 3], "stack": [4, 2, 3], "rows": [4, 3]}


def test_iteration_number_becomes_a_constant_per_copy():
    # s <- s + i * x (i the iteration number, x read from the outer graph) and a scan of i itself
    b = body([node("Cast", ["i"], ["fi"], to=TensorProto.FLOAT), node("Mul", ["fi", "x"], ["ix"]),
              node("Add", ["s", "ix"], ["s_next"]), node("Identity", ["i"], ["i_out"])],
             [COND, out("s_next"), out("i_out", (), TensorProto.INT64)])
    m = model([node("Loop", ["m", "", "x"], ["y", "iters"], body=b)], X,
              {"y": [2, 3], "iters": [4]}, TRIP, output_types={"iters": TensorProto.INT64})
    result = unrolled(m)
    feeds = random_feeds(m)
    (_, iters) = run(result, feeds)
    assert iters.tolist() == [0, 1, 2, 3]


def test_outer_scope_values_are_read_by_every_copy():
    # the body reads a graph input (x), an outer initializer (w) and an outer node's output (x2)
    b = body([node("MatMul", ["s", "w"], ["sw"]), node("Add", ["sw", "x2"], ["s_next"])], [COND, out("s_next")])
    m = model([node("Mul", ["x", "x"], ["x2"]), node("Loop", ["m", "", "x"], ["y"], body=b)], X, Y,
              {**TRIP, "w": np.random.default_rng(1).standard_normal((3, 3)).astype(np.float32) * 0.5})
    unrolled(m)


def test_body_with_an_if_is_copied_with_unique_names():
    # the If's condition reads the outer graph (data-dependent), so every copy keeps an If whose
    # branches read that copy's state: each branch of each copy needs names of its own
    then_ = helper.make_graph([const("one", f32(1.0)), node("Add", ["s", "one"], ["r"])], "then", [], [out("r")])
    else_ = helper.make_graph([node("Mul", ["s", "s"], ["r2"])], "else", [], [out("r2")])
    b = body([node("ReduceSum", ["x"], ["total"], keepdims=0), node("Greater", ["total", "zero"], ["positive"]),
              node("If", ["positive"], ["branch"], then_branch=then_, else_branch=else_),
              node("Tanh", ["branch"], ["s_next"])], [COND, out("s_next")])
    m = model([node("Loop", ["m", "", "x"], ["y"], body=b)], X, Y, {**TRIP, "zero": f32(0.0)})
    result = unrolled(m, feeds={"x": np.full((2, 3), 0.5, np.float32)})
    assert_same(m, result, **REASSOCIATED, feeds={"x": np.full((2, 3), -0.5, np.float32)})
    assert all_ops(result.graph)["If"] == 4
    defined = names(result.graph)
    assert len(defined) == len(set(defined)), sorted(n for n in defined if defined.count(n) > 1)


def test_initializers_of_a_branch_in_the_body_are_renamed_per_copy():
    # onnxruntime rejects an initializer in an If inside a Loop body, so the reference is numpy:
    # s <- tanh(s + 1) when sum(x) > 0, four times
    then_ = helper.make_graph([node("Add", ["s", "one"], ["r"])], "then", [], [out("r")],
                              [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    else_ = helper.make_graph([node("Mul", ["s", "s"], ["r2"])], "else", [], [out("r2")])
    b = body([node("ReduceSum", ["x"], ["total"], keepdims=0), node("Greater", ["total", "zero"], ["positive"]),
              node("If", ["positive"], ["branch"], then_branch=then_, else_branch=else_),
              node("Tanh", ["branch"], ["s_next"])], [COND, out("s_next")])
    m = model([node("Loop", ["m", "", "x"], ["y"], body=b)], X, Y, {**TRIP, "zero": f32(0.0)})
    original = m.SerializeToString()
    result, record = optimize(m)
    assert m.SerializeToString() == original, "renaming a copy renamed the input's initializer"
    assert record["rules"]["unroll-loops"] == 1 and all_ops(result.graph)["Loop"] == 0
    onnx.checker.check_model(result, full_check=True)
    defined = names(result.graph)
    assert len(defined) == len(set(defined))
    x = np.random.default_rng(0).uniform(0.1, 1, (2, 3)).astype(np.float32)
    want = x
    for _ in range(4):
        want = np.tanh(want + 1)
    np.testing.assert_allclose(run(result, {"x": x})[0], want, **REASSOCIATED)


def test_tf2onnx_condition_is_proven_true_before_the_last_iteration():
    # tf2onnx: cond_out = i < M and counter + 1 < M, with counter carried from 0; false only after the last
    b = body([node("Add", ["s", "s"], ["s_next"]), node("Add", ["counter", "one"], ["counter_next"]),
              node("Less", ["i", "limit"], ["a"]), node("Less", ["counter_next", "limit"], ["b"]),
              node("And", ["a", "b"], ["cond_out"])],
             [out("cond_out", (), TensorProto.BOOL), out("counter_next", (), TensorProto.INT64), out("s_next")],
             carried=(out("counter", (), TensorProto.INT64), STATE),
             initializers=[helper.make_tensor("one", TensorProto.INT64, [], [1])])
    m = model([node("Loop", ["m", "go", "zero", "x"], ["count", "y"], body=b)], X,
              {"count": [], "y": [2, 3]}, {**TRIP, "limit": np.array(4, np.int64), "go": np.array(True),
                                           "zero": np.array(0, np.int64)},
              output_types={"count": TensorProto.INT64})
    assert reason(m) is None
    result = unrolled(m)
    assert run(result, random_feeds(m))[0] == 4


def test_trip_count_zero_gives_initial_values_and_empty_scans():
    b = body([node("Neg", ["s"], ["s_next"])], [COND, out("s_next"), out("s_next")])
    m = model([node("Loop", ["m", "", "x"], ["y", "stack"], body=b)], X, {"y": [2, 3], "stack": [0, 2, 3]},
              {"m": np.array(0, np.int64)})
    result = unrolled(m)
    assert all_ops(result.graph)["Neg"] == 0


def test_trip_count_from_a_graph_input_does_not_fire():
    b = body([node("Neg", ["s"], ["s_next"])], [COND, out("s_next")])
    m = model([node("Loop", ["m", "", "x"], ["y"], body=b)], {**X, "m": []}, {"y": [2, 3]},
              input_types={"m": TensorProto.INT64})
    assert reason(m) == "the trip count m is not a constant"
    result, record = optimize(m)
    assert record["rules"]["unroll-loops"] == 0 and all_ops(result.graph)["Loop"] == 1
    feeds = {"x": random_feeds(m)["x"], "m": np.array(3, np.int64)}
    assert_same(m, result, **REASSOCIATED, feeds=feeds)


def test_data_dependent_early_exit_does_not_fire():
    # while sum(s) < 10: s = 2 s; the condition reads the state, which starts from the input
    b = body([node("Add", ["s", "s"], ["s_next"]), node("ReduceSum", ["s_next"], ["total"], keepdims=0),
              node("Less", ["total", "ten"], ["cond_out"])], [out("cond_out", (), TensorProto.BOOL), out("s_next")],
             initializers=[helper.make_tensor("ten", TensorProto.FLOAT, [], [10.0])])
    m = model([node("Loop", ["m", "", "x"], ["y"], body=b)], X, Y, TRIP)
    assert reason(m) == "the condition depends on the loop-carried s, whose initial x is not a constant"
    check_does_not_fire(m, "unroll-loops", kept=("Loop",), tolerance=REASSOCIATED)


def test_constant_early_exit_does_not_fire():
    # a counter from 0 against 2 under a trip count of 4: the loop stops after 2 iterations
    b = body([node("Add", ["counter", "one"], ["counter_next"]), node("Less", ["counter_next", "two"], ["cond_out"]),
              node("Neg", ["s"], ["s_next"])],
             [out("cond_out", (), TensorProto.BOOL), out("counter_next", (), TensorProto.INT64), out("s_next")],
             carried=(out("counter", (), TensorProto.INT64), STATE),
             initializers=[helper.make_tensor("one", TensorProto.INT64, [], [1]),
                           helper.make_tensor("two", TensorProto.INT64, [], [2])])
    m = model([node("Loop", ["m", "", "zero", "x"], ["count", "y"], body=b)], X, {"count": [], "y": [2, 3]},
              {**TRIP, "zero": np.array(0, np.int64)}, output_types={"count": TensorProto.INT64})
    assert reason(m) == "the condition is false after iteration 1 of 4 (an early exit)"
    check_does_not_fire(m, "unroll-loops", kept=("Loop",), tolerance=REASSOCIATED)


def test_trip_count_above_the_limit_does_not_fire():
    b = body([node("Neg", ["s"], ["s_next"])], [COND, out("s_next")])
    m = model([node("Loop", ["m", "", "x"], ["y"], body=b)], X, Y,
              {"m": np.array(loops.MAX_TRIP_COUNT + 1, np.int64)})
    assert reason(m) == f"the trip count {loops.MAX_TRIP_COUNT + 1} is above {loops.MAX_TRIP_COUNT}"
    check_does_not_fire(m, "unroll-loops", kept=("Loop",), tolerance=REASSOCIATED)


@pytest.fixture(scope="module")
def keras_lstm(tmp_path_factory):
    """LSTM(4) over 3 steps of 5 features, returning the sequence, saved as .keras; an input and
    Keras' output. tf2onnx converts its recurrence into a Loop with a constant trip count."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.keras.utils.set_random_seed(0)
    inp = tf.keras.Input((3, 5), batch_size=1, name="steps")
    seq = tf.keras.layers.LSTM(4, return_sequences=True)(inp)
    keras_model = tf.keras.Model(inp, tf.keras.layers.Dense(2)(seq))
    path = tmp_path_factory.mktemp("keras") / "lstm.keras"
    keras_model.save(path)
    x = np.random.default_rng(0).standard_normal((1, 3, 5)).astype(np.float32)
    return path, x, keras_model.predict(x, verbose=0)


def test_keras_lstm_imports_unrolled_with_keras_answer(tmp_path, keras_lstm):
    from edgesdk.pipeline import BuildOptions, build

    path, x, want = keras_lstm
    result = build(BuildOptions(model=path, target="x86", out=tmp_path / "o", until="import"))
    record = result.stages[0].record
    assert record["nodes_before"].get("Loop") == 1 and record["rules"]["unroll-loops"] == 1
    imported = onnx.load(str(tmp_path / "o" / ".build" / "1-import" / "model.onnx"))
    assert all_ops(imported.graph)["Loop"] == 0
    (got,) = run(imported, {imported.graph.input[0].name: x})
    assert got.shape == want.shape == (1, 3, 2)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
