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
