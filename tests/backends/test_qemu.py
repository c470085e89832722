"""The emulated aarch64 system: packaging/arm64_rootfs.sh builds it, backends/qemu.py runs Python in it.

Under qemu-user, in the arm64 root file system, each test runs what an aarch64 bundle's self-test
runs and compares with the x86-64 host: a TVM library cross-compiled here (vs onnxruntime, rtol
1e-5 / atol 1e-5: the same float32 conv, only summation order and FMA contraction differ) and an
int8 .tflite under LiteRT (vs the host's LiteRT, bit-exact: integer kernels with the same
requantization on both CPUs). The rootfs is built once if `make rootfs` has not built it yet.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk.backends import qemu
from edgesdk.errors import UserError
from tests.numeric import assert_close

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "packaging" / "arm64_rootfs.sh"
PINS = REPO / "packaging" / "requirements-aarch64.txt"


def _pins(path: Path) -> dict[str, str]:
    """name -> version of a `name==version` file, names normalized as PyPI does (PEP 503)."""
    pins = {}
    for line in path.read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name.strip()).lower()] = version.strip()
    return pins


SLOW_FIXTURES = ("rootfs",)  # made with debootstrap where it is missing: the tests that need it are slow


@pytest.fixture(scope="session")
def rootfs() -> Path:
    found = qemu.find_rootfs()
    if found is not None:
        return found
    missing = [tool for tool in ("qemu-aarch64-static", "debootstrap") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (`make system` installs them): no emulated aarch64 here")
    # cached: a no-op when `make rootfs` already built it with the same recipe
    subprocess.run(["bash", str(SCRIPT), str(qemu.default_rootfs())], check=True, timeout=1200)
    found = qemu.find_rootfs()
    assert found is not None, f"{SCRIPT} finished but {qemu.default_rootfs()} is not complete"
    return found


def guest(rootfs: Path, code: str, cwd: Path, **env: str) -> str:
    """Run `python3 -c CODE` under qemu in `cwd`; its stdout, or the test fails with its stderr."""
    proc = qemu.run_python(rootfs, ["-c", code], cwd=cwd, env=env, timeout=300)
    assert proc.returncode == 0, f"guest python exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.stdout


# -- the rootfs and run_python ------------------------------------------------------------------


def test_device_pins_match_the_build_host():
    # The golden outputs come from the host's wheels: the device must run the very same versions.
    device, host = _pins(PINS), _pins(REPO / "constraints.txt")
    assert {"numpy", "apache-tvm", "apache-tvm-ffi", "ai-edge-litert"} <= device.keys()
    assert {name: version for name, version in device.items() if host.get(name, version) != version} == {}


def test_find_rootfs_ignores_an_incomplete_rootfs(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESDK_ARM64_ROOTFS", str(tmp_path))
    assert qemu.default_rootfs() == tmp_path
    (tmp_path / "usr" / "bin").mkdir(parents=True)
    (tmp_path / "usr" / "bin" / "python3").touch()
    assert qemu.find_rootfs() is None  # no .complete: the script was interrupted


def test_run_python_refuses_a_directory_without_python(tmp_path):
    if shutil.which(qemu.QEMU) is None:
        pytest.skip("qemu-aarch64-static not installed")
    with pytest.raises(UserError) as info:
        qemu.run_python(tmp_path, ["-c", "pass"], cwd=tmp_path)
    assert info.value.code == "qemu.no-rootfs"


def test_script_is_idempotent(rootfs):
    proc = subprocess.run(["bash", str(SCRIPT), str(rootfs)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "up to date" in proc.stdout


@pytest.mark.qemu
def test_guest_is_aarch64_with_the_pinned_packages(rootfs, tmp_path):
    # PYTHONPATH from `env` comes first, the host's (PYTHONPATH=sdk under pytest) never reaches the guest
    (tmp_path / "bundle_mod.py").write_text("WHERE = 'bundle'\n")
    out = guest(rootfs, """
import importlib.metadata as md, importlib.util, json, platform, numpy, bundle_mod
names = [d.metadata["Name"] for d in md.distributions()]
print(json.dumps({"machine": platform.machine(), "edgesdk": importlib.util.find_spec("edgesdk") is not None,
                  "bundle": bundle_mod.WHERE, "dists": {n: md.version(n) for n in names}}))
""", tmp_path, PYTHONPATH=str(tmp_path))
    facts = json.loads(out.strip().splitlines()[-1])
    assert facts["machine"] == "aarch64"
    assert facts["bundle"] == "bundle" and facts["edgesdk"] is False
    installed = {re.sub(r"[-_.]+", "-", n).lower(): v for n, v in facts["dists"].items()}
    assert {name: installed.get(name) for name in _pins(PINS)} == _pins(PINS)


# -- TVM: a library cross-compiled on the host runs in the guest's runtime-only TVM --------------


def _conv_relu() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((8, 3, 3, 3)) * 0.5).astype(np.float32)
    bias = rng.standard_normal(8).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["h"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["h"], ["y"])],
        "conv_relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])],
        initializer=[numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


@pytest.fixture(scope="module")
def aarch64_library(tmp_path_factory) -> tuple[Path, onnx.ModelProto]:
    """The conv+relu graph compiled by TVM for aarch64+NEON and linked by the cross gcc."""
    if shutil.which("aarch64-linux-gnu-gcc") is None:
        pytest.skip("aarch64-linux-gnu-gcc not installed (`make system` installs it)")
    import tvm
    from tvm.relax.frontend.onnx import from_onnx
    from tvm.support import cc

    model = _conv_relu()
    target = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]})
    executable = tvm.compile(from_onnx(model, shape_dict={"x": [1, 3, 16, 16]}, keep_params_in_input=False),
                             target=target)
    path = tmp_path_factory.mktemp("tvm-aarch64") / "conv_relu.so"
    executable.export_library(str(path), fcompile=cc.cross_compiler("aarch64-linux-gnu-gcc"))
    return path, model


@pytest.mark.qemu
def test_tvm_library_runs_under_emulation(rootfs, aarch64_library):
    import onnxruntime as ort

    library, model = aarch64_library
    work = library.parent
    x = np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)
    np.save(work / "x.npy", x)
    guest(rootfs, """
import numpy as np, tvm.runtime
from tvm.runtime.vm import VirtualMachine
assert tvm.base._RUNTIME_ONLY
device = tvm.runtime.cpu()
vm = VirtualMachine(tvm.runtime.load_module("conv_relu.so"), device)
np.save("y.npy", vm["main"](tvm.runtime.tensor(np.load("x.npy"), device)).numpy())
""", work)
    got = np.load(work / "y.npy")
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, {"x": x})
    assert got.shape == expected.shape == (1, 8, 16, 16)
    assert (expected > 0).mean() > 0.2  # the relu leaves real work to compare
    assert_close(got, expected)


# -- LiteRT: an int8 model computes the same integers in the guest as on the host ----------------


@pytest.fixture(scope="module")
def int8_tflite(tmp_path_factory) -> Path:
    """A full-int8 conv -> relu -> depthwise conv, converted by TF with calibration data."""
    import tensorflow as tf

    rng = np.random.default_rng(2)
    kernel = tf.constant((rng.standard_normal((3, 3, 3, 8)) * 0.5).astype(np.float32))
    bias = tf.constant(rng.standard_normal(8).astype(np.float32))
    depthwise = tf.constant((rng.standard_normal((3, 3, 8, 1)) * 0.5).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([1, 16, 16, 3], tf.float32)])
    def model(x):
        h = tf.nn.relu(tf.nn.conv2d(x, kernel, 1, "SAME") + bias)
        return tf.nn.depthwise_conv2d(h, depthwise, [1, 1, 1, 1], "SAME")

    converter = tf.lite.TFLiteConverter.from_concrete_functions([model.get_concrete_function()], model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = lambda: (
        [rng.uniform(-1, 1, (1, 16, 16, 3)).astype(np.float32)] for _ in range(16))
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    converter.inference_input_type = tf.int8
    converter.inference_output_type = tf.int8
    path = tmp_path_factory.mktemp("tflite-int8") / "conv_dw_int8.tflite"
    path.write_bytes(converter.convert())
    return path


_LITERT_RUN = """
import sys, numpy as np
from ai_edge_litert.interpreter import Interpreter
interpreter = Interpreter(model_path="conv_dw_int8.tflite")
interpreter.allocate_tensors()
interpreter.set_tensor(interpreter.get_input_details()[0]["index"], np.load("x.npy"))
interpreter.invoke()
np.save(sys.argv[1], interpreter.get_tensor(interpreter.get_output_details()[0]["index"]))
"""


@pytest.mark.qemu
def test_litert_int8_is_bit_exact_under_emulation(rootfs, int8_tflite):
    work = int8_tflite.parent
    np.save(work / "x.npy", np.random.default_rng(3).integers(-128, 128, (1, 16, 16, 3), dtype=np.int8))
    (work / "run.py").write_text(_LITERT_RUN)
    # the host's own LiteRT, the same script, in a separate process so both run it the same way
    host = subprocess.run([sys.executable, "run.py", "host.npy"], cwd=work, capture_output=True, text=True, timeout=120)
    assert host.returncode == 0, host.stderr[-3000:]
    proc = qemu.run_python(rootfs, ["run.py", "guest.npy"], cwd=work, timeout=300)
    assert proc.returncode == 0, f"guest python exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    expected, got = np.load(work / "host.npy"), np.load(work / "guest.npy")
    assert got.dtype == expected.dtype == np.int8 and got.shape == expected.shape == (1, 16, 16, 8)
    assert len(np.unique(expected)) > 32  # not a saturated output that any kernel would match
    np.testing.assert_array_equal(got, expected)


# -- onnxruntime: what an aarch64 bundle runs on the CPU where TVM does not lower a node ------------


def test_onnxruntime_runs_a_quantized_segment_as_the_host_does(rootfs, tmp_path):
    """A full-int8 model's input DequantizeLinear and output QuantizeLinear run on onnxruntime on an ARM CPU:
    the emulated system lacked onnxruntime, and such a bundle's self-test failed ('No module named
    onnxruntime'). Integer in, integer out: the guest's answer is the host's, to the bit."""
    import onnxruntime as ort

    inits = [numpy_helper.from_array(np.array(0.05, np.float32), "s"), numpy_helper.from_array(np.array(-3, np.int8), "z")]
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["x", "s", "z"], ["f"]), helper.make_node("Relu", ["f"], ["r"]),
         helper.make_node("QuantizeLinear", ["r", "s", "z"], ["y"])], "qdq",
        [helper.make_tensor_value_info("x", TensorProto.INT8, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.INT8, [1, 64])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.save(model, tmp_path / "qdq.onnx")
    x = np.arange(-128, 128, 4, dtype=np.int8).reshape(1, 64)
    np.save(tmp_path / "x.npy", x)
    out = guest(rootfs, """
import numpy as np, onnxruntime as ort
y = ort.InferenceSession("qdq.onnx", providers=["CPUExecutionProvider"]).run(None, {"x": np.load("x.npy")})[0]
print(",".join(map(str, y.ravel().tolist())))
""", tmp_path)
    want = ort.InferenceSession(str(tmp_path / "qdq.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert out.strip().splitlines()[-1] == ",".join(map(str, want.ravel().tolist()))
