"""backends/openvino.py and runtime/backends/ov_runner.py: a CPU span as OpenVINO IR, run by OpenVINO's CPU
plugin in float32, as a candidate the tune stage measures beside TVM, onnxruntime and LiteRT."""

from __future__ import annotations

from contextlib import closing

import numpy as np
import onnx
import onnxruntime as ort
import openvino as ov
import pytest
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from edgesdk import backends
from edgesdk.config import load_target
from edgesdk.ir import model as irm
from edgesdk.runtime.backends import ov_runner
from edgesdk.runtime.manifest import ManifestError, Segment, TensorSpec
from edgesdk.scheduling import selection
from edgesdk.scheduling.plan import PlanSegment
from edgesdk.timing import InProcess, TimingCache
from tests import model_zoo
from tests.scheduling.test_selection import _plan, _segment_models, _timer

# float32 kernels that sum in another order than onnxruntime's: of each output's scale (its largest magnitude)
FP32_RELATIVE = 1e-4


def _whole(model: onnx.ModelProto, backend: str = "openvino") -> tuple[selection.Candidate, dict]:
    """The whole model as one CPU segment on `backend`: the candidate the tune stage would build for a span."""
    g = model.graph
    inits = {i.name for i in g.initializer}
    seg = PlanSegment("s0", "cpu", backend, "segments/s0.onnx", tuple(irm.node_name(n, i) for i, n in enumerate(g.node)),
                      tuple(i.name for i in g.input if i.name not in inits), tuple(o.name for o in g.output), 0.0, 0, 1.0)
    return selection.Candidate(backend, (seg,)), {"s0": model}


def _photos(size: int) -> np.ndarray:
    """scikit-image's photographs at size x size, NHWC, scaled to [-1, 1] as MobileNetV2 takes them."""
    out = [np.asarray(Image.fromarray(p).resize((size, size), Image.BILINEAR), np.float32) / 127.5 - 1.0
           for p in model_zoo.photos()]
    return np.stack(out)[:, None]


def test_a_real_model_runs_as_float32_ir_and_answers_as_onnxruntime_does_on_photographs(tmp_path):
    """MobileNetV2 built as an OpenVINO candidate bundle and run by the runtime's executor, as a device runs
    it: every photograph's logits within FP32_RELATIVE of onnxruntime's on the same model, the same class."""
    path = model_zoo.mobilenet_v2(96, 0.35)
    model = irm.infer_shapes(onnx.load(path))
    cand, models = _whole(model)
    target, _ = load_target("x86")
    manifest = selection.build(cand, models, target, tmp_path / "bundle", tmp_path / "db")
    (seg,) = manifest.segments
    assert (seg.backend, seg.artifact) == ("openvino", "segments/s0.xml")
    # every weight kept in float32: OpenVINO's saver would halve them to float16 by default
    weights = sum(numpy_helper.to_array(i).nbytes for i in model.graph.initializer)
    assert (tmp_path / "bundle" / "segments" / "s0.bin").stat().st_size >= weights
    ir = ov.Core().read_model(str(tmp_path / "bundle" / seg.artifact))
    assert ir.get_rt_info(["edgesdk", "inference_precision"]).astype(str) == "f32"

    session = ort.InferenceSession(path.read_bytes(), providers=["CPUExecutionProvider"])
    name = model.graph.input[0].name
    with closing(InProcess().open(tmp_path / "bundle")) as handle:
        for x in _photos(96):
            want = session.run(None, {name: x})[0]
            got = handle.run({name: x})[model.graph.output[0].name]
            assert got.dtype == np.float32 and got.shape == want.shape
            assert np.abs(got - want).max() <= FP32_RELATIVE * np.abs(want).max()
            assert got.argmax() == want.argmax()


def test_the_runner_asks_openvino_for_float32_where_its_default_is_bfloat16(tmp_path):
    """OpenVINO computes in bfloat16 by default on a CPU with AVX512_BF16 or AMX; the runner compiles in the
    precision the IR names, float32 here, on every host."""
    model = _matmul_argmax()
    cand, models = _whole(model)
    target, _ = load_target("x86")
    manifest = selection.build(cand, models, target, tmp_path / "bundle", tmp_path / "db")
    runner = ov_runner.open_runner(tmp_path / "bundle", manifest.segments[0], None)
    assert runner.compiled.get_property("INFERENCE_PRECISION_HINT") == ov.Type.f32
    assert runner.precision == "f32"


def _matmul_argmax() -> onnx.ModelProto:
    """x [2, 8] -> MatMul -> y (float) and its ArgMax (int64): an output of each kind."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 5)).astype(np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
             helper.make_node("ArgMax", ["y"], ["k"], name="argmax", axis=1, keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5]),
                           helper.make_tensor_value_info("k", TensorProto.INT64, [2])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return irm.infer_shapes(m)


def test_each_output_keeps_the_dtype_the_manifest_names(tmp_path):
    model = _matmul_argmax()
    cand, models = _whole(model)
    target, _ = load_target("x86")
    selection.build(cand, models, target, tmp_path / "bundle", tmp_path / "db")
    x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    with closing(InProcess().open(tmp_path / "bundle")) as handle:
        got = handle.run({"x": x})
    assert got["k"].dtype == np.int64 and np.array_equal(got["k"], want[1])
    assert np.abs(got["y"] - want[0]).max() <= FP32_RELATIVE * np.abs(want[0]).max()


def test_the_ir_is_the_same_bytes_whatever_the_process_read_before(tmp_path):
    """OpenVINO numbers the ops its frontend leaves unnamed from one counter per process: a build that read
    other models first (the tune stage's other candidates) must still write the same IR."""
    cand, models = _whole(_matmul_argmax())
    target, _ = load_target("x86")
    selection.build(cand, models, target, tmp_path / "a", tmp_path / "db")
    ov.Core().read_model(str(model_zoo.mobilenet_v2(96, 0.35)))  # the counter moves on by hundreds of ops
    selection.build(cand, models, target, tmp_path / "b", tmp_path / "db")
    for name in ("s0.xml", "s0.bin"):
        assert (tmp_path / "a" / "segments" / name).read_bytes() == (tmp_path / "b" / "segments" / name).read_bytes()


def test_a_span_openvino_cannot_read_is_skipped_with_the_op_it_names(tmp_path):
    """Det has no conversion rule in OpenVINO's ONNX frontend: the candidate is skipped, the record naming the
    op, and the span keeps a candidate that runs it."""
    w = numpy_helper.from_array(np.eye(4, dtype=np.float32) * 2, "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node("Det", ["h"], ["y"], name="det")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])], [w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    model = irm.infer_shapes(model)
    plan = _plan(model, [("onnxruntime", ["mm", "det"], ("x",), ("y",))])
    target, _ = load_target("x86")
    x = np.random.default_rng(2).standard_normal((4, 4)).astype(np.float32)
    got = selection.select(plan, model, _segment_models(model), target, [{"x": x}, {"x": x + 1}],
                           allowed=["onnxruntime", "openvino"], tuning_db=tmp_path / "db" / "cpu",
                           cache=TimingCache(tmp_path / "db" / "timing.json"), measurable=None, host="test host",
                           log=lambda line: None, timer=_timer({"planned": 0.5, "openvino": 0.1}))
    (span,) = got.record["spans"]
    why = span["candidates"]["openvino"]["skipped"]
    assert why.startswith("OpenVINO cannot read segment s0:") and "Det" in why, why
    assert span["chosen"] == "planned"


def test_a_file_openvino_cannot_read_is_a_manifest_error(tmp_path):
    (tmp_path / "segments").mkdir()
    (tmp_path / "segments" / "s0.xml").write_text("<net>not a model")
    seg = Segment("s0", "cpu", "openvino", "segments/s0.xml", (TensorSpec("x", (1,), "float32"),),
                  (TensorSpec("y", (1,), "float32"),))
    with pytest.raises(ManifestError, match="segment s0: segments/s0.xml is not a model OpenVINO reads"):
        ov_runner.open_runner(tmp_path, seg, None)


def test_openvino_is_measured_for_cpu_spans_and_pinned_in_the_bundles_requirements():
    assert "openvino" in backends.cpu_candidates()
    b = backends.backend("openvino")
    assert (b.runner, b.precision, b.tunes, b.quantizes) == ("openvino", "fp32", False, False)
    from edgesdk.bundling.bundle import requirements
    seg = Segment("s0", "cpu", "openvino", "segments/s0.xml", (), ())
    lines = requirements([seg], "x86_64").splitlines()
    assert f"openvino=={ov.__version__.split('-')[0]}" in lines
