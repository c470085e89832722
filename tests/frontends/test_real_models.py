"""Real pretrained models from the model cache (`make models` fetches them from PyPI wheels):
MediaPipe's TFLite face detector and selfie segmenter (float16 weights; the segmenter holds the
custom op Convolution2DTransposeBias), and silero-vad's ONNX (If subgraphs, LSTM). Each test is
skipped, and reported as a skip, where the cache lacks its file.

The selfie segmenter's reference: the interpreter cannot run the custom op, so the file is
rewritten back to TFLite's builtin TRANSPOSE_CONV + bias (`tf_models.builtin_transpose_conv`).
Measured: the converted custom op and tf2onnx's own conversion of the builtin are bit-identical;
against the interpreter (XNNPACK kernels, another float32 summation order through ~60 layers)
the logits differ by up to 1.3e-5 of their max |y|.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgesdk import frontends
from edgesdk.frontends.standard_ops import nonstandard_ops
from tests import model_zoo
from tests.frontends import tf_models
from tests.frontends.conftest import relative_error, run_onnx

pytestmark = pytest.mark.slow  # real TFLite models through the converter


def _cached(name: str):
    path = model_zoo.CACHE / name
    if not path.exists():
        pytest.skip(f"{path} is missing: run `make models`")
    return path


@pytest.fixture(scope="module")
def selfie():
    return _cached("selfie_segmentation.tflite")


def test_face_detector_matches_the_interpreter(tmp_path):
    """Float16 weights behind DEQUANTIZE; two outputs. Measured: 4e-7 / 1.4e-6 of max |y|."""
    from ai_edge_litert.interpreter import Interpreter

    path = _cached("face_detection_short_range.tflite")
    model, info = frontends.load(path, tmp_path)
    assert info["format"] == "tflite" and info["notes"] == []
    assert [o.name for o in model.graph.output] == ["regressors", "classificators"]
    interpreter = Interpreter(str(path))
    interpreter.allocate_tensors()
    assert any(d["dtype"] == np.float16 for d in interpreter.get_tensor_details())
    for x in np.random.default_rng(0).uniform(-1, 1, (3, 1, 128, 128, 3)).astype(np.float32):
        interpreter.set_tensor(interpreter.get_input_details()[0]["index"], x)
        interpreter.invoke()
        expected = {d["name"]: interpreter.get_tensor(d["index"]) for d in interpreter.get_output_details()}
        got = dict(zip([o.name for o in model.graph.output], run_onnx(model, {"input": x})))
        for name in expected:
            assert relative_error(got[name], expected[name]) <= 1e-5, name


@pytest.mark.parametrize("name, opset", [("silero_vad.onnx", 16), ("silero_vad_16k_op15.onnx", 15)])
def test_silero_vad_subgraphs_are_standard(tmp_path, name, opset):
    """Must not fire: If branches holding LSTMs are walked and every op in them is standard."""
    model, info = frontends.load(_cached(name), tmp_path)
    assert info["opset"] == opset
    assert any(a.type == a.GRAPH for n in model.graph.node for a in n.attribute)
    assert nonstandard_ops(model) == []


def _with_logits(model):
    """Also output the custom op's own tensor ('segment', the logits before the sigmoid): the
    sigmoid saturates on random inputs, the logits do not."""
    model.graph.output.add().name = "segment"
    return model


def test_selfie_segmentation_converts_and_matches(selfie, tmp_path):
    from ai_edge_litert.interpreter import Interpreter

    model, info = frontends.load(selfie, tmp_path / "custom")
    assert info["notes"] == ["TFLite custom op Convolution2DTransposeBias (1 node(s)) converted by edgesdk as "
                             "ConvTranspose + bias"]
    builtin = tf_models.builtin_transpose_conv(selfie, tmp_path)
    reference, _ = frontends.load(builtin, tmp_path / "builtin")
    _with_logits(model), _with_logits(reference)

    interpreter = Interpreter(str(builtin), experimental_preserve_all_tensors=True)
    interpreter.allocate_tensors()
    logits = next(d["index"] for d in interpreter.get_tensor_details() if d["name"] == "segment")
    rng = np.random.default_rng(0)
    for x in [rng.uniform(0, 1, (1, 256, 256, 3)).astype(np.float32),
              np.tile(np.linspace(0, 1, 256, dtype=np.float32)[None, :, None, None], (1, 1, 256, 3))]:
        (mask, ours), (_, theirs) = run_onnx(model, {"input_1": x}), run_onnx(reference, {"input_1": x})
        assert mask.shape == (1, 256, 256, 1) and 0 <= mask.min() and mask.max() <= 1
        assert relative_error(ours, theirs) <= 1e-6  # measured: 0 (bit-identical)
        interpreter.set_tensor(interpreter.get_input_details()[0]["index"], x)
        interpreter.invoke()
        expected = interpreter.get_tensor(logits)
        # tf2onnx moved the layout transposes past the op: its 'segment' is NCHW
        assert relative_error(ours.reshape(expected.shape), expected) <= 1e-4  # measured: 1.3e-5
