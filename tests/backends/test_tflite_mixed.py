"""Mixed-precision int8 for LiteRT CPU segments (backends/tflite/mixed.py): the ops that cost the most
accuracy kept float, found on the calibration samples, replayable, never for the Edge TPU.

The model is made so that full int8 must fail and a known set of ops must stay float: `y = (big + a)
- big`, where `big` is 100x the input's positive part and `a` a small convolution. Quantized whole, the
sum's int8 step (range about 100) is far coarser than `a`, so `a` is lost; with the Add and the Sub
float (and the Sub's consumer, so that its output is not quantized right away: TensorFlow's quantizer
puts a QUANTIZE after a float op unless its consumer is float too), the cancellation is exact.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk.backends import AccuracyTarget
from edgesdk.backends.tflite import mixed
from edgesdk.backends.tflite.convert import convert_int8
from edgesdk.backends.tflite.flatbuffer import op_counts
from edgesdk.errors import UserError
from edgesdk.ir.numeric import fidelity

TARGET = AccuracyTarget(cosine=0.99, top1=0.9)


def cancelling_model() -> onnx.ModelProto:
    """x (1, 4, 8, 8) -> z (1, 4, 8, 8): z = Conv2(((Relu(x) * 100, twice) + Conv1(x)) - (Relu(x) * 100, twice))."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.normal(0, 0.05, (8, 4, 3, 3)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.normal(0, 0.3, (4, 8, 1, 1)).astype(np.float32), "w2")
    k = numpy_helper.from_array(np.array(100, np.float32), "k")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Mul", ["r", "k"], ["big4"], name="scale"),
             helper.make_node("Concat", ["big4", "big4"], ["big"], axis=1, name="twice"),
             helper.make_node("Add", ["big", "a"], ["sum"], name="add"),
             helper.make_node("Sub", ["sum", "big"], ["y"], name="sub"),
             helper.make_node("Conv", ["y", "w2"], ["z"], name="conv2")]
    g = helper.make_graph(nodes, "cancelling", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4, 8, 8])], [w1, w2, k])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m


def _samples(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.uniform(-1, 1, (1, 4, 8, 8)).astype(np.float32)} for _ in range(n)]


def _reference(model: onnx.ModelProto, samples: list[dict]) -> list[dict]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [{"z": session.run(None, s)[0]} for s in samples]


def _outputs(path, samples: list[dict]) -> list[dict]:
    """The .tflite's z on `samples`, dequantized where int8, in ONNX layout (NCHW)."""
    from ai_edge_litert.interpreter import Interpreter

    runner = Interpreter(model_path=str(path)).get_signature_runner()
    (key_in, d_in), = runner.get_input_details().items()
    (key_out, d_out), = runner.get_output_details().items()
    got = []
    for s in samples:
        x = s["x"].transpose(0, 2, 3, 1)
        if d_in["dtype"] == np.int8:
            scale, zero = d_in["quantization"]
            x = np.clip(np.round(x / scale + zero), -128, 127).astype(np.int8)
        y = runner(**{key_in: x})[key_out]
        if d_out["dtype"] == np.int8:
            scale, zero = d_out["quantization"]
            y = (y.astype(np.float32) - zero) * scale
        got.append({"z": y.transpose(0, 3, 1, 2)})
    return got


def test_full_int8_misses_and_mixed_precision_keeps_the_cancelling_ops_float(tmp_path):
    model, calib, new = cancelling_model(), _samples(16, 0), _samples(8, 1)
    lines: list[str] = []
    full = convert_int8(model, calib, tmp_path / "full.tflite")
    assert full.mixed is None and "DEQUANTIZE" not in full.op_counts  # the Edge TPU's path: every op int8
    full_cos, _ = fidelity(_outputs(tmp_path / "full.tflite", new), _reference(model, new))
    assert full_cos["z"] < 0.95, full_cos  # the sum's int8 step swallows `a`

    got = convert_int8(model, calib, tmp_path / "mixed.tflite", target=TARGET, reference=_reference(model, calib),
                       log=lines.append)
    assert got.mixed is not None and got.mixed.searched
    kept = set(got.mixed.float_ops)  # TensorFlow's op names, in the scope of the ONNX node each computes
    assert {"Add", "Sub"} <= {name.rsplit("/", 1)[-1] for name in kept} and len(kept) <= got.mixed.ops // 2, got.mixed
    assert got.mixed.cosine >= TARGET.cosine
    # a mixed model takes and gives float; the float ops sit between a DEQUANTIZE and a QUANTIZE
    assert [t.quant is None for t in (*got.inputs, *got.outputs)] == [True, True]
    assert [t.quant is not None for t in (*full.inputs, *full.outputs)] == [True, True]
    assert op_counts((tmp_path / "mixed.tflite").read_bytes())["DEQUANTIZE"] >= 1
    # the search chose on the calibration samples; on new ones it holds too
    new_cos, _ = fidelity(_outputs(tmp_path / "mixed.tflite", new), _reference(model, new))
    assert new_cos["z"] >= TARGET.cosine, new_cos
    assert lines[0].startswith("full int8 misses the target on the calibration samples (z's cosine similarity 0.")
    assert any(line.strip().startswith(f"{len(kept)} of {got.mixed.ops} ops float: cosine") for line in lines)


def test_the_ops_a_search_kept_float_replay_to_the_same_bytes(tmp_path):
    model, calib = cancelling_model(), _samples(16, 0)
    searched = convert_int8(model, calib, tmp_path / "a.tflite", target=TARGET, reference=_reference(model, calib))
    replayed = convert_int8(model, calib, tmp_path / "b.tflite", keep_float=searched.mixed.float_ops)
    assert (tmp_path / "a.tflite").read_bytes() == (tmp_path / "b.tflite").read_bytes()
    assert replayed.mixed.float_ops == searched.mixed.float_ops and not replayed.mixed.searched
    assert replayed.mixed.record() == {"float_ops": list(searched.mixed.float_ops), "ops": searched.mixed.ops}


def test_a_segment_that_full_int8_serves_is_not_searched(tmp_path):
    """Where full int8 meets the target on the calibration samples no op is ranked or kept float."""
    model, calib = cancelling_model(), _samples(16, 0)
    lines: list[str] = []
    loose = AccuracyTarget(cosine=0.5, top1=0.0)
    got = convert_int8(model, calib, tmp_path / "m.tflite", target=loose, reference=_reference(model, calib),
                       log=lines.append)
    assert got.mixed.float_ops == () and lines == []
    convert_int8(model, calib, tmp_path / "f.tflite")
    assert (tmp_path / "m.tflite").read_bytes() == (tmp_path / "f.tflite").read_bytes()


def test_the_searchs_progress_reaches_stderr_while_the_converters_own_noise_does_not(tmp_path, capfd):
    """A build logs to stderr, where the converter also writes (`fully_quantize: ...`) from native code:
    only the converter's output is held back."""
    import sys

    model, calib = cancelling_model(), _samples(8, 0)
    convert_int8(model, calib, tmp_path / "m.tflite", target=TARGET, reference=_reference(model, calib),
                 log=lambda line: print(line, file=sys.stderr, flush=True))
    err = capfd.readouterr().err
    assert "ranking 7 ops by the error each adds alone" in err and "ops float: cosine" in err
    assert "fully_quantize" not in err


def test_a_target_no_share_of_float_ops_meets_is_a_user_error_saying_how_close_it_came(tmp_path):
    model, calib = cancelling_model(), _samples(8, 0)
    with pytest.raises(UserError) as e:
        convert_int8(model, calib, tmp_path / "m.tflite", target=AccuracyTarget(cosine=1.01, top1=0.9),
                     reference=_reference(model, calib))
    assert e.value.code == "tune.mixed-precision"
    assert "mixed precision misses the accuracy target even with 3 of 7 ops float" in str(e.value)
    assert "keep this span fp32" in e.value.hint
    assert not (tmp_path / "m.tflite").exists()  # nothing half-written


def test_op_names_are_the_calibrated_models_ops_in_order(tmp_path):
    from edgesdk.backends.tflite.convert import _calibrate
    from edgesdk.backends.tflite.trace import _lower, _to_tf_layout

    lowered = _lower(cancelling_model())
    calibrated, _, _ = _calibrate(lowered, [_to_tf_layout(lowered, s) for s in _samples(2, 0)], "minmax", 99.99)
    names = [name.rsplit("/", 1)[-1] for name in mixed.op_names(calibrated)]  # each in its ONNX node's scope
    assert len(names) == 7 and names.index("Add") < names.index("Sub")
