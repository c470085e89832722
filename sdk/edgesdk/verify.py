"""Verify a bundle: the signature, every hash, then the golden self-test on the bundle's own architecture.

The signature (when a key is given) and every file are checked here, by the SDK's own code: nothing of
the bundle runs before they passed. Only then does the self-test run the bundle's code, in a separate Python process whose only
import path is the bundle (so the bundle proves it is self-contained), in a process group of its own that
ends at the timeout with everything it started; for an aarch64 bundle on another host it runs under
qemu-user in the arm64 root file system when one is present. When the self-test cannot run, the report
says so plainly and never claims it passed.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .backends import qemu
from .errors import UsageError, UserError
from .runtime import trust
from .runtime.manifest import Manifest, ManifestError, RuntimeTooOld
from .runtime.process import run_bounded
from .runtime.unpack import UnpackError, max_bundle_bytes, unpack

SELFTEST_TIMEOUT_S = 900.0  # `edgesdk verify --selftest-timeout`; the device's installer has its own


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
    signature: str = ""  # verified by which key, or why it was not checked
    bundle_version: int = 0
    trust_notes: list[str] = field(default_factory=list)  # an allowed downgrade


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


def _unpack(path: Path, dest: Path) -> Path:
    """Unpack the archive `path` into `dest` once every member passed (runtime/unpack.py, which the device's
    installer shares); returns the bundle root."""
    try:
        return unpack(path, dest, max_bundle_bytes())
    except UnpackError as e:
        if isinstance(e.__cause__, ManifestError):
            raise _bad_manifest(path, e.__cause__) from None
        if e.code == "bundle.unpack-failed":
            raise UserError(e.code, f"{path}: {e.problem}",
                            "free space in the temporary directory (TMPDIR) and try again") from None
        limit = " (EDGESDK_MAX_BUNDLE_BYTES)" if e.code == "bundle.too-large" else ""
        raise UserError(e.code, f"{path}: {e.problem}{limit}", "this archive was not written by edgesdk, or it was "
                        "damaged on the way; do not flash it: fetch or rebuild the bundle") from None


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
    """What does not match the manifest (`runtime.trust.file_problems`, the device's own check)."""
    return trust.file_problems(bundle, manifest)


def check_bundle(bundle: Path, shown: Path | None = None) -> Manifest:
    """The manifest, once every hash matches and every path stays inside; else `bundle.tampered`."""
    manifest = load_manifest(bundle, shown)
    problems = check_hashes(bundle, manifest)
    if problems:
        raise UserError("bundle.tampered", f"{shown or bundle}: {len(problems)} file(s) do not match the manifest",
                        "do not flash this bundle; rebuild it or fetch it again", notes=problems[:20]
                        + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else []))
    return manifest


def check_trust(bundle: Path, shown: Path, keys: list[trust.TrustedKey] | None, *,
                installed_version: int | None = None, allow_downgrade: bool = False) -> trust.Verified:
    """The device's checks (`runtime.trust`), as user errors naming the file or field: the signature by
    one of `keys` first (None: not asked for), then the manifest and every file, then the version."""
    if keys is not None:
        try:
            key = trust.check_signature(*trust.read_signed(bundle), keys)
        except trust.TrustError as e:
            raise UserError(f"bundle.{e.code}", f"{shown}: not trusted: {e}", _TRUST_HINTS[e.code]) from None
    manifest = check_bundle(bundle, shown)
    try:
        notes = trust.check_version(manifest, installed_version, allow_downgrade)
    except trust.TrustError as e:
        raise UserError(f"bundle.{e.code}", f"{shown}: not trusted: {e}", _TRUST_HINTS[e.code]) from None
    return trust.Verified(manifest, key if keys is not None else None, notes)


_TRUST_HINTS = {
    "signature-missing": "sign it (`edgesdk sign BUNDLE --key KEY`) or fetch the signed release",
    "signature-bad": "do not flash it: the bundle was changed after it was signed; fetch or rebuild it",
    "key-unknown": "add the vendor's public key to the trust directory (docs/trust.md, rotating a key), or "
                   "fetch a bundle signed by a key it trusts",
    "downgrade": "install a bundle at least as new as the installed one, or pass --allow-downgrade on purpose",
    "manifest": "the bundle is damaged or was not written by this edgesdk; rebuild it",
    "files": "do not flash this bundle; rebuild it or fetch it again",
}


def signature_state(bundle: Path, manifest: Manifest) -> str:
    """What a verify without a key can say of the signature."""
    if not (bundle / trust.SIGNATURE_FILE).exists():
        return "none: the bundle is unsigned (its hashes show damage, not who made it)"
    return (f"present (key {manifest.signing.get('key_id', '?')}) but NOT checked: give --public-key or --trust "
            "to check who signed it")


def verify(path: Path, *, run_selftest: bool = True, keys: list[trust.TrustedKey] | None = None,
           installed_version: int | None = None, allow_downgrade: bool = False,
           selftest_timeout: float = SELFTEST_TIMEOUT_S) -> VerifyReport:
    """The report on the bundle at `path`; `UserError` for a bundle refused before its self-test, and for
    a self-test that did not finish within `selftest_timeout` seconds (`verify.selftest-timeout`)."""
    with opened_bundle(path) as bundle:
        verified = check_trust(bundle, Path(path), keys, installed_version=installed_version,
                               allow_downgrade=allow_downgrade)
        manifest = verified.manifest
        report = VerifyReport(Path(path), True, len(manifest.files), "not-run", "")
        report.bundle_version = manifest.bundle_version
        report.trust_notes = verified.notes
        report.signature = (f"verified: signed by key {verified.key.key_id} ({verified.key.path.name})"
                            if verified.key else signature_state(bundle, manifest))
        if not run_selftest:
            report.detail = "self-test not requested (--no-selftest)"
            return report
        proc = _selftest_process(bundle, Path(path), manifest, report, selftest_timeout)
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


def _selftest_process(bundle: Path, shown: Path, manifest: Manifest, report: VerifyReport, timeout: float):
    how, why_not = where_it_runs(manifest)
    if how is None:
        report.detail = f"self-test did NOT run: {why_not}"
        return None
    report.detail = f"{how} "
    try:
        return runtime_process(bundle, manifest, ["selftest", "--json"], timeout=timeout, capture_output=True,
                               text=True, errors="replace")
    except subprocess.TimeoutExpired:
        raise UserError("verify.selftest-timeout", f"{shown}: the self-test ({how}) did not finish in {timeout:g} s; "
                        "it was stopped with every process it started",
                        "give it longer with --selftest-timeout SECONDS (qemu-user runs a bundle many times slower "
                        "than the board); if it never finishes, the bundle hangs on this host: rebuild it, and "
                        "report it if a fresh build hangs too") from None


def where_it_runs(manifest: Manifest) -> tuple[str | None, str]:
    """How this host runs the bundle's code: ("natively" | "under qemu-user", "") or (None, why not)."""
    host = platform.machine()
    if any(s.device.startswith("gpu") for s in manifest.segments) and not _has_gpu():
        return None, "this bundle has GPU segments and this host has no NVIDIA GPU"
    if manifest.arch == host:
        return "natively", ""
    if manifest.arch == "aarch64":
        if qemu.find_rootfs() is None:
            return None, (f"the bundle is for aarch64, this host is {host}, and no arm64 root file system was found "
                          "for qemu-user (make rootfs prepares it)")
        return "under qemu-user", ""
    return None, f"the bundle is for {manifest.arch} and this host is {host}"


def runtime_process(bundle: Path, manifest: Manifest, args: list[str], *, timeout: float,
                    **kwargs) -> subprocess.CompletedProcess:
    """`python -B -m runtime ARGS` in the bundle, with only the bundle on the import path: natively, or
    under qemu-user for an aarch64 bundle (with EDGESDK_EMULATED=qemu-user), as `where_it_runs` says it
    can. Run by `runtime.process.run_bounded`: after `timeout` seconds the process and everything it
    started (the emulator's guest processes too) are killed and `subprocess.TimeoutExpired` is raised.
    `kwargs` go to `subprocess.Popen` (stdout, stderr, text, capture_output)."""
    root = str(bundle.resolve())
    if manifest.arch == platform.machine():
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        # -B: no bytecode written into the bundle, which must stay byte for byte what was hashed
        env.update(PYTHONPATH=root, PYTHONDONTWRITEBYTECODE="1")
        command = [sys.executable, "-B", "-m", "runtime", *args]
    else:
        command, env = qemu.guest_command(qemu.find_rootfs(), ["-B", "-m", "runtime", *args],
                                          {"PYTHONPATH": root, "EDGESDK_EMULATED": "qemu-user"})
    return run_bounded(command, timeout=timeout, cwd=bundle.resolve(), env=env, **kwargs)


def _has_gpu() -> bool:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return False
    return subprocess.run([exe, "-L"], capture_output=True).returncode == 0


RUN_EMULATED_TIMEOUT_S = 3600.0  # an emulated run of one input: qemu-user is many times slower than the board


def where_runnable(manifest: Manifest, shown: Path) -> str:
    """"native" where this host runs the bundle, "qemu-user" where it emulates it (an aarch64 bundle on another
    host with the arm64 root file system, `make rootfs`); else UsageError `run.foreign-arch` naming the way."""
    if manifest.arch == platform.machine():
        return "native"
    if manifest.arch == "aarch64" and qemu.find_rootfs() is not None:  # qemu-user emulates aarch64 only
        return "qemu-user"
    raise UsageError("run.foreign-arch", f"{shown} is built for {manifest.arch}; this host is {platform.machine()}"
                     + (", and no arm64 root file system was found to emulate it in" if manifest.arch == "aarch64"
                        else ""),
                     ("prepare the root file system with `make rootfs` (or point EDGESDK_ARM64_ROOTFS at one) to "
                      "run it under qemu-user here, or " if manifest.arch == "aarch64" else "")
                     + "run it on the device: python -B -m runtime run IN.npz OUT.npz")


def run_bundle(bundle: Path, feeds: dict, *, manifest: Manifest | None = None, allow_nonfinite: bool = False,
               say=lambda line: None, shown: Path | None = None) -> dict:
    """The outputs of the bundle directory `bundle` (its files checked: `check_bundle`) on `feeds` (input name
    -> array), on this host: by its own `BundleModel` where this host runs its code, or, for an aarch64 bundle
    on another host, by its own runtime (`python -B -m runtime run`) under qemu-user in the arm64 root file
    system, `say` (the caller's stderr) told that it is emulated. Inputs are checked first either way, so a
    refusal reads the same (`runtime.InputError`); an emulated run that fails or outlives
    RUN_EMULATED_TIMEOUT_S is a UserError (`run.failed`, `run.timeout`); the inputs and outputs pass
    through a temporary directory outside the bundle, removed after."""
    import numpy as np

    from .runtime import BundleModel
    from .runtime.inputs import check_feeds

    shown = shown or bundle
    manifest = manifest or Manifest.load(bundle)
    if where_runnable(manifest, shown) == "native":
        return BundleModel(bundle).run(feeds, allow_nonfinite=allow_nonfinite)
    checked, notes = check_feeds(manifest.inputs, feeds, allow_nonfinite=allow_nonfinite)
    for note in notes:  # as the runtime says them natively
        say(f"runtime: {note}")
    say(f"note: {shown} is built for aarch64: it runs emulated under qemu-user in {qemu.find_rootfs()}, many times "
        "slower than on the board")
    with tempfile.TemporaryDirectory(prefix="edgesdk-run-") as work:
        given, made = Path(work) / "inputs.npz", Path(work) / "outputs.npz"
        np.savez(given, **checked)
        try:
            proc = runtime_process(bundle, manifest, ["run", str(given), str(made),
                                                      *(["--allow-nonfinite"] if allow_nonfinite else [])],
                                   timeout=RUN_EMULATED_TIMEOUT_S, capture_output=True, text=True, errors="replace")
        except subprocess.TimeoutExpired:
            raise UserError("run.timeout", f"{shown}: the emulated run did not finish in {RUN_EMULATED_TIMEOUT_S:g} "
                            "s; it was stopped with every process it started",
                            "run it on the device, or `edgesdk verify` the bundle: its self-test shows whether it "
                            "hangs") from None
        for line in proc.stderr.splitlines():  # the runtime's own notes (a TPU it runs without, casts)
            if line.startswith("runtime:"):
                say(line)
        if proc.returncode != 0 or not made.is_file():
            said = [line for line in proc.stderr.splitlines() if line.startswith("error:")] or \
                proc.stderr.strip().splitlines()[-1:] or ["no output"]
            raise UserError("run.failed", f"{shown}: the bundle's runtime under qemu-user ended with exit code "
                            f"{proc.returncode}: {said[-1].removeprefix('error: ')}",
                            "run `edgesdk verify` on the bundle: its self-test shows what fails")
        with np.load(made) as out:
            return {t.name: out[t.name] for t in manifest.outputs}
