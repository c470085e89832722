"""`edgesdk calibrate`: measures on this host, fits the CPU figures (and a backend's own, from runs
timed as a bundle runs them), writes a valid target with them, and refuses a target whose CPU is another
architecture. No timing is asserted: only that the fits and the reports are there and well formed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import yaml

from tests.model_zoo import PPOCR_CLS, PPOCR_CLS_SHAPE, ROOT

ENV = {**os.environ, "PYTHONPATH": str(ROOT / "sdk")}


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "edgesdk.cli", *args], capture_output=True, text=True, env=ENV,
                          timeout=300)


def test_calibrate_fits_and_writes_a_valid_target(tmp_path):
    out = tmp_path / "fitted.yaml"
    r = _cli("calibrate", "--target", "x86", "-m", f"{PPOCR_CLS}@{PPOCR_CLS_SHAPE}",
             "--holdout", f"{PPOCR_CLS}@{PPOCR_CLS_SHAPE}", "--runs", "3", "--backends", "none", "-o", str(out),
             "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    fit = result["fit"]
    assert result["backends"] == {}
    assert fit["peak_gflops"] > 0 and fit["bandwidth_gbps"] > 0 and fit["overhead_us"] > 0
    assert result["samples"] > 100 and result["held_out"]["models"]
    cpu = next(d for d in yaml.safe_load(out.read_text())["devices"] if d["kind"] == "cpu")
    assert cpu["kernel_overhead"]["value"] == fit["overhead_us"]
    assert cpu["kernel_overhead"]["source"].startswith("fitted by edgesdk calibrate")
    assert _cli("targets", "validate", str(out)).returncode == 0


def test_calibrate_fits_a_backends_own_figures_and_reports_held_out_models(tmp_path):
    out = tmp_path / "fitted.yaml"
    args = ("calibrate", "--target", "x86", "-m", f"{PPOCR_CLS}@{PPOCR_CLS_SHAPE}", "--holdout",
            f"{PPOCR_CLS}@{PPOCR_CLS_SHAPE}", "--runs", "2", "--backends", "onnxruntime", "--cuts", "8", "--rounds", "2")
    r = _cli(*args, "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    ort = json.loads(r.stdout)["backends"]["onnxruntime"]
    assert ort["runs"] == 9 and ort["skipped"] == []  # the model whole and in 8 cuts
    assert all(ort["fit"][k] > 0 for k in ("peak_gflops", "bandwidth_gbps", "overhead_us"))
    held = ort["held_out"]["models"][PPOCR_CLS.name]
    assert held["measured_ms"] > 0 and held["predicted_ms"] > 0 and held["predicted_shared_ms"] > 0
    assert held["within_tolerance"] == (held["rel_error"] <= ort["held_out"]["tolerance"] == 0.25)
    cpu = next(d for d in yaml.safe_load(out.read_text())["devices"] if d["kind"] == "cpu")
    own = cpu["backends"]["onnxruntime"]
    assert own["kernel_overhead"]["value"] == ort["fit"]["overhead_us"]
    assert "timed on onnxruntime as a bundle runs them" in own["peak_gflops"]["float32"]["source"]
    assert _cli("targets", "validate", str(out)).returncode == 0
    # the human report: the backend's fit and its held-out model against the tolerance
    text = _cli(*args).stdout
    assert "backend onnxruntime: fitted on 9 timed runs" in text
    assert f"  held out {PPOCR_CLS.name}: predicted" in text and "25%); with the CPU's one set of figures" in text


def test_calibrate_refuses_an_unknown_backend():
    r = _cli("calibrate", "--target", "x86", "-m", f"{PPOCR_CLS}@{PPOCR_CLS_SHAPE}", "--backends", "onnxruntime,tflite")
    assert r.returncode == 2 and "unknown backend 'tflite'" in r.stderr and "Traceback" not in r.stderr


def test_calibrate_refuses_a_foreign_cpu(tmp_path):
    r = _cli("calibrate", "--target", "arm_2tpu", "-m", f"{PPOCR_CLS}@{PPOCR_CLS_SHAPE}")
    assert r.returncode == 2 and "aarch64" in r.stderr and "Traceback" not in r.stderr


def _tiny_model(path, ops: int):
    """A chain of `ops` nodes on a 1x8 input, of kinds no optimization merges (Sigmoid, Tanh, Neg in turn)."""
    import onnx
    from onnx import TensorProto, helper

    names = ["x", *(f"r{k}" for k in range(ops - 1)), "y"]
    kinds = ("Sigmoid", "Tanh", "Neg")
    nodes = [helper.make_node(kinds[k % 3], [a], [b]) for k, (a, b) in enumerate(zip(names, names[1:]))]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    onnx.save(m, path)
    return path


def _user_facing(r, code: int, error: str, hint: str) -> None:
    assert r.returncode == code, r.stderr
    lines = r.stderr.strip().splitlines()
    assert [line for line in lines if line.startswith("error: ")] == [error], r.stderr
    assert lines[-1].startswith("hint: ") and hint in lines[-1], r.stderr
    assert "Traceback" not in r.stderr


def test_calibrate_refuses_an_output_that_is_a_directory_or_in_a_missing_one_before_measuring(tmp_path):
    """`-o DIR` was an internal error after the whole measurement, leaving `.DIR.tmp` beside it; `-o` into
    a missing directory too. Both are refused first (exit 2), and nothing is written."""
    model = _tiny_model(tmp_path / "chain.onnx", 4)
    (tmp_path / "fitted").mkdir()
    hint = "give the name of the target file (YAML) to write, in a directory that exists"
    for given, why in (("fitted", "is a directory"),
                       ("none/fitted.yaml", f"its directory {tmp_path}/none does not exist")):
        r = _cli("calibrate", "--target", "x86", "-m", str(model), "--backends", "none", "-o", str(tmp_path / given))
        _user_facing(r, 2, f"error: --output {tmp_path / given}: {why}", hint)
        assert "calibrate: measuring" not in r.stderr  # refused before anything ran
        assert sorted(p.name for p in tmp_path.rglob("*")) == ["chain.onnx", "fitted"]


def test_calibrate_refuses_more_threads_than_the_host_has(tmp_path):
    """--threads 100000 ran past any timeout: more threads than CPUs measure their contention."""
    cpus = len(os.sched_getaffinity(0))
    r = _cli("calibrate", "--target", "x86", "-m", str(_tiny_model(tmp_path / "chain.onnx", 4)), "--threads", "100000")
    _user_facing(r, 2, f"error: --threads 100000: this host has {cpus} CPU(s)",
                 f"calibrate with the threads the bundle will run with on this device, at most {cpus}")


def test_calibrate_on_a_model_of_fewer_than_three_ops_is_a_user_error(tmp_path):
    """Three figures need three timed ops: a two-op model was an internal error (ValueError, exit 3)."""
    r = _cli("calibrate", "--target", "x86", "-m", str(_tiny_model(tmp_path / "two.onnx", 2)), "--backends", "none",
             "--runs", "2", "-o", str(tmp_path / "fitted.yaml"))
    _user_facing(r, 1, "error: the model(s) to fit give 2 timed op(s) (two.onnx: 2); fitting the CPU's figures "
                 "(peak rate, bandwidth, overhead) needs at least 3", "fit on a model of the kind the device will run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["two.onnx"]
