"""The exact rules an unrolled Keras LSTM needs on the Edge TPU (tf2onnx's TensorList reads become
Gathers of constant indices; its cell adds x*W + b to h*U as a Gemm's computed C): each fires on a
small model and keeps the function within its mark, refuses the cases its check names, and after
legalize every rewritten node is Edge-TPU-capable and lowers to int8 TFLite.

Tolerances: gather-constant-index-to-slice is marked exact and compared bit for bit (BITWISE);
gemm-computed-bias-to-add against its stated bound, |got - want| <= 2^-24 * (|alpha| |A| |B| + |beta C|)
elementwise (measured up to 0.70 of it), computed in float64 from the feeds.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from tests.legalization.harness import BITWISE, check_does_not_fire, check_fires, legalized
from tests.passes.harness import model, node, ops, random_feeds, run

U = 2.0**-24  # float32's unit roundoff
RNG = np.random.default_rng(11)


def _inits(m: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}


# --- gather-constant-index-to-slice -------------------------------------------------------------


@pytest.mark.parametrize("shape, axis, index, start, squeezed", [
    ([3, 2, 5], 0, np.int64(1), 1, True),  # a TensorList read: [T, B, F], step 1
    ([3, 2, 5], 0, np.int64(-1), 2, True),  # the last step, negative index normalized by T
    ([2, 5, 3], 1, np.int32(4), 4, True),
    ([2, 5, 3], -1, np.array([2], np.int64), 2, False),  # a one-element vector keeps the axis: Slice alone
    ([4, 6], 1, np.int64(-6), 0, True),
])
def test_gather_of_a_constant_index_becomes_slice(shape, axis, index, start, squeezed):
    m = model([node("Gather", ["x", "i"], ["y"], axis=axis)], {"x": shape}, ["y"], {"i": index})
    out = check_fires(m, "gather-constant-index-to-slice", gone=("Gather",), tolerance=BITWISE)
    assert ops(out) == ({"Slice": 1, "Squeeze": 1} if squeezed else {"Slice": 1})
    sliced = next(n for n in out.graph.node if n.op_type == "Slice")
    starts, ends, axes = (_inits(out)[name].tolist() for name in sliced.input[1:4])
    assert (starts, ends, axes) == ([start], [start + 1], [axis % len(shape)])


@pytest.mark.parametrize("shape, axis, index, start", [
    ([1280], 0, np.arange(1280).reshape(1, 1280, 1, 1), 0),  # PyTorch's as_strided view before a classifier
    ([2, 12, 3], 1, np.arange(4, 10).reshape(2, 3), 4),  # a run from 4, shaped
    ([6, 2], 0, np.arange(-6, -3), 0),  # negative indices, taken modulo the axis
])
def test_gather_of_a_constant_run_of_indices_becomes_slice_and_reshape(shape, axis, index, start):
    m = model([node("Gather", ["x", "i"], ["y"], axis=axis)], {"x": shape}, ["y"], {"i": index.astype(np.int64)})
    out = check_fires(m, "gather-constant-run-to-reshape", gone=("Gather",), tolerance=BITWISE)
    assert ops(out) == {"Slice": 1, "Reshape": 1}
    sliced = next(n for n in out.graph.node if n.op_type == "Slice")
    starts, ends, axes = (_inits(out)[name].tolist() for name in sliced.input[1:4])
    assert (starts, ends, axes) == ([start], [start + index.size], [axis])


@pytest.mark.parametrize("index", [np.array([0, 2, 3]), np.array([3, 2, 1]), np.array([[0, 1], [1, 2]])])
def test_gather_of_indices_that_are_no_run_stays(index):
    m = model([node("Gather", ["x", "i"], ["y"], axis=0)], {"x": [5, 2]}, ["y"], {"i": index.astype(np.int64)})
    check_does_not_fire(m, "gather-constant-run-to-reshape")


def test_every_step_of_a_tensor_list_is_read_by_its_own_slice():
    # T reads of one [T, B, F] tensor, as an unrolled loop makes them: one firing each, shared constants.
    nodes = [node("Gather", ["x", f"i{t}"], [f"y{t}"], axis=0) for t in range(3)]
    m = model(nodes, {"x": [3, 2, 5]}, [f"y{t}" for t in range(3)], {f"i{t}": np.int64(t) for t in range(3)})
    out = check_fires(m, "gather-constant-index-to-slice", times=3, gone=("Gather",), tolerance=BITWISE)
    assert ops(out) == {"Slice": 3, "Squeeze": 3}
    assert len(out.graph.initializer) == 3 + 3 + 1  # starts 0..2, ends 1..3, one axes tensor for all


@pytest.mark.parametrize("case", ["tensor-index", "two-indices", "matrix-index", "integer-data", "dynamic-shape",
                                  "constant-data"])
def test_gather_that_is_a_real_gather_stays(case):
    inputs, inits, feeds = {"x": [3, 2, 5]}, {"i": np.int64(1)}, None
    if case == "tensor-index":
        inputs, inits = {"x": [3, 2, 5], "i": []}, {}
    elif case == "two-indices":
        inits = {"i": np.array([0, 2], np.int64)}
    elif case == "matrix-index":  # one element, but the output gains an axis
        inits = {"i": np.array([[1]], np.int64)}
    elif case == "dynamic-shape":
        inputs = {"x": ["t", 2, 5]}
    elif case == "constant-data":
        inputs, inits = {"z": [1]}, {"x": RNG.standard_normal((3, 2, 5)).astype(np.float32), "i": np.int64(1)}
    types = {"i": TensorProto.INT64}
    if case == "integer-data":  # shape arithmetic, not an Edge TPU tensor
        types["x"] = TensorProto.INT64
    nodes = [node("Gather", ["x", "i"], ["y"], axis=0)]
    if case == "constant-data":
        nodes.append(node("Add", ["y", "z"], ["out"]))
    m = model(nodes, inputs, ["out" if case == "constant-data" else "y"], inits, input_types=types,
              output_types={"y": types.get("x", TensorProto.FLOAT)})
    if case == "tensor-index":
        feeds = {**random_feeds(m), "i": np.array(2, np.int64)}
    elif case == "dynamic-shape":
        feeds = {"x": RNG.standard_normal((4, 2, 5)).astype(np.float32)}
    check_does_not_fire(m, "gather-constant-index-to-slice", feeds=feeds)


def test_gather_of_an_index_out_of_range_stays():
    # Gather fails at run time there; a Slice would clamp and return a row.
    m = model([node("Gather", ["x", "i"], ["y"], axis=0)], {"x": [3, 2, 5]}, {"y": [2, 5]}, {"i": np.int64(3)})
    _, counts = legalized(m, only=["gather-constant-index-to-slice"])
    assert counts == {"gather-constant-index-to-slice": 0}


# --- gemm-computed-bias-to-add ------------------------------------------------------------------


def _check_gemm_bound(m: onnx.ModelProto, out: onnx.ModelProto, seeds: int = 4) -> None:
    gemm = next(n for n in m.graph.node if n.op_type == "Gemm")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gemm.attribute}
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    b = _inits(m)["b"].astype(np.float64)
    b = b.T if attrs.get("transB", 0) else b
    for seed in range(seeds):
        feeds = random_feeds(m, seed)
        feeds["c"] = feeds["c"] * 10  # a bias larger than the product, as x*W + b often is
        want, got = run(m, feeds)[0], run(out, feeds)[0]
        assert got.shape == want.shape and got.dtype == want.dtype
        bound = U * (abs(alpha) * (np.abs(feeds["a"]).astype(np.float64) @ np.abs(b)) + abs(beta) * np.abs(feeds["c"]))
        excess = np.abs(got.astype(np.float64) - want) - bound
        assert excess.max() <= 0, excess.max()


@pytest.mark.parametrize("attrs, k, c_shape, extra", [
    ({}, 6, [4, 5], {}),
    ({}, 300, [4, 5], {}),  # more than one of MLAS's K blocks (256 on x86): the two orders round apart
    ({"beta": 0.5}, 6, [5], {"Mul": 1}),
    ({"alpha": 1.7, "beta": 2.0, "transB": 1}, 513, [1, 5], {"Mul": 1}),
    ({"transB": 1}, 6, [4, 1], {}),
])
def test_gemm_with_a_computed_bias_adds_it_after_the_product(attrs, k, c_shape, extra):
    b = RNG.standard_normal((5, k) if attrs.get("transB") else (k, 5)).astype(np.float32)
    m = model([node("Gemm", ["a", "b", "c"], ["y"], **attrs)], {"a": [4, k], "c": c_shape}, ["y"], {"b": b})
    out, counts = legalized(m, only=["gemm-computed-bias-to-add"])
    assert counts == {"gemm-computed-bias-to-add": 1}
    assert ops(out) == {"Gemm": 1, "Add": 1, **extra}
    gemm = next(n for n in out.graph.node if n.op_type == "Gemm")
    assert len(gemm.input) == 2 and "beta" not in {a.name for a in gemm.attribute}
    _check_gemm_bound(m, out)


def test_gemm_with_unit_scales_and_a_short_k_is_bitwise_the_same():
    m = model([node("Gemm", ["a", "b", "c"], ["y"])], {"a": [4, 6], "c": [4, 5]}, ["y"],
              {"b": RNG.standard_normal((6, 5)).astype(np.float32)})
    check_fires(m, "gemm-computed-bias-to-add", tolerance=BITWISE)


def test_gemm_with_zero_beta_drops_the_bias():
    m = model([node("Gemm", ["a", "b", "c"], ["y"], beta=0.0)], {"a": [4, 6], "c": [4, 5]}, ["y"],
              {"b": RNG.standard_normal((6, 5)).astype(np.float32)})
    out = check_fires(m, "gemm-computed-bias-to-add", tolerance=BITWISE)
    assert ops(out) == {"Gemm": 1}


def test_gemm_with_a_computed_bias_then_becomes_fully_connected():
    # With gemm-to-fully-connected, as legalize runs them: weights [N, K], alpha folded in, no C.
    w = RNG.standard_normal((6, 5)).astype(np.float32)
    m = model([node("Gemm", ["a", "b", "c"], ["y"], alpha=0.5, beta=3.0)], {"a": [4, 6], "c": [4, 5]}, ["y"], {"b": w})
    out, counts = legalized(m, only=["gemm-to-fully-connected", "gemm-computed-bias-to-add"])
    assert counts == {"gemm-to-fully-connected": 1, "gemm-computed-bias-to-add": 1}
    gemm = next(n for n in out.graph.node if n.op_type == "Gemm")
    assert {a.name: onnx.helper.get_attribute_value(a) for a in gemm.attribute} == {"transB": 1}
    assert len(gemm.input) == 2 and _inits(out)[gemm.input[1]].shape == (5, 6)
    # alpha*B is rounded once more (a power of two here: exact), on top of the rule's bound
    _check_gemm_bound(m, out)


@pytest.mark.parametrize("case", ["constant-C", "tensor-B", "no-C", "constant-A"])
def test_gemm_that_has_a_constant_bias_or_no_constant_weight_stays(case):
    w, bias = RNG.standard_normal((6, 5)).astype(np.float32), RNG.standard_normal(5).astype(np.float32)
    nodes, inputs, inits = [node("Gemm", ["a", "b", "c"], ["y"])], {"a": [4, 6], "c": [4, 5]}, {"b": w}
    if case == "constant-C":  # gemm-to-fully-connected makes it the FULLY_CONNECTED bias
        inputs, inits = {"a": [4, 6]}, {"b": w, "c": bias}
    elif case == "tensor-B":
        inputs, inits = {"a": [4, 6], "b": [6, 5], "c": [4, 5]}, {}
    elif case == "no-C":
        nodes, inputs = [node("Gemm", ["a", "b"], ["y"])], {"a": [4, 6]}
    elif case == "constant-A":
        nodes = [node("Gemm", ["a", "b", "c"], ["y"])]
        inputs, inits = {"c": [4, 5]}, {"a": RNG.standard_normal((4, 6)).astype(np.float32), "b": w}
    check_does_not_fire(model(nodes, inputs, ["y"], inits), "gemm-computed-bias-to-add")


# --- an unrolled LSTM step through legalize and the int8 lowering -------------------------------

HIDDEN, FEATURES, STEPS = 8, 4, 3


def _lstm_step() -> onnx.ModelProto:
    """One step of a Keras LSTM as tf2onnx unrolls it: read step 1 of the [T, B, F] input (a Gather
    of a constant index), x*W + b, then h*U with that sum as the Gemm's C, the four gates, c' and h'."""
    w = (RNG.standard_normal((FEATURES, 4 * HIDDEN)) * 0.5).astype(np.float32)
    u = (RNG.standard_normal((HIDDEN, 4 * HIDDEN)) * 0.5).astype(np.float32)
    return model([
        node("Gather", ["x", "step"], ["xt"], axis=0),
        node("MatMul", ["xt", "w"], ["xw"]),
        node("Add", ["xw", "b"], ["xwb"]),
        node("Gemm", ["h", "u", "xwb"], ["z"]),
        node("Split", ["z", "quarters"], ["zi", "zf", "zg", "zo"], axis=1),
        node("Sigmoid", ["zi"], ["i"]), node("Sigmoid", ["zf"], ["f"]), node("Tanh", ["zg"], ["g"]),
        node("Sigmoid", ["zo"], ["o"]),
        node("Mul", ["f", "c"], ["fc"]), node("Mul", ["i", "g"], ["ig"]), node("Add", ["fc", "ig"], ["c2"]),
        node("Tanh", ["c2"], ["tc"]), node("Mul", ["o", "tc"], ["h2"]),
    ], {"x": [STEPS, 1, FEATURES], "h": [1, HIDDEN], "c": [1, HIDDEN]}, ["h2", "c2"], {
        "step": np.int64(1), "w": w, "u": u, "b": (RNG.standard_normal(4 * HIDDEN) * 0.1).astype(np.float32),
        "quarters": np.full(4, HIDDEN, np.int64),
    })


def _stage_legalize(m: onnx.ModelProto, tmp_path) -> dict:
    """The legalize stage's own path (`legalization.legalize`, what `edgesdk build` runs) on arm_2tpu."""
    from edgesdk.config.target import load_target
    from edgesdk.legalization.legalize import legalize
    from edgesdk.pipeline import BuildOptions

    target, _ = load_target("arm_2tpu")
    options = BuildOptions(model=tmp_path / "m.onnx", target="arm_2tpu", out=tmp_path)
    inputs = [{"name": vi.name, "shape": [d.dim_value for d in vi.type.tensor_type.shape.dim], "dtype": "float32"}
              for vi in m.graph.input]
    return legalize(m, target, options, inputs)


def test_lstm_step_is_refused_on_the_edge_tpu_until_legalized(tmp_path):
    m = _lstm_step()
    result = _stage_legalize(m, tmp_path)
    refused = {(r["op"], r["code"], r["count"]) for r in result["before"]["refused"] if r["device"] == "edgetpu"}
    assert refused == {("Gather", "edgetpu.unsupported-op", 1), ("Gemm", "edgetpu.no-lowering", 1)}, refused
    rewrites = {name: r["count"] for name, r in result["rewrites"].items()}
    assert rewrites["gather-constant-index-to-slice"] == 1 and rewrites["gemm-computed-bias-to-add"] == 1, rewrites
    out = result["model"]
    assert "Gather" not in ops(out) and {"Slice", "Gemm", "Add"} <= set(ops(out)), ops(out)
    not_on_tpu = [(s.name, s.op, s.refusals) for s in result["support"] if "edgetpu" not in s.capable]
    assert not_on_tpu == [], not_on_tpu
    assert result["after"]["coverage"]["edgetpu"]["ops_fraction"] == 1.0 and result["after"]["transitions"] == 0
    # K = 8 stays within one MLAS block: bit-identical here; REASSOCIATED leaves room for the FC rewrites' kernels
    for seed in range(3):
        feeds = random_feeds(m, seed)
        for want, got in zip(run(m, feeds), run(out, feeds)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_legalized_lstm_step_lowers_to_int8_tflite(tmp_path):
    from edgesdk.backends import tflite
    from edgesdk.runtime.backends.tflite_runner import open_runner
    from edgesdk.runtime.manifest import Segment

    m = _lstm_step()
    out = _stage_legalize(m, tmp_path)["model"]
    rng = np.random.default_rng(3)
    calibration = [{"x": rng.uniform(-1, 1, (STEPS, 1, FEATURES)).astype(np.float32),
                    "h": rng.uniform(-1, 1, (1, HIDDEN)).astype(np.float32),
                    "c": rng.uniform(-1, 1, (1, HIDDEN)).astype(np.float32)} for _ in range(16)]
    # the float lowering first: the rewritten forms mean the same in TF (the TFLite tests' 1e-4 / 1e-5)
    fp32 = tflite.convert_float(out, tmp_path / "fp32.tflite")
    assert "GATHER" not in fp32.op_counts and {"STRIDED_SLICE", "FULLY_CONNECTED", "ADD"} <= set(fp32.op_counts)
    result = tflite.convert_int8(out, calibration, tmp_path / "int8.tflite")
    assert "GATHER" not in result.op_counts and {"STRIDED_SLICE", "FULLY_CONNECTED", "ADD"} <= set(result.op_counts)
    assert not {"DEQUANTIZE", "QUANTIZE"} & set(result.op_counts), result.op_counts  # int8 throughout

    def runner(name, converted):
        segment = Segment("s0", "edgetpu:0", "tflite", name, converted.inputs, converted.outputs,
                          fallback_artifact=name)
        return open_runner(tmp_path, segment, None)

    fp32_runner, int8_runner = runner("fp32.tflite", fp32), runner("int8.tflite", result)
    for feeds in calibration[:4]:
        want = dict(zip(["h2", "c2"], run(m, feeds)))
        got32, got8 = fp32_runner.run(feeds), int8_runner.run(feeds)
        for name, ref in want.items():
            np.testing.assert_allclose(got32[name], ref, rtol=1e-4, atol=1e-5, err_msg=name)
            # int8: h' in (-1, 1), c' in (-2, 2), an int8 step ~1/128 of a range, rounded by each op
            # (measured 0.017 at most on the 16 calibration samples)
            assert np.abs(got8[name] - ref).max() < 0.05, (name, np.abs(got8[name] - ref).max())
