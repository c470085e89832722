"""ONNX files: external data, opsets, and every non-standard op reported at once, subgraphs included."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk import frontends
from edgesdk.errors import UserError
from edgesdk.ir import model as irm
from tests.frontends.conftest import run_onnx


def _model(nodes, opset=17, inputs=None, outputs=None, initializer=(), functions=(), extra_opsets=()):
    graph = helper.make_graph(
        nodes, "g",
        inputs or [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        outputs or [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        initializer=list(initializer))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), *extra_opsets],
                              functions=list(functions), producer_name="test")
    model.ir_version = 8
    return model


def _matmul_model(seed=0):
    w = np.random.default_rng(seed).normal(size=(4, 4)).astype(np.float32)
    return _model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
                  initializer=[numpy_helper.from_array(w, "w")]), w


def _load(path, tmp_path):
    return frontends.load(path, tmp_path / "work")


def test_plain_model_loads_with_info(tmp_path):
    model, w = _matmul_model()
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    loaded, info = _load(path, tmp_path)
    assert info["format"] == "onnx" and info["converter"] is None and info["opset"] == 17 and info["notes"] == []
    assert info["seconds"] >= 0 and loaded.producer_name == "test"
    x = np.arange(4, dtype=np.float32)[None]
    np.testing.assert_allclose(run_onnx(loaded, {"x": x})[0], x @ w, rtol=1e-6)  # summation order


def test_external_data_is_loaded(tmp_path):
    model, w = _matmul_model()
    path = tmp_path / "m.onnx"
    onnx.save(model, path, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    assert (tmp_path / "m.onnx.data").stat().st_size == w.nbytes
    loaded, _ = _load(path, tmp_path)
    # mapped where it lies (irm.is_mapped), not copied into the message; its values read through irm.array
    (weight,) = loaded.graph.initializer
    assert irm.is_mapped(weight) and not weight.raw_data
    np.testing.assert_array_equal(irm.array(weight), w)
    x = np.ones((1, 4), np.float32)
    np.testing.assert_allclose(irm.onnxruntime_session(loaded).run(None, {"x": x})[0], x @ w, rtol=1e-6)
    np.testing.assert_allclose(run_onnx(irm.materialize(loaded), {"x": x})[0], x @ w, rtol=1e-6)


def test_missing_external_data_names_the_file(tmp_path):
    model, _ = _matmul_model()
    path = tmp_path / "m.onnx"
    onnx.save(model, path, save_as_external_data=True, location="weights.bin", size_threshold=0)
    (tmp_path / "weights.bin").unlink()
    with pytest.raises(UserError) as e:
        _load(path, tmp_path)
    assert e.value.code == "import.external-data" and str(path) in e.value.message
    assert e.value.notes == [f"tensor 'w': {tmp_path / 'weights.bin'} is missing"]


def test_truncated_external_data_says_how_short(tmp_path):
    model, _ = _matmul_model()
    path = tmp_path / "m.onnx"
    onnx.save(model, path, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    data = tmp_path / "m.onnx.data"
    data.write_bytes(data.read_bytes()[:40])
    with pytest.raises(UserError) as e:
        _load(path, tmp_path)
    assert e.value.code == "import.external-data"
    assert e.value.notes == ["tensor 'w': m.onnx.data holds 40 bytes, the tensor needs bytes 0..64"]


def test_external_data_longer_than_its_tensor_is_refused(tmp_path):
    """No length given, and the file holds more than the tensor's type and shape need (found by `make
    fuzz`: onnx's checker took the extra bytes, and import wrote a malformed weight on)."""
    model, w = _matmul_model()
    (weight,) = model.graph.initializer
    weight.ClearField("raw_data")
    weight.ClearField("float_data")
    weight.data_location = TensorProto.EXTERNAL
    weight.external_data.add(key="location", value="w.bin")
    (tmp_path / "w.bin").write_bytes(w.tobytes() + bytes(8))
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    with pytest.raises(UserError) as e:
        _load(path, tmp_path)
    assert e.value.code == "import.invalid-model"
    assert f"tensor 'w': its external data holds {w.nbytes + 8} bytes, its type and shape need {w.nbytes}" in e.value.message


@pytest.mark.parametrize("extra", [13, 1 << 20])
def test_raw_data_longer_than_its_tensor_is_refused(tmp_path, extra):
    """onnx's checker refuses raw data too short for a tensor's shape, not too long: 13 bytes more went on to
    onnxruntime, which refused the model deep in the tune stage, and a MiB more (counted a weight by its
    size) to a reshape: internal errors both (exit 3)."""
    model, w = _matmul_model()
    model.graph.initializer[0].raw_data = w.tobytes() + bytes(extra)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    with pytest.raises(UserError) as e:
        _load(path, tmp_path)
    assert e.value.code == "import.invalid-model"
    assert f"tensor 'w': its raw data holds {w.nbytes + extra} bytes, its type and shape need {w.nbytes}" in e.value.message


def test_external_data_outside_the_model_directory_is_refused(tmp_path):
    model, _ = _matmul_model()
    inner = tmp_path / "models"
    inner.mkdir()
    onnx.save(model, inner / "m.onnx", save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    proto = onnx.load(inner / "m.onnx", load_external_data=False)
    for entry in proto.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = "../m.onnx.data"
    (inner / "m.onnx.data").rename(tmp_path / "m.onnx.data")
    onnx.save(proto, inner / "m.onnx")
    with pytest.raises(UserError) as e:
        _load(inner / "m.onnx", tmp_path)
    assert e.value.code == "import.external-data" and "is outside" in e.value.notes[0]


def test_opset_11_is_accepted(tmp_path):
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Clip", ["r", "lo", "hi"], ["y"])]
    init = [numpy_helper.from_array(np.array(0.0, np.float32), "lo"), numpy_helper.from_array(np.array(0.5, np.float32), "hi")]
    path = tmp_path / "m11.onnx"
    onnx.save(_model(nodes, opset=11, initializer=init), path)
    loaded, info = _load(path, tmp_path)
    assert info["opset"] == 11
    x = np.array([[-1, 0.25, 0.75, 2]], np.float32)
    np.testing.assert_array_equal(run_onnx(loaded, {"x": x})[0], np.clip(x, 0, 0.5))


def test_opset_older_than_11_is_refused(tmp_path):
    path = tmp_path / "m9.onnx"
    onnx.save(_model([helper.make_node("Relu", ["x"], ["y"])], opset=9), path)
    with pytest.raises(UserError) as e:
        _load(path, tmp_path)
    assert e.value.code == "import.old-opset" and "opset 9 is older than 11" in e.value.message
    assert "convert_version" in e.value.hint


def _if_with(then_nodes, else_nodes, name="cond_if"):
    out = helper.make_tensor_value_info("b", TensorProto.FLOAT, [1, 4])
    return helper.make_node("If", ["c"], ["y"], name=name,
                            then_branch=helper.make_graph(then_nodes, "then", [], [out]),
                            else_branch=helper.make_graph(else_nodes, "else", [], [out]))


def test_every_nonstandard_op_is_reported_at_once_with_where_it_sits(tmp_path):
    """A custom-domain op in the main graph, one inside an If branch, one inside a Loop body
    inside the other If branch, and a misspelled standard op: one error, four notes (in the order
    the walk meets them: onnx.helper stores If's attributes sorted, else_branch first)."""
    loop_body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Scatter3", ["v_in"], ["v_out"], name="deep", domain="com.vendor")],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [1, 4])])
    then_nodes = [helper.make_node("FancyAct", ["h"], ["b"], name="in_then", domain="com.vendor")]
    else_nodes = [helper.make_node("Loop", ["", "true", "h"], ["b"], name="loop", body=loop_body)]
    nodes = [
        helper.make_node("Rleu", ["x"], ["r"], name="typo"),
        helper.make_node("MyNorm", ["r"], ["h"], name="top", domain="com.vendor"),
        helper.make_node("Constant", [], ["true"], value=helper.make_tensor("t", TensorProto.BOOL, [], [True])),
        _if_with(then_nodes, else_nodes),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4]),
              helper.make_tensor_value_info("c", TensorProto.BOOL, [])]
    path = tmp_path / "custom.onnx"
    onnx.save(_model(nodes, inputs=inputs, extra_opsets=[helper.make_opsetid("com.vendor", 1)]), path)
    with pytest.raises(UserError) as e:
        _load(path, tmp_path)
    assert e.value.code == "import.unsupported-op"
    assert "4 node(s)" in e.value.message and str(path) in e.value.message
    assert e.value.notes == [
        "node 'typo': op Rleu is not a standard ONNX op",
        "node 'top': op com.vendor::MyNorm is not a standard ONNX op (custom domain 'com.vendor')",
        "node 'deep' inside Loop 'loop' body, inside If 'cond_if' else_branch: op com.vendor::Scatter3 is not a standard ONNX op (custom domain 'com.vendor')",
        "node 'in_then' inside If 'cond_if' then_branch: op com.vendor::FancyAct is not a standard ONNX op (custom domain 'com.vendor')",
    ]


def test_op_newer_than_the_models_opset_says_when_onnx_added_it(tmp_path):
    path = tmp_path / "gelu.onnx"
    onnx.save(_model([helper.make_node("Gelu", ["x"], ["y"], name="act")], opset=17), path)
    with pytest.raises(UserError) as e:
        _load(path, tmp_path)
    assert e.value.notes == ["node 'act': op Gelu is not defined at opset 17 (ONNX has it from opset 20)"]


def test_standard_ops_in_subgraphs_and_local_functions_pass(tmp_path):
    """Must not fire: If branches of standard ops, and a call of a model-local function whose body
    is standard (the function's own domain is not an ONNX domain, yet the call is valid)."""
    fn = helper.make_function("local.fn", "Twice", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])],
                              opset_imports=[helper.make_opsetid("", 17)])
    nodes = [helper.make_node("Twice", ["x"], ["h"], domain="local.fn"),
             _if_with([helper.make_node("Relu", ["h"], ["b"])], [helper.make_node("Neg", ["h"], ["b"])])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4]),
              helper.make_tensor_value_info("c", TensorProto.BOOL, [])]
    path = tmp_path / "fn.onnx"
    onnx.save(_model(nodes, inputs=inputs, functions=[fn], extra_opsets=[helper.make_opsetid("local.fn", 1)]), path)
    loaded, _ = _load(path, tmp_path)
    x = np.array([[-1, 2, -3, 4]], np.float32)
    np.testing.assert_array_equal(run_onnx(loaded, {"x": x, "c": np.array(True)})[0], np.maximum(2 * x, 0))
    np.testing.assert_array_equal(run_onnx(loaded, {"x": x, "c": np.array(False)})[0], -2 * x)


def test_custom_op_inside_a_local_function_is_reported(tmp_path):
    fn = helper.make_function("local.fn", "Wrap", ["a"], ["b"],
                              [helper.make_node("Secret", ["a"], ["b"], name="hidden", domain="com.vendor")],
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.vendor", 1)])
    path = tmp_path / "fn.onnx"
    onnx.save(_model([helper.make_node("Wrap", ["x"], ["y"], domain="local.fn")], functions=[fn],
                     extra_opsets=[helper.make_opsetid("local.fn", 1)]), path)
    with pytest.raises(UserError) as e:
        _load(path, tmp_path)
    assert e.value.notes == ["node 'hidden' inside function 'local.fn::Wrap': op com.vendor::Secret is not a standard "
                             "ONNX op (custom domain 'com.vendor')"]


@pytest.mark.parametrize("content, code", [
    (b"this is not a protobuf at all \xff\xff\xff", "import.bad-file"),
    (b"\x08\x08", "import.empty-graph"),
])
def test_bad_bytes(tmp_path, content, code):
    path = tmp_path / "bad.onnx"
    path.write_bytes(content)
    with pytest.raises(UserError) as e:
        _load(path, tmp_path)
    assert e.value.code == code and str(path) in e.value.message


def test_invalid_graph_is_refused_by_the_checker(tmp_path):
    path = tmp_path / "dangling.onnx"
    onnx.save(_model([helper.make_node("Relu", ["nowhere"], ["y"], name="act")]), path)
    with pytest.raises(UserError) as e:
        _load(path, tmp_path)
    assert e.value.code == "import.invalid-model"
    # the checker's whole message on one line, the node it is about included
    assert "\n" not in e.value.message and "input 'nowhere' of node: name: act OpType: Relu is not output" in e.value.message


def _retyped(vi: onnx.ValueInfoProto, kind: str) -> onnx.ValueInfoProto:
    """`vi` as another kind of ONNX value (its tensor type inside where the kind wraps one)."""
    tensor = onnx.TypeProto()
    tensor.CopyFrom(vi.type)
    vi.type.Clear()
    if kind == "sequence":
        vi.type.sequence_type.elem_type.CopyFrom(tensor)
    elif kind == "map":
        vi.type.map_type.key_type = TensorProto.INT64
        vi.type.map_type.value_type.CopyFrom(tensor)
    elif kind == "optional":
        vi.type.optional_type.elem_type.CopyFrom(tensor)
    elif kind == "sparse":
        vi.type.sparse_tensor_type.elem_type = TensorProto.FLOAT
        vi.type.sparse_tensor_type.shape.dim.add().dim_value = 4
    else:  # an element type ONNX does not define
        vi.type.CopyFrom(tensor)
        vi.type.tensor_type.elem_type = int(kind)
    return vi


@pytest.mark.parametrize("kind, said", [("sequence", "is a sequence"), ("map", "is a map"), ("optional", "is an optional"),
                                        ("sparse", "is a sparse tensor"),
                                        ("0", "has element type 0, which ONNX does not define"),
                                        ("99", "has element type 99, which ONNX does not define")])
def test_an_input_or_output_that_is_not_a_tensor_is_refused(tmp_path, kind, said):
    """Found by tests/fuzz: such a model passed the checker, then failed in the graph optimizations
    (onnx_ir) or in import.json's description of the inputs (KeyError, exit 3)."""
    model, _ = _matmul_model()
    model.graph.input.append(_retyped(helper.make_tensor_value_info("unused", TensorProto.FLOAT, [1]), kind))
    _retyped(model.graph.output[0], kind)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    with pytest.raises(UserError) as e:
        _load(path, tmp_path)
    assert e.value.code == "import.unsupported-type"
    assert e.value.notes == [f"input 'unused' {said}", f"output 'y' {said}"]


def test_a_function_output_its_body_never_computes_is_refused(tmp_path):
    """onnx.checker passes it; the graph optimizations (onnx_ir) cannot read it (found by tests/fuzz)."""
    opsets = [helper.make_opsetid("", 17)]
    empty = helper.make_function("local.fn", "Empty", ["a"], ["b"], [], opsets)
    model = _model([helper.make_node("Empty", ["x"], ["y"], domain="local.fn")], functions=[empty],
                   extra_opsets=[helper.make_opsetid("local.fn", 1)])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    with pytest.raises(UserError) as e:
        _load(path, tmp_path)
    assert e.value.code == "import.invalid-model"
    assert e.value.notes == ["function local.fn::Empty: output 'b' is computed by no node of its body"]


def test_a_tensor_of_an_element_type_onnx_does_not_define_is_refused(tmp_path):
    """onnx.checker passes an initializer of type 2^31 - 1; the graph optimizations (onnx_ir) cannot
    read it (found by tests/fuzz). A Constant's tensor inside an If branch is checked too."""
    model, _ = _matmul_model()
    model.graph.initializer[0].data_type = 2**31 - 1
    branch = helper.make_graph([helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(
        np.ones(1, np.float32), "cv"))], "then", [], [helper.make_tensor_value_info("c", TensorProto.FLOAT, [1])])
    model.graph.node.append(helper.make_node("If", ["cond"], ["z"], then_branch=branch, else_branch=branch))
    model.graph.node[-1].attribute[0].g.node[0].attribute[0].t.data_type = 99
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    with pytest.raises(UserError) as e:
        frontends.onnx_file.reject_undefined_tensor_types(onnx.load(path), path)
    assert e.value.code == "import.invalid-model"
    assert e.value.notes == ["tensor 'w': element type 2147483647", "tensor 'cv': element type 99"]
    with pytest.raises(UserError, match="element type ONNX does not define|not a valid ONNX model"):
        _load(path, tmp_path)
