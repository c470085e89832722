"""The bundle runtime's TFLite runner: layout, int8 (de)quantization, the CPU fallback, threads.

The int8 model is built by the real backend (`edgesdk.backends.tflite`) from a small inline
ONNX graph whose outputs come back in NHWC (perm (0, 3, 1, 2)) and in 2-d. No Edge TPU or
libedgetpu exists here: the delegate path is exercised through `FakeCoralDelegates`, a test double
standing in for libedgetpu (named as such), which records what the runner asks Coral's library for.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk.backends import tflite
from edgesdk.runtime.backends import open_runner
from edgesdk.runtime.manifest import Segment

ROOT = Path(__file__).resolve().parents[2]


def _model():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((6, 3, 3, 3)) * 0.3).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["conv"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["conv"], ["feat"]),
             helper.make_node("GlobalAveragePool", ["feat"], ["pool"]),
             helper.make_node("Flatten", ["pool"], ["vec"])]
    graph = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, 3, 8, 8))],
                              [helper.make_tensor_value_info("feat", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("vec", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """A bundle directory holding the int8 segment; returns (dir, TfliteResult, onnx model)."""
    root = tmp_path_factory.mktemp("bundle")
    (root / "segments").mkdir()
    model = _model()
    rng = np.random.default_rng(1)
    calibration = [{"x": rng.uniform(-1, 1, (1, 3, 8, 8)).astype(np.float32)} for _ in range(32)]
    result = tflite.convert_int8(model, calibration, root / "segments" / "s1.tflite")
    return root, result, model


def _segment(result, artifact: str = "segments/s1.tflite", fallback: str | None = "segments/s1.tflite") -> Segment:
    return Segment("s1", "edgetpu:0", "tflite", artifact, result.inputs, result.outputs, fallback_artifact=fallback)


def _reference(model, x):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(["feat", "vec"], session.run(["feat", "vec"], {"x": x})))


def test_uncompiled_segment_runs_on_cpu_in_onnx_layout(bundle):
    root, result, model = bundle
    runner = open_runner(root, _segment(result), "usb:0")
    assert runner.note == "segment s1 is not compiled for the Edge TPU: its int8 model runs on the CPU interpreter"
    assert result.outputs[0].perm == (0, 3, 1, 2)  # feat is NHWC inside the model
    # The first calibration sample: no value falls outside the calibrated ranges and saturates.
    x = np.random.default_rng(1).uniform(-1, 1, (1, 3, 8, 8)).astype(np.float32)
    got, want = runner.run({"x": x}), _reference(model, x)
    for spec in result.outputs:
        assert got[spec.name].shape == want[spec.name].shape and got[spec.name].dtype == np.float32
        # int8: input rounding plus output rounding, a few LSBs of the output scale.
        np.testing.assert_allclose(got[spec.name], want[spec.name], atol=4 * spec.quant.scale, err_msg=spec.name)


def test_missing_edgetpu_falls_back_to_the_uncompiled_model(bundle):
    root, result, model = bundle
    # The "compiled" artifact is garbage: the runner must never hand it to the CPU interpreter.
    (root / "segments" / "s1_edgetpu.tflite").write_bytes(b"not a model")
    segment = _segment(result, artifact="segments/s1_edgetpu.tflite")
    runner = open_runner(root, segment, "usb:0")
    assert runner.note == ("edgetpu:0 (usb:0) not found (libedgetpu.so.1 is not installed): "
                           "segment s1 runs its int8 model on the CPU")
    x = np.zeros((1, 3, 8, 8), np.float32)
    reference = open_runner(root, _segment(result), None).run({"x": x})
    for name, value in runner.run({"x": x}).items():
        np.testing.assert_array_equal(value, reference[name])
    assert "runs its int8 model on the CPU" in open_runner(root, segment, None).note


class FakeCoralDelegates:
    """TEST DOUBLE for libedgetpu.so.1 (no Edge TPU here). It stands in for the interpreter module the
    runner uses: `load_delegate` records the library and options it is asked for and returns a marker
    (or raises as the real one does for an unplugged TPU); `Interpreter` is LiteRT's real interpreter,
    which, given the marker, runs the uncompiled int8 model on the CPU in place of the TPU, so the
    runner's own code (encode, signature call, decode) runs for real."""

    def __init__(self, real, fallback: Path, unplugged: set[str] = frozenset()):
        self.real, self.fallback, self.unplugged = real, fallback, unplugged
        self.loaded: list[tuple[str, dict]] = []
        self.opened: list[str] = []

    def load_delegate(self, library: str, options: dict):
        if options.get("device") in self.unplugged:
            raise ValueError(f"Failed to load delegate from {library}")
        self.loaded.append((library, dict(options)))
        return ("fake-edgetpu-delegate", options["device"])

    def Interpreter(self, model_path: str, experimental_delegates=None, num_threads=None):  # noqa: N802
        self.opened.append(Path(model_path).name)
        if experimental_delegates:
            assert all(d[0] == "fake-edgetpu-delegate" for d in experimental_delegates)
            model_path = str(self.fallback)  # the compiled model needs a TPU; the double runs the int8 one
        return self.real.Interpreter(model_path=model_path, num_threads=num_threads)


def test_compiled_segment_loads_coral_delegate_per_tpu(bundle, monkeypatch):
    from edgesdk.runtime.backends import tflite_runner

    root, result, model = bundle
    shutil.copyfile(root / "segments" / "s1.tflite", root / "segments" / "s1_edgetpu.tflite")
    double = FakeCoralDelegates(tflite_runner._interpreter_module(), root / "segments" / "s1.tflite",
                                unplugged={"usb:1"})
    monkeypatch.setattr(tflite_runner, "_interpreter_module", lambda: double)
    monkeypatch.setattr(tflite_runner, "_libedgetpu_present", lambda: True)
    compiled = _segment(result, artifact="segments/s1_edgetpu.tflite")
    on_tpu = open_runner(root, compiled, "usb:0")
    assert on_tpu.note == ""  # the delegate loaded: nothing to tell the user
    assert double.loaded == [("libedgetpu.so.1", {"device": "usb:0"})]
    assert double.opened == ["s1_edgetpu.tflite"]  # the compiled model goes to the delegate
    x = np.random.default_rng(4).uniform(-1, 1, (1, 3, 8, 8)).astype(np.float32)
    reference = open_runner(root, _segment(result), None).run({"x": x})
    for name, value in on_tpu.run({"x": x}).items():
        np.testing.assert_array_equal(value, reference[name])
    # the second TPU is unplugged: the runner says so and runs the uncompiled int8 model on the CPU
    missing = open_runner(root, dataclasses.replace(compiled, device="edgetpu:1"), "usb:1")
    assert missing.note == "edgetpu:1 (usb:1) not found: segment s1 runs its int8 model on the CPU"
    assert double.opened[-1] == "s1.tflite" and len(double.loaded) == 1
    for name, value in missing.run({"x": x}).items():
        np.testing.assert_array_equal(value, reference[name])


def test_quantization_rounds_and_clips(bundle):
    root, result, model = bundle
    runner = open_runner(root, _segment(result), None)
    q = result.inputs[0].quant
    # Values far outside the calibrated range clip to the int8 range instead of wrapping around.
    big = np.full((1, 3, 8, 8), 1e6, np.float32)
    edge = np.full((1, 3, 8, 8), q.scale * (127 - q.zero_point), np.float32)
    for name, value in runner.run({"x": big}).items():
        np.testing.assert_array_equal(value, runner.run({"x": edge})[name])


def test_concurrent_runs_agree(bundle, monkeypatch):
    root, result, model = bundle
    monkeypatch.setenv("EDGESDK_NUM_THREADS", "1")
    runner = open_runner(root, _segment(result), None)
    xs = [np.random.default_rng(i).uniform(-1, 1, (1, 3, 8, 8)).astype(np.float32) for i in range(8)]
    expected = [runner.run({"x": x})["vec"] for x in xs]
    got: dict[int, np.ndarray] = {}

    def work(i: int) -> None:
        for _ in range(20):
            got[i] = runner.run({"x": xs[i]})["vec"]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(8):
        np.testing.assert_array_equal(got[i], expected[i])


def test_runner_imports_neither_tensorflow_nor_the_build_side(bundle, tmp_path):
    # Inside a bundle the runtime is a top-level package named `runtime`.
    shutil.copytree(ROOT / "sdk" / "edgesdk" / "runtime", tmp_path / "runtime")
    root, result, model = bundle
    code = (
        "import sys; from pathlib import Path\n"
        "from runtime.manifest import Segment, tensor_from_dict\n"
        "from runtime.backends import open_runner\n"
        "import json, numpy as np\n"
        f"specs = json.loads({_specs_json(result)!r})\n"
        "seg = Segment('s1', 'edgetpu:0', 'tflite', 'segments/s1.tflite',"
        " tuple(map(tensor_from_dict, specs['in'])), tuple(map(tensor_from_dict, specs['out'])),"
        " fallback_artifact='segments/s1.tflite')\n"
        f"out = open_runner(Path({str(root)!r}), seg, None).run({{'x': np.zeros((1, 3, 8, 8), np.float32)}})\n"
        "assert set(out) == {'feat', 'vec'}\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'edgesdk', 'onnx', 'keras')]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]


def _specs_json(result) -> str:
    import json

    from edgesdk.runtime.manifest import _plain

    return json.dumps({"in": _plain(result.inputs), "out": _plain(result.outputs)})
