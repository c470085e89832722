"""The bundle runtime's onnxruntime runner: how many threads its session gets."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from edgesdk.runtime.backends import open_runner
from edgesdk.runtime.manifest import Segment, TensorSpec


def _segment(tmp_path, threads: int = 0) -> Segment:
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, 4))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, (1, 4))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    (tmp_path / "segments").mkdir(exist_ok=True)
    onnx.save(model, tmp_path / "segments" / "s0.onnx")
    spec = (TensorSpec(name="x", shape=(1, 4), dtype="float32"),)
    return Segment(id="s0", device="cpu", backend="onnxruntime", artifact="segments/s0.onnx", inputs=spec,
                   outputs=(TensorSpec(name="y", shape=(1, 4), dtype="float32"),), threads=threads)


@pytest.mark.parametrize("env,threads,want", [("2", 0, 2), ("3", 0, 3), ("2", 1, 1), (None, 0, 0)])
def test_the_session_gets_the_bundles_cpu_threads(tmp_path, monkeypatch, env, threads, want):
    """A segment without threads of its own runs on the bundle's CPU threads (EDGESDK_NUM_THREADS, which
    the executor sets from the manifest), not on onnxruntime's default of one pinned thread per
    physical core; a parallel step's segment keeps its own; without either, onnxruntime's default (0)."""
    if env is None:
        monkeypatch.delenv("EDGESDK_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("EDGESDK_NUM_THREADS", env)
    runner = open_runner(tmp_path, _segment(tmp_path, threads), None, alone=True)
    assert runner.session.get_session_options().intra_op_num_threads == want


def test_a_zero_pad_before_a_max_pool_is_not_folded_into_the_pool(tmp_path):
    """onnxruntime's Pad_Fusion folds a Pad into the MaxPool after it as the pool's padding, which MaxPool fills
    with -inf, not 0: where a border window's values are all negative, the model's answer is 0 (ResNet50V2's
    stem: off by 0.78). The runner's session, and the build's reference runs (`backends.onnxruntime.run_many`), compute what
    the model says: numpy's zero pad then max, on pre-activation-like values."""
    import numpy as np
    from onnx import numpy_helper

    from edgesdk.backends import onnxruntime as ort_backend

    graph = helper.make_graph([helper.make_node("Pad", ["x", "pads"], ["p"]),
                               helper.make_node("MaxPool", ["p"], ["y"], kernel_shape=[3, 3], strides=[2, 2])], "stem",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, 4, 16, 16))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, (1, 4, 8, 8))],
                              initializer=[numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "pads")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    (tmp_path / "segments").mkdir()
    onnx.save(model, tmp_path / "segments" / "s0.onnx")
    x = -np.abs(np.random.default_rng(0).standard_normal((1, 4, 16, 16))).astype(np.float32) - 0.1  # all negative
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    want = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))[:, :, ::2, ::2].max(axis=(-1, -2))
    assert (want[..., 0, :] == 0).all()  # every top window holds the pad's zeros: the case in question
    segment = Segment(id="s0", device="cpu", backend="onnxruntime", artifact="segments/s0.onnx",
                      inputs=(TensorSpec(name="x", shape=(1, 4, 16, 16), dtype="float32"),),
                      outputs=(TensorSpec(name="y", shape=(1, 4, 8, 8), dtype="float32"),))
    assert np.array_equal(open_runner(tmp_path, segment, None).run({"x": x})["y"], want)
    assert np.array_equal(ort_backend.run_many(model, [{"x": x}], ["y"])[0]["y"], want)
