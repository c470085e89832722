"""TensorFlow formats (Keras .keras / .h5, SavedModel, TFLite) converted by tf2onnx in a child
process, compared with the original framework's own output on random inputs.

Tolerances: float models within 1e-5 of max |y| (float32 rounding; measured 1e-7..1e-6). Int8
TFLite within one quantization step of the interpreter: the ONNX graph requantizes with float
math (QuantizeLinear rounds half to even) where TFLite's kernels use fixed-point multipliers, so
a value that lands on a rounding boundary may differ by one step (measured on this 4-layer net:
all 2000 outputs exact). On deep nets the one-step differences of single layers compound: int8
MobileNetV2-0.35 (96x96), 20 inputs, logits: per-channel 96% exact, max 7 steps; per-tensor 85%
exact, max 7 steps. Not asserted here (the test would cost a MobileNet int8 conversion).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from edgesdk import frontends
from edgesdk.errors import UsageError, UserError
from edgesdk.frontends import conversion
from tests.frontends import tf_models
from tests.frontends.conftest import relative_error, run_onnx

RTOL = 1e-5


def _images(n: int, seed: int = 0, shape=tf_models.IMAGE) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (n, 1) + tuple(shape)).astype(np.float32)


def _check_converted(model: onnx.ModelProto, info: dict, fmt: str) -> None:
    assert info["format"] == fmt and info["converter"] == "tf2onnx 1.17.0" and info["opset"] == 17
    assert model.producer_name == "tf2onnx" and model.ir_version <= 10
    assert not any(o.domain not in ("", "ai.onnx", "ai.onnx.ml") for o in model.opset_import)


def _dims(value_info) -> list:
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in value_info.type.tensor_type.shape.dim]


@pytest.mark.parametrize("fmt", ["keras", "h5"])
def test_keras_file_matches_keras(conv_net_files, tmp_path, capfd, fmt):
    import keras

    model, info = frontends.load(conv_net_files[fmt], tmp_path)
    _check_converted(model, info, fmt)
    assert [i.name for i in model.graph.input] == ["image"] and [o.name for o in model.graph.output] == ["logits"]
    assert _dims(model.graph.input[0]) == [1, 16, 16, 3]  # batch fixed before conversion
    assert "Traceback" not in "".join(capfd.readouterr())  # the child's output stays in its log

    reference = keras.models.load_model(conv_net_files[fmt], compile=False)
    errors = [relative_error(run_onnx(model, {"image": x})[0], reference(x).numpy()) for x in _images(8)]
    assert max(errors) <= RTOL, errors


def _float64_copy(model):
    """The same Keras model computing in float64: the reference both float32 answers are measured against."""
    import keras

    def widen(config):
        if isinstance(config, dict):
            return {k: "float64" if k == "dtype" else widen(v) for k, v in config.items()}
        return [widen(v) for v in config] if isinstance(config, list) else config

    wide = keras.Model.from_config(widen(model.get_config()))
    wide.set_weights([w.astype(np.float64) for w in model.get_weights()])
    return wide


@pytest.mark.slow
def test_mobilenet_v2_keras_matches_keras(mobilenet_keras, tmp_path):
    """Against Keras in float64: over MobileNetV2's 50-odd layers, float32 Keras and float32
    onnxruntime each drift 5e-6..8e-6 from the float64 answer (onnxruntime up to 1.04e-5 on an
    AVX2-only CPU, whose kernels sum in another order), so they differ from each other by up to
    1.2e-5 (measured); the converted model must be as close to the exact answer as Keras is: within
    twice Keras's own drift, and within ten times RTOL however far Keras drifts."""
    import keras

    model, info = frontends.load(mobilenet_keras, tmp_path)
    _check_converted(model, info, "keras")
    assert _dims(model.graph.input[0]) == [1, 96, 96, 3]
    reference = keras.models.load_model(mobilenet_keras, compile=False)
    exact = _float64_copy(reference)
    name = model.graph.input[0].name
    onnx_errors, keras_errors = [], []
    for x in _images(3, shape=(96, 96, 3)):
        y64 = exact(x.astype(np.float64)).numpy()
        onnx_errors.append(relative_error(run_onnx(model, {name: x})[0], y64))
        keras_errors.append(relative_error(reference(x).numpy(), y64))
    assert max(onnx_errors) <= 2 * max(keras_errors), (onnx_errors, keras_errors)
    assert max(onnx_errors) <= 10 * RTOL, (onnx_errors, keras_errors)


def test_savedmodel_matches_its_serving_signature(conv_net_files, tmp_path):
    import tensorflow as tf

    model, info = frontends.load(conv_net_files["savedmodel"], tmp_path)
    _check_converted(model, info, "savedmodel")
    assert info["notes"] == []  # model.export's twin signatures serve / serving_default are not worth a warning
    assert [i.name for i in model.graph.input] == ["image"] and [o.name for o in model.graph.output] == ["output_0"]
    # weights past 1024 values, which tf2onnx's large-model path keeps apart from the graph, came back
    assert any(np.prod(t.dims) > 1024 for t in model.graph.initializer)
    signature = tf.saved_model.load(str(conv_net_files["savedmodel"])).signatures["serving_default"]
    errors = [relative_error(run_onnx(model, {"image": x})[0], signature(image=tf.constant(x))["output_0"].numpy())
              for x in _images(8)]
    assert max(errors) <= RTOL, errors


def test_batch_is_fixed_before_conversion(conv_net_files, tmp_path):
    """--batch 3: a static input, no Shape arithmetic left behind, same numbers."""
    import keras

    model, _ = frontends.load(conv_net_files["keras"], tmp_path, batch=3)
    assert _dims(model.graph.input[0]) == [3, 16, 16, 3]
    assert not {"Shape", "Gather", "Concat"} & {n.op_type for n in model.graph.node}
    x = _images(3).reshape((3,) + tf_models.IMAGE)
    reference = keras.models.load_model(conv_net_files["keras"], compile=False)
    assert relative_error(run_onnx(model, {"image": x})[0], reference(x).numpy()) <= RTOL


@pytest.fixture(scope="module")
def dynamic_keras(tmp_path_factory):
    """A fully convolutional Keras model with unknown height and width."""
    import keras

    keras.utils.set_random_seed(1)
    image = keras.Input((None, None, 3), name="image")
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(image)
    x = keras.layers.GlobalAveragePooling2D()(x)
    model = keras.Model(image, keras.layers.Dense(2, name="score")(x))
    path = tmp_path_factory.mktemp("dynamic") / "dynamic.keras"
    model.save(path)
    return path


def test_input_shapes_fix_the_other_dynamic_dims(dynamic_keras, tmp_path):
    import keras

    model, _ = frontends.load(dynamic_keras, tmp_path, input_shapes={"image": (1, 24, 20, 3)})
    assert _dims(model.graph.input[0]) == [1, 24, 20, 3]
    x = np.random.default_rng(2).uniform(-1, 1, (1, 24, 20, 3)).astype(np.float32)
    reference = keras.models.load_model(dynamic_keras, compile=False)
    assert relative_error(run_onnx(model, {"image": x})[0], reference(x).numpy()) <= RTOL


def test_keras_grouped_convolution_is_one_conv_with_its_groups(tmp_path):
    """Keras 3 runs a grouped Conv2D (ConvNeXt's depthwise 7x7 is one: groups = channels) as an XLA
    function, which tf2onnx left a PartitionedCall it cannot convert: traced inline, it is one Conv."""
    import keras

    keras.utils.set_random_seed(3)
    image = keras.Input((12, 12, 8), name="image")
    x = keras.layers.Conv2D(8, 7, padding="same", groups=8, name="depthwise")(image)
    x = keras.layers.Conv2D(16, 3, groups=4, name="grouped")(x)
    path = tmp_path / "grouped.keras"
    keras.Model(image, keras.layers.GlobalAveragePooling2D()(x)).save(path)

    model, _ = frontends.load(path, tmp_path / "out")
    groups = sorted(next(a.i for a in n.attribute if a.name == "group") for n in model.graph.node
                    if n.op_type == "Conv")
    assert groups == [4, 8], groups
    x = np.random.default_rng(4).uniform(-1, 1, (1, 12, 12, 8)).astype(np.float32)
    reference = keras.models.load_model(path, compile=False)
    assert relative_error(run_onnx(model, {"image": x})[0], reference(x).numpy()) <= RTOL


def test_input_shape_contradicting_the_model_is_a_usage_error(conv_net_files, tmp_path):
    with pytest.raises(UsageError) as e:
        frontends.load(conv_net_files["keras"], tmp_path, input_shapes={"image": (1, 32, 16, 3)})
    assert e.value.code == "import.dynamic-shape"
    assert e.value.notes == ["input 'image': dimension 1 is 16 in the model, --input-shape says 32"]


def _interpreter(path):
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(str(path))
    interpreter.allocate_tensors()
    return interpreter


def _interpreter_outputs(path, inputs) -> list[np.ndarray]:
    interpreter = _interpreter(path)
    (given,), (wanted,) = interpreter.get_input_details(), interpreter.get_output_details()
    outputs = []
    for x in inputs:
        interpreter.set_tensor(given["index"], x)
        interpreter.invoke()
        outputs.append(interpreter.get_tensor(wanted["index"]).copy())
    return outputs


@pytest.mark.parametrize("variant", ["float32", "float16"])
def test_tflite_float_matches_the_interpreter(conv_net_files, tmp_path, variant):
    model, info = frontends.load(conv_net_files[variant], tmp_path)
    _check_converted(model, info, "tflite")
    # the signature's names, not the flatbuffer's tensor names (serving_default_image:0 ...)
    assert [i.name for i in model.graph.input] == ["image"] and [o.name for o in model.graph.output] == ["output_0"]
    inputs = list(_images(8))
    expected = _interpreter_outputs(conv_net_files[variant], inputs)
    errors = [relative_error(run_onnx(model, {"image": x})[0], e) for x, e in zip(inputs, expected)]
    assert max(errors) <= RTOL, errors


def test_float16_fixture_holds_fp16_weights_and_dequantize(conv_net_files):
    """What the float16 test claims to cover: fp16 weight tensors that DEQUANTIZE ops widen."""
    interpreter = _interpreter(conv_net_files["float16"])
    assert sum(d["dtype"] == np.float16 for d in interpreter.get_tensor_details()) >= 4
    assert "DEQUANTIZE" in {op["op_name"] for op in interpreter._get_ops_details()}


@pytest.mark.parametrize("variant, per_channel", [("int8-per-channel", True), ("int8-per-tensor", False)])
def test_tflite_int8_within_one_step_of_the_interpreter(conv_net_files, tmp_path, variant, per_channel):
    model, _ = frontends.load(conv_net_files[variant], tmp_path)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    scale_sizes = [inits[n.input[1]].size for n in model.graph.node
                   if n.op_type == "DequantizeLinear" and n.input[1] in inits]
    assert (max(scale_sizes) > 1) == per_channel, scale_sizes  # the fixture is what it says

    rng = np.random.default_rng(3)
    floats = [rng.uniform(-1, 1, (1,) + tf_models.IMAGE).astype(np.float32) for _ in range(200)]
    scale, zero = _interpreter(conv_net_files[variant]).get_input_details()[0]["quantization"]
    inputs = [np.clip(np.round(x / scale) + zero, -128, 127).astype(np.int8) for x in floats]
    expected = _interpreter_outputs(conv_net_files[variant], inputs)
    got = [run_onnx(model, {"image": x})[0] for x in inputs]
    assert got[0].dtype == np.int8
    steps = np.abs(np.stack(got).astype(np.int32) - np.stack(expected).astype(np.int32))
    assert steps.max() <= 1
    assert (steps == 0).mean() >= 0.99, f"exact {(steps == 0).mean():.4f} of {steps.size} outputs"


def test_a_full_int8_tflite_legalized_for_the_edge_tpu_is_float_between_its_int8_input_and_output(
        conv_net_files, tmp_path):
    """Coral's own format, through tf2onnx: every weight an int8 constant behind a DequantizeLinear (which
    kept every Conv off the Edge TPU: its weight was no constant) and every activation a Q/DQ pair. After
    float-of-quantized only the input's DequantizeLinear and the output's QuantizeLinear are left, every
    Conv has a float weight, and the int8 output stays within a few steps of the interpreter's (the
    dropped roundings, half a step each, add up through the layers; measured at most 3)."""
    from edgesdk.legalization import exact

    model, _ = frontends.load(conv_net_files["int8-per-channel"], tmp_path)
    out, counts = exact.apply(model, only=["float-of-quantized"])
    assert counts["float-of-quantized"] > 0
    quant = Counter(n.op_type for n in out.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear"))
    assert quant == {"DequantizeLinear": 1, "QuantizeLinear": 1}, quant
    inits = {i.name for i in out.graph.initializer}
    assert all(n.input[1] in inits for n in out.graph.node if n.op_type == "Conv")
    rng = np.random.default_rng(4)
    scale, zero = _interpreter(conv_net_files["int8-per-channel"]).get_input_details()[0]["quantization"]
    inputs = [np.clip(np.round(rng.uniform(-1, 1, (1,) + tf_models.IMAGE) / scale) + zero, -128, 127)
              .astype(np.int8) for _ in range(50)]
    expected = np.stack(_interpreter_outputs(conv_net_files["int8-per-channel"], inputs)).astype(np.int32)
    got = np.stack([run_onnx(out, {"image": x})[0] for x in inputs]).astype(np.int32)
    assert np.abs(got - expected).max() <= 4, np.abs(got - expected).max()


@pytest.mark.parametrize("own_grids", [True, False])
def test_a_full_int8_tflite_quantized_again_on_its_own_grids_answers_as_it_does(conv_net_files, tmp_path, own_grids):
    """float-of-quantized keeps each removed pair's grid (and the int8 input's and output's), and the
    compress stage's converter given them writes int8 that answers as the original file does, bit for bit:
    every activation on the model's own scale and zero point (weights are per-channel max-abs in both). Without
    them the ranges are calibrated again on the samples, and the answers move (a deep model's by much: a
    MobileNetV2 read another class on 3 of 8 photos)."""
    from edgesdk.backends.tflite.convert import convert_int8
    from edgesdk.legalization import exact
    from edgesdk.ir.grids import grids
    from edgesdk.runtime.backends import tflite_runner
    from edgesdk.runtime.manifest import Segment

    source = conv_net_files["int8-per-channel"]
    model, _ = frontends.load(source, tmp_path)
    out, _ = exact.apply(model, only=["float-of-quantized"])
    kept = grids(out)
    dq = next(n for n in out.graph.node if n.op_type == "DequantizeLinear")
    q = next(n for n in out.graph.node if n.op_type == "QuantizeLinear")
    assert {dq.output[0], q.input[0]} <= set(kept) and len(kept) >= 4, sorted(kept)
    onnx.save(out, tmp_path / "legalized.onnx")
    onnx.utils.extract_model(str(tmp_path / "legalized.onnx"), str(tmp_path / "front.onnx"), ["image"], [dq.output[0]])
    onnx.utils.extract_model(str(tmp_path / "legalized.onnx"), str(tmp_path / "float.onnx"), [dq.output[0]], [q.input[0]])
    scale, zero = _interpreter(source).get_input_details()[0]["quantization"]
    rng = np.random.default_rng(5)
    inputs = [np.clip(np.round(rng.uniform(-1, 1, (1,) + tf_models.IMAGE) / scale) + zero, -128, 127)
              .astype(np.int8) for _ in range(24)]
    front = onnx.load(tmp_path / "front.onnx")
    feeds = [{dq.output[0]: run_onnx(front, {"image": x})[0]} for x in inputs]
    segment = onnx.load(tmp_path / "float.onnx")
    for d, n in zip(segment.graph.input[0].type.tensor_type.shape.dim, feeds[0][dq.output[0]].shape):
        d.dim_value = n  # static, as the schedule stage's segments are
    result = convert_int8(segment, feeds[:16], tmp_path / "s.tflite", method="minmax",
                          grids=kept if own_grids else None)
    runner = tflite_runner.open_runner(tmp_path, Segment(id="s", device="cpu", backend="tflite", artifact="s.tflite",
                                                         fallback_artifact="s.tflite", inputs=result.inputs,
                                                         outputs=result.outputs), None)
    (o_scale, o_zero) = _interpreter(source).get_output_details()[0]["quantization"]
    expected = (np.stack(_interpreter_outputs(source, inputs)).astype(np.float64) - o_zero) * o_scale
    got = np.stack([runner.run(f)[q.input[0]] for f in feeds]).astype(np.float64)
    steps = np.abs(got - expected) / o_scale
    if own_grids:
        assert result.ranges["model_grids"]["tensors"] >= 4
        assert steps.max() < 1e-3, f"{(steps > 1e-3).sum()} of {steps.size} outputs off, at most {steps.max():.2f} steps"
    else:
        assert "model_grids" not in result.ranges
        assert steps.max() >= 1, "re-calibrated ranges happened to be the model's own: the test shows nothing"


def test_a_quantized_tflite_is_judged_against_litert_running_the_file(conv_net_files, tmp_path):
    """The accuracy gate's reference for a quantized TFLite model is LiteRT running the file, by its signature
    (onnxruntime's kernels for the converted QDQ graph round differently: a MobileNetV2's answer moved by a
    cosine of 0.16 on one photo); a sample its signature does not take (an input reshaped at import) falls
    back to onnxruntime (None here)."""
    from edgesdk.backends.tflite.own import outputs as litert_outputs

    source = conv_net_files["int8-per-channel"]
    scale, zero = _interpreter(source).get_input_details()[0]["quantization"]
    rng = np.random.default_rng(6)
    inputs = [np.clip(np.round(rng.uniform(-1, 1, (1,) + tf_models.IMAGE) / scale) + zero, -128, 127)
              .astype(np.int8) for _ in range(4)]
    got = litert_outputs(source, [{"image": x} for x in inputs], ["output_0"])
    assert got is not None
    for g, want in zip(got, _interpreter_outputs(source, inputs)):
        assert g["output_0"].dtype == np.int8 and np.array_equal(g["output_0"], want)
    assert litert_outputs(source, [{"image": inputs[0].astype(np.float32)}], ["output_0"]) is None
    assert litert_outputs(source, [{"image": inputs[0][:, :-1]}], ["output_0"]) is None
    assert litert_outputs(source, [{"image": inputs[0]}], ["not_an_output"]) is None


def test_conversion_is_deterministic(conv_net_files, tmp_path):
    """Same file, same bytes. Without `tf2onnx_patches._number_nodes`, tf2onnx merged duplicate Q/DQ
    constants and nodes in address order: 3 runs of this file gave 3 different graphs."""
    first, _ = frontends.load(conv_net_files["int8-per-tensor"], tmp_path / "a")
    second, _ = frontends.load(conv_net_files["int8-per-tensor"], tmp_path / "b")
    assert first.SerializeToString() == second.SerializeToString()


def test_unsupported_tf_ops_are_reported_together(unsupported_files, tmp_path):
    with pytest.raises(UserError) as e:
        frontends.load(unsupported_files["savedmodel"], tmp_path)
    assert e.value.code == "import.unsupported-op" and "3 node(s)" in e.value.message
    assert sorted(e.value.notes) == [
        "TensorFlow op BesselI0e at node 'bessel_i0e/BesselI0e' has no ONNX conversion in tf2onnx",
        "TensorFlow op Igamma at node 'Igamma' has no ONNX conversion in tf2onnx",
        "TensorFlow op Zeta at node 'Zeta' has no ONNX conversion in tf2onnx",
    ]


def test_tflite_custom_ops_are_reported_together(unsupported_files, tmp_path):
    with pytest.raises(UserError) as e:
        frontends.load(unsupported_files["tflite"], tmp_path)
    assert e.value.code == "import.unsupported-op" and "3 node(s)" in e.value.message
    assert sorted(e.value.notes) == [
        "TFLite custom op 'BesselI0e' at tensor 'bessel_i0e/BesselI0e'",
        "TFLite custom op 'Igamma' at tensor 'Igamma'",
        "TFLite custom op 'Zeta' at tensor 'Zeta'",
    ]


def test_stateful_tflite_is_refused_naming_the_state_ops(unsupported_files, tmp_path):
    """Resource variables: refused before tf2onnx (which fails with an IndexError), each state op
    and the subgraph it sits in named."""
    path = unsupported_files["stateful"]
    with pytest.raises(UserError) as e:
        frontends.load(path, tmp_path)
    assert e.value.code == "import.tflite-stateful"
    assert e.value.message == (f"{path}: the TFLite model keeps state in resource variables: ops VAR_HANDLE, "
                               "READ_VARIABLE, ASSIGN_VARIABLE, CALL_ONCE in 2 of its 2 subgraph(s); edgesdk "
                               "converts stateless models only")
    assert e.value.notes == ["subgraph 0 'main': VAR_HANDLE x1, READ_VARIABLE x2, ASSIGN_VARIABLE x1, CALL_ONCE x1",
                             "subgraph 1 'NoOp': VAR_HANDLE x1, ASSIGN_VARIABLE x1"]
    assert "without state" in e.value.hint and "as an input" in e.value.hint


def test_stateful_tflite_through_the_cli_exits_1_and_leaves_nothing(unsupported_files, tmp_path):
    import os
    import subprocess

    from tests.model_zoo import ROOT

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "edgesdk.cli", "build", str(unsupported_files["stateful"]),
                           "--target", "x86", "-o", str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "sdk")})
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    assert "keeps state in resource variables" in errors[0] and "VAR_HANDLE" in errors[0], proc.stderr
    assert any(line.startswith("hint: export the model without state") for line in lines), proc.stderr
    assert "Traceback" not in proc.stderr and "IndexError" not in proc.stderr
    assert not out.exists()


def test_savedmodel_with_several_signatures_and_no_default(unsupported_files, tmp_path):
    with pytest.raises(UserError) as e:
        frontends.load(unsupported_files["two-signatures"], tmp_path)
    assert e.value.code == "import.savedmodel-signature" and "none is serving_default" in e.value.message
    assert e.value.notes == ["signature 'double'", "signature 'half'"]


def test_mediapipe_convolution2d_transpose_bias_is_converted(transpose_conv_files, tmp_path):
    """The custom op (SAME and VALID padding) against TFLite's builtin TRANSPOSE_CONV + bias on
    the interpreter: the same weights, so the same function."""
    custom, builtin = transpose_conv_files
    model, info = frontends.load(custom, tmp_path, batch=2)
    assert info["notes"] == [
        "TFLite custom op Convolution2DTransposeBias (2 node(s)) converted by edgesdk as ConvTranspose + bias",
        "TFLite input 'x' has the static shape 1x8x8x4 in the file: --batch 2 does not apply to it",
    ]
    assert Counter(n.op_type for n in model.graph.node)["ConvTranspose"] == 2

    interpreter = _interpreter(builtin)
    x = np.random.default_rng(4).normal(size=(1, 8, 8, 4)).astype(np.float32)
    interpreter.set_tensor(interpreter.get_input_details()[0]["index"], x)
    interpreter.invoke()
    expected = {d["name"]: interpreter.get_tensor(d["index"]) for d in interpreter.get_output_details()}
    got = dict(zip([o.name for o in model.graph.output], run_onnx(model, {model.graph.input[0].name: x})))
    assert set(got) == set(expected)
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in expected.items()}
    assert sorted(v.shape for v in got.values()) == [(1, 16, 16, 6), (1, 17, 17, 2)]
    for name in got:
        assert relative_error(got[name], expected[name]) <= RTOL, name


def test_converter_exception_is_one_line_of_convert_failed(conv_net_files, tmp_path, capfd):
    """A tensor name that is not UTF-8: the flatbuffer reads, tf2onnx raises while converting."""
    from tensorflow.lite.tools import flatbuffer_utils

    flatbuffer = flatbuffer_utils.read_model(str(conv_net_files["float32"]))
    graph = flatbuffer.subgraphs[0]
    graph.tensors[graph.operators[1].outputs[0]].name = b"conv\xff\xfe"
    broken = tmp_path / "bad_name.tflite"
    flatbuffer_utils.write_model(flatbuffer, str(broken))
    with pytest.raises(UserError) as e:
        frontends.load(broken, tmp_path / "work")
    assert e.value.code == "import.convert-failed"
    assert e.value.message == (f"{broken}: tf2onnx failed to convert it: UnicodeDecodeError: 'utf-8' codec can't "
                               "decode byte 0xff in position 4: invalid start byte")
    assert "Traceback" not in "".join(capfd.readouterr())


def test_bad_keras_file_is_a_bad_file_error_without_traceback(conv_net_files, tmp_path, capfd):
    """A .keras whose config names a layer class Keras does not know: the child's exception
    becomes one line of message, and nothing reaches the terminal."""
    import zipfile

    broken = tmp_path / "broken.keras"
    with zipfile.ZipFile(conv_net_files["keras"]) as src, zipfile.ZipFile(broken, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename == "config.json":
                data = data.replace(b'"Conv2D"', b'"NoSuchLayer"')
            dst.writestr(item, data)
    with pytest.raises(UserError) as e:
        frontends.load(broken, tmp_path / "work")
    assert e.value.code == "import.bad-file" and str(broken) in e.value.message
    assert "cannot be read as a Keras 3 .keras archive" in e.value.message and "\n" not in e.value.message
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "NoSuchLayer" not in out + err


# The parent's handling of a child that dies, hangs, or answers with an error: fake children
# (no TensorFlow), so these run in well under a second each.
FAKE_CHILDREN = {
    "segfault": "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)",
    "abort": "import faulthandler, os; faulthandler.enable(); os.abort()",
    "exit-without-result": "print('Traceback (most recent call last): boom'); raise SystemExit(3)",
    "hang": "import time; time.sleep(60)",
}


@pytest.fixture
def fake_child(monkeypatch):
    def use(name):
        monkeypatch.setattr(conversion, "child_command", lambda request: [sys.executable, "-c", FAKE_CHILDREN[name]])
    return use


@pytest.mark.parametrize("name, says", [
    ("segfault", "was killed by signal SIGSEGV"),
    ("abort", "was killed by signal SIGABRT"),
    ("exit-without-result", "exited with status 3 without a result"),
])
def test_child_that_dies_is_a_user_error_naming_file_and_signal(conv_net_files, tmp_path, fake_child, capfd, name, says):
    fake_child(name)
    with pytest.raises(UserError) as e:
        frontends.load(conv_net_files["float32"], tmp_path)
    assert e.value.code == "import.converter-crashed"
    assert e.value.message == f"{conv_net_files['float32']}: the TFLite converter {says} while reading the file"
    assert "may be damaged" in e.value.hint
    if name == "abort":  # faulthandler's frame in the log becomes a note
        assert e.value.notes and e.value.notes[-1].startswith("the converter crashed in <module>")
    assert "Traceback" not in "".join(capfd.readouterr())


def test_child_that_hangs_is_killed_after_the_timeout(conv_net_files, tmp_path, fake_child, monkeypatch):
    import time

    fake_child("hang")
    monkeypatch.setattr(conversion, "TIMEOUT_S", 1)
    t0 = time.perf_counter()
    with pytest.raises(UserError) as e:
        frontends.load(conv_net_files["h5"], tmp_path)
    assert e.value.code == "import.convert-timeout" and "longer than 1 s" in e.value.message
    assert time.perf_counter() - t0 < 10


def test_the_converter_reports_its_progress_and_peak_memory(conv_net_files, tmp_path, monkeypatch):
    """While the converter runs, a line every PROGRESS_EVERY_S with its elapsed time and memory; its peak
    resident memory comes back in the import info (the import record's `converter_peak_rss`)."""
    import re

    monkeypatch.setattr(conversion, "PROGRESS_EVERY_S", 0.5)
    lines: list[str] = []
    model, info = frontends.load(conv_net_files["keras"], tmp_path, log=lines.append)
    assert model.graph.node
    assert info["converter_peak_rss"] > 100 * 2**20, info  # TensorFlow and Keras alone hold more
    assert lines, "no progress line in a conversion of several seconds"
    for line in lines:
        assert re.fullmatch(r"import: converting a Keras 3 \.keras archive: \d+ s, the converter holds "
                            r"\d+(\.\d+ GiB| MiB)", line), line


def test_a_converter_that_would_exhaust_memory_is_stopped(conv_net_files, tmp_path, monkeypatch):
    """Available memory under the floor stops the converter (its process group killed, nothing of it
    left running) with an error naming what it held, before the kernel's OOM killer would pick a process.
    A floor above any machine's memory makes the first sample trip it."""
    monkeypatch.setenv("EDGESDK_MEMORY_FLOOR_MB", str(2**30))
    with pytest.raises(UserError) as e:
        frontends.load(conv_net_files["keras"], tmp_path / "work")
    assert e.value.code == "import.out-of-memory", e.value
    assert "was stopped before this machine ran out of memory: the converter held" in e.value.message
    assert "build on a machine with more memory" in e.value.hint
    request = str(tmp_path / "work")
    running = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if request in cmdline.read_bytes().decode(errors="replace"):
                running.append(cmdline.parent.name)
        except OSError:
            pass  # a process that ended while we looked
    assert not running, f"converter processes left running: {running}"

    monkeypatch.setenv("EDGESDK_MEMORY_FLOOR_MB", "lots")
    with pytest.raises(UsageError, match="EDGESDK_MEMORY_FLOOR_MB='lots' is not a number of MiB"):
        frontends.load(conv_net_files["keras"], tmp_path / "work")


def test_keras_weights_stay_out_of_tensorflows_graph(conv_net_files, tmp_path):
    """The Keras converter traces the model with its weights as inputs (`keras_file._keras_weights_apart`).
    A 64 MiB dense layer: the converter's peak above a tiny model's was ~47 copies of the weights when
    tf2onnx froze them into TensorFlow's graph (3.6 GB, measured on the build host), ~6 now; under 10
    passes. Its output equals Keras's, and the weights sit in the external data file beside the
    converted model, under their Keras names."""
    import keras

    x_in = keras.Input((4096,), name="x")
    big = keras.Model(x_in, keras.layers.Dense(4096, name="wide")(x_in))
    path = tmp_path / "wide.keras"
    big.save(path)
    weight_bytes = 4096 * 4097 * 4
    _, tiny = frontends.load(conv_net_files["keras"], tmp_path / "tiny")
    model, info = frontends.load(path, tmp_path / "wide")
    grown = info["converter_peak_rss"] - tiny["converter_peak_rss"]
    assert grown < 10 * weight_bytes, (grown / weight_bytes, info["converter_peak_rss"], tiny["converter_peak_rss"])
    x = np.random.default_rng(0).uniform(-1, 1, (1, 4096)).astype(np.float32)
    assert relative_error(run_onnx(model, {model.graph.input[0].name: x})[0], big(x).numpy()) <= RTOL
    names = {t.name for t in model.graph.initializer}
    assert {"wide/kernel", "wide/bias"} <= names, names
    assert (tmp_path / "wide" / "keras-converted.onnx.data").stat().st_size == weight_bytes


def test_tensors_a_layer_made_when_built_are_constants_not_inputs(tmp_path):
    """keras.applications' EfficientNets normalize their input with `Normalization(mean=..., variance=...)`,
    whose mean and variance are tensors the layer made when built, not variables: the traced graph captured
    them, and tf2onnx left each a graph input ('normalization_1/Sub/y:0'), so the model asked its user to
    feed ImageNet's statistics (every build refused: no calibration array for them). They are constants,
    the model has its one image input, and answers as Keras does."""
    import keras

    keras.utils.set_random_seed(0)
    image = keras.Input((16, 16, 3), name="image", batch_size=1)
    x = keras.layers.Normalization(mean=[0.485, 0.456, 0.406], variance=[0.052, 0.050, 0.051])(image)
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(x)
    net = keras.Model(image, keras.layers.GlobalAveragePooling2D()(x))
    path = tmp_path / "normalized.keras"
    net.save(path)
    model, _ = frontends.load(path, tmp_path / "out")
    assert [i.name for i in model.graph.input] == ["image"]
    x = np.random.default_rng(0).uniform(0, 1, (1, 16, 16, 3)).astype(np.float32)
    want = keras.models.load_model(path, compile=False)(x).numpy()
    assert relative_error(run_onnx(model, {"image": x})[0], want) <= RTOL
