"""backends/onnxruntime/nchwc.py: constant affine maps after convolutions as BatchNormalization, so
onnxruntime's NCHWc layout keeps them blocked; the onnxruntime backend's segments are compiled with it."""

from __future__ import annotations

import collections
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from edgesdk.backends import CompileJob
from edgesdk.backends import onnxruntime as ort_backend
from edgesdk.backends.onnxruntime.nchwc import affine_as_batchnorm
from edgesdk.scheduling.plan import PlanSegment
from tests import model_zoo
from tests.passes.harness import REASSOCIATED, model, ops

EXACT_ENOUGH = {"rtol": 1e-6, "atol": 1e-7}  # one Mul then one Add: the same arithmetic, maybe fused into one fma


def run(m: onnx.ModelProto, feeds: dict, *, optimized: bool = False) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if not optimized:  # our rewrite alone, not onnxruntime's own fusions
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feeds)


def conv_block(after: list, inits: dict, *, out: str = "y", channels: int = 16) -> onnx.ModelProto:
    """x -> Conv 3x3 -> Relu -> `after` (nodes reading "r") -> Conv 1x1 -> out, NCHW 1x8x10x10."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["r"]),
             *after, helper.make_node("Conv", [after[-1].output[0] if after else "r", "w2"], [out])]
    return model(nodes, {"x": [1, 8, 10, 10]}, [out],
                 {"w1": rng.normal(0, 0.2, (channels, 8, 3, 3)).astype(np.float32),
                  "w2": rng.normal(0, 0.2, (4, channels, 1, 1)).astype(np.float32), **inits})


def feeds() -> dict:
    return {"x": np.random.default_rng(1).normal(0, 1, (1, 8, 10, 10)).astype(np.float32)}


def test_scalar_scale_and_shift_after_a_conv_become_one_batchnorm():
    """PP-LCNetV3's learnable affine block: act(conv(x)) * a + b, a and b scalars."""
    m = conv_block([helper.make_node("Mul", ["r", "a"], ["m"]), helper.make_node("Add", ["m", "b"], ["n"])],
                   {"a": np.array([1.7], np.float32), "b": np.array(-0.3, np.float32)})
    out, rewritten = affine_as_batchnorm(m)
    assert (rewritten.maps, rewritten.nodes) == (1, 2)
    assert ops(out) == {"Conv": 2, "Relu": 1, "BatchNormalization": 1}
    bn = next(n for n in out.graph.node if n.op_type == "BatchNormalization")
    assert bn.output[0] == "n" and helper.get_attribute_value(bn.attribute[0]) == 0.0  # epsilon 0: s / sqrt(1) = s
    onnx.checker.check_model(out, full_check=True)
    assert {"a", "b"}.isdisjoint(i.name for i in out.graph.initializer)
    np.testing.assert_allclose(run(out, feeds())[0], run(m, feeds())[0], **EXACT_ENOUGH)
    assert ops(m)["Mul"] == 1, "the argument was changed"


def test_per_channel_constants_and_longer_chains_compose():
    """Mul by (1,C,1,1), Sub of (C,1,1), Mul by a scalar: one BN with the composed scale and bias."""
    rng = np.random.default_rng(2)
    m = conv_block([helper.make_node("Mul", ["r", "s"], ["m"]), helper.make_node("Sub", ["m", "t"], ["n"]),
                    helper.make_node("Mul", ["k", "n"], ["o"])],
                   {"s": rng.uniform(0.5, 2, (1, 16, 1, 1)).astype(np.float32),
                    "t": rng.normal(0, 1, (16, 1, 1)).astype(np.float32), "k": np.float32(0.25)})
    out, rewritten = affine_as_batchnorm(m)
    assert (rewritten.maps, rewritten.nodes) == (1, 3)
    assert ops(out)["BatchNormalization"] == 1 and "Mul" not in ops(out) and "Sub" not in ops(out)
    np.testing.assert_allclose(run(out, feeds())[0], run(m, feeds())[0], **REASSOCIATED)


@pytest.mark.parametrize("case", ["after_matmul", "spatial_constant", "constant_minus_x", "graph_input_default",
                                  "enlarges", "int64"])
def test_does_not_fire(case):
    """What onnxruntime would not keep blocked, what is no per-channel map, what BN cannot express."""
    rng = np.random.default_rng(3)
    if case == "after_matmul":  # attention's scale: onnxruntime fuses it into the MatMul
        m = model([helper.make_node("MatMul", ["x", "w"], ["q"]), helper.make_node("Mul", ["q", "a"], ["y"])],
                  {"x": [1, 2, 6, 8]}, ["y"], {"w": rng.normal(0, 1, (8, 6)).astype(np.float32),
                                               "a": np.float32(0.125)})
    elif case == "spatial_constant":  # varies along H: not one number per channel
        m = conv_block([helper.make_node("Mul", ["r", "a"], ["m"])],
                       {"a": rng.normal(0, 1, (1, 1, 10, 1)).astype(np.float32)})
    elif case == "constant_minus_x":  # c - x negates x: no BN with these inputs... and not worth one
        m = conv_block([helper.make_node("Sub", ["a", "r"], ["m"])], {"a": np.float32(1.0)})
    elif case == "graph_input_default":  # an initializer that is also a graph input: the caller may change it
        m = conv_block([helper.make_node("Mul", ["r", "a"], ["m"])], {"a": np.float32(2.0)})
        m.graph.input.append(helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, []))
    elif case == "enlarges":  # the constant broadcasts the tensor to a larger shape
        m = conv_block([helper.make_node("Add", ["r", "a"], ["m"])], {"a": np.zeros((2, 16, 1, 1), np.float32)},
                       out="y")
    else:  # an integer tensor: BatchNormalization is float only
        m = model([helper.make_node("Mul", ["x", "a"], ["y"])], {"x": [1, 4, 2, 2]}, ["y"],
                  {"a": np.array(3, np.int64)}, input_type=onnx.TensorProto.INT64)
    out, rewritten = affine_as_batchnorm(m)
    assert rewritten.maps == 0 and out is m


def test_a_shared_intermediate_ends_the_chain():
    """m feeds the Add and a graph output: the Mul alone becomes a BN, the Add stays."""
    m = conv_block([helper.make_node("Mul", ["r", "a"], ["m"]), helper.make_node("Add", ["m", "b"], ["n"])],
                   {"a": np.float32(2.0), "b": np.float32(1.0)})
    m.graph.output.append(helper.make_tensor_value_info("m", onnx.TensorProto.FLOAT, [1, 16, 10, 10]))
    out, rewritten = affine_as_batchnorm(m)
    assert (rewritten.maps, rewritten.nodes) == (1, 1)
    assert ops(out)["Add"] == 1 and ops(out)["BatchNormalization"] == 1
    for got, want in zip(run(out, feeds()), run(m, feeds())):
        np.testing.assert_allclose(got, want, **EXACT_ENOUGH)


def reorders(m: onnx.ModelProto) -> collections.Counter:
    """The nodes of onnxruntime's own optimized graph (ORT_ENABLE_ALL, its NCHWc layout included)."""
    with tempfile.TemporaryDirectory() as tmp:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.intra_op_num_threads = 1
        opts.optimized_model_filepath = str(Path(tmp) / "opt.onnx")
        ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        return ops(onnx.load(opts.optimized_model_filepath))


def imported(path: Path, input_shapes: dict | None = None) -> tuple[onnx.ModelProto, dict]:
    """The model as the import stage leaves it (static shapes, the graph optimized), and the
    optimization's record: a whole-model CPU segment's graph."""
    from types import SimpleNamespace

    from edgesdk import frontends, passes

    options = SimpleNamespace(input_shapes=input_shapes or {}, input_values={}, batch=1)
    read = frontends.import_model(path, options, log=lambda line: None, warn=lambda line: None)
    model, record = passes.optimize(read.model)
    return frontends.finish_import(model, read, path, max_trip_count=passes.loops.MAX_TRIP_COUNT)[0], record


def compiled_whole(m: onnx.ModelProto, tmp_path: Path) -> tuple[onnx.ModelProto, list[str]]:
    """`m` as one segment compiled by the onnxruntime backend: the artifact, and the lines it logged."""
    seg = PlanSegment("s0", "cpu", "onnxruntime", "segments/s0.onnx", tuple(n.name for n in m.graph.node),
                      tuple(i.name for i in m.graph.input), tuple(o.name for o in m.graph.output), 0.0, 0, 1.0)
    (tmp_path / "segments").mkdir()
    lines: list[str] = []
    compiled = ort_backend.compile_segment(CompileJob(segment=seg, model=m, device=None, segments_dir=tmp_path / "segments",
                                                      tuning_db=tmp_path / "db", compressed=None, twin_dir=tmp_path,
                                                      log=lines.append))
    return onnx.load(tmp_path / compiled.artifact), lines


def test_pretrained_recognizer_compiles_with_fewer_reorders_and_the_same_answer(tmp_path):
    """PP-OCRv4's recognizer (PP-LCNetV3 backbone): its affine blocks become BNs in the onnxruntime
    backend's artifact, onnxruntime's optimized graph loses a reorder pair per block, and the outputs on
    text lines agree with the original's within 1e-4 of their scale (both onnxruntime, all optimizations)."""
    m, _ = imported(model_zoo.ppocr_rec(), {"x": (1, 3, 48, 320)})
    shipped, lines = compiled_whole(m, tmp_path)
    before, after = ops(m), ops(shipped)
    maps = after["BatchNormalization"] - before.get("BatchNormalization", 0)
    assert maps >= 20, after  # 28 in PP-OCRv4 rec
    assert before["Mul"] - after["Mul"] >= maps and any("as BatchNormalization" in line for line in lines)
    fewer = reorders(m)["ReorderOutput"] - reorders(shipped)["ReorderOutput"]
    assert fewer >= maps // 2, (reorders(m), reorders(shipped))
    x = np.pad(model_zoo.text_lines(2, seed=4), ((0, 0), (0, 0), (0, 0), (0, 0), (0, 128)), constant_values=1.0)
    for xi in x:
        got, want = run(shipped, {"x": xi}, optimized=True)[0], run(m, {"x": xi}, optimized=True)[0]
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_a_convolutions_output_asked_for_before_the_add_it_feeds():
    from onnx import TensorProto, numpy_helper

    """onnxruntime's NCHWc layout transformer (ORT_ENABLE_ALL, x86) fuses a Conv with the Add after it even
    where the Conv's output is asked for, and the session fails (NASNetMobile's tune stage: an internal
    error); the build's reference runs ask for such tensors (every CPU segment's inputs and outputs). This small
    pair of branches does not make onnxruntime 1.31 fuse so (NASNetMobile's own graph did: checked by its build);
    it holds the reference runs to the values asked for."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 16, 3, 3)).astype(np.float32)
    v = rng.standard_normal((16, 16, 1, 1)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Conv", ["x", "v"], ["d"]),
         helper.make_node("Add", ["c", "d"], ["y"]), helper.make_node("Relu", ["y"], ["z"])], "two branches",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, 16, 16, 16))],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, (1, 16, 16, 16))],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(v, "v")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    x = rng.standard_normal((1, 16, 16, 16)).astype(np.float32)
    got = ort_backend.run_many(model, [{"x": x}], ["c", "d", "z"])[0]
    assert got["c"].shape == (1, 16, 16, 16)
    np.testing.assert_allclose(np.maximum(got["c"] + got["d"], 0), got["z"], rtol=1e-5, atol=1e-5)
