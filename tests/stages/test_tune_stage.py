"""The tune stage through the pipeline: MetaSchedule records found with --trials N are applied to
the compiled kernel, persisted in the database, and reused by a later build with --trials 0."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgesdk.backends import onnxruntime as ort_backend
from edgesdk.pipeline import BuildOptions, build
from edgesdk.runtime import BundleModel, Manifest


def _conv_model(path):
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(0, 0.2, (16, 8, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])]
    g = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 16, 16])], initializer=[w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    onnx.save(m, str(path))
    return m


def test_tuned_records_are_applied_and_reused(tmp_path):
    model = _conv_model(tmp_path / "conv.onnx")
    db = tmp_path / "db"
    first = build(BuildOptions(model=tmp_path / "conv.onnx", target="x86", out=tmp_path / "a", trials=8, tuning_db=db))
    tune = first.stages[3].record
    assert tune["segments"]["s0"]["trials"] > 0, tune
    m = Manifest.load(first.bundle)
    applied = m.tuning["segments"]["s0"]
    assert applied["tasks"] >= 1 and applied["tuned"] == applied["tasks"], applied

    x = np.random.default_rng(1).normal(size=(1, 8, 16, 16)).astype(np.float32)
    got = BundleModel(first.bundle, log=lambda s: None).run({"x": x})["y"]
    np.testing.assert_allclose(got, ort_backend.run(model, {"x": x})["y"], rtol=1e-4, atol=1e-5)

    # a later build, --trials 0: no search, the persisted records are applied again
    second = build(BuildOptions(model=tmp_path / "conv.onnx", target="x86", out=tmp_path / "b", trials=0, tuning_db=db))
    assert Manifest.load(second.bundle).tuning["segments"]["s0"]["tuned"] == applied["tuned"]
    # and without the database the same kernel is untuned
    third = build(BuildOptions(model=tmp_path / "conv.onnx", target="x86", out=tmp_path / "c", tuning_db=tmp_path / "empty"))
    assert Manifest.load(third.bundle).tuning["segments"]["s0"]["tuned"] == 0
