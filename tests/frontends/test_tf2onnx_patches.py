"""Each patch of tf2onnx names the version it was written against (`tf2onnx_patches.written_for`). With
another version installed, applying one fails with `import.converter-version` and patches nothing, and
the converter child reports that as its result, a usage error (the environment, not the model)."""

from __future__ import annotations

import faulthandler
import json
import re
from pathlib import Path

import pytest

from edgesdk.errors import UsageError
from edgesdk.frontends import converter_child, tf2onnx_patches, tf2onnx_steps

PATCHES = {"_number_nodes", "_fresh_protos", "_missing_ops", "_numpy_2", "_constants_stay", "_shapes_without_weights",
           "_constants_made_once", "_values_moved", "weights_stored", "lean_first", "tflite_read_lean"}


def test_every_patch_names_the_version_constraints_pin():
    pinned = re.search(r"^tf2onnx==(\S+)$", (Path(__file__).parents[2] / "constraints.txt").read_text(), re.M)[1]
    named = {name: f.tf2onnx_version for name, f in vars(tf2onnx_patches).items() if hasattr(f, "tf2onnx_version")}
    assert set(named) == PATCHES
    assert set(named.values()) == {pinned}


@pytest.fixture
def other_tf2onnx(monkeypatch):
    _, tf2onnx, _ = tf2onnx_steps.tensorflow()
    monkeypatch.setattr(tf2onnx, "__version__", "1.99.0")
    return tf2onnx


def test_a_patch_refuses_another_tf2onnx_and_patches_nothing(other_tf2onnx):
    class Node:
        def __init__(self):
            pass

    init = Node.__init__
    with pytest.raises(UsageError) as e:
        tf2onnx_patches._number_nodes(Node)
    assert e.value.code == "import.converter-version"
    assert e.value.message == ("tf2onnx 1.99.0 is installed; edgesdk's patch _number_nodes of it was written for "
                               "tf2onnx 1.17.0")
    assert "tf2onnx==1.17.0" in e.value.hint
    assert Node.__init__ is init and "__hash__" not in vars(Node)

    make_model = other_tf2onnx.graph.Graph.make_model
    with pytest.raises(UsageError, match="patch weights_stored"), tf2onnx_patches.weights_stored():
        pass
    assert other_tf2onnx.graph.Graph.make_model is make_model


def test_the_child_reports_another_tf2onnx_as_a_usage_error(other_tf2onnx, tmp_path, monkeypatch):
    monkeypatch.setattr(faulthandler, "enable", lambda: None)  # pytest's own stays in place
    result = tmp_path / "result.json"
    request = {"format": "tflite", "source": str(tmp_path / "model.tflite"), "onnx": str(tmp_path / "model.onnx"),
               "result": str(result), "batch": 1, "opset": 17, "input_shapes": {}}
    (tmp_path / "request.json").write_text(json.dumps(request))
    assert converter_child.main(["converter_child", str(tmp_path / "request.json")]) == 0
    reported = json.loads(result.read_text())
    assert (reported["ok"], reported["kind"], reported["code"]) == (False, "usage", "import.converter-version")
    assert not (tmp_path / "model.onnx").exists()
