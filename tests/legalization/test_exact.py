"""Exact legalization rules: each fires on a small model, removes what it says, and keeps the
function within its exactness mark; each refuses the cases its check names."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from edgesdk.devices import edgetpu
from edgesdk.legalization import exact
from edgesdk.legalization import legalize as legalization
from tests.legalization.harness import BITWISE, ONE_ULP, REASSOCIATED, check_does_not_fire, check_fires, legalized
from tests.passes.harness import assert_same, f32, model, node, ops, random_feeds, run

X4 = {"x": [1, 3, 4, 5]}
SIXTH = float(np.float32(1 / 6))
U = 2.0**-24  # float32's unit roundoff


def specials(m: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs with zeros of both signs, infinities and extreme magnitudes mixed in, for the
    rules that claim bit-identical results."""
    feeds = random_feeds(m, seed)
    for name, array in feeds.items():
        if array.dtype == np.float32:
            flat, values = array.reshape(-1), [0.0, -0.0, np.inf, -np.inf, 1e30, -1e30, 1e-30, -3.0]
            flat[:len(values)] = values[:flat.size]
    return feeds


# --- the table ----------------------------------------------------------------------------------


def test_every_rule_is_marked_and_named_once():
    names = [r.name for r in exact.RULES]
    assert len(set(names)) == len(names)
    for r in exact.RULES:
        assert r.rule.name == r.name
        # the one inexact mark: a quantized model's own int8 rounding, which compress applies again
        assert r.exactness in (exact.EXACT, exact.QUANTIZED) or r.exactness.startswith("exact up to float rounding ("), r
        assert r.description
        # A rule removes op types, or puts one into the form the device takes (replaces nothing): then
        # legalize needs to know which refusal makes it worth running, or it never runs.
        assert r.replaces or r.name in legalization.TRIGGERS, r.name


def test_unknown_rule_name_is_refused():
    with pytest.raises(ValueError, match="no-such-rule"):
        exact.apply(model([node("Relu", ["x"], ["y"])], X4, ["y"]), only=["no-such-rule"])


# --- leaky-relu-to-prelu ------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.1, 0.01, 1.0, -0.5, 1.5])
def test_leaky_relu_becomes_prelu(alpha):
    # PRelu with the one slope a is LeakyRelu for every a, negative ones and those above 1 included.
    m = model([node("LeakyRelu", ["x"], ["y"], alpha=alpha)], X4, ["y"])
    out = check_fires(m, "leaky-relu-to-prelu", gone=("LeakyRelu",), feeds=specials(m))
    assert ops(out) == {"PRelu": 1}


def test_leaky_relu_default_alpha_becomes_prelu():
    m = model([node("LeakyRelu", ["x"], ["y"])], X4, ["y"])
    out = check_fires(m, "leaky-relu-to-prelu", gone=("LeakyRelu",), feeds=specials(m))
    assert [numpy_helper.to_array(i).reshape(-1).tolist() for i in out.graph.initializer] == [[float(np.float32(0.01))]]


def test_leaky_relu_with_zero_alpha_becomes_relu():
    # Relu differs from the spec's 0*x only at -inf, where 0*(-inf) is NaN and Relu gives 0.
    m = model([node("LeakyRelu", ["x"], ["y"], alpha=0.0)], X4, ["y"])
    feeds = specials(m)
    feeds["x"].reshape(-1)[3] = 1.0
    out = check_fires(m, "leaky-relu-to-prelu", gone=("LeakyRelu",), feeds=feeds)
    assert ops(out) == {"Relu": 1}
    at_minus_inf = {"x": np.full((1, 3, 4, 5), -np.inf, np.float32)}
    assert np.isnan(run(m, at_minus_inf)[0]).all() and (run(out, at_minus_inf)[0] == 0).all()


# --- hardswish / hardsigmoid --------------------------------------------------------------------


def test_hardswish_becomes_scaled_x_times_relu6():
    m = model([node("HardSwish", ["x"], ["y"])], {"x": [1, 3, 100, 100]}, ["y"])
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.uniform(-100, 100, 10000), rng.standard_normal(10000) * 4,
                        np.linspace(-3.001, -2.999, 10000)]).astype(np.float32).reshape(1, 3, 100, 100)
    # Within 3u*|x| absolute (the reference's x/6 + 1/2 cancels near -3): at most 3e-5 for |x| <= 100.
    out = check_fires(m, "hardswish-to-relu6", gone=("HardSwish",), tolerance={"rtol": 0, "atol": 3e-5},
                      feeds={"x": x})
    want, got = run(m, {"x": x})[0], run(out, {"x": x})[0]
    assert np.all(np.abs(got.astype(np.float64) - want) <= 3 * U * np.abs(x))
    assert not np.array_equal(got, want)  # the bound is needed: the two forms round differently
    assert_same(m, out, rtol=0, atol=3e-5, feeds=specials(m))
    # (x * 1/6) * Clip(x + 3, 0, 6): the order the TFLite converter does not fuse into HARD_SWISH.
    final = out.graph.node[-1]
    producers = {o: n for n in out.graph.node for o in n.output}
    assert final.op_type == "Mul" and sorted(producers[i].op_type for i in final.input) == ["Clip", "Mul"]
    scaled = next(producers[i] for i in final.input if producers[i].op_type == "Mul")
    assert "x" in scaled.input
    assert ops(out) == {"Add": 1, "Clip": 1, "Mul": 2}


def test_hardsigmoid_one_sixth_becomes_relu6():
    m = model([node("HardSigmoid", ["x"], ["y"], alpha=SIXTH, beta=0.5)], X4, ["y"])
    x = np.linspace(-3.5, 3.5, 60, dtype=np.float32).reshape(1, 3, 4, 5)
    out = check_fires(m, "hardsigmoid-to-relu6", gone=("HardSigmoid",), tolerance={"rtol": 0, "atol": U},
                      feeds={"x": x})
    assert_same(m, out, rtol=0, atol=U, feeds=specials(m))
    assert ops(out) == {"Add": 1, "Clip": 1, "Mul": 1}


@pytest.mark.parametrize("alpha, beta", [(0.2, 0.5), (0.1667, 0.5), (SIXTH, 0.4)])
def test_hardsigmoid_other_constants_do_not_go_through_relu6(alpha, beta):
    m = model([node("HardSigmoid", ["x"], ["y"], alpha=alpha, beta=beta)], X4, ["y"])
    check_does_not_fire(m, "hardsigmoid-to-relu6")


def test_hardsigmoid_times_its_input_does_not_go_through_relu6():
    # x * (relu6(x + 3) / 6) is what the converter fuses into HARD_SWISH.
    m = model([node("HardSigmoid", ["x"], ["h"], alpha=SIXTH, beta=0.5), node("Mul", ["h", "x"], ["y"])], X4, ["y"])
    check_does_not_fire(m, "hardsigmoid-to-relu6")


@pytest.mark.parametrize("alpha, beta", [(0.2, 0.5), (SIXTH, 0.5), (-0.3, 0.25)])
def test_hardsigmoid_becomes_clip(alpha, beta):
    m = model([node("HardSigmoid", ["x"], ["y"], alpha=alpha, beta=beta)], X4, ["y"])
    out = check_fires(m, "hardsigmoid-to-clip", gone=("HardSigmoid",), feeds=specials(m))
    assert ops(out) == {"Add": 1, "Clip": 1, "Mul": 1}


def test_float16_hardsigmoid_gets_float16_constants():
    m = model([node("HardSigmoid", ["x"], ["y"])], X4, ["y"], input_type=TensorProto.FLOAT16)
    out = check_fires(m, "hardsigmoid-to-clip", gone=("HardSigmoid",), tolerance={"rtol": 2e-3, "atol": 2e-3})
    assert {i.data_type for i in out.graph.initializer} == {TensorProto.FLOAT16}


# --- PRelu ---------------------------------------------------------------------------------------


def test_prelu_is_left_to_the_edge_tpus_prelu():
    """No rule takes PRelu apart: the Edge TPU runs PRELU, and Relu(x) + Min(x, 0)*s, the rewrite this
    replaced, clipped x in full int8 (MINIMUM gives its input its output's range)."""
    m = model([node("PRelu", ["x", "s"], ["y"])], X4, ["y"], {"s": f32([[[0.25]], [[-0.5]], [[2.0]]])})
    out, counts = legalized(m)
    assert not any(counts.values()) and ops(out) == {"PRelu": 1}


def test_fold_rank_takes_a_prelu_of_one_slope_and_leaves_a_per_channel_one():
    one = model([node("PRelu", ["x", "s"], ["y"])], {"x": X5}, ["y"], {"s": f32([0.2])})
    out = check_fires(one, "fold-rank-for-elementwise", feeds=specials(one))
    assert ops(out) == {"PRelu": 1, "Reshape": 2}
    per_channel = model([node("PRelu", ["x", "s"], ["y"])], {"x": X5}, ["y"],
                        {"s": np.linspace(0.1, 0.4, X5[1], dtype=np.float32).reshape(-1, 1, 1, 1)})
    check_does_not_fire(per_channel, "fold-rank-for-elementwise")


# --- sub-constant-to-add, div-constant-to-mul --------------------------------------------------


def test_sub_constant_becomes_add():
    m = model([node("Sub", ["x", "c"], ["y"])], X4, ["y"], {"c": f32([[[1.5]], [[-0.0]], [[1e30]]])})
    out = check_fires(m, "sub-constant-to-add", gone=("Sub",), feeds=specials(m))
    assert ops(out) == {"Add": 1}


@pytest.mark.parametrize("case", ["tensor", "constant-first", "integer"])
def test_sub_without_a_constant_subtrahend_stays(case):
    if case == "tensor":
        m = model([node("Sub", ["x", "z"], ["y"])], {**X4, "z": [5]}, ["y"])
    elif case == "constant-first":
        m = model([node("Sub", ["c", "x"], ["y"])], X4, ["y"], {"c": f32(2.0)})
    else:  # the Edge TPU segment is float; integer Sub is shape arithmetic
        m = model([node("Sub", ["x", "c"], ["y"])], X4, ["y"], {"c": np.int64(2)}, input_type=TensorProto.INT64)
    check_does_not_fire(m, "sub-constant-to-add")


def test_square_becomes_mul_bit_for_bit():
    m = model([node("Pow", ["x", "two"], ["y"])], X4, ["y"], {"two": f32(2.0)})
    out = check_fires(m, "pow-to-mul", gone=("Pow",))
    assert ops(out) == {"Mul": 1}


@pytest.mark.parametrize("n, muls", [(3.0, 2), (4.0, 2)])
def test_cube_and_fourth_power_become_muls_within_two_ulps(n, muls):
    m = model([node("Pow", ["x", "n"], ["y"])], X4, ["y"], {"n": f32(n)})
    out = check_fires(m, "pow-to-mul", gone=("Pow",), tolerance={"rtol": 2 * 2.0**-23, "atol": 0.0})
    assert ops(out) == {"Mul": muls}


@pytest.mark.parametrize("case", ["half", "tensor", "vector"])
def test_other_powers_stay(case):
    if case == "half":
        m = model([node("Pow", ["x", "n"], ["y"])], X4, ["y"], {"n": f32(0.5)})
    elif case == "tensor":
        m = model([node("Pow", ["x", "z"], ["y"])], {**X4, "z": [1]}, ["y"])
    else:
        m = model([node("Pow", ["x", "n"], ["y"])], X4, ["y"], {"n": f32([2.0, 2.0, 2.0, 2.0, 2.0])})
    check_does_not_fire(m, "pow-to-mul")


def test_div_by_power_of_two_becomes_mul_bit_for_bit():
    m = model([node("Div", ["x", "c"], ["y"])], X4, ["y"], {"c": f32([[[2.0]], [[0.25]], [[-1024.0]]])})
    out = check_fires(m, "div-constant-to-mul", gone=("Div",), feeds=specials(m))
    assert ops(out) == {"Mul": 1}


def test_div_by_other_constants_is_within_one_ulp():
    m = model([node("Div", ["x", "c"], ["y"])], X4, ["y"], {"c": f32([[[3.0]], [[0.1]], [[-7.3]]])})
    check_fires(m, "div-constant-to-mul", gone=("Div",), tolerance=ONE_ULP)
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 3, 4, 5)).astype(np.float32) * 1e3}
    out, _ = legalized(m, only=["div-constant-to-mul"])
    assert_same(m, out, **ONE_ULP, feeds=feeds)


@pytest.mark.parametrize("c", [f32([1.0, 0.0, 2.0, 3.0, 4.0]), f32(1e38), f32(1e-40)])
def test_div_by_zero_or_by_a_reciprocal_out_of_range_stays(c):
    # 1/1e38 is subnormal (precision lost), 1/1e-40 overflows.
    check_does_not_fire(model([node("Div", ["x", "c"], ["y"])], X4, ["y"], {"c": c}), "div-constant-to-mul")


def test_div_by_a_tensor_stays():
    m = model([node("Div", ["x", "z"], ["y"])], {**X4, "z": [5]}, ["y"])
    check_does_not_fire(m, "div-constant-to-mul")


def test_integer_div_stays():
    m = model([node("Div", ["x", "c"], ["y"])], X4, ["y"], {"c": np.int64(4)}, input_type=TensorProto.INT64)
    check_does_not_fire(m, "div-constant-to-mul")


# --- clip-to-relu -------------------------------------------------------------------------------


def test_clip_at_zero_to_inf_becomes_relu():
    m = model([node("Clip", ["x", "lo", "hi"], ["y"])], X4, ["y"], {"lo": f32(0.0), "hi": f32(np.inf)})
    out = check_fires(m, "clip-to-relu", gone=("Clip",), feeds=specials(m))
    assert ops(out) == {"Relu": 1}


@pytest.mark.parametrize("inputs", [["x", "lo"], ["x", "lo", ""]])
def test_clip_at_zero_without_maximum_becomes_relu(inputs):
    # An absent maximum is FLT_MAX by the spec: the two differ at +inf only.
    m = model([node("Clip", inputs, ["y"])], X4, ["y"], {"lo": f32(0.0)})
    feeds = specials(m)
    feeds["x"].reshape(-1)[2] = 1.0
    out = check_fires(m, "clip-to-relu", gone=("Clip",), feeds=feeds)
    assert ops(out) == {"Relu": 1}
    at_inf = {"x": np.full((1, 3, 4, 5), np.inf, np.float32)}
    assert (run(m, at_inf)[0] == np.finfo(np.float32).max).all() and (run(out, at_inf)[0] == np.inf).all()


@pytest.mark.parametrize("lo, hi", [(0.0, 6.0), (-1.0, 1.0), (0.0, 1.0), (-1.0, None), (None, 6.0), (None, None),
                                    (0.0, 3.4028235e38), (1e-30, None)])
def test_clip_of_other_ranges_stays(lo, hi):
    # Clip(0, 6) and Clip(-1, 1) are RELU6 and RELU_N1_TO_1 in TFLite; Clip(0, FLT_MAX) differs at inf.
    inputs = ["x", "lo" if lo is not None else "", "hi" if hi is not None else ""]
    while inputs[-1] == "":
        inputs.pop()
    inits = {k: f32(v) for k, v in (("lo", lo), ("hi", hi)) if v is not None}
    check_does_not_fire(model([node("Clip", inputs, ["y"])], X4, ["y"], inits), "clip-to-relu")


def test_clip_with_a_tensor_minimum_stays():
    m = model([node("Clip", ["x", "lo"], ["y"])], {**X4, "lo": []}, ["y"])
    check_does_not_fire(m, "clip-to-relu", feeds={**random_feeds(m), "lo": np.array(0.0, np.float32)})


# --- gemm-to-fully-connected --------------------------------------------------------------------

A = {"a": [4, 6]}
W = np.random.default_rng(3).standard_normal((6, 5)).astype(np.float32)
BIAS = np.random.default_rng(4).standard_normal(5).astype(np.float32)


def _fc_form(out: onnx.ModelProto) -> tuple[list, list]:
    gemm = next(n for n in out.graph.node if n.op_type == "Gemm")
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in out.graph.initializer}
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gemm.attribute}
    assert attrs == {"transB": 1}, attrs
    return [inits[n].shape for n in gemm.input[1:]], list(gemm.input)


@pytest.mark.parametrize("attrs, b, c", [
    ({}, W, BIAS),
    ({"transB": 0}, W, BIAS.reshape(1, 5)),
    ({"transB": 1, "alpha": 0.5, "beta": 2.0}, W.T.copy(), BIAS),
    ({"alpha": 1.7}, W, None),
    ({"beta": 0.3}, W, f32(0.25)),
    ({"transB": 1}, W.T.copy(), BIAS.reshape(1, 5)),
])
def test_gemm_becomes_fully_connected(attrs, b, c):
    inits = {"b": b} if c is None else {"b": b, "c": c}
    m = model([node("Gemm", ["a", "b"] + (["c"] if c is not None else []), ["y"], **attrs)], A, ["y"], inits)
    out = check_fires(m, "gemm-to-fully-connected", tolerance=REASSOCIATED)
    shapes, _ = _fc_form(out)
    assert shapes == [(5, 6)] + ([(5,)] if c is not None else [])


def test_gemm_with_unit_scales_is_bitwise_the_same():
    m = model([node("Gemm", ["a", "b", "c"], ["y"])], A, ["y"], {"b": W, "c": BIAS})
    check_fires(m, "gemm-to-fully-connected", tolerance=BITWISE)


@pytest.mark.parametrize("case", ["canonical", "canonical-no-bias", "transA", "tensor-B", "tensor-C", "bias-per-row"])
def test_gemm_that_is_already_fully_connected_or_cannot_be_stays(case):
    nodes, inputs, inits = [node("Gemm", ["a", "b", "c"], ["y"], transB=1)], dict(A), {"b": W.T.copy(), "c": BIAS}
    if case == "canonical-no-bias":
        nodes, inits = [node("Gemm", ["a", "b"], ["y"], transB=1)], {"b": W.T.copy()}
    elif case == "transA":
        nodes, inputs = [node("Gemm", ["a", "b", "c"], ["y"], transA=1, transB=1)], {"a": [6, 4]}
    elif case == "tensor-B":
        nodes, inputs, inits = [node("Gemm", ["a", "b", "c"], ["y"])], {**A, "b": [6, 5]}, {"c": BIAS}
    elif case == "tensor-C":
        nodes, inputs, inits = [node("Gemm", ["a", "b", "c"], ["y"])], {**A, "c": [5]}, {"b": W}
    elif case == "bias-per-row":  # a FULLY_CONNECTED bias is one number per output column
        inits = {"b": W.T.copy(), "c": np.ones((4, 5), np.float32)}
    check_does_not_fire(model(nodes, inputs, ["y"], inits), "gemm-to-fully-connected")


# --- matmul-to-fully-connected ------------------------------------------------------------------


@pytest.mark.parametrize("shape, reshapes", [([4, 6], 0), ([2, 3, 6], 2), ([2, 1, 3, 6], 2)])
def test_matmul_by_a_weight_becomes_fully_connected(shape, reshapes):
    m = model([node("MatMul", ["a", "b"], ["y"])], {"a": shape}, ["y"], {"b": W})
    out = check_fires(m, "matmul-to-fully-connected", gone=("MatMul",), tolerance=REASSOCIATED)
    assert ops(out) == {"Gemm": 1, **({"Reshape": reshapes} if reshapes else {})}
    shapes, _ = _fc_form(out)
    assert shapes == [(5, 6)]
    # The same dot products: onnxruntime's MatMul and Gemm kernels agree bit for bit here.
    assert_same(m, out, **BITWISE)


@pytest.mark.parametrize("case", ["tensor-B", "batched-B", "vector-A"])
def test_matmul_without_a_matrix_weight_stays(case):
    if case == "tensor-B":
        m = model([node("MatMul", ["a", "b"], ["y"])], {**A, "b": [6, 5]}, ["y"])
    elif case == "batched-B":
        m = model([node("MatMul", ["a", "b"], ["y"])], {"a": [2, 4, 6]}, ["y"], {"b": np.stack([W, W])})
    else:
        m = model([node("MatMul", ["a", "b"], ["y"])], {"a": [6]}, ["y"], {"b": W})
    check_does_not_fire(m, "matmul-to-fully-connected")


# --- fold-rank-for-elementwise ------------------------------------------------------------------

X5 = [2, 3, 4, 5, 6]


@pytest.mark.parametrize("op, inputs, inits, extra", [
    ("Add", ["x", "z"], {}, {"z": X5}),
    ("Mul", ["x", "c"], {"c": np.full((1, 1, 1, 1, 1), 1.5, np.float32)}, {}),
    ("Sub", ["c", "x"], {"c": f32(2.0)}, {}),
    ("Max", ["x", "z", "w"], {}, {"z": X5, "w": X5}),
    ("Relu", ["x"], {}, {}),
    ("Sigmoid", ["x"], {}, {}),
    ("Clip", ["x", "lo", "hi"], {"lo": f32(-1.0), "hi": f32(2.0)}, {}),
    ("Mul", ["x", "s"], {}, {"s": [1, 1, 1, 1, 1]}),
])
def test_elementwise_op_of_more_than_three_big_dims_works_on_rank_three(op, inputs, inits, extra):
    m = model([node(op, inputs, ["y"])], {"x": X5, **extra}, ["y"], inits)
    out, counts = legalized(m, only=["fold-rank-for-elementwise"])
    assert counts == {"fold-rank-for-elementwise": 1}
    assert ops(out)[op] == 1
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in out.graph.value_info}
    target = next(n for n in out.graph.node if n.op_type == op)
    assert shapes[target.output[0]] == [24, 5, 6]
    assert_same(m, out, **BITWISE, feeds=specials(m))


def test_folded_neighbours_share_their_reshapes():
    m = model([node("Add", ["x", "z"], ["t"]), node("Mul", ["t", "w"], ["y"])], {"x": X5, "z": X5, "w": X5}, ["y"])
    out, counts = legalized(m, only=["fold-rank-for-elementwise"])
    assert counts == {"fold-rank-for-elementwise": 2}
    # x, z, w in and y out; the Add's way back and the Mul's way in cancel.
    assert ops(out) == {"Add": 1, "Mul": 1, "Reshape": 4}
    assert_same(m, out, **BITWISE, feeds=specials(m))


@pytest.mark.parametrize("shape, other", [([1, 3, 4, 5], None), ([2, 3, 4, 5], [1, 3, 1, 1]), ([2, 3, 4, 5], [5]),
                                          ([2, 3, 4, 1, 1], None)])
def test_elementwise_op_of_at_most_three_big_dims_or_broadcasting_stays(shape, other):
    inputs, inits = ["x", "x"], {}
    if other is not None:
        inputs, inits = ["x", "c"], {"c": np.ones(other, np.float32)}
    check_does_not_fire(model([node("Add", inputs, ["y"])], {"x": shape}, ["y"], inits), "fold-rank-for-elementwise")


# --- reduce-mean-to-average-pool ----------------------------------------------------------------


@pytest.mark.parametrize("axes, keepdims, extra", [([2, 3], 1, 0), ([3, 2], 0, 1), ([-2, -1], 1, 0)])
def test_spatial_mean_becomes_global_average_pool(axes, keepdims, extra):
    m = model([node("ReduceMean", ["x"], ["y"], axes=axes, keepdims=keepdims)], {"x": [2, 8, 7, 9]}, ["y"])
    out = check_fires(m, "reduce-mean-to-average-pool", gone=("ReduceMean",), tolerance=REASSOCIATED)
    assert ops(out) == {"GlobalAveragePool": 1, **({"Reshape": 1} if extra else {})}


def test_spatial_mean_with_axes_as_an_input_becomes_global_average_pool():
    # Opset 18 moved ReduceMean's axes to an input.
    m = model([node("ReduceMean", ["x", "axes"], ["y"], keepdims=0)], {"x": [2, 8, 7, 9]}, ["y"],
              {"axes": np.array([2, 3], np.int64)}, opset=18)
    out = check_fires(m, "reduce-mean-to-average-pool", gone=("ReduceMean",), tolerance=REASSOCIATED)
    assert ops(out) == {"GlobalAveragePool": 1, "Reshape": 1}


@pytest.mark.parametrize("shape, axes", [([2, 8, 7, 9], [1]), ([2, 8, 7, 9], [3]), ([2, 8, 7, 9], [1, 2, 3]),
                                         ([2, 8, 7], [2]), ([2, 8, 7, 9, 3], [2, 3]), ([2, 8, 7, 9], None)])
def test_other_means_stay(shape, axes):
    attrs = {} if axes is None else {"axes": axes}
    m = model([node("ReduceMean", ["x"], ["y"], **attrs)], {"x": shape}, ["y"])
    check_does_not_fire(m, "reduce-mean-to-average-pool")


def test_mean_over_tensor_axes_stays():
    m = model([node("ReduceMean", ["x", "axes"], ["y"])], {"x": [2, 8, 7, 9], "axes": [1]}, {"y": [2, 8, 7, 1]},
              input_types={"axes": TensorProto.INT64}, opset=18)
    check_does_not_fire(m, "reduce-mean-to-average-pool", feeds={**random_feeds(m), "axes": np.array([3], np.int64)})


# --- all rules together -------------------------------------------------------------------------


def _chain() -> onnx.ModelProto:
    return model([
        node("LeakyRelu", ["x"], ["a"], alpha=0.2),
        node("HardSwish", ["a"], ["b"]),
        node("PRelu", ["b", "s"], ["c"]),
        node("Sub", ["c", "m"], ["d"]),
        node("Div", ["d", "v"], ["e"]),
        node("HardSigmoid", ["e"], ["f"]),
        node("ReduceMean", ["f"], ["g"], axes=[2, 3], keepdims=0),
        node("MatMul", ["g", "w"], ["y"]),
    ], {"x": [1, 4, 5, 6]}, ["y"], {
        "s": np.linspace(0.1, 0.4, 4, dtype=np.float32).reshape(4, 1, 1),
        "m": f32(0.5), "v": f32(4.0), "w": np.random.default_rng(5).standard_normal((4, 3)).astype(np.float32),
    })


def test_apply_reaches_a_fixed_point_without_the_replaced_ops():
    m = _chain()
    out, counts = legalized(m)
    assert {k: v for k, v in counts.items() if v} == {
        "leaky-relu-to-prelu": 1, "hardswish-to-relu6": 1, "sub-constant-to-add": 1,
        "div-constant-to-mul": 1, "hardsigmoid-to-clip": 1, "reduce-mean-to-average-pool": 1,
        "matmul-to-fully-connected": 1}
    replaced = {op for r in exact.RULES for op in r.replaces} - {"Clip"}  # Clip(0, 1) is legal and stays
    assert not replaced & set(ops(out)), ops(out)
    assert set(ops(out)) <= set(edgetpu.OPS), ops(out)
    assert_same(m, out, **REASSOCIATED)
    again, counts = legalized(out)
    assert not any(counts.values()), counts
    assert again.graph.SerializeToString() == out.graph.SerializeToString()


def test_rules_run_in_rounds_so_later_rules_see_new_values():
    # LeakyRelu's PRelu is rank 5: fold-rank takes it in the next round, with shapes inferred in
    # between.
    m = model([node("LeakyRelu", ["x"], ["y"], alpha=0.1)], {"x": X5}, ["y"])
    out, counts = legalized(m, only=["leaky-relu-to-prelu", "fold-rank-for-elementwise"])
    assert counts == {"leaky-relu-to-prelu": 1, "fold-rank-for-elementwise": 1}
    assert ops(out) == {"PRelu": 1, "Reshape": 2}
    assert_same(m, out, **BITWISE, feeds=specials(m))


def test_tflite_lowering_of_the_results(tmp_path):
    """The facts exact.py's docstring states about the converter, on the rewritten forms."""
    from edgesdk.backends.tflite import convert_float

    def lowered(nodes, inits=None):
        m, _ = legalized(model(nodes, {"x": [1, 8, 8, 8]}, ["y"], inits))
        return convert_float(m, tmp_path / "m.tflite").op_counts

    def clip(lo, hi):
        return lowered([node("Clip", ["x", "lo", "hi"], ["y"])], {"lo": f32(lo), "hi": f32(hi)})

    assert clip(0.0, 6.0) == {"RELU6": 1}
    assert clip(-1.0, 1.0) == {"RELU_N1_TO_1": 1}
    assert clip(0.0, np.inf) == {"RELU": 1}
    assert clip(0.0, 1.0) == {"RELU": 1, "MINIMUM": 1}
    assert "HARD_SWISH" not in lowered([node("HardSwish", ["x"], ["y"])])
    hard_swish_in_two = [node("HardSigmoid", ["x"], ["h"], alpha=SIXTH, beta=0.5), node("Mul", ["x", "h"], ["y"])]
    assert "HARD_SWISH" not in lowered(hard_swish_in_two)
    assert lowered([node("LeakyRelu", ["x"], ["y"], alpha=0.1)]) == {"PRELU": 1}


def test_device_rank_triggers_name_the_rules_rank_pseudo_op():
    """A device model (which may not import legalization) spells exact.RANK itself: the two must agree,
    or a rank refusal never runs fold-rank-for-elementwise."""
    from edgesdk.devices import registry

    triggers = {t for m in registry.models() for t in m.rewrite_triggers.values()}
    assert triggers and triggers <= {exact.RANK} | {op for r in exact.RULES for op in r.replaces}
