"""The bundle runtime's TVM runner, on a library the TVM backend builds for this host.

Outputs must match onnxruntime within rtol 1e-4 / atol 1e-5: from one thread, from several
at once, and in TVM's runtime-only mode (`TVM_USE_RUNTIME_LIB=1`) with the runtime package
copied out as the top-level `runtime` package a bundle ships.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk.backends import tvm as tvm_backend
from edgesdk.runtime import manifest as mf
from edgesdk.runtime.backends import open_runner
from tests.numeric import assert_close as close_to_scale

RUNTIME_PACKAGE = Path(mf.__file__).parent


def two_in_two_out():
    rng = np.random.default_rng(0)
    inits = {"w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
             "m": rng.standard_normal((4, 5)).astype(np.float32)}
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["act"]),
         helper.make_node("GlobalAveragePool", ["act"], ["g"]),
         helper.make_node("Flatten", ["g"], ["f"]),
         helper.make_node("MatMul", ["f", "m"], ["mm"]),
         helper.make_node("Add", ["mm", "bias"], ["logits"])],
        "runner",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, 3, 8, 8)),
         helper.make_tensor_value_info("bias", TensorProto.FLOAT, (1, 5))],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, (1, 5)),
         helper.make_tensor_value_info("act", TensorProto.FLOAT, (1, 4, 8, 8))],
        initializer=[numpy_helper.from_array(v, n) for n, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def feeds_for(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32),
            "bias": rng.standard_normal((1, 5)).astype(np.float32)}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """A bundle directory holding one CPU segment; returns (dir, segment, onnx model)."""
    root = tmp_path_factory.mktemp("tvm-bundle")
    model = two_in_two_out()
    result = tvm_backend.compile_onnx(model, {"kind": "llvm"}, root / "segments" / "s0.so")
    segment = mf.Segment("s0", "cpu", "tvm", "segments/s0.so", result.inputs, result.outputs)
    return root, segment, model


def reference(model, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(["logits", "act"], session.run(["logits", "act"], feeds)))


def assert_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == np.float32
        close_to_scale(got[name], want[name], name)


def test_runs_by_onnx_name(bundle):
    root, segment, model = bundle
    runner = open_runner(root, segment, None)
    assert runner.note == ""
    feeds = feeds_for(1)
    assert_close(runner.run(feeds), reference(model, feeds))
    # keys are positions: a reversed feed dict changes nothing
    assert_close(runner.run(dict(reversed(list(feeds.items())))), reference(model, feeds))


def test_native_outputs_pass_to_the_next_call_without_numpy(bundle):
    import tvm

    root, segment, model = bundle
    runner = open_runner(root, segment, None)
    feeds = feeds_for(2)
    native = runner.run(feeds, native=True)
    assert all(isinstance(v, tvm.runtime.Tensor) for v in native.values())
    assert_close({k: v.numpy() for k, v in native.items()}, reference(model, feeds))
    # a TVM tensor feed is used as it is; one of the wrong shape is refused like a numpy array would be
    x = tvm.runtime.tensor(feeds["x"])
    assert_close(runner.run({"x": x, "bias": feeds["bias"]}), reference(model, feeds))
    with pytest.raises(ValueError, match="has shape"):
        runner.run({"x": tvm.runtime.tensor(np.zeros((1, 3, 4, 4), np.float32)), "bias": feeds["bias"]})


def test_a_library_compiled_again_to_the_same_path_in_the_same_process_is_the_new_one(tmp_path):
    """A build's accuracy remedy compiles a segment again, to the same file name, in the same process, and
    runs it: the dynamic loader handed back the library it had loaded under that path (its old code, taking
    one weight, met the new weights file holding two: an internal error, on a MobileNetV2 for arm_2tpu). The
    second segment's answers are its own."""
    rng = np.random.default_rng(4)
    first = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "m"], ["y"])], "first",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, 320))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, (1, 2))],
        initializer=[numpy_helper.from_array(rng.standard_normal((320, 2)).astype(np.float32), "m")]),
        opset_imports=[helper.make_opsetid("", 13)])
    second = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "m"], ["h"]), helper.make_node("MatMul", ["h", "n"], ["y"])], "second",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, 320))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, (1, 2))],
        initializer=[numpy_helper.from_array(rng.standard_normal((320, 320)).astype(np.float32), "m"),
                     numpy_helper.from_array(rng.standard_normal((320, 2)).astype(np.float32), "n")]),
        opset_imports=[helper.make_opsetid("", 13)])
    x = {"x": rng.standard_normal((1, 320)).astype(np.float32)}
    (tmp_path / "segments").mkdir()
    for model in (first, second, first):
        model.ir_version = 8
        result = tvm_backend.compile_onnx(model, {"kind": "llvm"}, tmp_path / "segments" / "s1.so")
        segment = mf.Segment("s1", "cpu", "tvm", "segments/s1.so", result.inputs, result.outputs)
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], x)[0]
        close_to_scale(open_runner(tmp_path, segment, None).run(x)["y"], want, model.graph.name)


def test_concurrent_runs_stay_correct(bundle):
    root, segment, model = bundle
    runner = open_runner(root, segment, None)
    failures: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for i in range(10):
                feeds = feeds_for(100 * seed + i)
                assert_close(runner.run(feeds), reference(model, feeds))
        except BaseException as exc:  # noqa: BLE001 -- reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[0]


def test_wrong_feeds_are_named(bundle):
    root, segment, _ = bundle
    runner = open_runner(root, segment, None)
    with pytest.raises(KeyError, match="bias"):
        runner.run({"x": feeds_for(1)["x"]})
    with pytest.raises(ValueError, match=r"'x' has shape \(1, 3, 9, 9\), expected \(1, 3, 8, 8\)"):
        runner.run({**feeds_for(1), "x": np.zeros((1, 3, 9, 9), np.float32)})


def test_gpu_segment_without_gpu_says_so(bundle):
    import tvm

    if tvm.cuda(0).exist:
        pytest.skip("a GPU is present")
    root, segment, _ = bundle
    gpu_segment = mf.Segment("s0", "gpu:0", "tvm", segment.artifact, segment.inputs, segment.outputs)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        open_runner(root, gpu_segment, "cuda:0")


def test_cuda_source_compiles_for_the_loading_gpu_in_runtime_only_mode(tmp_path):
    """A CUDA library built without a GPU carries CUDA source that TVM compiles when it loads.
    TVM's own compile callback reads the architecture from the compiler's current Target, which
    runtime-only TVM lacks (on an H200 every CUDA bundle failed to load with "no attribute
    'TargetCurrent'"). The runner's callback compiles for the loading GPU's architecture instead.
    Test double: no GPU and no NVRTC here, so TVM's `compile_cuda` is replaced by a recorder; the
    callback is reached through TVM's global function, as the CUDA module loader reaches it."""
    shutil.copytree(RUNTIME_PACKAGE, tmp_path / "runtime", ignore=shutil.ignore_patterns("__pycache__"))
    script = """
import json, tvm, tvm_ffi
import tvm.support.nvcc as nvcc
calls = []
nvcc.compile_cuda = lambda code, **kw: calls.append([code, kw]) or b"cubin"
from runtime.backends import tvm_runner
tvm_runner._CUDA_ARCH[0] = "sm_86"
tvm_runner._register_cuda_compiler()
out = tvm_ffi.get_global_func("tvm_callback_cuda_compile")("__global__ void k() {}")
print(json.dumps({"calls": calls, "out": bytes(out).decode()}))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"TVM_USE_RUNTIME_LIB": "1"}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["calls"] == [["__global__ void k() {}", {"target_format": "cubin", "arch": "sm_86",
                                                           "compiler": "nvrtc"}]]
    assert facts["out"] == "cubin"


def test_cuda_compile_mode_nvcc_without_nvcc_says_so(monkeypatch):
    from edgesdk.runtime.backends import tvm_runner

    monkeypatch.setenv("TVM_CUDA_COMPILE_MODE", "nvcc")
    monkeypatch.setenv("PATH", "")
    with pytest.raises(RuntimeError, match="nvcc is not on PATH"):
        tvm_runner._compile_cuda("__global__ void k() {}")
    monkeypatch.setenv("TVM_CUDA_COMPILE_MODE", "clang")
    with pytest.raises(ValueError, match="expected 'nvrtc' or 'nvcc'"):
        tvm_runner._compile_cuda("__global__ void k() {}")


def test_runtime_only_tvm_as_a_bundle_runs_it(bundle, tmp_path):
    """The bundle's `runtime` package with TVM_USE_RUNTIME_LIB=1: no compiler is loaded."""
    root, segment, model = bundle
    shutil.copytree(RUNTIME_PACKAGE, tmp_path / "runtime", ignore=shutil.ignore_patterns("__pycache__"))
    feeds = feeds_for(7)
    np.savez(tmp_path / "feeds.npz", **feeds)
    (tmp_path / "segment.json").write_text(json.dumps(dataclasses.asdict(segment)))
    script = f"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np
from runtime.backends import open_runner
from runtime.manifest import segment_from_dict
segment = segment_from_dict(json.loads(open("segment.json").read()))
out = open_runner({str(root)!r}, segment, None).run(dict(np.load("feeds.npz")))
import tvm
np.savez("out.npz", **out)
print(json.dumps({{"runtime_only": tvm.base._RUNTIME_ONLY, "relax": "tvm.relax" in sys.modules,
                   "edgesdk": any(m.startswith("edgesdk") for m in sys.modules),
                   "seconds": time.perf_counter() - t0}}))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"TVM_USE_RUNTIME_LIB": "1"}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["runtime_only"] is True and facts["relax"] is False and facts["edgesdk"] is False
    assert_close(dict(np.load(tmp_path / "out.npz")), reference(model, feeds))


def test_a_scalar_input_stays_a_scalar():
    """A scalar that another segment computed (a DequantizeLinear of a scalar constant, on onnxruntime) reaches a
    TVM segment as a 0-d array: np.ascontiguousarray made it 1-d and the runner refused it as shape (1,)."""
    import numpy as np

    from edgesdk.runtime.backends.tvm_runner import _checked
    from edgesdk.runtime.manifest import TensorSpec

    value = _checked({"s": np.array(0.5, np.float32)}, TensorSpec(name="s", shape=(), dtype="float32"), "s1")
    assert value.shape == () and value.flags.c_contiguous


def _placed(value: np.ndarray, misalign: int) -> np.ndarray:
    """A copy of `value` whose data starts `misalign` bytes past a 64-byte boundary."""
    raw = np.empty(value.nbytes + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + misalign
    out = raw[start:start + value.nbytes].view(value.dtype).reshape(value.shape)
    out[...] = value
    assert out.ctypes.data % 64 == misalign
    return out


def test_an_aligned_feed_is_taken_as_it_is_and_any_other_is_copied_into_the_runners_own_tensor(bundle):
    root, segment, model = bundle
    runner = open_runner(root, segment, None)
    spec = {s.name: (i, s) for i, s in enumerate(runner._inputs)}
    feeds = feeds_for(3)
    aligned = {n: _placed(v, 0) for n, v in feeds.items()}
    slot, x = spec["x"]
    assert runner._argument(aligned, x, slot).data_ptr() == aligned["x"].ctypes.data  # no copy
    assert_close(runner.run(aligned), reference(model, feeds))
    # unaligned, read-only or not C-ordered: copied, each into the same tensor call after call
    for seed, make in [(4, lambda v: _placed(v, 16)), (5, lambda v: np.asfortranarray(v)), (6, _read_only)]:
        feeds = feeds_for(seed)
        given = {n: make(v) for n, v in feeds.items()}
        tensor = runner._argument(given, x, slot)
        assert tensor.data_ptr() != given["x"].ctypes.data
        if given["x"].flags.c_contiguous:  # an F-ordered feed is made C-ordered first: that copy may be aligned
            assert tensor.data_ptr() == runner._staging[slot][2]
        assert_close(runner.run(given), reference(model, feeds))


def _read_only(value: np.ndarray) -> np.ndarray:
    out = _placed(value, 0)
    out.flags.writeable = False
    return out


def test_an_input_returned_as_an_output_outlives_the_next_call(tmp_path):
    """A segment may return an input as it is (an Identity): where that input was copied into the runner's own
    tensor, the output handed on (native) must not change when the next call refills that tensor."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["same"]), helper.make_node("Relu", ["x"], ["r"])], "passthrough",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, (2, 8))],
        [helper.make_tensor_value_info("same", TensorProto.FLOAT, (2, 8)),
         helper.make_tensor_value_info("r", TensorProto.FLOAT, (2, 8))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    result = tvm_backend.compile_onnx(model, {"kind": "llvm"}, tmp_path / "segments" / "s0.so")
    runner = open_runner(tmp_path, mf.Segment("s0", "cpu", "tvm", "segments/s0.so", result.inputs, result.outputs),
                         None)
    first, second = (np.arange(16, dtype=np.float32).reshape(2, 8) * s for s in (1, -1))
    kept = runner.run({"x": _placed(first, 16)}, native=True)
    runner.run({"x": _placed(second, 16)}, native=True)
    np.testing.assert_array_equal(kept["same"].numpy(), first)
    np.testing.assert_array_equal(kept["r"].numpy(), np.maximum(first, 0))
