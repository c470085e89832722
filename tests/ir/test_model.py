"""ir/model.py's loading: external-data references that cannot be read are a user error naming the
tensor, never an OSError (found by the fuzzing suite: a location longer than a file name may be)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk.errors import UserError
from edgesdk.ir import model as irm


def _external(tmp_path, location: str):
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    w.data_location = TensorProto.EXTERNAL
    w.ClearField("raw_data")
    w.external_data.add(key="location", value=location)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [w])
    path = tmp_path / "m.onnx"
    path.write_bytes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    return path


@pytest.mark.parametrize("location, needle", [
    ("x" * 300, "cannot be read (File name too long)"),
    ("missing.data", "is missing"),
])
def test_unreadable_external_data_names_the_tensor(tmp_path, location, needle):
    with pytest.raises(UserError) as e:
        irm.load(_external(tmp_path, location))
    assert e.value.code == "import.external-data"
    assert any(n.startswith("tensor 'w': ") and needle in n for n in e.value.notes), e.value.notes
