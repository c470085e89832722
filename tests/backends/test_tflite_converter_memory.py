"""What TensorFlow's converter holds while it converts a segment: the traced function's
weights are let go before the converter's importer runs, and the converter's steps that rebuild the
whole FlatBuffer as Python objects (buffer deduplication, the calibrator's intermediate tensors) run
only where they would change the model. Each check is against TensorFlow's own behaviour."""

from __future__ import annotations

import weakref

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk.backends import tflite
from edgesdk.backends.tflite import convert, trace
from tests import model_zoo


def _dense(width: int = 256, layers: int = 2, seed: int = 0) -> onnx.ModelProto:
    """Fully connected layers with weights past trace.WEIGHT_BYTES: held as variables by the trace."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        inits.append(numpy_helper.from_array((rng.standard_normal((width, width)) * 0.05).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]))
        nodes.append(helper.make_node("Relu", [f"m{i}"], [f"r{i}"]))
        x = f"r{i}"
    graph = helper.make_graph(nodes, "dense", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _interpreter_out(model: bytes, x: np.ndarray) -> np.ndarray:
    from ai_edge_litert.interpreter import Interpreter

    runner = Interpreter(model_content=model).get_signature_runner()
    key = next(iter(runner.get_input_details()))
    return next(iter(runner(**{key: x}).values()))


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_the_converter_runs_without_the_traced_functions_weights(monkeypatch, int8):
    """When TensorFlow's converter starts, no variable of the trace is alive: the converter's importer
    is the one holder of the weights (before, the module's variables and a loaded-back copy were held
    beside it: 9 bytes per byte of weights instead of 3 to 4)."""
    from tensorflow.lite.python import lite

    model = _dense()
    lowered = trace._lower(model, cpu=True)
    refs = [weakref.ref(v) for v in lowered.module.weights]
    assert len(refs) == 2  # both 256 KiB weights are variables
    alive_at_start = []
    real = lite._convert_saved_model

    def watched(**kwargs):
        alive_at_start.append(sum(r() is not None for r in refs))
        return real(**kwargs)

    monkeypatch.setattr(lite, "_convert_saved_model", watched)
    rng = np.random.default_rng(1)
    samples = [[rng.standard_normal((1, 256)).astype(np.float32)] for _ in range(4)] if int8 else None
    converted = convert._convert(lowered, samples)
    assert alive_at_start == [0]
    assert lowered.function is None and [s.name for s in lowered.inputs] == ["x"]  # the specs stay
    # and it converted what the model computes (the float one against onnxruntime)
    if not int8:
        import onnxruntime as ort

        x = rng.standard_normal((1, 256)).astype(np.float32)
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        got = _interpreter_out(converted, x)
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def _with_equal_weights(model: bytes) -> tuple[bytes, int]:
    """`model` with its second weight buffer overwritten by its first (both 256 x 256 floats, read by a
    tensor each): two equal buffers, as TensorFlow's deduplication finds them. Also the number of
    non-empty buffers."""
    from tensorflow.lite.tools import flatbuffer_utils

    obj = flatbuffer_utils.convert_bytearray_to_object(model)
    weights = [b for b in obj.buffers if b.data is not None and len(b.data) == 256 * 256 * 4]
    assert len(weights) == 2
    weights[1].data = np.array(weights[0].data, copy=True)
    filled = sum(1 for b in obj.buffers if b.data is not None and len(b.data))
    return bytes(flatbuffer_utils.convert_object_to_bytearray(obj)), filled


def test_buffers_are_deduplicated_only_where_two_are_equal(tmp_path):
    """A converted model with no two equal buffers skips TensorFlow's deduplication (the same bytes
    come back); one with two equal buffers gets it, and still computes the same."""
    from tensorflow.lite.python import convert as tf_convert
    from tensorflow.lite.tools import flatbuffer_utils

    tflite.convert_float(_dense(), tmp_path / "dense.tflite", cpu=True)
    model = (tmp_path / "dense.tflite").read_bytes()
    data = [bytes(b.data) for b in flatbuffer_utils.convert_bytearray_to_object(model).buffers if b.data is not None]
    assert len(set(data)) == len(data)  # checked independently: no two equal
    dedup = convert._only_if(convert._has_equal_buffers, tf_convert.deduplicate_readonly_buffers)
    assert not convert._has_equal_buffers(model) and dedup(model) is model

    doubled, filled = _with_equal_weights(model)
    assert convert._has_equal_buffers(doubled)
    merged = dedup(doubled)
    left = [b for b in flatbuffer_utils.convert_bytearray_to_object(merged).buffers
            if b.data is not None and len(b.data)]
    assert len(left) == filled - 1
    x = np.random.default_rng(2).standard_normal((1, 256)).astype(np.float32)
    np.testing.assert_array_equal(_interpreter_out(merged, x), _interpreter_out(doubled, x))


def _tensor_counts(model: bytes) -> list[int]:
    from tensorflow.lite.python import schema_py_generated as schema

    root = schema.Model.GetRootAsModel(model, 0)
    return [root.Subgraphs(i).TensorsLength() for i in range(root.SubgraphsLength())]


def test_the_calibrators_intermediate_tensors_are_added_only_where_an_op_takes_them(tmp_path):
    """TensorFlow's calibrator adds intermediate tensors to LSTM ops only. A lowered MobileNetV2 has none:
    the step is skipped, and TensorFlow's own would have added nothing. A model with an LSTM op (one
    op's code made UNIDIRECTIONAL_SEQUENCE_LSTM: Keras 3's LSTM converts to a WHILE loop) is found."""
    from tensorflow.lite.python import schema_py_generated as schema
    from tensorflow.lite.python.optimize import calibrator
    from tensorflow.lite.tools import flatbuffer_utils

    tflite.convert_float(onnx.load(str(model_zoo.mobilenet_v2(96, 0.35))), tmp_path / "m.tflite", cpu=True)
    ours = (tmp_path / "m.tflite").read_bytes()
    assert not convert._has_ops_with_intermediates(ours)
    assert _tensor_counts(calibrator.add_intermediate_tensors(ours)) == _tensor_counts(ours)
    skipped = convert._only_if(convert._has_ops_with_intermediates, calibrator.add_intermediate_tensors)
    assert skipped(ours) is ours

    obj = flatbuffer_utils.convert_bytearray_to_object(ours)
    obj.operatorCodes[0].builtinCode = obj.operatorCodes[0].deprecatedBuiltinCode = \
        schema.BuiltinOperator.UNIDIRECTIONAL_SEQUENCE_LSTM
    assert convert._has_ops_with_intermediates(bytes(flatbuffer_utils.convert_object_to_bytearray(obj)))
