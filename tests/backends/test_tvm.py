"""The TVM backend: ONNX segments compiled for x86-64, aarch64 and CUDA, and MetaSchedule tuning.

Libraries built for this host run through the bundle runtime's TVM runner and must match
onnxruntime within rtol 1e-4 / atol 1e-5. Foreign builds are checked for what this host can
see: an aarch64 ELF shared object, a CUDA library (no GPU here) whose kernels nvcc accepts.
Each model is compiled once per module.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import onnxscript
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk.backends import tvm as tvm_backend
from edgesdk.errors import UserError
from edgesdk.runtime.backends.tvm_runner import open_runner
from edgesdk.runtime.manifest import Segment
from tests import model_zoo

RTOL, ATOL = 1e-4, 1e-5
HOST = {"kind": "llvm", "mcpu": "native"}
AARCH64 = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a53", "mattr": ["+neon"]}
CUDA = {"kind": "cuda", "arch": "sm_86", "host": {"kind": "llvm", "mtriple": "x86_64-linux-gnu"}}
EM_AARCH64, EM_X86_64 = 183, 62


def _model(nodes, inputs: dict[str, tuple[int, ...]], outputs: list[str],
           inits: dict[str, np.ndarray]) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "case",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        initializer=[numpy_helper.from_array(v, n) for n, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def conv_graph() -> onnx.ModelProto:
    """Two inputs and two outputs, so that positions (TensorSpec.key) matter both ways."""
    rng = np.random.default_rng(0)
    return _model(
        [helper.make_node("Conv", ["x", "w", "b"], ["conv"], pads=[1, 1, 1, 1], strides=[2, 2]),
         helper.make_node("Add", ["conv", "shift"], ["sum"]),
         helper.make_node("Relu", ["sum"], ["features"]),
         helper.make_node("GlobalAveragePool", ["features"], ["pooled"])],
        {"x": (1, 3, 16, 16), "shift": (1, 8, 1, 1)}, ["pooled", "features"],
        {"w": rng.standard_normal((8, 3, 3, 3)).astype(np.float32),
         "b": rng.standard_normal(8).astype(np.float32)})


def single_task_graph() -> onnx.ModelProto:
    """Conv + bias + relu: one fused TIR function, so tuning it is one task."""
    rng = np.random.default_rng(1)
    return _model(
        [helper.make_node("Conv", ["x", "w", "b"], ["conv"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["conv"], ["y"])],
        {"x": (1, 4, 16, 16)}, ["y"],
        {"w": rng.standard_normal((8, 4, 3, 3)).astype(np.float32),
         "b": rng.standard_normal(8).astype(np.float32)})


def ppocr_cls_static() -> onnx.ModelProto:
    model = onnx.load(str(model_zoo.ppocr_cls()))
    for dim, value in zip(model.graph.input[0].type.tensor_type.shape.dim, (1, 3, 48, 192)):
        dim.Clear()
        dim.dim_value = value
    return onnxscript.optimizer.optimize(model)  # folds the Shape/Slice/Concat chains


def random_feeds(model: onnx.ModelProto, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    return {v.name: rng.standard_normal([d.dim_value for d in v.type.tensor_type.shape.dim]).astype(np.float32)
            for v in model.graph.input if v.name not in inits}


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    return dict(zip(names, session.run(names, feeds)))


def run_library(path: Path, result: tvm_backend.TvmResult, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    segment = Segment("s0", "cpu", "tvm", path.name, result.inputs, result.outputs)
    return open_runner(path.parent, segment, None).run(feeds)


def assert_matches_ort(model, path, result, seed: int = 1) -> None:
    feeds = random_feeds(model, seed)
    got, want = run_library(path, result, feeds), run_ort(model, feeds)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)


def elf_machine(path: Path) -> tuple[int, int, int]:
    """(EI_CLASS, e_type, e_machine) of an ELF file: 2 = 64-bit, 3 = shared object."""
    head = path.read_bytes()[:20]
    assert head[:4] == b"\x7fELF"
    e_type, e_machine = struct.unpack("<HH", head[16:20])
    return head[4], e_type, e_machine


@pytest.fixture(scope="module")
def conv_x86(tmp_path_factory):
    out = tmp_path_factory.mktemp("tvm-conv") / "conv.so"
    return conv_graph(), out, tvm_backend.compile_onnx(conv_graph(), HOST, out)


def test_target_arch():
    assert tvm_backend.target_arch(AARCH64) == "aarch64"
    assert tvm_backend.target_arch({"kind": "llvm", "mtriple": "x86_64-linux-gnu"}) == "x86_64"
    assert tvm_backend.target_arch(CUDA) == "x86_64"
    assert tvm_backend.target_arch({"kind": "cuda", "arch": "sm_87", "host": AARCH64}) == "aarch64"
    with pytest.raises(UserError) as err:
        tvm_backend.target_arch({"kind": "opencl"})
    assert err.value.code == "tvm.unsupported-target"


def test_x86_interface_follows_the_onnx_graph(conv_x86):
    _, out, result = conv_x86
    assert [(s.name, s.key, s.shape, s.dtype) for s in result.inputs] == [
        ("x", "0", (1, 3, 16, 16), "float32"), ("shift", "1", (1, 8, 1, 1), "float32")]
    assert [(s.name, s.key, s.shape) for s in result.outputs] == [("pooled", "0", (1, 8, 1, 1)),
                                                                  ("features", "1", (1, 8, 8, 8))]
    assert result.tasks >= 2 and result.tuned == 0
    assert result.target["mcpu"] not in ("native", None)  # resolved to this host's cpu
    assert elf_machine(out) == (2, 3, EM_X86_64)


def test_x86_conv_graph_matches_onnxruntime(conv_x86):
    model, out, result = conv_x86
    assert_matches_ort(model, out, result, seed=1)
    assert_matches_ort(model, out, result, seed=2)


@pytest.mark.slow
def test_x86_mobilenet_v2_matches_onnxruntime(tmp_path):
    model = onnx.load(str(model_zoo.mobilenet_v2(96, 0.35)))
    result = tvm_backend.compile_onnx(model, HOST, tmp_path / "mnv2.so")
    assert [(s.name, s.shape) for s in result.inputs] == [("input", (1, 96, 96, 3))]
    assert result.tasks > 20
    assert_matches_ort(model, tmp_path / "mnv2.so", result)


@pytest.mark.slow
def test_x86_ppocr_classifier_matches_onnxruntime(tmp_path):
    model = ppocr_cls_static()
    result = tvm_backend.compile_onnx(model, HOST, tmp_path / "cls.so")
    assert [(s.name, s.shape) for s in result.outputs] == [(model.graph.output[0].name, (1, 2))]
    assert_matches_ort(model, tmp_path / "cls.so", result)


def test_aarch64_cross_compile_is_an_aarch64_shared_object(tmp_path):
    result = tvm_backend.compile_onnx(conv_graph(), AARCH64, tmp_path / "conv.so")
    assert elf_machine(tmp_path / "conv.so") == (2, 3, EM_AARCH64)
    assert result.target == AARCH64
    assert [s.name for s in result.outputs] == ["pooled", "features"]


def test_cuda_compiles_without_a_gpu(tmp_path):
    result = tvm_backend.compile_onnx(conv_graph(), CUDA, tmp_path / "conv.so")
    library = tmp_path / "conv.so"
    assert elf_machine(library) == (2, 3, EM_X86_64)  # the host side, for the CUDA host's cpu
    # Without a CUDA driver the kernels travel as CUDA source (compiled on the GPU host at
    # load time); every function got a thread-bound schedule, or codegen would have failed.
    assert library.read_bytes().count(b'extern "C" __global__') >= result.tasks


def test_dynamic_input_is_a_user_error(tmp_path):
    model = conv_graph()
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    with pytest.raises(UserError) as err:
        tvm_backend.compile_onnx(model, HOST, tmp_path / "x.so")
    assert err.value.code == "tvm.dynamic-shape" and "x [batch,3,16,16]" in err.value.message
    assert not (tmp_path / "x.so").exists()


def test_unsupported_ops_are_named_together(tmp_path):
    model = _model([helper.make_node("Relu", ["x"], ["r"]),
                    helper.make_node("QLinearConv", ["r", "s", "z", "w", "s", "z", "s", "z"], ["y"])],
                   {"x": (1, 1, 4, 4)}, ["y"],
                   {"s": np.float32(1.0).reshape(()), "z": np.uint8(0).reshape(()),
                    "w": np.ones((1, 1, 1, 1), np.uint8)})
    assert "QLinearConv" not in tvm_backend.importer_ops() and "Conv" in tvm_backend.importer_ops()
    with pytest.raises(UserError) as err:
        tvm_backend.compile_onnx(model, HOST, tmp_path / "x.so")
    assert err.value.code == "tvm.unsupported-op" and "QLinearConv" in err.value.message


def test_tuning_database_must_exist(tmp_path):
    with pytest.raises(UserError) as err:
        tvm_backend.compile_onnx(single_task_graph(), HOST, tmp_path / "x.so", tuning_db=tmp_path / "nope")
    assert err.value.code == "tvm.no-tuning-db"


def test_untuned_functions_get_the_default_schedule_deterministically(conv_x86, tmp_path):
    """Without tuning records every function gets MetaSchedule's design space replayed with fixed
    choices (parallel, vectorized, unrolled): none stays a naive loop nest, and the library is the
    same bytes on every compile."""
    model, out, result = conv_x86
    assert result.tuned == 0 and result.default_scheduled == result.tasks
    again = tvm_backend.compile_onnx(model, HOST, tmp_path / "again.so")
    assert (tmp_path / "again.so").read_bytes() == out.read_bytes()
    assert again.default_scheduled == result.default_scheduled


def test_a_missing_cross_linker_is_named(monkeypatch, tmp_path):
    """Exported libraries and tuning candidates alike are linked by `_cross_compiler`'s choice."""
    monkeypatch.setattr(tvm_backend.shutil, "which", lambda name: None)
    with pytest.raises(UserError) as err:
        tvm_backend.compile_onnx(single_task_graph(), AARCH64, tmp_path / "x.so")
    assert err.value.code == "tvm.no-cross-compiler" and "aarch64-linux-gnu-gcc" in err.value.message
    assert "apt-get install gcc-aarch64-linux-gnu" in err.value.hint
    assert not (tmp_path / "x.so").exists()
    assert tvm_backend._cross_compiler(HOST) is None
