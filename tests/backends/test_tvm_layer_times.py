"""The TVM backend's layer times for `--prune-plan auto` (backends/tvm/layer_times.py): convolution shapes read
from ONNX as onnxruntime computes them, each layer's kernels and the dense segments timed by TVM on this host,
kept in the tuning database's kernel times and replayed from there."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from edgesdk import backends
from edgesdk.backends.tvm import kernel_timing, layer_times, sparse_measured
from edgesdk.compression import build as pruning
from edgesdk.compression import parse_method, prunable
from edgesdk.config import load_target
from tests.test_prune_e2e import small_cnn


@pytest.mark.parametrize("attrs", [
    {"pads": [1, 0, 2, 1]},
    {"pads": [1, 1, 1, 1], "strides": [2, 2]},
    {"auto_pad": "SAME_UPPER", "strides": [2, 2]},
    {"auto_pad": "SAME_LOWER", "strides": [2, 2]},
    {"pads": [2, 1, 2, 1], "dilations": [2, 2]},
    {"auto_pad": "VALID"},
])
def test_conv_shapes_give_the_output_onnxruntime_computes(attrs):
    x_shape, w_shape = (2, 4, 11, 9), (6, 4, 3, 3)
    node = helper.make_node("Conv", ["x", "w"], ["y"], **attrs)
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.ones(w_shape, np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": np.ones(x_shape, np.float32)})[0]
    shape = layer_times.conv_shape(node, x_shape, w_shape)
    assert (shape.n, shape.co, *shape.out) == y.shape


def test_grouped_and_unshaped_convolutions_have_no_shape():
    node = helper.make_node("Conv", ["x", "w"], ["y"], group=2)
    assert layer_times.conv_shape(node, (1, 4, 8, 8), (4, 2, 3, 3)) is None
    assert layer_times.conv_shape(helper.make_node("Conv", ["x", "w"], ["y"]), None, (4, 4, 3, 3)) is None


def test_each_convolution_is_timed_dense_and_per_method_then_replayed(tmp_path, monkeypatch):
    model = onnx.load(small_cnn(tmp_path / "cnn.onnx"))
    layers = prunable(model)
    methods = [parse_method("2:4"), parse_method("1:4")]
    weights = {x.output: {m.text: pruning.pruned_weight(model, x, m) for m in methods} for x in layers[1:]}
    target, _ = load_target("x86")
    job = backends.LayerTimesJob(model=model, weights=weights, segments={"dense": (model,)}, device=target.host,
                                 tuning_db=tmp_path / "db", log=lambda s: None)
    got = backends.backend("tvm").time_layers(job)
    convs = [x.output for x in layers[1:] if x.op == "Conv"]
    assert list(got["layers"]) == convs  # the Gemm has no sparse kernel: not timed
    for entry in got["layers"].values():
        assert entry["dense_ms"] > 0 and set(entry["sparse_ms"]) == {"2:4", "1:4"}
        assert all(t > 0 for t in entry["sparse_ms"].values())
    assert got["segments_ms"]["dense"] > 0
    kept = json.loads((tmp_path / "db" / backends.KERNEL_TIMES).read_text())
    assert len(kept) == 2 * len(convs) + 1  # per layer and method one entry (2:4 and 1:4 pack differently), the segment

    def no_measuring(run):
        raise AssertionError("measured again instead of replaying the database's times")

    monkeypatch.setattr(kernel_timing, "median_ms", no_measuring)
    assert backends.backend("tvm").time_layers(job) == got


def test_a_native_target_is_timed_as_compilation_resolves_it(tmp_path):
    """`mcpu: native` with a triple is generic x86-64 to LLVM (no AVX): the layer times must use the host's CPU,
    as compilation does, and share its kernel-time cache entries."""
    from edgesdk.backends.tvm.targets import _resolve_target

    model = onnx.load(small_cnn(tmp_path / "cnn.onnx"))
    layer = [x for x in prunable(model) if x.name == "conv3"][0]
    weights = {layer.output: {"1:4": pruning.pruned_weight(model, layer, parse_method("1:4"))}}
    device = type("Cpu", (), {"codegen": {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "native"}})()
    job = backends.LayerTimesJob(model=model, weights=weights, segments={}, device=device, tuning_db=tmp_path / "db",
                                 log=lambda s: None)
    backends.backend("tvm").time_layers(job)
    resolved = _resolve_target(device.codegen)[0]
    assert resolved["mcpu"] != "native"
    measured = sparse_measured.Measured(resolved, tmp_path / "db" / backends.KERNEL_TIMES)
    before = dict(measured.entries)
    node = next(n for n in model.graph.node if n.output[0] == layer.output)
    shape = layer_times.conv_shape(node, (4, 32, 8, 8), layer.shape)
    measured(shape, weights[layer.output]["1:4"])
    assert measured.entries == before  # compilation's lookup finds the plan's entry: nothing measured anew
