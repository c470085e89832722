"""Session-scoped model files for the frontend tests: each is built once, offline, from a fixed seed."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tests.frontends import tf_models


@pytest.fixture(scope="session")
def conv_net_files(tmp_path_factory) -> dict:
    """The small conv net as .keras, .h5, SavedModel and four TFLite variants."""
    out = tmp_path_factory.mktemp("conv-net")
    model = tf_models.conv_net()
    return {**tf_models.save_keras_formats(model, out), **tf_models.tflite_variants(model, out)}


@pytest.fixture(scope="session")
def mobilenet_keras(tmp_path_factory):
    return tf_models.mobilenet_v2_keras(tmp_path_factory.mktemp("mobilenet"))


@pytest.fixture(scope="session")
def unsupported_files(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("unsupported")
    return {"savedmodel": tf_models.unsupported_savedmodel(out), "tflite": tf_models.custom_op_tflite(out),
            "two-signatures": tf_models.several_signatures_savedmodel(out), "stateful": tf_models.stateful_tflite(out)}


@pytest.fixture(scope="session")
def transpose_conv_files(tmp_path_factory):
    return tf_models.transpose_conv_tflites(tmp_path_factory.mktemp("transpose-conv"))


def run_onnx(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    model.ir_version = 10  # onnxruntime 1.31 reads IR <= 13; the frontend already writes <= 10
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def relative_error(y: np.ndarray, ref: np.ndarray) -> float:
    """max |y - ref| / max |ref|: the error measured against the output's own scale."""
    return float(np.abs(y.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))
