"""The Python API (edgesdk/api.py, edgesdk/__init__.py): a light import, the public names, options checked
as the command line checks them, the same bundle as the command line builds, byte for byte, from a path
and from an onnx.ModelProto in memory, and a bundle opened, run, streamed, inspected, verified and benched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import edgesdk
from edgesdk import api
from edgesdk.backends import onnxruntime as ort_backend
from edgesdk.errors import UsageError, UserError
from tests.numeric import assert_close


def tiny(name: str = "tiny") -> onnx.ModelProto:
    """A convolution, ReLU and pooling: small enough to build for x86 in seconds."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(8, 3, 3, 3)).astype(np.float32) * 0.3, "w")
    b = numpy_helper.from_array(rng.normal(size=(8,)).astype(np.float32) * 0.1, "b")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["r"]),
         helper.make_node("GlobalAveragePool", ["r"], ["y"])],
        name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 1, 1])], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_importing_edgesdk_imports_nothing_heavy():
    code = ("import sys, edgesdk\n"
            "edgesdk.build, edgesdk.Bundle, edgesdk.BuildOptions, edgesdk.EdgeSDKError, edgesdk.targets\n"
            "print([m for m in ('numpy', 'onnx', 'onnxruntime', 'tvm', 'tensorflow', 'torch', 'typer', 'yaml')"
            " if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_every_public_name_is_documented_and_listed():
    for name in edgesdk.__all__:
        value = getattr(edgesdk, name)
        assert name == "__version__" or value.__doc__, name
    assert set(edgesdk.__all__) <= set(dir(edgesdk))
    assert edgesdk.build is api.build and edgesdk.EdgeSDKError is UserError.__mro__[1]
    with pytest.raises(AttributeError):
        edgesdk.no_such_name  # noqa: B018
    assert edgesdk.targets.load("x86").name == "x86" and "arm_2tpu" in edgesdk.targets.shipped()


@pytest.mark.parametrize("given, code, says", [
    ({"calib_methd": "auto"}, "api.unknown-option", "'calib_methd'"),
    ({"mode": "fast"}, "cli.bad-mode", "mode fast: expected latency or throughput"),
    ({"calib_percentile": 120.0}, "cli.bad-calib-percentile", "outside (50, 100]"),
    ({"prune_layers": "conv*"}, "cli.prune-options", "need --prune or --prune-plan"),
    ({"rpc_tracker": "host:9190"}, "cli.rpc", "go together"),
    ({"input_shapes": ["x=1xAx3"]}, "cli.bad-shape", "expected NAME=DIMS"),
    ({"input_shapes": {"x": (1, 0, 3)}}, "cli.bad-shape", "x=1x0x3"),
    ({"cpu_backends": ("tvm", "tensorrt")}, "cli.bad-cpu-backends", "unknown backend 'tensorrt'"),
    ({"time_budget": -5}, "cli.bad-duration", "not a duration"),
])
def test_options_are_refused_as_the_command_line_refuses_them_before_anything_is_written(tmp_path, given, code,
                                                                                         says):
    with pytest.raises(UsageError) as e:
        edgesdk.build(tiny(), "x86", tmp_path / "out", **given)
    assert e.value.code == code and says in e.value.message, e.value
    assert not (tmp_path / "out").exists()


def test_an_unknown_option_names_the_one_meant():
    with pytest.raises(UsageError) as e:
        api.options("m.onnx", "x86", "out", calib_methd="auto")
    assert "did you mean 'calib_method'" in e.value.hint


def test_typed_values_and_the_command_lines_text_give_the_same_options():
    typed = api.options("m.onnx", "x86", "out", input_shapes={"x": (1, 3, 16, 16)}, time_budget=90,
                        cpu_backends=("tvm",), input_ranges={"x": (0, 1)}, keep_on_cpu=("a", "b"), mode="throughput")
    text = api.options("m.onnx", "x86", "out", input_shapes=["x=1x3x16x16"], time_budget="90s", cpu_backends="tvm",
                       input_ranges="x=0,1", keep_on_cpu=["a,b"], mode="throughput")
    assert typed == text
    assert typed.input_shapes == {"x": (1, 3, 16, 16)} and typed.time_budget == 90.0
    assert typed.model == Path("m.onnx") and typed.out == Path("out")


def test_check_analyses_an_object_in_memory_without_writing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    report = edgesdk.check(tiny(), "arm_2tpu", log=lambda s: None)
    assert report["model"] == "tiny.onnx (in memory)" and report["target"] == "arm_2tpu"
    assert report["before"]["coverage"], report["before"]  # the Edge TPU's share of the ops
    assert list(tmp_path.iterdir()) == []


def test_objects_that_are_no_model_are_refused(tmp_path):
    with pytest.raises(UsageError) as e:
        edgesdk.build({"not": "a model"}, "x86", tmp_path / "out")
    assert e.value.code == "api.unknown-model" and "builtins.dict" in e.value.message
    with pytest.raises(UsageError) as e:
        edgesdk.build(b"\x00" * 64, "x86", tmp_path / "out")
    assert e.value.code == "api.unknown-model" and "TFLite" in e.value.message
    with pytest.raises(UsageError) as e:
        edgesdk.build(tiny(), "x86", tmp_path / "out", example_inputs=(np.zeros(3),))
    assert e.value.code == "api.example-inputs"


SOURCE_DATE_EPOCH = "1700000000"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The tiny model built for x86 by the command line, and from Python from its path and from the
    ModelProto in memory, into three directories with one tuning database."""
    tmp = tmp_path_factory.mktemp("api")
    model = tiny()
    path = tmp / "tiny.onnx"
    onnx.save(model, str(path))
    common = ["--target", "x86", "--cpu-backends", "planned", "--tuning-db", str(tmp / "db")]
    env = {**os.environ, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH}
    proc = subprocess.run([sys.executable, "-m", "edgesdk", "build", str(path), "-o", str(tmp / "cli"), *common,
                           "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    saved = os.environ.get("SOURCE_DATE_EPOCH")
    os.environ["SOURCE_DATE_EPOCH"] = SOURCE_DATE_EPOCH
    try:
        lines: list[str] = []
        from_path = edgesdk.build(path, "x86", tmp / "api", cpu_backends=("planned",), tuning_db=tmp / "db",
                                  log=lines.append)
        from_proto = edgesdk.build(model, "x86", tmp / "proto", cpu_backends="planned", tuning_db=tmp / "db",
                                   log=lambda s: None)
    finally:
        if saved is None:
            del os.environ["SOURCE_DATE_EPOCH"]
        else:
            os.environ["SOURCE_DATE_EPOCH"] = saved
    return {"tmp": tmp, "model": model, "cli": json.loads(proc.stdout), "api": from_path, "proto": from_proto,
            "lines": lines}


@pytest.mark.slow
def test_a_build_from_python_is_the_command_lines_bundle_byte_for_byte(built):
    cli = (built["tmp"] / "cli" / "bundle.tar.gz").read_bytes()
    assert built["api"].tarball.read_bytes() == cli
    # the ModelProto was written to OUT/.build/source/tiny.onnx (its graph's name) and built as that file
    assert built["proto"].tarball.read_bytes() == cli
    assert (built["tmp"] / "proto" / ".build" / "source" / "tiny.onnx").is_file()
    # the summary is what --json prints, stage by stage
    assert [s["name"] for s in built["api"].summary["stages"]] == [s["name"] for s in built["cli"]["stages"]]
    assert built["api"].summary["signed_by"] is None and built["api"].bundle.path == built["tmp"] / "api" / "bundle"
    assert set(built["api"].stages) == {"import", "legalize", "schedule", "tune", "compress", "package"}
    # what the command line prints on stderr went to the callback
    assert any("placement" in line or "segment" in line for line in built["lines"]), built["lines"]


@pytest.mark.slow
def test_nothing_goes_to_stdout_and_progress_goes_to_logging(built, tmp_path, capfd, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="edgesdk")
    shutil.copytree(built["tmp"] / "api", tmp_path / "again")  # its stages cached: the build replays them
    capfd.readouterr()
    again = edgesdk.build(built["tmp"] / "tiny.onnx", "x86", tmp_path / "again", cpu_backends=("planned",),
                          tuning_db=built["tmp"] / "db")
    assert capfd.readouterr().out == ""
    assert again.bundle is not None and any(r.name == "edgesdk" for r in caplog.records)
    assert any("cached" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_a_bundle_opened_runs_streams_inspects_and_verifies(built, tmp_path):
    x = np.random.default_rng(3).normal(size=(1, 3, 16, 16)).astype(np.float32)
    want = ort_backend.run(built["model"], {"x": x})["y"]
    with edgesdk.Bundle.open(built["api"].tarball) as bundle:  # the archive, unpacked while it is open
        assert bundle.inputs == {"x": ((1, 3, 16, 16), "float32")}
        assert_close(bundle.run({"x": x})["y"], want)
        assert_close(bundle.run(x)["y"], want)  # one input: the array alone
        frames = [x, x * 0.5, -x]
        streamed = list(bundle.stream(frames))
        for frame, got in zip(frames, streamed):
            assert_close(got["y"], bundle.run(frame)["y"])
        assert bundle.inspect()["model"]["name"] == "tiny"
        report = bundle.verify()
        assert report.hashes_ok and report.selftest == "passed", report.detail
        with pytest.raises(UserError) as e:
            bundle.run({"x": np.full((1, 3, 16, 16), np.nan, np.float32)})
        assert e.value.code == "run.input-refused"
        with pytest.raises(UsageError) as e:
            bundle.run({"x": x, "z": x})
        assert e.value.code == "run.bad-input" and "'z'" in e.value.message
        figures = bundle.bench(runs=5, warmup=1, callers=(1,), depth=(1,), frames=4)
        assert figures["latency_ms"]["n"] == 5 and figures["latency_ms"]["p50"] > 0, figures
        assert figures["model"] == "tiny" and figures["emulated"] is None


@pytest.mark.slow
def test_a_damaged_bundle_is_refused_as_it_is_opened(built, tmp_path):
    damaged = tmp_path / "bundle"
    shutil.copytree(built["api"].bundle.path, damaged)
    victim = next(p for p in sorted(damaged.rglob("*")) if p.is_file() and p.name != "manifest.json")
    victim.write_bytes(victim.read_bytes() + b"\x00")
    with pytest.raises(UserError) as e:
        edgesdk.Bundle.open(damaged)
    assert victim.name in str(e.value) or victim.name in " ".join(e.value.notes), e.value


@pytest.mark.slow
def test_a_bundle_is_signed_and_verified_with_the_key(built, tmp_path):
    shutil.copytree(built["api"].out, tmp_path / "out", ignore=shutil.ignore_patterns(".build"))
    private, public, key_id = edgesdk.generate_keys(tmp_path / "keys", "release")
    written, manifest = edgesdk.sign(tmp_path / "out" / "bundle", private, bundle_version=7)
    assert written == [tmp_path / "out" / "bundle", tmp_path / "out" / "bundle.tar.gz"]
    assert manifest.bundle_version == 7 and manifest.signing["key_id"] == key_id
    with edgesdk.Bundle.open(tmp_path / "out" / "bundle.tar.gz") as bundle:
        report = bundle.verify(public_key=public, selftest=False)
        assert report.signature.startswith("verified") and key_id in report.signature, report.signature
        with pytest.raises(UserError):
            bundle.verify(public_key=public, installed_version=8, selftest=False)


@pytest.mark.slow
def test_a_keras_model_and_tflite_bytes_in_memory_build_as_their_files_do(tmp_path):
    """A Keras model object (saved as .keras under OUT/.build/source) and the bytes TFLiteConverter returns
    (written as .tflite): each bundle answers as Keras does, on photo crops."""
    import tensorflow as tf

    from tests import model_zoo
    from tests.frontends.tf_models import IMAGE, conv_net

    model = conv_net()
    rng = np.random.default_rng(0)
    photo = model_zoo.photos()[0].astype(np.float32) / 255.0
    xs = [photo[y:y + IMAGE[0], x:x + IMAGE[1]][None] for y, x in rng.integers(0, 200, size=(4, 2))]
    want = [model(x, training=False).numpy() for x in xs]
    flat = tf.lite.TFLiteConverter.from_keras_model(model).convert()
    for given, name, suffix in ((model, None, ".keras"), (flat, "net", ".tflite")):
        build = edgesdk.build(given, "x86", tmp_path / suffix[1:], name=name, low_memory=True,
                              log=lambda s: None)
        assert len(list((tmp_path / suffix[1:] / ".build" / "source").glob(f"*{suffix}"))) == 1
        with edgesdk.Bundle.open(build.bundle.path) as bundle:
            (inp,) = bundle.inputs
            for x, w in zip(xs, want):
                assert_close(next(iter(bundle.run({inp: x}).values())), w)
