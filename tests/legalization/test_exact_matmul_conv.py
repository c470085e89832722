"""matmul-rows-to-conv and gemm-rows-to-conv: a product by a constant matrix with several rows and
columns out (a transformer's projections) made Edge TPU-capable as a 1x1 convolution, checked by
onnxruntime, by the legalize stage's own path on arm_2tpu, and by real TFLite conversion (fp32 and
int8)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.legalization.harness import REASSOCIATED, check_does_not_fire, check_fires, legalized
from tests.legalization.test_exact_lstm import _stage_legalize
from tests.passes.harness import model, node, ops, random_feeds, run

RULE = "matmul-rows-to-conv"
RNG = np.random.default_rng(7)
W = RNG.standard_normal((16, 24)).astype(np.float32) / 4


@pytest.mark.parametrize("shape", [[1, 32, 16], [2, 3, 16], [12, 16], [1, 2, 3, 16]])
def test_matmul_with_rows_becomes_a_1x1_convolution(shape):
    m = model([node("MatMul", ["a", "w"], ["y"])], {"a": shape}, ["y"], {"w": W})
    out = check_fires(m, RULE, gone=("MatMul",), tolerance=REASSOCIATED)
    assert ops(out) == {"Reshape": 2, "Transpose": 2, "Conv": 1}
    conv = next(n for n in out.graph.node if n.op_type == "Conv")
    weights = next(t for t in out.graph.initializer if t.name == conv.input[1])
    assert list(weights.dims) == [24, 16, 1, 1] and len(conv.input) == 2


@pytest.mark.parametrize("case", ["one-row", "one-column", "tensor-weight", "batched-weight"])
def test_one_dimensional_outputs_and_other_products_stay(case):
    if case == "one-row":  # FULLY_CONNECTED takes it (matmul-to-fully-connected)
        m = model([node("MatMul", ["a", "w"], ["y"])], {"a": [1, 16]}, ["y"], {"w": W})
    elif case == "one-column":
        m = model([node("MatMul", ["a", "w"], ["y"])], {"a": [8, 16]}, ["y"], {"w": W[:, :1].copy()})
    elif case == "tensor-weight":  # attention's Q K^T: a product of two activations
        m = model([node("MatMul", ["a", "b"], ["y"])], {"a": [8, 16], "b": [16, 24]}, ["y"])
    else:
        m = model([node("MatMul", ["a", "w"], ["y"])], {"a": [2, 8, 16]}, ["y"], {"w": np.stack([W, W])})
    check_does_not_fire(m, RULE)


@pytest.mark.parametrize("trans_b, alpha, bias", [(0, 1.0, True), (1, 0.5, True), (0, 1.0, False)])
def test_gemm_with_rows_becomes_a_1x1_convolution_with_its_bias(trans_b, alpha, bias):
    """gemm-to-fully-connected puts it in fully-connected form first (transB, alpha, beta folded),
    then gemm-rows-to-conv takes it, the bias going into the convolution."""
    from tests.passes.harness import assert_same

    inits = {"w": np.ascontiguousarray(W.T) if trans_b else W}
    if bias:
        inits["c"] = RNG.standard_normal(24).astype(np.float32)
    m = model([node("Gemm", ["a", "w", *(["c"] if bias else [])], ["y"], transB=trans_b, alpha=alpha, beta=0.5)],
              {"a": [12, 16]}, ["y"], inits)
    out, counts = legalized(m, only=["gemm-to-fully-connected", "gemm-rows-to-conv"])
    assert counts["gemm-rows-to-conv"] == 1
    assert ops(out) == {"Reshape": 2, "Transpose": 2, "Conv": 1}
    conv = next(n for n in out.graph.node if n.op_type == "Conv")
    assert len(conv.input) == (3 if bias else 2)
    assert_same(m, out, **REASSOCIATED)
    one_row = model([node("Gemm", ["a", "w"], ["y"], transB=1)], {"a": [1, 16]}, ["y"], {"w": np.ascontiguousarray(W.T)})
    check_does_not_fire(one_row, "gemm-rows-to-conv")


def _projection():
    """A transformer's feed-forward block on 32 tokens: MatMul, bias, Relu, MatMul, bias."""
    w2 = RNG.standard_normal((24, 16)).astype(np.float32) / 4
    return model([node("MatMul", ["x", "w1"], ["h"]), node("Add", ["h", "b1"], ["hb"]), node("Relu", ["hb"], ["r"]),
                  node("MatMul", ["r", "w2"], ["o"]), node("Add", ["o", "b2"], ["y"])],
                 {"x": [1, 32, 16]}, ["y"],
                 {"w1": W, "b1": RNG.standard_normal(24).astype(np.float32), "w2": w2,
                  "b2": RNG.standard_normal(16).astype(np.float32)})


def test_projection_is_refused_on_the_edge_tpu_until_legalized(tmp_path):
    m = _projection()
    result = _stage_legalize(m, tmp_path)
    refused = {(r["op"], r["code"], r["count"]) for r in result["before"]["refused"] if r["device"] == "edgetpu"}
    assert refused == {("MatMul", "edgetpu.fc-output", 2)}, refused
    assert result["rewrites"][RULE]["count"] == 2
    assert "MatMul" not in ops(result["model"]) and "Gemm" not in ops(result["model"])
    assert result["after"]["coverage"]["edgetpu"]["ops_fraction"] == 1.0
    for seed in range(3):
        feeds = random_feeds(m, seed)
        for want, got in zip(run(m, feeds), run(result["model"], feeds)):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_legalized_projection_lowers_to_conv_2d_in_fp32_and_int8(tmp_path):
    """What the Edge TPU gets: RESHAPE, CONV_2D, RESHAPE (the Transposes cost nothing in our NHWC
    lowering), int8 throughout, no FULLY_CONNECTED; numbers against onnxruntime on the original."""
    from edgesdk.backends import tflite
    from edgesdk.runtime.backends.tflite_runner import open_runner
    from edgesdk.runtime.manifest import Segment

    m = _projection()
    out = _stage_legalize(m, tmp_path)["model"]
    fp32 = tflite.convert_float(out, tmp_path / "fp32.tflite")
    assert fp32.op_counts.get("CONV_2D") == 2, fp32.op_counts
    assert not {"TRANSPOSE", "FULLY_CONNECTED", "BATCH_MATMUL"} & set(fp32.op_counts), fp32.op_counts
    calibration = [{"x": RNG.uniform(-1, 1, (1, 32, 16)).astype(np.float32)} for _ in range(16)]
    int8 = tflite.convert_int8(out, calibration, tmp_path / "int8.tflite")
    assert int8.op_counts.get("CONV_2D") == 2, int8.op_counts
    assert not {"TRANSPOSE", "FULLY_CONNECTED", "DEQUANTIZE", "QUANTIZE"} & set(int8.op_counts), int8.op_counts

    def runner(name, converted):
        segment = Segment("s0", "edgetpu:0", "tflite", name, converted.inputs, converted.outputs,
                          fallback_artifact=name)
        return open_runner(tmp_path, segment, None)

    for feeds in calibration[:4]:
        want = run(m, feeds)[0]
        scale = np.abs(want).max()
        np.testing.assert_allclose(runner("fp32.tflite", fp32).run(feeds)["y"], want, rtol=0, atol=1e-5 * scale)
        # int8: two layers, each rounding to ~1/256 of its range: within 5 % of the output's scale
        assert np.abs(runner("int8.tflite", int8).run(feeds)["y"] - want).max() < 0.05 * scale
