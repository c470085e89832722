"""Input shapes as `canonical.fix_input_shapes` fixes them: no dimension past MAX_DIM reaches shape
inference. Found by tests/fuzz: an input dimension of 2^63 - 1 before a Resize that doubles it made
onnx's shape inference abort the process (a failed assertion in its Slice inference, SIGABRT: no error
message at all); --input-shape could give such a dimension too, or one past int64 (ValueError)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from edgesdk.errors import UsageError, UserError
from edgesdk.frontends.canonical import MAX_DIM, fix_input_shapes

PATH = Path("m.onnx")


def _model(dims) -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _dims(model: onnx.ModelProto) -> list[int]:
    return [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]


@pytest.mark.parametrize("dims", [[1, 3, 2**62, 8], [1, 2**31], [2**63 - 1]])
def test_an_input_dimension_past_max_dim_is_refused_before_shape_inference(dims):
    with pytest.raises(UserError) as e:
        fix_input_shapes(_model(dims), {}, 1, PATH)
    assert e.value.code == "import.huge-shape"
    big = next(d for d in dims if d > MAX_DIM)
    assert e.value.notes == [f"input 'x': dimension {dims.index(big)} is {big}"]
    assert f"larger than {MAX_DIM}" in e.value.message and e.value.hint


@pytest.mark.parametrize("given", [(1, 2**31), (1, 2**64)])
def test_an_input_shape_flag_past_max_dim_is_a_usage_error(given):
    with pytest.raises(UsageError) as e:
        fix_input_shapes(_model(["batch", "n"]), {"x": given}, 1, PATH)
    assert e.value.notes == [f"input 'x': --input-shape gives a dimension larger than {MAX_DIM}"]


def test_dimensions_up_to_max_dim_are_kept():
    model = _model([1, MAX_DIM])
    fix_input_shapes(model, {}, 1, PATH)
    assert _dims(model) == [1, MAX_DIM]
    model = _model(["batch", "n"])
    fix_input_shapes(model, {"x": (2, MAX_DIM)}, 1, PATH)
    assert _dims(model) == [2, MAX_DIM]
