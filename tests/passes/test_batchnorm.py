"""BatchNormalization folding into Conv, ConvTranspose, Gemm; never in training mode."""

from __future__ import annotations

import numpy as np
import pytest

from tests.passes.harness import REASSOCIATED, check_does_not_fire, check_fires, model, node

rng = np.random.default_rng(0)


def bn_params(c: int, prefix: str = "") -> dict:
    return {f"{prefix}scale": rng.uniform(0.5, 2, c).astype(np.float32),
            f"{prefix}bias": rng.standard_normal(c).astype(np.float32),
            f"{prefix}mean": rng.standard_normal(c).astype(np.float32),
            f"{prefix}var": rng.uniform(0.5, 2, c).astype(np.float32)}


BN_INPUTS = ["scale", "bias", "mean", "var"]


@pytest.mark.parametrize("with_bias", [False, True])
def test_batchnorm_after_conv_folds(with_bias):
    inits = {"w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32), **bn_params(4)}
    conv_inputs = ["x", "w"]
    if with_bias:
        inits["b"] = rng.standard_normal(4).astype(np.float32)
        conv_inputs.append("b")
    m = model([node("Conv", conv_inputs, ["c"], pads=[1, 1, 1, 1]),
               node("BatchNormalization", ["c", *BN_INPUTS], ["y"], epsilon=1e-3)],
              {"x": [1, 3, 8, 8]}, ["y"], inits)
    check_fires(m, "fold-batchnorm-conv", gone=("BatchNormalization",), tolerance=REASSOCIATED)


def test_batchnorm_after_grouped_conv_transpose_folds():
    inits = {"w": rng.standard_normal((4, 3, 2, 2)).astype(np.float32), **bn_params(6)}
    m = model([node("ConvTranspose", ["x", "w"], ["c"], group=2, strides=[2, 2]),
               node("BatchNormalization", ["c", *BN_INPUTS], ["y"])],
              {"x": [1, 4, 5, 5]}, ["y"], inits)
    check_fires(m, "fold-batchnorm-conv-transpose", gone=("BatchNormalization",), tolerance=REASSOCIATED)


@pytest.mark.parametrize("trans_b", [0, 1])
def test_batchnorm_after_gemm_folds(trans_b):
    w = rng.standard_normal((5, 6) if trans_b else (6, 5)).astype(np.float32)
    m = model([node("Gemm", ["x", "w", "b"], ["g"], transB=trans_b, alpha=0.5, beta=2.0),
               node("BatchNormalization", ["g", *BN_INPUTS], ["y"])],
              {"x": [3, 6]}, ["y"], {"w": w, "b": rng.standard_normal(5).astype(np.float32), **bn_params(5)})
    check_fires(m, "fold-batchnorm-gemm", gone=("BatchNormalization",), tolerance=REASSOCIATED)


def conv_bn() -> dict:
    return {"w": rng.standard_normal((4, 3, 1, 1)).astype(np.float32), **bn_params(4)}


def test_batchnorm_in_training_mode_does_not_fold():
    # training_mode=1 normalizes with the batch's statistics; the running-statistics outputs are
    # unused, so onnxscript's rule (which does not look at training_mode) would fold it.
    m = model([node("Conv", ["x", "w"], ["c"]),
               node("BatchNormalization", ["c", *BN_INPUTS], ["y", "rm", "rv"], training_mode=1)],
              {"x": [2, 3, 4, 4]}, ["y"], conv_bn())
    check_does_not_fire(m, "fold-batchnorm-conv", kept=("BatchNormalization",))


def test_batchnorm_whose_running_statistics_are_used_does_not_fold():
    m = model([node("Conv", ["x", "w"], ["c"]),
               node("BatchNormalization", ["c", *BN_INPUTS], ["y", "running_mean", "running_var"],
                    training_mode=1, momentum=0.9)],
              {"x": [2, 3, 4, 4]}, ["y", "running_mean"], conv_bn())
    check_does_not_fire(m, "fold-batchnorm-conv", kept=("BatchNormalization",))


def test_batchnorm_with_parameters_from_graph_inputs_does_not_fold():
    inits = conv_bn()
    del inits["scale"]
    m = model([node("Conv", ["x", "w"], ["c"]), node("BatchNormalization", ["c", *BN_INPUTS], ["y"])],
              {"x": [1, 3, 4, 4], "scale": [4]}, ["y"], inits)
    check_does_not_fire(m, "fold-batchnorm-conv", kept=("BatchNormalization",))


def test_batchnorm_after_conv_whose_output_is_also_used_does_not_fold():
    m = model([node("Conv", ["x", "w"], ["c"]), node("BatchNormalization", ["c", *BN_INPUTS], ["b"]),
               node("Add", ["b", "c"], ["y"])],
              {"x": [1, 3, 4, 4]}, ["y"], conv_bn())
    check_does_not_fire(m, "fold-batchnorm-conv", kept=("BatchNormalization",))
