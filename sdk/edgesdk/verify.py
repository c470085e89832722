"""Verify a bundle: every hash, then the golden self-test on the bundle's own architecture.

The self-test runs in a separate Python process whose only import path is the bundle (so the
bundle proves it is self-contained); for an aarch64 bundle on another host it runs under
qemu-user in the arm64 root file system when one is present. When the self-test cannot run,
the report says so plainly and never claims it passed.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .backends import qemu
from .errors import UserError
from .ir.digest import file_sha256
from .runtime.manifest import MAX_MANIFEST_BYTES, Manifest, ManifestError, RuntimeTooOld, path_problem


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


@contextlib.contextmanager
def opened_bundle(path: Path) -> Iterator[Path]:
    """The bundle directory of `path`: a directory as it is, or a .tar.gz unpacked safely into a
    temporary directory that is removed when the block ends, whatever happens in it.

    An archive is unpacked only after every member passed: names relative with no `..`, no links or
    special files, no member twice, names of sane length; manifest.json read from the archive and
    valid; every other member a file the manifest lists, with the size it lists; the total within
    `max_bundle_bytes()`. So a 1 GiB member the manifest does not list, or a member declaring 100 GiB,
    is refused before a byte is written."""
    path = Path(path)
    if path.is_dir():
        if not (path / "manifest.json").is_file():
            raise UserError("bundle.no-manifest", f"{path}: no manifest.json, so this is not an edgesdk bundle",
                            "give the bundle/ directory or bundle.tar.gz that `edgesdk build` wrote")
        yield path
        return
    if not path.exists():
        raise UserError("bundle.not-found", f"bundle {path} does not exist", "give a bundle directory or .tar.gz")
    dest = Path(tempfile.mkdtemp(prefix="edgesdk-bundle-"))
    try:
        yield _unpack(path, dest)
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def max_bundle_bytes() -> int:
    """The most an archive may unpack to: EDGESDK_MAX_BUNDLE_BYTES, default 16 GiB."""
    value = os.environ.get("EDGESDK_MAX_BUNDLE_BYTES", "")
    return int(value) if value.isdigit() else 16 << 30


def _unpack(path: Path, dest: Path) -> Path:
    """Unpack the archive `path` into `dest` once every member passed; returns the bundle root."""
    def refuse(code: str, problem: str) -> UserError:
        return UserError(code, f"{path}: {problem}", "this archive was not written by edgesdk, or it was damaged "
                         "on the way; do not flash it: fetch or rebuild the bundle")

    limit = max_bundle_bytes()
    try:
        tar = tarfile.open(path, "r:*")
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise refuse("bundle.bad-archive", f"not a bundle archive ({str(e).splitlines()[0][:200]})") from None
    try:
        with tar:
            members, total = {}, 0
            for m in tar:  # headers one by one: a hostile size is refused before its data is read
                name = _member_name(m.name)
                parts = name.split("/")
                if m.name.startswith("/") or ".." in parts or "\\" in m.name:
                    raise refuse("bundle.unsafe-member", f"refuses member '{m.name[:200]}' (absolute path or '..')")
                if not (m.isfile() or m.isdir()):
                    raise refuse("bundle.unsafe-member", f"refuses member '{m.name[:200]}' (a link or special file)")
                if len(name) > 1024 or any(len(x.encode()) > 255 for x in parts):
                    raise refuse("bundle.unsafe-member", f"refuses member '{m.name[:60]}...' (a name of "
                                 f"{len(m.name)} characters: a path part is at most 255 bytes)")
                if name in members:
                    raise refuse("bundle.unsafe-member", f"member '{name}' appears twice")
                total += m.size
                if m.size > limit or total > limit:
                    raise refuse("bundle.too-large", f"member '{name}' takes the archive past {limit:,} bytes "
                                 "unpacked (EDGESDK_MAX_BUNDLE_BYTES)")
                members[name] = m
            prefix = "bundle/" if members and all(n == "bundle" or n.startswith("bundle/") for n in members) else ""
            manifest = members.get(f"{prefix}manifest.json")
            if manifest is None or not manifest.isfile():
                raise refuse("bundle.no-manifest", "no manifest.json in the archive, so this is not an edgesdk bundle")
            reader = tar.extractfile(manifest)
            try:
                listed = Manifest.from_json(reader.read(MAX_MANIFEST_BYTES + 1)).files
            except ManifestError as e:
                raise _bad_manifest(path, e) from None
            for name, m in members.items():
                rel = name[len(prefix):] if name.startswith(prefix) else name
                if m.isdir() or rel == "manifest.json":
                    continue
                if rel not in listed:
                    raise refuse("bundle.unlisted-member", f"member '{name}' is not listed in the manifest")
                if m.size != listed[rel]["size"]:
                    raise refuse("bundle.tampered", f"member '{name}' is {m.size:,} bytes; the manifest lists "
                                 f"{listed[rel]['size']:,}")
            tar.extractall(dest, members=list(members.values()), filter="data")
            return dest / prefix.rstrip("/") if prefix else dest
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        if isinstance(e, OSError) and not isinstance(e, gzip.BadGzipFile) and e.errno is not None:
            # the disk, not the archive: full, read-only, ...
            raise UserError("bundle.unpack-failed", f"{path}: cannot be unpacked into {dest} ({e.strerror})",
                            "free space in the temporary directory (TMPDIR) and try again") from None
        raise refuse("bundle.bad-archive", f"not a complete bundle archive ({type(e).__name__}: "
                     f"{str(e).splitlines()[0][:200] if str(e) else 'unexpected end'})") from None


def _member_name(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name.rstrip("/")


def load_manifest(bundle: Path, shown: Path | None = None) -> Manifest:
    """The bundle's manifest, validated; a malformed one or one for a newer runtime is a user error."""
    try:
        return Manifest.load(bundle)
    except ManifestError as e:
        raise _bad_manifest(shown or bundle, e) from None


def _bad_manifest(where: Path, e: ManifestError) -> UserError:
    if isinstance(e, RuntimeTooOld):
        return UserError("bundle.runtime-too-old", f"{where}: {e}",
                         "update edgesdk (and the runtime on the device), or rebuild the bundle with this edgesdk")
    return UserError("bundle.bad-manifest", f"{where}: manifest.json is not valid: {e}",
                     "the bundle is damaged or was not written by this edgesdk; rebuild it")


def check_hashes(bundle: Path, manifest: Manifest) -> list[str]:
    """What does not match the manifest: a listed file missing, changed, a link or outside the bundle;
    any file, link or directory entry it does not list (compiled Python files included: a planted
    `__pycache__/*.pyc` would run instead of the checked source)."""
    problems = []
    for rel, meta in sorted(manifest.files.items()):
        problem = path_problem(bundle, rel)
        if problem:
            problems.append(f"{rel}: {problem}")
        elif os.path.getsize(bundle / rel) != meta["size"] or file_sha256(bundle / rel) != meta["sha256"]:
            problems.append(f"{rel}: sha256 does not match the manifest (the file was changed)")
    for seg in manifest.segments:
        for rel in filter(None, (seg.artifact, seg.fallback_artifact)):
            if rel not in manifest.files:
                problems.append(f"{rel}: segment {seg.id} runs it, but the manifest does not list its hash")
    listed = set(manifest.files) | {"manifest.json"}
    for top, dirs, files in os.walk(bundle):
        for name in sorted(dirs + files):
            p = Path(top) / name
            rel = p.relative_to(bundle).as_posix()
            if p.is_symlink():
                problems.append(f"{rel}: a link (a bundle holds none)")
            elif rel == "manifest.sig":
                problems.append("manifest.sig: a signature, but this edgesdk neither writes nor checks signatures: "
                                "the file was not written by `edgesdk build`")
            elif name in files and rel not in listed:
                problems.append(f"{rel}: not listed in the manifest"
                                + (" (compiled Python: run the runtime with `python -B`)" if name.endswith(".pyc") else ""))
    return problems


def check_bundle(bundle: Path, shown: Path | None = None) -> Manifest:
    """The manifest, once every hash matches and every path stays inside; else `bundle.tampered`."""
    manifest = load_manifest(bundle, shown)
    problems = check_hashes(bundle, manifest)
    if problems:
        raise UserError("bundle.tampered", f"{shown or bundle}: {len(problems)} file(s) do not match the manifest",
                        "do not flash this bundle; rebuild it or fetch it again", notes=problems[:20]
                        + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else []))
    return manifest


def verify(path: Path, *, run_selftest: bool = True) -> VerifyReport:
    with opened_bundle(path) as bundle:
        manifest = check_bundle(bundle, path)
        report = VerifyReport(Path(path), True, len(manifest.files), "not-run", "")
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
    report.selftest = "passed" if result["passed"] and proc.returncode == 0 else "failed"
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
        # -B: no bytecode written into the bundle, which must stay byte for byte what was hashed
        env["PYTHONPATH"] = str(bundle.resolve())
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        report.detail = "natively "
        return subprocess.run([sys.executable, "-B", "-m", "runtime", "selftest", "--json"], cwd=bundle, env=env,
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
