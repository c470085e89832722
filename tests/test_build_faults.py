"""Faults injected into builds: a build SIGKILLed at every stage boundary is resumed
by the next one, which reuses exactly the stages that finished (each killed build's progress lines say
so) and writes the same bytes as a build never interrupted; a stage cache entry changed on disk is
detected by its digest and rebuilt, never trusted. A two-node model, the schedule's cut and no tuning,
so every build is deterministic."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from edgesdk.ir.digest import file_sha256
from edgesdk.pipeline import CRASH_ENV, PHASE_NAMES, stage_dir
from tests.model_zoo import ROOT
from tests.test_interrupted_build import tiny_model

pytestmark = pytest.mark.slow  # a dozen whole builds, each in a process of its own


def _limit_files(limit: int) -> None:
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails (EFBIG) instead of killing the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def build(model: Path, out: Path, db: Path, crash_after: str | None = None,
          max_file_bytes: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "sdk")}
    env.pop(CRASH_ENV, None)
    if crash_after:
        env[CRASH_ENV] = crash_after
    return subprocess.run([sys.executable, "-m", "edgesdk.cli", "build", str(model), "-t", "x86", "-o", str(out),
                           "--cpu-backends", "planned", "--tuning-db", str(db), "--json"],
                          capture_output=True, text=True, env=env, timeout=600,
                          preexec_fn=(lambda: _limit_files(max_file_bytes)) if max_file_bytes else None)


def cached(proc: subprocess.CompletedProcess) -> list[str]:
    return [s["name"] for s in json.loads(proc.stdout)["stages"] if s["cached"]]


def _reused(stderr: str) -> list[str]:
    """The stages a build's progress lines (`[i/6] NAME cached`) say it reused, killed or not."""
    return [line.split()[1] for line in stderr.splitlines() if line.startswith("[") and line.endswith(" cached")]


def bundle_bytes(out: Path) -> dict[str, str]:
    files = {p.relative_to(out).as_posix(): file_sha256(p) for p in (out / "bundle").rglob("*") if p.is_file()}
    return {**files, "bundle.tar.gz": file_sha256(out / "bundle.tar.gz")}


def test_killed_at_every_stage_boundary_the_next_build_resumes_with_the_same_bytes(tmp_path):
    model, db = tiny_model(tmp_path / "m.onnx", 3), tmp_path / "db"
    reference = build(model, tmp_path / "ref", db)
    assert reference.returncode == 0, reference.stderr
    out = tmp_path / "out"
    for k, stage in enumerate(PHASE_NAMES[:-1]):  # killed once each stage's output is in place
        proc = build(model, out, db, crash_after=stage)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        # it reused exactly the stages the builds killed before it finished, and ran this one
        assert _reused(proc.stderr) == list(PHASE_NAMES[:k]), proc.stderr
        assert (stage_dir(out, stage) / "digest").is_file()
        assert not (out / "bundle").exists() and not (out / "bundle.tar.gz").exists()
        assert not list((out / ".build").glob(".*.tmp"))
    # killed after package too: the bundle is published, then the process dies
    proc = build(model, out, db, crash_after="package")
    assert proc.returncode == -signal.SIGKILL
    final = build(model, out, db)
    assert final.returncode == 0, final.stderr
    assert cached(final) == list(PHASE_NAMES)  # every stage finished before a kill, and is reused
    assert bundle_bytes(out) == bundle_bytes(tmp_path / "ref")


def test_a_changed_cache_entry_is_rebuilt_never_trusted(tmp_path):
    model, db = tiny_model(tmp_path / "m.onnx", 5), tmp_path / "db"
    out = tmp_path / "out"
    assert build(model, out, db).returncode == 0
    before = bundle_bytes(out)
    # a byte of the schedule's output changed on disk, its digest file left as it was
    plan = stage_dir(out, "schedule") / "plan.json"
    plan.write_text(plan.read_text() + " ")
    again = build(model, out, db)
    assert again.returncode == 0, again.stderr
    assert cached(again) == ["import", "legalize"]  # schedule ran again, and so did what reads it
    assert "schedule: its cached output" in again.stderr and "no longer matches its digest" in again.stderr
    assert bundle_bytes(out) == before
    # a file added to a stage's output, and a digest file replaced, are caught alike
    (stage_dir(out, "legalize") / "planted.txt").write_text("x")
    (stage_dir(out, "import") / "digest").write_text("0" * 64)
    third = build(model, out, db)
    assert third.returncode == 0, third.stderr
    assert cached(third) == [] and bundle_bytes(out) == before


def test_a_full_disk_while_packaging_leaves_no_partial_bundle(tmp_path):
    """Writes that fail as on a full disk (RLIMIT_FSIZE: no file may grow past a size that every earlier
    stage's files stay under and the package stage's largest does not): a user error naming the stage,
    nothing of its output kept, no bundle; with room again, the next build reuses the stages before it."""
    model, db, out = tiny_model(tmp_path / "m.onnx", 6), tmp_path / "db", tmp_path / "out"
    assert build(model, out, db).returncode == 0  # a bundle of an earlier build is in place
    (out / "bundle" / "manifest.json").write_text("{}")  # and it must not survive as this build's
    model2 = tiny_model(tmp_path / "m2.onnx", 9)
    largest = {p: max(f.stat().st_size for f in stage_dir(out, p).rglob("*") if f.is_file()) for p in PHASE_NAMES}
    earlier = max(v for p, v in largest.items() if p != "package")
    assert earlier < largest["package"], largest
    proc = build(model2, out, db, max_file_bytes=(earlier + largest["package"]) // 2)
    assert proc.returncode == 1, proc.stderr
    assert "error: a file grew past the size limit under" in proc.stderr and "the package stage" in proc.stderr
    assert "Traceback" not in proc.stderr and "hint: free space" in proc.stderr
    assert not (out / "bundle").exists() and not (out / "bundle.tar.gz").exists()
    assert not list((out / ".build").glob(".*.tmp")) and not stage_dir(out, "package").exists()
    again = build(model2, out, db)
    assert again.returncode == 0, again.stderr
    assert cached(again) == ["import", "legalize", "schedule", "tune", "compress"]
