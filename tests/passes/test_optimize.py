"""optimize() as a whole: the record, subgraphs, a failing rule, and two real models."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, shape_inference, version_converter

from edgesdk import passes
from edgesdk.passes.rule import Rule, fixed_point
from tests import model_zoo
from tests.passes.harness import EXACT, REASSOCIATED, assert_same, f32, model, node, ops, optimized, run

X = {"x": [2, 3]}


def small_model() -> onnx.ModelProto:
    return model([node("Mul", ["x", "one"], ["a"]), node("Relu", ["a"], ["b"]), node("Relu", ["b"], ["y"])], X, ["y"],
                 {"one": f32(1.0)})


def test_record_lists_every_rule_in_order_and_counts_nodes():
    m = small_model()
    out, record = optimized(m)
    assert list(record["rules"]) == [rule.name for rule in passes.RULES]
    assert all(isinstance(n, int) and n >= 0 for n in record["rules"].values())
    assert record["rules"]["remove-mul-by-one"] == 1 and record["rules"]["merge-relu-relu"] == 1
    assert record["nodes_before"] == {"Mul": 1, "Relu": 2}
    assert record["nodes_after"] == {"Relu": 1}
    assert 2 <= record["rounds"] <= passes.MAX_ROUNDS  # one round that fires, one quiet round
    assert_same(m, out, **EXACT)


def test_no_rule_holds_the_model_it_rewrote():
    """A pattern matcher keeps its last match and the graph it matched in unless let go: a model's weights
    (VGG16's 528 MiB) stayed held through the whole build after import. Once the rules have run, nothing
    of theirs refers to the model (a weak reference to its graph dies with the last reference here)."""
    ir_model = ir.serde.deserialize_model(small_model())
    graph = weakref.ref(ir_model.graph)
    ir_model, run = fixed_point(ir_model, passes.RULES)
    assert run.counts["remove-mul-by-one"] == 1  # the matchers matched in it
    del ir_model
    gc.collect()
    assert graph() is None


def test_rule_names_are_unique():
    names = [rule.name for rule in passes.RULES]
    assert len(names) == len(set(names))


def test_a_rule_that_raises_is_switched_off_and_the_round_undone(monkeypatch):
    def half_done_then_raise(model: ir.Model) -> int:
        next(iter(model.graph)).op_type = "Sigmoid"  # a change that must not survive
        raise ValueError("boom")

    monkeypatch.setattr(passes, "RULES", (Rule("broken", half_done_then_raise), *passes.RULES))
    m = small_model()
    out, record = passes.optimize(m)
    assert record["rule_errors"] == {"broken": "ValueError: boom"}
    assert record["rules"]["broken"] == 0 and record["rules"]["remove-mul-by-one"] == 1
    assert ops(out) == {"Relu": 1}
    assert_same(m, out, **EXACT)


def test_an_invalid_result_returns_the_input(monkeypatch):
    def corrupt(model: ir.Model) -> int:
        for n in model.graph:
            n.op_type = "NoSuchOp"
        return 0

    monkeypatch.setattr(passes, "RULES", (*passes.RULES, Rule("corrupt", corrupt)))
    m = small_model()
    out, record = passes.optimize(m)
    assert "checker" in record["rule_errors"]
    assert out.SerializeToString() == m.SerializeToString()
    assert not any(record["rules"].values())


def test_loop_body_is_optimized():
    # Loop body: acc' = Relu(Relu(acc * 1)) + 1, three times; the optimized body must agree.
    body = helper.make_graph(
        [node("Mul", ["acc_in", "one"], ["m"]), node("Relu", ["m"], ["r1"]), node("Relu", ["r1"], ["r2"]),
         node("Add", ["r2", "one"], ["acc_out"]), node("Identity", ["cond_in"], ["cond_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [2, 3])])
    m = model([node("Loop", ["trips", "", "x"], ["y"], body=body)], X, {"y": [2, 3]},
              {"trips": np.int64(100), "one": f32(1.0)})
    out, record = optimized(m)
    assert record["rules"]["remove-mul-by-one"] == 1 and record["rules"]["merge-relu-relu"] == 1
    body_ops = [n.op_type for n in out.graph.node[0].attribute[0].g.node]
    assert "Mul" not in body_ops and body_ops.count("Relu") == 1
    assert_same(m, out, **EXACT)


def close_to_scale(got: np.ndarray, want: np.ndarray) -> None:
    """Within rtol 1e-5 and atol 1e-5 x max|want|: the folded weights and reassociated sums of a
    whole network move each output by rounding errors of the sums behind it, which scale with the
    network's activations rather than with each output element."""
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def ppocr_classifier() -> onnx.ModelProto:
    """The PP-OCR text-direction classifier as the import stage hands it over: input fixed to
    1x3x48x192 (the file's output dims were -1: cleared), opset 11 upgraded to 17, shapes inferred."""
    m = onnx.load(str(model_zoo.ppocr_cls()))
    for dim, value in zip(m.graph.input[0].type.tensor_type.shape.dim, (1, 3, 48, 192)):
        dim.Clear()
        dim.dim_value = value
    for out in m.graph.output:
        for dim in out.type.tensor_type.shape.dim:
            dim.Clear()
    m = version_converter.convert_version(m, 17)
    return shape_inference.infer_shapes(m, strict_mode=True, data_prop=True)


def mobilenet() -> onnx.ModelProto:
    m = onnx.load(str(model_zoo.mobilenet_v2(96, 0.35)))
    return shape_inference.infer_shapes(m, strict_mode=True, data_prop=True)


@pytest.mark.parametrize("load, fired", [
    (ppocr_classifier, ("fold-batchnorm-conv", "fuse-hardswish", "fold-bias-into-conv", "matmul-add-to-gemm")),
    (mobilenet, ("fold-scale-into-conv", "fold-bias-into-conv")),
], ids=["ppocr-cls", "mobilenet-v2-96-0.35"])
def test_real_model(load, fired):
    m = load()
    out, record = optimized(m)
    before, after = sum(record["nodes_before"].values()), sum(record["nodes_after"].values())
    assert after < before, (before, after)
    assert all(record["rules"][name] > 0 for name in fired), record["rules"]
    assert ops(out)["BatchNormalization"] == 0
    for seed in range(2):
        feeds = {m.graph.input[0].name: np.random.default_rng(seed).standard_normal(
            [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]).astype(np.float32)}
        for got, want in zip(run(out, feeds), run(m, feeds)):
            close_to_scale(got, want)
    # A second pass finds nothing left to do.
    _, again = optimized(out)
    assert not any(again["rules"].values()), {k: v for k, v in again["rules"].items() if v}
    assert again["rounds"] == 1


def test_reassociated_tolerance_is_what_the_harness_states():
    assert REASSOCIATED == {"rtol": 1e-5, "atol": 1e-6} and EXACT == {"rtol": 1e-6, "atol": 0.0}


def test_a_rule_set_none_of_whose_ops_the_model_has_is_not_tried(monkeypatch):
    """onnxscript tries every rule at every node; a rule whose pattern is rooted at an op the model does not
    have cannot match and is passed over, and one whose op is there still fires (also in a subgraph)."""
    from onnxscript.rewriter import pattern

    from edgesdk.passes import rule as rules

    tried = []
    real = pattern.RewriteRuleSet.apply_to_model
    monkeypatch.setattr(pattern.RewriteRuleSet, "apply_to_model",
                        lambda self, model, **kw: tried.append(self) or real(self, model, **kw))
    double_relu = rules.from_patterns("relu-relu", pattern.RewriteRule(
        lambda op, x: op.Relu(op.Relu(x)), lambda op, x: op.Relu(x)))
    softmax = rules.from_patterns("softmax-of-sigmoid", pattern.RewriteRule(
        lambda op, x: op.Softmax(op.Sigmoid(x)), lambda op, x: op.Sigmoid(x)))
    ir_model = ir.serde.deserialize_model(small_model())
    assert softmax.apply(ir_model) == 0 and tried == []
    assert double_relu.apply(ir_model) == 1 and len(tried) == 1
    then = helper.make_graph([node("Relu", ["x"], ["r"])], "then", [],
                             [helper.make_tensor_value_info("r", TensorProto.FLOAT, [2, 3])])
    graph = helper.make_graph([node("If", ["c"], ["y"], then_branch=then, else_branch=then)], "branchy",
                              [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                               helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    branchy = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert rules.op_types(branchy) == {"If", "Relu"}  # the branch's op counts: a rule may rewrite there
