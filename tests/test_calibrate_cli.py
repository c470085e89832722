"""`edgesdk calibrate`: measures on this host, fits the CPU figures, writes a valid target with them,
and refuses a target whose CPU is another architecture."""

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
             "--holdout", f"{PPOCR_CLS}@{PPOCR_CLS_SHAPE}", "--runs", "3", "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    fit = result["fit"]
    assert fit["peak_gflops"] > 0 and fit["bandwidth_gbps"] > 0 and fit["overhead_us"] > 0
    assert result["samples"] > 100 and result["held_out"]["models"]
    cpu = next(d for d in yaml.safe_load(out.read_text())["devices"] if d["kind"] == "cpu")
    assert cpu["kernel_overhead"]["value"] == fit["overhead_us"]
    assert cpu["kernel_overhead"]["source"].startswith("fitted by edgesdk calibrate")
    assert _cli("targets", "validate", str(out)).returncode == 0


def test_calibrate_refuses_a_foreign_cpu(tmp_path):
    r = _cli("calibrate", "--target", "arm_2tpu", "-m", f"{PPOCR_CLS}@{PPOCR_CLS_SHAPE}")
    assert r.returncode == 2 and "aarch64" in r.stderr and "Traceback" not in r.stderr
