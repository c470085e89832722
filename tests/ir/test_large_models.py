"""Models of any size: onnx.checker, shape inference, onnxruntime sessions and the stage
files never serialize a model's weights with the rest of it; past protobuf's 2 GB they cannot be."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk.errors import UserError
from edgesdk.ir import model as irm


def _mlp(weights: list[np.ndarray], *, reshape: bool = False) -> onnx.ModelProto:
    """x @ w0 @ w1 ..., each weight an initializer (and a Reshape by a small constant shape)."""
    nodes, inits, x = [], [], "x"
    for i, w in enumerate(weights):
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]))
        x = f"m{i}"
    if reshape:
        inits.append(numpy_helper.from_array(np.array([-1], np.int64), "flat"))
        nodes.append(helper.make_node("Reshape", [x, "flat"], ["y"]))
        x = "y"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, weights[0].shape[0]])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [weights[-1].shape[1]] if reshape else
                                                             [1, weights[-1].shape[1]])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = irm.IR_VERSION
    return model


def _weights(rng, *shapes) -> list[np.ndarray]:
    return [(rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32) for s in shapes]


def test_weightless_keeps_small_tensors_and_declares_the_weights_as_inputs():
    model = _mlp(_weights(np.random.default_rng(0), (64, 512), (512, 8)), reshape=True)
    shell, weights = irm.weightless(model)
    assert [t.name for t in weights] == ["w0"]  # 128 KiB; w1 (16 KiB) and the shape stay
    assert {t.name for t in shell.graph.initializer} == {"w1", "flat"}
    declared = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in shell.graph.input}
    assert declared == {"x": [1, 64], "w0": [64, 512]}
    assert weights[0] is not None and model.graph.initializer[0].raw_data == weights[0].raw_data
    stubs, _ = irm.weightless(model, stubs=True)
    stub = next(t for t in stubs.graph.initializer if t.name == "w0")
    assert stub.data_location == TensorProto.EXTERNAL and not stub.raw_data and list(stub.dims) == [64, 512]


def test_shapes_are_inferred_into_the_model_itself_through_small_constants():
    model = _mlp(_weights(np.random.default_rng(0), (64, 512), (512, 8)), reshape=True)
    before = model.graph.initializer[0].raw_data
    assert irm.infer_shapes(model) is model
    shapes = irm.static_shapes(model)
    assert shapes["m0"] == (1, 512) and shapes["y"] == (8,)  # Reshape's output: data propagated from `flat`
    assert model.graph.initializer[0].raw_data == before


def test_check_still_reads_every_weight():
    model = _mlp(_weights(np.random.default_rng(0), (64, 512)))
    irm.check(model)
    model.graph.initializer[0].raw_data = model.graph.initializer[0].raw_data[:-4]
    with pytest.raises(Exception, match="raw_data size"):
        irm.check(model)


def test_a_session_gets_the_weights_as_arrays_and_computes_what_onnxruntime_does(tmp_path):
    w = _weights(np.random.default_rng(1), (256, 512), (512, 64))
    model = _mlp(w)
    x = np.random.default_rng(2).standard_normal((1, 256)).astype(np.float32)
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = plain.run(None, {"x": x})[0]
    session = irm.onnxruntime_session(model)
    got = session.run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * float(np.abs(want).max()))
    inner = irm.onnxruntime_session(model, outputs=[helper.make_tensor_value_info("m0", TensorProto.FLOAT, None)])
    np.testing.assert_allclose(inner.run(None, {"x": x})[0], x @ w[0], rtol=1e-5, atol=1e-5)


def test_a_large_model_is_saved_with_its_weights_beside_it_aligned(tmp_path, monkeypatch):
    monkeypatch.setattr(irm, "EXTERNAL_FROM", 1 << 16)
    w = _weights(np.random.default_rng(3), (128, 300), (300, 200))
    model = _mlp(w)
    path = tmp_path / "model.onnx"
    irm.save(model, path)
    data = tmp_path / "model.onnx.data"
    assert data.is_file() and path.stat().st_size < 4096
    shell = onnx.load(str(path), load_external_data=False)
    offsets = [int(next(e.value for e in t.external_data if e.key == "offset")) for t in shell.graph.initializer]
    assert len(offsets) == 2 and all(o % 4096 == 0 for o in offsets)
    assert not list(tmp_path.glob("*.tmp*"))
    for i, want in enumerate(irm.load(path).graph.initializer):
        np.testing.assert_array_equal(irm.array(want), w[i])
    # the stage cache shares an unchanged weights file by a hard link: a stage reads it (`read`), while a
    # user's model keeps onnx's own checks (`load`: no symlink, no hard link, nothing outside its folder)
    os.link(data, tmp_path / "linked.data")
    loaded = irm.read(path)
    for i, want in enumerate(w):
        np.testing.assert_array_equal(irm.array(loaded.graph.initializer[i]), want)
    with pytest.raises(UserError, match="hard link") as refused:
        irm.load(path)
    assert refused.value.code == "import.external-data"
    assert irm.sha256(irm.read(path)) == irm.sha256(model)
    # saved small again: the weights go back into the file, and no stale .data is left
    monkeypatch.setattr(irm, "EXTERNAL_FROM", 1 << 30)
    irm.save(model, path)
    assert not data.exists()


@pytest.mark.slow
def test_a_model_past_protobufs_2gb_is_checked_inferred_hashed_saved_and_run(tmp_path):
    """Two 1 GiB weights: a model that protobuf cannot serialize whole (its limit is 2 GiB - 1)."""
    n = 16384

    def diagonal(value: float) -> np.ndarray:
        w = np.zeros((n, n), np.float32)
        w[np.arange(n), np.arange(n)] = value
        return w

    w2 = np.zeros((n, 8), np.float32)
    w2[np.arange(n), np.arange(n) % 8] = 1.0     # sums of every 8th element
    model = _mlp([diagonal(2.0), diagonal(-0.5), w2])  # x @ w0 @ w1 = -x
    with pytest.raises(Exception):
        model.SerializeToString()  # what every one of the calls below used to do
    irm.check(model)
    irm.infer_shapes(model)
    assert irm.static_shapes(model)["m2"] == (1, 8)
    digest = irm.sha256(model)
    path = tmp_path / "big.onnx"
    irm.save(model, path)
    assert (tmp_path / "big.onnx.data").stat().st_size >= 2 * n * n * 4
    x = np.arange(n, dtype=np.float32).reshape(1, n) / n
    want = -x @ w2
    del model
    # read back, the weights stay in the file: mapped, handed to onnxruntime as views of it, linked by a save
    again = irm.read(path)
    assert [(t.name, list(t.dims)) for t in again.graph.initializer] == [("w0", [n, n]), ("w1", [n, n]), ("w2", [n, 8])]
    assert all(irm.is_mapped(t) and not t.raw_data for t in again.graph.initializer)
    assert irm.array(again.graph.initializer[1])[0, :2].tolist() == [-0.5, 0.0]
    assert hashlib.sha256(irm.array(again.graph.initializer[2]).tobytes()).digest() == hashlib.sha256(w2.tobytes()).digest()
    np.testing.assert_allclose(irm.onnxruntime_session(again).run(None, {"x": x})[0], want, rtol=1e-5)
    irm.save(again, tmp_path / "again.onnx")
    assert (tmp_path / "again.onnx.data").stat().st_ino == (tmp_path / "big.onnx.data").stat().st_ino
    del again
    # as a bundle's runtime loads a segment: onnxruntime reads the file and its weights beside it
    from_file = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(from_file, want, rtol=1e-5)
    assert len(digest) == 64  # hashed part by part: the whole would not serialize


def test_a_weight_numpy_cannot_hand_over_is_serialized_with_the_model():
    """bfloat16 has no numpy dtype onnxruntime takes: that weight goes in the bytes the session parses."""
    w = np.random.default_rng(4).standard_normal((256, 128)).astype(np.float32)
    bf16 = helper.make_tensor("w", TensorProto.BFLOAT16, w.shape,
                              (w.view(np.uint32) >> 16).astype(np.uint16).tobytes(), raw=True)
    graph = helper.make_graph([helper.make_node("Cast", ["w"], ["wf"], to=TensorProto.FLOAT),
                               helper.make_node("MatMul", ["x", "wf"], ["y"])], "bf16",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 128])], initializer=[bf16])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = irm.IR_VERSION
    assert irm.is_weight(model.graph.initializer[0])
    x = np.ones((1, 256), np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(irm.onnxruntime_session(model).run(None, {"x": x})[0], want)


def _saved_large(tmp_path, monkeypatch, name: str = "model.onnx"):
    """A three-weight model saved with its weights beside it (the threshold lowered), and its weights."""
    monkeypatch.setattr(irm, "EXTERNAL_FROM", 1 << 16)
    w = _weights(np.random.default_rng(5), (64, 300), (300, 200), (200, 100))  # each 64 KiB or more: a weight
    path = tmp_path / name
    irm.save(_mlp(w), path)
    return path, w


def test_a_stage_file_is_read_with_its_weights_left_in_their_file(tmp_path, monkeypatch):
    path, w = _saved_large(tmp_path, monkeypatch)
    model = irm.read(path)
    for t, want in zip(model.graph.initializer, w):
        assert irm.is_mapped(t) and irm.is_weight(t) and not t.raw_data
        got = irm.array(t)
        np.testing.assert_array_equal(got, want)
        assert not got.flags.writeable and not got.flags.owndata  # a view of the file, not a copy
        np.testing.assert_array_equal(numpy_helper.to_array(irm.inline(t)), want)
    inline = irm.materialize(irm.read(path))
    assert not any(irm.is_mapped(t) for t in inline.graph.initializer)
    assert irm.sha256(model) == irm.sha256(inline) == irm.sha256(_mlp(w))  # the bytes count, not where they are
    irm.check(model)
    x = np.random.default_rng(6).standard_normal((1, 64)).astype(np.float32)
    want = x @ w[0] @ w[1] @ w[2]
    np.testing.assert_allclose(irm.onnxruntime_session(model).run(None, {"x": x})[0], want, rtol=0,
                               atol=1e-5 * np.abs(want).max())
    with pytest.raises(Exception, match="relative path"):
        numpy_helper.to_array(model.graph.initializer[0])  # onnx's own reader refuses it: `irm.array` is the way


def test_saving_mapped_weights_links_their_file_copies_a_part_and_never_links_a_users_file(tmp_path, monkeypatch):
    path, w = _saved_large(tmp_path, monkeypatch)
    data = tmp_path / "model.onnx.data"
    model = irm.read(path)
    irm.save(model, tmp_path / "same.onnx")  # every weight, unchanged: the one file, linked
    assert (tmp_path / "same.onnx.data").stat().st_ino == data.stat().st_ino
    irm.save(model, tmp_path / "copy.onnx", link=False)  # for onnx's own loader, which refuses a linked file
    assert (tmp_path / "copy.onnx.data").stat().st_ino != data.stat().st_ino
    np.testing.assert_array_equal(irm.array(irm.load(tmp_path / "copy.onnx").graph.initializer[2]), w[2])
    # a segment of two of the three weights: those two copied file to file, at aligned offsets
    part = irm.extract_segment(irm.infer_shapes(model), [1, 2], ["m0"], ["m2"])
    irm.save(part, tmp_path / "part.onnx")
    assert (tmp_path / "part.onnx.data").stat().st_size < data.stat().st_size
    again = irm.read(tmp_path / "part.onnx")
    for t, want in zip(again.graph.initializer, w[1:]):
        np.testing.assert_array_equal(irm.array(t), want)
        assert int(next(e.value for e in t.external_data if e.key == "offset")) % 4096 == 0
    # a changed weight is written from memory beside the mapped ones
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(w[0] * 2, "w0"))
    irm.save(model, tmp_path / "changed.onnx")
    changed = irm.read(tmp_path / "changed.onnx")
    np.testing.assert_array_equal(irm.array(changed.graph.initializer[0]), w[0] * 2)
    np.testing.assert_array_equal(irm.array(changed.graph.initializer[1]), w[1])
    # a user's model is mapped where it lies, and a save copies it: a link would follow the user's later edits
    user = tmp_path / "user"
    user.mkdir()
    onnx.save(_mlp(w), str(user / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True, location="m.data")
    loaded = irm.load(user / "m.onnx")
    assert all(irm.is_mapped(t) for t in loaded.graph.initializer)
    irm.save(loaded, tmp_path / "imported.onnx")
    assert (tmp_path / "imported.onnx.data").stat().st_ino != (user / "m.data").stat().st_ino
    assert irm.sha256(irm.read(tmp_path / "imported.onnx")) == irm.sha256(_mlp(w))
    # below the threshold, mapped weights are saved into the model itself, and no .data is left
    monkeypatch.setattr(irm, "EXTERNAL_FROM", 1 << 30)
    irm.save(irm.read(path), tmp_path / "small.onnx")
    assert not (tmp_path / "small.onnx.data").exists()
    small = onnx.load(str(tmp_path / "small.onnx"))
    np.testing.assert_array_equal(numpy_helper.to_array(small.graph.initializer[1]), w[1])
    assert irm.sha256(irm.read(path)) == irm.sha256(small)
