"""`edgesdk bench` and the device's `python -B -m runtime bench` on real bundles: the
x86 PP-OCR classifier natively and the arm_2tpu recognizer under qemu-user. What is asserted is the
shape and consistency of the figures, never a time (the hosts are shared and noisy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from edgesdk.runtime.bench import percentiles, report
from edgesdk.runtime.manifest import Manifest
from tests.test_cli import assert_user_facing, edgesdk


def _consistent(r: dict, manifest: Manifest, runs: int, callers: list[int], depths: list[int]) -> None:
    lat = r["latency_ms"]
    assert lat["n"] == runs and 0 < lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert lat["predicted"] == manifest.predicted["latency_ms"]
    assert [c["callers"] for c in r["callers"]] == callers
    for c in r["callers"]:
        assert c["results_differ"] == 0 and c["fps"] > 0 and c["calls"] == c["callers"] * max(2, runs // c["callers"])
    assert [d["depth"] for d in r["stream"]["depths"]] == depths
    assert all(d["frames"] == r["stream"]["frames"] and d["fps"] > 0 for d in r["stream"]["depths"])
    plan = [s for s in manifest.segments if not s.replica]
    assert [g["segment"] for g in r["segments"]] == [s.id for s in plan]
    assert [g["predicted_ms"] for g in r["segments"]] == [s.predicted_ms for s in plan]
    assert all(0 < g["p50_ms"] <= g["p90_ms"] for g in r["segments"])
    assert r["load"]["seconds"] > 0 and r["peak_rss_mib"] >= r["load"]["rss_mib_after"] > 0


def test_percentiles_match_numpy():
    ms = list(np.random.default_rng(0).exponential(3.0, 257))
    p = percentiles(ms)
    assert p["p99"] == pytest.approx(np.percentile(ms, 99)) and p["max"] == max(ms) and p["n"] == 257


def test_device_bench_needs_nothing_of_the_sdk(x86_ppocr):
    """The bundle's own runtime, with only the bundle on the import path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = str(x86_ppocr.bundle)
    proc = subprocess.run([sys.executable, "-B", "-m", "runtime", "bench", "--runs", "6", "--warmup", "1",
                           "--callers", "1,3", "--depth", "1,2", "--frames", "5", "--json"], env=env,
                          cwd=x86_ppocr.bundle, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    _consistent(r, Manifest.load(x86_ppocr.bundle), 6, [1, 3], [1, 2])
    assert r["emulated"] is None and r["arch"] == "x86_64" and r["stream"]["frames"] == 5
    assert "progress: latency 6/6" in proc.stderr  # no terminal: one line per finished phase
    assert not list(x86_ppocr.bundle.rglob("__pycache__"))


def test_edgesdk_bench_text_and_json(x86_ppocr):
    archive = x86_ppocr.bundle.parent / "bundle.tar.gz"
    proc = edgesdk("bench", str(archive), "--runs", "5", "--warmup", "0", "--callers", "2")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert text.startswith("bench: ") and "latency     p50 " in text and "callers   2 " in text
    assert "EMULATED" not in text and "results equal" in text
    for seg in Manifest.load(x86_ppocr.bundle).segments:
        assert f"\n{seg.id} " in text
    js = edgesdk("bench", str(x86_ppocr.bundle), "--runs", "4", "--warmup", "0", "--callers", "1", "--depth", "3",
                 "--json")
    assert js.returncode == 0, js.stderr
    _consistent(json.loads(js.stdout), Manifest.load(x86_ppocr.bundle), 4, [1], [3])


@pytest.mark.parametrize("args, code, needle", [
    (["--callers", "0,2"], 2, "--callers 0,2: expected positive integers"),
    (["--depth", "x"], 2, "--depth x: expected positive integers"),
])
def test_bad_invocations(x86_ppocr, args, code, needle):
    assert_user_facing(edgesdk("bench", str(x86_ppocr.bundle), *args), code, needle)


def test_a_tampered_bundle_is_not_benched(x86_ppocr, tmp_path):
    import shutil

    bundle = tmp_path / "bundle"
    shutil.copytree(x86_ppocr.bundle, bundle)
    with open(bundle / "plan.json", "a") as f:
        f.write(" ")
    assert_user_facing(edgesdk("bench", str(bundle)), 1, "do not match the manifest")


def test_report_says_when_figures_are_emulated():
    r = {"model": "m", "target": "arm_2tpu", "arch": "aarch64", "emulated": "qemu-user", "cpus": 2,
         "devices": ["cpu"], "notes": [], "peak_rss_mib": 10.0,
         "load": {"seconds": 0.1, "rss_mib_before": 1.0, "rss_mib_after": 5.0},
         "latency_ms": {**percentiles([1.0, 2.0]), "warmup": 0, "predicted": None},
         "callers": [], "stream": {"frames": 2, "predicted_fps": None, "depths": []}, "segments": []}
    assert "EMULATED by qemu-user" in report(r).splitlines()[0]


@pytest.mark.qemu
def test_an_aarch64_bundle_is_benched_under_qemu_and_says_so(arm_rec):
    from edgesdk.backends import qemu

    if qemu.find_rootfs() is None:
        pytest.fail("the arm64 root file system is missing: `make rootfs` prepares it (make test does)")
    proc = edgesdk("bench", str(arm_rec.bundle), "--runs", "2", "--warmup", "0", "--callers", "1", "--depth", "2",
                   "--frames", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["arch"] == "aarch64" and r["emulated"] == "qemu-user"
    _consistent(r, Manifest.load(arm_rec.bundle), 2, [1], [2])
    # the Edge TPU is absent here: its segments ran their int8 models on the CPU, and say so
    tpu = [g for g in r["segments"] if g["device"].startswith("edgetpu")]
    assert tpu and all("CPU" in g["note"] for g in tpu)


def test_a_concurrent_callers_error_is_raised_not_lost():
    """A caller thread whose run() raises: the bench raises that error (it used to die with its thread
    and the figures were made of the other callers' calls)."""
    import threading

    from edgesdk.runtime.bench import _callers

    class Model:
        def run(self, feeds):
            if threading.current_thread().name == "bench-caller-1":
                raise RuntimeError("segment s1 failed on edgetpu:0")
            return {"y": feeds["x"] + 1}

    with pytest.raises(RuntimeError, match="segment s1 failed"):
        _callers(Model(), {"x": np.zeros(3, np.float32)}, 3, 2, lambda *a: None)
    assert not [t for t in threading.enumerate() if t.name.startswith("bench-caller")]
