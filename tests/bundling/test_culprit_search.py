"""The accuracy remedy's culprit search (bundling/gate.py `search`) where a segment starts at a tensor legalize
made: the imported fp32 model has no such tensor, and onnxruntime refused it as an output ('Graph output
(val_428) does not exist in the graph': an internal error of a ViT's arm_2tpu build in its second round)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
from onnx import TensorProto, helper

from edgesdk.bundling import gate


def _model(nodes, outputs) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, 4))],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def test_a_segment_input_only_the_planned_model_has_is_computed_from_it(tmp_path):
    reference = _model([helper.make_node("Relu", ["x"], ["y"])], ["y"])
    # as legalize leaves it: the same function, by a tensor of its own making
    planned = _model([helper.make_node("Relu", ["x"], ["made_by_legalize"]),
                      helper.make_node("Identity", ["made_by_legalize"], ["y"])], ["y"])
    onnx.save(planned, tmp_path / "model.onnx")
    (tmp_path / "segments").mkdir()
    seg_graph = helper.make_graph([helper.make_node("Identity", ["made_by_legalize"], ["y"])], "s1",
                                  [helper.make_tensor_value_info("made_by_legalize", TensorProto.FLOAT, (1, 4))],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, (1, 4))])
    onnx.save(helper.make_model(seg_graph, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "segments" / "s1.onnx")
    segment = SimpleNamespace(id="s1", inputs=("made_by_legalize",), nodes=("n",), artifact="segments/s1.onnx",
                              backend="tflite")
    said = []
    samples = [{"x": np.array([[-1.0, 0.5, 2.0, -3.0]], np.float32)}]
    found = gate.search([gate.Searched(segment, {}, tmp_path / "s1.tflite")], tmp_path, reference, samples, [],
                        said.append)
    assert found == []  # the segment's int8 model is not there: its comparison fails, and is said so
    assert not any("could not be computed in float" in line for line in said), said
    assert any("s1 could not be compared layer by layer" in line for line in said), said


def test_a_loss_spread_over_many_layers_still_names_those_adding_the_most(tmp_path, monkeypatch):
    """No layer adds 2 % of its range, together they miss the gate (a MobileNetV2 at cosine 0.973 < 0.98): the
    search names the layers that add the most, so that the accuracy remedy has something to keep in float
    (it named none, and the build was refused with every layer on the Edge TPU)."""
    from edgesdk.compression import culprits

    reference = _model([helper.make_node("Relu", ["x"], ["y"])], ["y"])
    onnx.save(reference, tmp_path / "model.onnx")
    (tmp_path / "segments").mkdir()
    onnx.save(reference, tmp_path / "segments" / "s0.onnx")
    small = culprits.Culprit("relu", "s0", "y", "Relu", "RELU", 0.012, 30.0, 0.011, 31.0, "unknown", "")

    def rank(*args, least=culprits.MIN_ADDED, **kwargs):
        return [small] if small.added_error >= least else []

    monkeypatch.setattr(gate.layers, "rank", rank)
    monkeypatch.setattr(gate.backends, "backend", lambda name: SimpleNamespace(int8_layers=lambda job: {}))
    segment = SimpleNamespace(id="s0", inputs=("x",), nodes=("relu",), artifact="segments/s0.onnx", backend="tflite")
    said = []
    found = gate.search([gate.Searched(segment, {}, tmp_path / "s0.tflite")], tmp_path, reference,
                        [{"x": np.ones((1, 4), np.float32)}], [], said.append)
    assert found == [small]
    assert any("the loss is spread over many; the 1 that add the most are named" in line for line in said), said
