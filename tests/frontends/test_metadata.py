"""The range a model states for its inputs (frontends/metadata.py, frontends.input_ranges), which synthetic
calibration samples follow: ONNX's image metadata, TFLite Support's metadata in MediaPipe's real models,
and the table an index input indexes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk import frontends
from edgesdk.frontends import metadata
from tests import model_zoo


def _cached(name: str) -> Path:
    path = model_zoo.CACHE / name
    if not path.exists():
        pytest.skip(f"{path} is missing: run `make models`")
    return path


@pytest.mark.parametrize("name, low, high", [("face_detection_short_range.tflite", -1.0, 1.0),
                                             ("selfie_segmentation.tflite", 0.0, 1.0)])
def test_mediapipes_tflite_metadata_states_its_input_range(name, low, high):
    """MediaPipe's face detector takes [-1, 1] and its selfie segmenter [0, 1]: their TFLite metadata says
    so in the input's stats. Matched by the TFLite input's name, or by position where the names differ."""
    path = _cached(name)
    for given in ("input", "input_1", "image"):
        found = metadata.input_ranges(onnx.ModelProto(), path, "tflite",
                                      [{"name": given, "shape": [1, 128, 128, 3], "dtype": "float32"}])
        assert found[given]["low"] == [low] and found[given]["high"] == [high], found
        assert found[given]["source"].startswith("the model's TFLite metadata (stats: min")


def test_tflite_without_readable_metadata_states_nothing(tmp_path):
    """A file whose metadata cannot be read is no range, never an error: the model still builds."""
    damaged = tmp_path / "m.tflite"
    data = bytearray(_cached("face_detection_short_range.tflite").read_bytes())
    at = data.find(b"M001")
    data[at - 4:at + 200] = bytes(204)
    damaged.write_bytes(bytes(data))
    assert metadata.input_ranges(onnx.ModelProto(), damaged, "tflite",
                                 [{"name": "input", "shape": [1, 128, 128, 3], "dtype": "float32"}]) == {}


def _image_model(props: dict[str, str]) -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 8, 8])])
    model = helper.make_model(graph)
    for k, v in props.items():
        model.metadata_props.add(key=k, value=v)
    return model


@pytest.mark.parametrize("stated, low, high", [("Normalized_0_1", 0.0, 1.0), ("NominalRange_0_255", 0.0, 255.0),
                                               ("Normalized_1_1", -1.0, 1.0)])
def test_onnx_image_metadata_states_the_pixel_range(stated, low, high, tmp_path):
    model = _image_model({"Image.NominalPixelRange": stated})
    found = frontends.input_ranges(model, tmp_path / "m.onnx", "onnx",
                                   [{"name": "x", "shape": [1, 3, 8, 8], "dtype": "float32"}])
    assert found == {"x": {"low": [low], "high": [high], "axis": None,
                           "source": f"the model's metadata (Image.NominalPixelRange = {stated})"}}


def test_metadata_that_states_no_range_states_none(tmp_path):
    """Ultralytics' metadata (a YOLOv8 export: imgsz, stride, names) says nothing of the pixel range."""
    model = _image_model({"author": "Ultralytics", "imgsz": "[320, 320]", "Image.NominalPixelRange": "Bogus"})
    assert frontends.input_ranges(model, tmp_path / "m.onnx", "onnx",
                                  [{"name": "x", "shape": [1, 3, 8, 8], "dtype": "float32"}]) == {}


def test_an_index_input_takes_the_rows_of_its_table(tmp_path):
    emb = numpy_helper.from_array(np.zeros((100, 4), np.float32), "emb")
    graph = helper.make_graph([helper.make_node("Gather", ["emb", "ids"], ["y"])], "g",
                              [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 4])], [emb])
    found = frontends.input_ranges(helper.make_model(graph), tmp_path / "m.onnx", "onnx",
                                   [{"name": "ids", "shape": [1, 6], "dtype": "int64"}])
    assert found["ids"]["low"] == [0] and found["ids"]["high"] == [99]
    assert found["ids"]["source"].startswith("the table it indexes (Gather")
