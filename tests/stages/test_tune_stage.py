"""The tune stage through the pipeline and the command line: MetaSchedule records found with
--trials N are applied, summarized per task, persisted in the database and reused; a build that
replays a database is the same bytes; tuning's invocation errors and an unreachable RPC tracker
are reported as such."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk.backends import onnxruntime as ort_backend
from edgesdk.ir.digest import tree_sha256
from edgesdk.pipeline import BuildOptions, build
from edgesdk.runtime import BundleModel, Manifest
from tests.test_cli import assert_user_facing, edgesdk
from tests.numeric import assert_close

pytestmark = pytest.mark.slow  # builds that tune


def _conv_model(path):
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(0, 0.2, (16, 8, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])]
    g = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 16, 16])], initializer=[w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    onnx.save(m, str(path))
    return m


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """`edgesdk build conv.onnx --target x86 --trials 16` as a user runs it."""
    tmp = tmp_path_factory.mktemp("tune")
    model = _conv_model(tmp / "conv.onnx")
    proc = edgesdk("build", str(tmp / "conv.onnx"), "--target", "x86", "-o", str(tmp / "a"), "--trials", "16",
                   "--tuning-db", str(tmp / "db"), "--cpu-backends", "planned")  # TVM's segment, however fast
    assert proc.returncode == 0, proc.stderr
    return {"tmp": tmp, "model": model, "db": tmp / "db", "out": tmp / "a", "stderr": proc.stderr}


PLANNED = ("planned",)  # the plan's TVM segment, no CPU backend measured: these tests are about its tuning


def test_the_build_shows_progress_and_a_summary_per_task(tuned):
    err = tuned["stderr"]
    assert "tune: cpu: segments s0: up to 16 trials, measured on this host" in err
    bars = [line for line in err.splitlines() if "tune: cpu [" in line]
    # the budget less the three untuned baselines: the convolution and, since x86 convolutions run
    # channels-last, the transposes at the model's NCHW input and output, which are compiled too
    assert bars and "/13 trials" in bars[-1] and "best" in bars[-1] and " ms" in bars[-1], err
    assert "untuned ms" in err and "speedup" in err
    row = next(line for line in err.splitlines() if line.strip().startswith("fused_conv2d"))
    assert row.strip().endswith("x"), row  # the speedup over the untuned schedule


def test_records_are_applied_and_the_digest_is_in_the_manifest(tuned):
    import json

    tune = json.loads((tuned["out"] / ".build" / "4-tune" / "tune.json").read_text())
    tasks = tune["kinds"]["cpu"]["per_task"]
    # the convolution, and the transposes to and from channels-last at the model's boundary
    assert sorted(t["name"].rstrip("0123456789") for t in tasks) == ["fused_conv2d_relu", "transpose", "transpose"]
    conv = next(t for t in tasks if t["name"].startswith("fused_conv2d"))
    assert conv["trials"] >= 8 and conv["untuned_ms"] > 0 and conv["best_ms"] <= conv["untuned_ms"]
    m = Manifest.load(tuned["out"] / "bundle")
    assert m.tuning["database_sha256"] == tree_sha256(tuned["out"] / ".build" / "4-tune" / "tuning_db")
    assert m.tuning["database_records"] == sum(t["trials"] for t in tasks) >= 16
    assert m.tuning["segments"]["s0"]["tuned"] == m.tuning["segments"]["s0"]["tasks"] == 3
    x = np.random.default_rng(1).normal(size=(1, 8, 16, 16)).astype(np.float32)
    got = BundleModel(tuned["out"] / "bundle", log=lambda s: None).run({"x": x})["y"]
    assert_close(got, ort_backend.run(tuned["model"], {"x": x})["y"])


def test_a_build_that_replays_a_database_is_the_same_bytes(tuned, tmp_path):
    """--trials 0 searches nothing: the same database (here a copy elsewhere) gives the same bundle,
    byte for byte; the same model without the database gets untuned kernels."""
    shutil.copytree(tuned["db"], tmp_path / "copy")
    src = tuned["tmp"] / "conv.onnx"
    one = build(BuildOptions(model=src, target="x86", out=tmp_path / "b", tuning_db=tuned["db"],
                             cpu_backends=PLANNED))
    two = build(BuildOptions(model=src, target="x86", out=tmp_path / "c", tuning_db=tmp_path / "copy",
                             cpu_backends=PLANNED))
    assert one.stages[3].record["kinds"]["cpu"]["trials"] == 0
    assert (tmp_path / "b" / "bundle.tar.gz").read_bytes() == (tmp_path / "c" / "bundle.tar.gz").read_bytes()
    assert Manifest.load(one.bundle).tuning["segments"]["s0"]["tuned"] == 3
    untuned = build(BuildOptions(model=src, target="x86", out=tmp_path / "d", tuning_db=tmp_path / "empty",
                             cpu_backends=PLANNED))
    assert Manifest.load(untuned.bundle).tuning["segments"]["s0"]["tuned"] == 0
    # the workload was searched with this budget before: asking again costs no trials
    again = build(BuildOptions(model=src, target="x86", out=tmp_path / "e", trials=16, tuning_db=tuned["db"],
                             cpu_backends=PLANNED))
    summary = again.stages[3].record["kinds"]["cpu"]
    assert (summary["trials"], summary["reused"], summary["stopped"]) == (0, 3, "done")


def test_tuning_invocation_errors(tuned, tmp_path):
    src, out = str(tuned["tmp"] / "conv.onnx"), str(tmp_path / "o")
    proc = edgesdk("build", src, "--target", "x86", "-o", out, "--trials", "8", "--time-budget", "soon")
    assert_user_facing(proc, 2, "--time-budget soon: not a duration")
    proc = edgesdk("build", src, "--target", "x86", "-o", out, "--trials", "8", "--rpc-tracker", "127.0.0.1:9190")
    assert_user_facing(proc, 2, "--rpc-tracker and --rpc-key go together")
    proc = edgesdk("build", src, "--target", "x86", "-o", out, "--trials", "8", "--rpc-tracker", "nohost",
                   "--rpc-key", "rk3588")
    assert_user_facing(proc, 2, "--rpc-tracker 'nohost' is not HOST:PORT")


def test_a_tracker_that_does_not_answer_is_a_user_error(tuned, tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = edgesdk("build", str(tuned["tmp"] / "conv.onnx"), "--target", "x86", "-o", str(tmp_path / "o"),
                   "--trials", "8", "--tuning-db", str(tmp_path / "db"),
                   "--rpc-tracker", f"127.0.0.1:{port}", "--rpc-key", "rk3588")
    assert_user_facing(proc, 1, f"the RPC tracker at 127.0.0.1:{port} does not answer", "rpc_tracker")
    assert not (tmp_path / "o" / "bundle").exists()
