"""Verify a bundle: every hash, then the golden self-test on the bundle's own architecture.

The self-test runs in a separate Python process whose only import path is the bundle (so the
bundle proves it is self-contained); for an aarch64 bundle on another host it runs under
qemu-user in the arm64 root file system when one is present. When the self-test cannot run,
the report says so plainly and never claims it passed.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .backends import qemu
from .errors import UserError
from .ir.digest import file_sha256
from .runtime.manifest import Manifest


@dataclass
class VerifyReport:
    bundle: Path
    hashes_ok: bool
    files: int
    selftest: str  # passed | failed | not-run
    detail: str
    outputs: list[dict] = field(default_factory=list)
    segments: list[dict] = field(default_factory=list)  # each segment on its own golden inputs
    notes: list[str] = field(default_factory=list)
    stream: dict = field(default_factory=dict)  # the pipelined stream's frames against run()
    load_seconds: float | None = None  # the runtime's load of every segment, on the device


def open_bundle(path: Path, workdir: Path | None = None) -> Path:
    """A bundle directory, or a .tar.gz unpacked safely (no absolute paths, no `..`, no links)."""
    path = Path(path)
    if path.is_dir():
        if not (path / "manifest.json").is_file():
            raise UserError("bundle.no-manifest", f"{path}: no manifest.json, so this is not an edgesdk bundle",
                            "give the bundle/ directory or bundle.tar.gz that `edgesdk build` wrote")
        return path
    if not path.exists():
        raise UserError("bundle.not-found", f"bundle {path} does not exist", "give a bundle directory or .tar.gz")
    try:
        tar = tarfile.open(path, "r:*")
    except (tarfile.TarError, OSError) as e:
        raise UserError("bundle.bad-archive", f"{path}: not a bundle archive ({e})",
                        "give the bundle/ directory or bundle.tar.gz that `edgesdk build` wrote") from None
    dest = Path(workdir or tempfile.mkdtemp(prefix="edgesdk-bundle-"))
    with tar:
        for m in tar.getmembers():
            parts = Path(m.name).parts
            if m.name.startswith("/") or ".." in parts or m.issym() or m.islnk() or not (m.isfile() or m.isdir()):
                raise UserError("bundle.unsafe-member", f"{path}: refuses member '{m.name}' (absolute path, '..' or link)",
                                "this archive was not written by edgesdk; do not flash it")
        tar.extractall(dest, filter="data")
    root = dest / "bundle"
    return open_bundle(root if root.is_dir() else dest)


def check_hashes(bundle: Path, manifest: Manifest) -> list[str]:
    problems = []
    for rel, meta in sorted(manifest.files.items()):
        p = bundle / rel
        if not p.is_file():
            problems.append(f"{rel}: missing")
        elif p.stat().st_size != meta["size"] or file_sha256(p) != meta["sha256"]:
            problems.append(f"{rel}: sha256 does not match the manifest (the file was changed)")
    listed = set(manifest.files) | {"manifest.json", "manifest.sig"}
    for p in sorted(bundle.rglob("*")):
        rel = p.relative_to(bundle).as_posix()
        if p.is_file() and rel not in listed and "__pycache__" not in rel:
            problems.append(f"{rel}: not listed in the manifest")
    return problems


def verify(path: Path, *, run_selftest: bool = True) -> VerifyReport:
    bundle = open_bundle(path)
    try:
        manifest = Manifest.load(bundle)
    except Exception as e:
        raise UserError("bundle.bad-manifest", f"{bundle}/manifest.json cannot be read ({e})",
                        "the bundle is damaged; rebuild it") from None
    problems = check_hashes(bundle, manifest)
    if problems:
        raise UserError("bundle.tampered", f"{bundle}: {len(problems)} file(s) do not match the manifest",
                        "do not flash this bundle; rebuild it or fetch it again", notes=problems)
    report = VerifyReport(bundle, True, len(manifest.files), "not-run", "")
    if not run_selftest:
        report.detail = "self-test not requested (--no-selftest)"
        return report
    proc = _selftest_process(bundle, manifest, report)
    if proc is None:
        return report
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        report.selftest = "failed"
        report.detail = "the self-test crashed: " + (proc.stderr.strip().splitlines() or ["no output"])[-1]
        report.notes = proc.stderr.strip().splitlines()[-15:]
        return report
    report.selftest = "passed" if result["passed"] else "failed"
    report.outputs = result["outputs"]
    report.segments = result.get("segments", [])
    report.notes = result.get("notes", [])
    report.stream = result.get("stream", {})
    report.load_seconds = result.get("load_seconds")
    report.detail += f"on {result['arch']}"
    return report


def _selftest_process(bundle: Path, manifest: Manifest, report: VerifyReport):
    host = platform.machine()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    if any(s.device.startswith("gpu") for s in manifest.segments) and not _has_gpu():
        report.detail = "self-test did NOT run: this bundle has GPU segments and this host has no NVIDIA GPU"
        return None
    if manifest.arch == host:
        env["PYTHONPATH"] = str(bundle.resolve())
        report.detail = "natively "
        return subprocess.run([sys.executable, "-m", "runtime", "selftest", "--json"], cwd=bundle, env=env,
                              capture_output=True, text=True, timeout=900)
    if manifest.arch == "aarch64":
        rootfs = qemu.find_rootfs()
        if rootfs is None:
            report.detail = (f"self-test did NOT run: the bundle is for aarch64, this host is {host}, and no arm64 root "
                             "file system was found for qemu-user (make rootfs prepares it)")
            return None
        report.detail = "under qemu-user "
        return qemu.run_python(rootfs, ["-m", "runtime", "selftest", "--json"], cwd=bundle.resolve(),
                               env={"PYTHONPATH": str(bundle.resolve())}, timeout=900)
    report.detail = f"self-test did NOT run: the bundle is for {manifest.arch} and this host is {host}"
    return None


def _has_gpu() -> bool:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return False
    return subprocess.run([exe, "-L"], capture_output=True).returncode == 0
