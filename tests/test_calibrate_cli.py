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
