"""The command line: bad input gets an `error:` line, a `hint:` line, the right exit code, no
traceback, and leaves nothing half-written behind. Runs `edgesdk` as a user does, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.model_zoo import PPOCR_CLS, ROOT


def edgesdk(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "sdk"), **(env or {})}
    return subprocess.run([sys.executable, "-m", "edgesdk.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=600)


def assert_user_facing(proc: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr  # progress lines may come before it, nothing after but notes
    assert any(line.startswith("hint: ") for line in lines[errors[0]:]), proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in proc.stderr, proc.stderr


def test_help_is_fast_and_lists_commands():
    proc = edgesdk("--help")
    assert proc.returncode == 0
    for cmd in ("build", "run", "verify", "inspect", "targets"):
        assert cmd in proc.stdout


def test_build_help_shows_the_written_defaults():
    """Defaults written into an option's help (where typer cannot show one) survive rich's markup."""
    proc = subprocess.run([sys.executable, "-m", "edgesdk.cli", "build", "--help"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "sdk"), "COLUMNS": "400"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for note in ("[default: ~/.cache/edgesdk/tuning/TARGET]", "[default: all]", "[default: the target's legalize"):
        assert note in text, note


def test_missing_model_file(tmp_path):
    out = tmp_path / "out"
    proc = edgesdk("build", str(tmp_path / "nope.onnx"), "--target", "x86", "-o", str(out))
    assert_user_facing(proc, 2, "nope.onnx does not exist")
    assert not out.exists()


def test_file_that_is_not_a_model(tmp_path):
    bad = tmp_path / "notes.onnx"
    bad.write_text("these are not the weights you are looking for\n" * 20)
    out = tmp_path / "out"
    proc = edgesdk("build", str(bad), "--target", "x86", "-o", str(out))
    assert_user_facing(proc, 1, "notes.onnx")
    assert not out.exists()


@pytest.mark.parametrize("keep", [0.5, 0.9])
def test_truncated_onnx(tmp_path, keep):
    data = PPOCR_CLS.read_bytes()
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(data[: int(len(data) * keep)])
    out = tmp_path / "out"
    proc = edgesdk("build", str(cut), "--target", "x86", "-o", str(out), "--input-shape", "x=1x3x48x192")
    assert_user_facing(proc, 1, "cut.onnx")
    assert not out.exists()


def test_unknown_target(tmp_path):
    out = tmp_path / "out"
    proc = edgesdk("build", str(PPOCR_CLS), "--target", "arm_4tpu", "-o", str(out))
    assert_user_facing(proc, 2, "unknown target 'arm_4tpu'", "arm_2tpu")
    assert not out.exists()


def test_bad_target_key_names_file_and_line(tmp_path):
    t = tmp_path / "mine.yaml"
    t.write_text((ROOT / "targets" / "x86.yaml").read_text().replace("cores: 4", "cores: 4\n    cache_mb: 8"))
    out = tmp_path / "out"
    proc = edgesdk("build", str(PPOCR_CLS), "--target", str(t), "-o", str(out))
    assert_user_facing(proc, 2, f"{t}:", "unknown key 'devices.0.cache_mb'")
    assert not out.exists()
    assert edgesdk("targets", "validate", str(t)).returncode == 2


def test_dynamic_dimension_names_the_input(tmp_path):
    out = tmp_path / "out"
    proc = edgesdk("build", str(PPOCR_CLS), "--target", "x86", "-o", str(out))
    assert_user_facing(proc, 2, "input 'x': dimension 2", "--input-shape")
    assert not out.exists()


def test_bad_invocations_exit_2(tmp_path):
    assert edgesdk("build").returncode == 2
    proc = edgesdk("build", str(PPOCR_CLS), "--target", "x86", "-o", str(tmp_path / "o"), "--until", "deploy")
    assert_user_facing(proc, 2, "--until deploy: no such stage")
    proc = edgesdk("build", str(PPOCR_CLS), "--target", "x86", "-o", str(tmp_path / "o"), "--input-shape", "x=1x3xbig")
    assert_user_facing(proc, 2, "--input-shape x=1x3xbig")
    proc = edgesdk("build", str(PPOCR_CLS), "--target", "x86", "-o", str(tmp_path / "o"), "--calib-method", "kl")
    assert_user_facing(proc, 2, "--calib-method kl: expected one of minmax, percentile, mse, entropy, auto")
    proc = edgesdk("build", str(PPOCR_CLS), "--target", "x86", "-o", str(tmp_path / "o"), "--calib-percentile", "20")
    assert_user_facing(proc, 2, "--calib-percentile 20.0: outside (50, 100]")


@pytest.mark.parametrize("given, message", [
    ("x=0", "--input-range x=0: expected NAME=LOW,HIGH like x=0,1"),
    ("x", "--input-range x: expected NAME=LOW,HIGH like x=0,1"),
    ("x=0,1,2", "--input-range x=0,1,2: expected NAME=LOW,HIGH like x=0,1"),
    ("x=0,nan", "--input-range x=0,nan: expected NAME=LOW,HIGH like x=0,1"),
    ("x=-inf,1", "--input-range x=-inf,1: expected NAME=LOW,HIGH like x=0,1"),
    ("=0,1", "--input-range =0,1: expected NAME=LOW,HIGH like x=0,1"),
    ("x=1,0", "--input-range x=1,0: LOW must be less than HIGH"),
    ("x=1,1", "--input-range x=1,1: LOW must be less than HIGH"),
])
def test_a_bad_input_range_is_refused_before_anything_runs(given, message, tmp_path):
    out = tmp_path / "o"
    proc = edgesdk("build", str(PPOCR_CLS), "--target", "arm_2tpu", "-o", str(out), "--input-shape", "x=1x3x48x192",
                   "--input-range", given)
    assert_user_facing(proc, 2, message)
    assert not out.exists()


def test_an_input_range_naming_no_input_or_twice_is_refused(tmp_path):
    """A name the model has no input of is said after import, before any later stage runs; the same
    input twice before anything runs."""
    out = tmp_path / "o"
    proc = edgesdk("build", str(PPOCR_CLS), "--target", "arm_2tpu", "-o", str(out), "--input-shape", "x=1x3x48x192",
                   "--input-range", "x=0,1", "--input-range", "x=0,2")
    assert_user_facing(proc, 2, "--input-range names 'x' twice")
    assert not out.exists()
    proc = edgesdk("build", str(PPOCR_CLS), "--target", "arm_2tpu", "-o", str(out), "--input-shape", "x=1x3x48x192",
                   "--input-range", "image=0,1")
    assert_user_facing(proc, 2, "--input-range names 'image', which is not an input of the model",
                       "hint: the model's inputs: x")
    assert [p.name for p in (out / ".build").iterdir()] == ["1-import"] and not (out / "bundle").exists()


def test_a_bad_output_activation_is_refused(tmp_path):
    """A malformed or repeated --output-activation before anything runs; an output the model lacks after
    import, naming the outputs it has."""
    out = tmp_path / "o"
    base = ("build", str(PPOCR_CLS), "--target", "arm_2tpu", "-o", str(out), "--input-shape", "x=1x3x48x192")
    for given, message in (("y=relu", "--output-activation y=relu: expected NAME=ACTIVATION with ACTIVATION one of "
                                      "sigmoid, softmax"),
                           ("sigmoid", "--output-activation sigmoid: expected NAME=ACTIVATION"),
                           ("=sigmoid", "--output-activation =sigmoid: expected NAME=ACTIVATION")):
        assert_user_facing(edgesdk(*base, "--output-activation", given), 2, message)
        assert not out.exists()
    proc = edgesdk(*base, "--output-activation", "y=sigmoid", "--output-activation", "y=softmax")
    assert_user_facing(proc, 2, "--output-activation names 'y' twice")
    proc = edgesdk(*base, "--output-activation", "logits=sigmoid")
    assert_user_facing(proc, 2, "--output-activation names 'logits', which is not an output of the model",
                       "hint: the model's outputs: ")
    assert [p.name for p in (out / ".build").iterdir()] == ["1-import"] and not (out / "bundle").exists()


def test_bad_calibration_images_are_a_user_error(tmp_path):
    """A --calib directory of images with a preprocessing that does not fit: exit 1, named, nothing left."""
    from PIL import Image

    calib = tmp_path / "calib"
    calib.mkdir()
    Image.new("RGB", (192, 48), (200, 200, 200)).save(calib / "a.png")
    out = tmp_path / "o"
    proc = edgesdk("build", str(PPOCR_CLS), "--input-shape", "x=1x3x48x192", "--target", "arm_2tpu", "-o", str(out),
                   "--calib", str(calib), "--calib-preprocess", "mean=0.5:0.5")
    assert_user_facing(proc, 1, "mean has 2 values, the input has 3 channel(s)")
    assert not (out / "bundle").exists()


def test_custom_ops_are_listed_together(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Relu", ["x"], ["a"]),
             helper.make_node("FancyNorm", ["a"], ["b"], domain="com.acme", name="norm1"),
             helper.make_node("FancyNorm", ["b"], ["y"], domain="com.acme", name="norm2")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("com.acme", 1)])
    m.ir_version = 10
    path = tmp_path / "custom.onnx"
    onnx.save(m, path)
    proc = edgesdk("build", str(path), "--target", "x86", "-o", str(tmp_path / "o"))
    assert_user_facing(proc, 1, "node 'norm1'", "node 'norm2'", "com.acme::FancyNorm")


def constants_only(path: Path) -> Path:
    """A model whose every output folds to a constant (Relu -> Shape -> Concat): nothing to compute."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Shape", ["r"], ["s"]),
             helper.make_node("Concat", ["s", "tail"], ["y"], axis=0)]
    g = helper.make_graph(nodes, "shape_only", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.INT64, [3])],
                          [numpy_helper.from_array(np.array([7], np.int64), "tail")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    onnx.save(m, path)
    return path


def test_a_model_that_folds_to_constants_is_a_user_error(tmp_path):
    """An output cut at a shape computation (here Shape -> Concat, as onnx.utils.extract_model leaves
    when cut there) folds to a constant: nothing to compile. Was an internal error (exit 3) in the
    schedule stage's simulator."""
    path = constants_only(tmp_path / "shape_only.onnx")
    proc = edgesdk("build", str(path), "--target", "x86", "-o", str(tmp_path / "o"))
    assert_user_facing(proc, 1, "no operator is left once constants are folded", "every output (y)",
                       "hint: an output cut at a shape computation")
    assert not (tmp_path / "o" / "bundle").exists()


def test_targets_commands():
    proc = edgesdk("targets", "list")
    assert proc.returncode == 0 and "arm_2tpu" in proc.stdout and "rtx3090" in proc.stdout
    proc = edgesdk("targets", "show", "arm_2tpu")
    assert proc.returncode == 0 and "usb:1" in proc.stdout and "Coral Edge TPU datasheet" in proc.stdout
    proc = edgesdk("targets", "schema")
    assert proc.returncode == 0 and '"EdgeTpuDevice"' in proc.stdout
    assert edgesdk("targets", "validate", str(ROOT / "targets" / "x86.yaml")).returncode == 0


def test_bundle_commands_on_non_bundles(tmp_path):
    proc = edgesdk("verify", str(tmp_path / "missing"))
    assert_user_facing(proc, 1, "does not exist")
    (tmp_path / "empty").mkdir()
    proc = edgesdk("inspect", str(tmp_path / "empty"))
    assert_user_facing(proc, 1, "no manifest.json")
    junk = tmp_path / "b.tar.gz"
    junk.write_bytes(b"\x1f\x8b not really")
    assert_user_facing(edgesdk("verify", str(junk)), 1, "not a bundle archive (neither a gzip-compressed nor a plain tar archive)")


@pytest.mark.parametrize("value, message", [
    ("tvm,cuda", "--cpu-backends 'tvm,cuda': unknown backend 'cuda'"),
    (",", "--cpu-backends ',': names no backend"),
])
def test_cpu_backends_are_checked_before_anything_runs(tmp_path, value, message):
    proc = edgesdk("build", str(PPOCR_CLS), "-t", "x86", "-o", str(tmp_path / "o"), "--cpu-backends", value)
    assert_user_facing(proc, 2, message, "choose among tvm,onnxruntime,litert")
    assert not (tmp_path / "o").exists()


def test_cpu_precision_is_checked_before_anything_runs(tmp_path):
    proc = edgesdk("build", str(PPOCR_CLS), "-t", "x86", "-o", str(tmp_path / "o"), "--cpu-precision", "int4")
    assert_user_facing(proc, 2, "--cpu-precision int4: expected fp32, bf16, fp16, int8 or auto",
                       "bf16, fp16 and int8 measure CPU candidates in that precision")
    assert not (tmp_path / "o").exists()


def test_a_target_sets_its_cpu_precision_and_the_flag_overrides_it(tmp_path):
    from types import SimpleNamespace

    import yaml

    from edgesdk.config import load_target
    from edgesdk.stages.tune import cpu_precision

    spec = yaml.safe_load((Path(__file__).resolve().parents[1] / "targets" / "x86.yaml").read_text())
    spec["devices"][0]["precision"] = "int8"
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(spec))
    target, _ = load_target(str(tmp_path / "t.yaml"))
    assert cpu_precision(SimpleNamespace(cpu_precision=None), target) == "int8"
    assert cpu_precision(SimpleNamespace(cpu_precision="fp32"), target) == "fp32"
    assert cpu_precision(SimpleNamespace(cpu_precision=None), load_target("x86")[0]) == "fp32"
    spec["devices"][0]["precision"] = "int4"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(spec))
    proc = edgesdk("build", str(PPOCR_CLS), "-t", str(tmp_path / "bad.yaml"), "-o", str(tmp_path / "o"))
    assert proc.returncode == 2 and "precision" in proc.stderr and "Traceback" not in proc.stderr


def _softplus_model(path: Path) -> Path:
    """A convolution then Softplus, 1x3x8x8: the Edge TPU lacks Softplus, so legalize fits an approximation
    on the calibration data (`check --target arm_2tpu` reads --calib)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).normal(size=(4, 3, 3, 3)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["h"], pads=[1, 1, 1, 1]),
                           helper.make_node("Softplus", ["h"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    onnx.save(m, path)
    return path


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.parametrize("kind", ["fifo", "bomb"])
def test_a_calibration_file_that_is_a_fifo_or_a_decompression_bomb_is_a_user_error(tmp_path, kind):
    """A FIFO named like an image hung the command (opened for reading, it waits for a writer); a PNG of
    a few bytes declaring 20000x20000 pixels was an internal error. Both are refused unread, and the
    command writes nothing."""
    from tests.ir.test_calibration import _png_header

    model = _softplus_model(tmp_path / "softplus.onnx")
    calib = tmp_path / "calib"
    calib.mkdir()
    if kind == "fifo":
        os.mkfifo(calib / "a.png")
    else:
        (calib / "a.png").write_bytes(_png_header(20000, 20000))
    before = _files(tmp_path)
    proc = edgesdk("check", str(model), "--target", "arm_2tpu", "--calib", str(calib), cwd=tmp_path)
    if kind == "fifo":
        assert_user_facing(proc, 1, f"error: {calib / 'a.png'}: not a regular file (a FIFO)",
                           "hint: give PNG, JPEG or BMP files")
    else:
        assert_user_facing(proc, 1, f"error: {calib / 'a.png'}: the image declares 20000x20000 pixels (400,000,000), "
                           "more than the 89,478,485 a calibration image may have", "may be a decompression bomb")
    assert _files(tmp_path) == before


def test_a_prune_plan_nested_without_end_is_an_invocation_error(tmp_path):
    """100,000 nested lists in a plan file: json's parser ran out of stack (RecursionError, exit 3)."""
    plan = tmp_path / "plan.json"
    plan.write_bytes(b'{"layers": {},\n "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    out = tmp_path / "o"
    proc = edgesdk("build", str(_softplus_model(tmp_path / "m.onnx")), "--target", "x86", "-o", str(out),
                   "--prune-plan", str(plan), "--cpu-backends", "planned")
    assert_user_facing(proc, 2, f"error: {plan}:2: nested more than 32 levels deep", 'hint: a plan is {"format"')
    assert not (out / "bundle").exists() and not (out / "bundle.tar.gz").exists()


def test_tensorflow_load_noise_stays_off_the_terminal(tmp_path):
    """A build that converts a segment to TFLite (here the Edge TPU's) imports TensorFlow, whose native
    libraries print absl's notice and oneDNN's line while they load, whatever TF_CPP_MIN_LOG_LEVEL says.
    Without --debug, neither reaches stderr; the build's own lines do."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((8, 4), np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    onnx.save(m, tmp_path / "mm.onnx")
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS")}
    proc = subprocess.run([sys.executable, "-m", "edgesdk.cli", "build", str(tmp_path / "mm.onnx"), "-t", "arm_2tpu",
                           "-o", str(tmp_path / "o"), "--tuning-db", str(tmp_path / "db")], capture_output=True,
                          text=True, env={**env, "PYTHONPATH": str(ROOT / "sdk")}, timeout=600)
    assert proc.returncode == 0, proc.stderr
    from edgesdk.runtime.manifest import Manifest

    # the segment went through TensorFlow's converter, in the build's own process
    assert [s.backend for s in Manifest.load(tmp_path / "o" / "bundle").segments] == ["tflite"]
    for noise in ("absl::InitializeLog", "oneDNN custom operations are on", "port.cc:"):
        assert noise not in proc.stderr, proc.stderr


def test_a_native_crash_under_held_back_stderr_still_says_where_it_happened(tmp_path):
    """A converter's segfault while the int8 conversion holds back what native code writes to fd 2, after
    importing TVM put its own handler on the signal: it killed a build with nothing said. The report goes to
    a copy of the real stderr, and each conversion step takes the handler back."""
    script = tmp_path / "crash.py"
    script.write_text(
        "import ctypes, signal\n"
        "from edgesdk import cli  # noqa: F401\n"
        "from edgesdk.crashes import report_native_crashes\n"
        "from edgesdk.backends.tflite import convert\n"
        "report_native_crashes()  # as cli.main does\n"
        "signal.signal(signal.SIGSEGV, signal.SIG_DFL)  # as a native library installing its own handler does\n"
        "def converting():\n"
        "    ctypes.string_at(0)\n"
        "convert._quiet(converting)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "sdk"), "PYTHONFAULTHANDLER": ""})
    assert done.returncode < 0
    assert "Segmentation fault" in done.stderr and "in converting" in done.stderr, done.stderr
