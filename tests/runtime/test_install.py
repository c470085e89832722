"""Install into A/B slots on the device (runtime/install.py and runtime/unpack.py): real bundles, real
processes.

One tiny x86 bundle (Conv+Relu, built through the real pipeline once per module) is signed at several
versions with a key made here, and the device root's trust/ holds that key's public half. Every command
runs as it does on a device, `python -B -m runtime ...` in its own process with the built bundle on
PYTHONPATH, so the installer under test is the one a bundle ships. A root with two installs (slot a:
version 1, previous; slot b: version 2, active) is made once and copied for each test that needs one.

After every refused or interrupted install the test checks what must hold on a device: status names
the same active slot with the same record, and that slot's bundle still verifies with the device's key.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import gzip
import hashlib
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk.bundling.archive import file_table, savez
from edgesdk.bundling.signing import SigningKey, generate_keys, load_private_key, stamp
from edgesdk.runtime import unpack as unpack_module
from edgesdk.runtime.install import CRASH_ENV, STEPS, installed_version
from edgesdk.runtime.trust import load_trust, verify_bundle
from edgesdk.runtime.unpack import UnpackError, unpack

ROOT_ENTRIES = ["install.lock", "slots", "state.json", "trust"]  # what a root holds between installs


def _conv_relu(path: Path) -> Path:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])]
    g = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, 3, 8, 8))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, (1, 4, 8, 8))],
                          [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


@dataclass
class Release:
    """The built bundle (its runtime runs every command), the signing key and the device's trust dir."""

    bundle: Path
    key: SigningKey
    trust: Path
    work: Path

    def archive(self, name: str, version: int, *, key: SigningKey | None = None, unsigned: bool = False,
                change=None) -> Path:
        """The bundle at `version` as NAME.tar.gz, signed by `key` (default: the release key) unless
        `unsigned`; `change(dir)` edits a copy first and the file table follows it, so the signature
        covers the change."""
        copy = self.work / name / "bundle"
        shutil.copytree(self.bundle, copy)
        if change is not None:
            change(copy)
            m = json.loads((copy / "manifest.json").read_text())
            m["files"] = file_table(copy)
            (copy / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")
        stamp(copy, version=version, key=None if unsigned else key or self.key, tarball=self.work / f"{name}.tar.gz")
        return self.work / f"{name}.tar.gz"


SLOW_FIXTURES = ("release",)  # a whole build, signed: the tests that need it are slow


@pytest.fixture(scope="module")
def release(tmp_path_factory, tuning_db) -> Release:
    from tests.conftest import _build

    d = tmp_path_factory.mktemp("install")
    built = _build(d / "out", _conv_relu(d / "tiny.onnx"), "x86", tuning_db=tuning_db, cpu_backends=("planned",))
    private, public, _ = generate_keys(d / "keys", "vendor")
    (d / "trust").mkdir()
    (d / "archives").mkdir()
    shutil.copy(public, d / "trust")
    return Release(built.bundle, load_private_key(private), d / "trust", d / "archives")


@pytest.fixture(scope="module")
def versions(release) -> dict[int, Path]:
    return {v: release.archive(f"v{v}", v) for v in (1, 2, 3)}


@pytest.fixture(scope="module")
def two_installs(release, versions, tmp_path_factory) -> Path:
    root = _empty_root(release, tmp_path_factory.mktemp("two-installs") / "root")
    for v in (1, 2):
        proc = runtime(release, "install", versions[v], "--root", root)
        assert proc.returncode == 0, proc.stderr
    return root


@pytest.fixture()
def root(two_installs, tmp_path) -> Path:
    """A copy of the root holding version 1 in slot a (previous) and version 2 in slot b (active)."""
    shutil.copytree(two_installs, tmp_path / "root")
    return tmp_path / "root"


def _empty_root(release: Release, root: Path) -> Path:
    root.mkdir(parents=True)
    shutil.copytree(release.trust, root / "trust")
    return root


def runtime(release: Release, *args, env: dict[str, str] | None = None, max_file_bytes: int | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -B -m runtime ARGS` as on a device: the runtime the built bundle ships, nothing else.
    `max_file_bytes`: no file may grow past it (RLIMIT_FSIZE: a write past it fails as on a full disk);
    `timeout`: where a hang is the failure looked for, it fails the test rather than stalling it."""
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", CRASH_ENV)}
    return subprocess.run([sys.executable, "-B", "-m", "runtime", *map(str, args)], capture_output=True, text=True,
                          env={**base, "PYTHONPATH": str(release.bundle), "PYTHONDONTWRITEBYTECODE": "1", **(env or {})},
                          cwd=release.work, timeout=timeout,
                          preexec_fn=(lambda: _limit_files(max_file_bytes)) if max_file_bytes else None)


def _limit_files(limit: int) -> None:
    import resource
    import signal as signals

    signals.signal(signals.SIGXFSZ, signals.SIG_IGN)  # the write fails (EFBIG) instead of killing the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def status(release: Release, root: Path) -> dict:
    proc = runtime(release, "status", "--root", root, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def host_verify(capsys, *args) -> subprocess.CompletedProcess:
    """`edgesdk verify ARGS --no-selftest` on the build host, in this process."""
    from edgesdk.cli import main

    capsys.readouterr()
    code = main(["verify", *map(str, args), "--no-selftest"])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["edgesdk", "verify"], code, out.out, out.err)


def assert_refused(proc: subprocess.CompletedProcess, code: int, needle: str) -> None:
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert needle in proc.stderr, proc.stderr
    assert proc.stderr.count("error: ") == 1 and "Traceback" not in proc.stderr, proc.stderr


def assert_still_active(release: Release, root: Path, before: dict) -> None:
    """The slot active before is active now, with the same record, and its bundle verifies."""
    now = status(release, root)
    active = before["active"]
    assert now["active"] == active and now["slots"][active] == before["slots"][active], (before, now)
    slot = root / "slots" / active
    verified = verify_bundle(slot, load_trust(release.trust))
    assert verified.manifest.bundle_version == before["slots"][active]["bundle_version"]
    assert hashlib.sha256((slot / "manifest.json").read_bytes()).hexdigest() == now["slots"][active]["manifest_sha256"]


def rewritten(archive: Path, dest: Path, *, extra: list[tuple[tarfile.TarInfo, bytes | None]] = (),
              change: dict[str, bytes] | None = None) -> Path:
    """`archive` written again with members' data replaced (`change`: name -> bytes) and `extra` members
    added at the end."""
    buf = io.BytesIO()
    with tarfile.open(archive) as src, tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as out:
        for m in src.getmembers():
            data = src.extractfile(m).read() if m.isfile() else None
            if change and m.name in change:
                data = change[m.name]
                m.size = len(data)
            out.addfile(m, io.BytesIO(data) if data is not None else None)
        for info, data in extra:
            if data is not None:
                info.size = len(data)
            out.addfile(info, io.BytesIO(data) if data is not None else None)
    dest.write_bytes(gzip.compress(buf.getvalue(), mtime=0))
    return dest


# --- install, status, rollback ----------------------------------------------------------------------


def test_install_into_an_empty_root_then_status(release, versions, tmp_path):
    root = _empty_root(release, tmp_path / "root")
    proc = runtime(release, "status", "--root", root)
    assert proc.returncode == 0 and proc.stdout.startswith(f"nothing is installed in {root}"), proc.stdout
    assert_refused(runtime(release, "rollback", "--root", root), 1, "no previous slot to roll back to (nothing is installed)")

    proc = runtime(release, "install", versions[1], "--root", root)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "installed: slot a is active: model tiny, bundle version 1"
    state = status(release, root)
    record = state["slots"]["a"]
    assert (state["active"], state["previous"], sorted(state["slots"])) == ("a", None, ["a"])
    assert (record["bundle_version"], record["model"], record["key_id"]) == (1, "tiny", release.key.key_id)
    assert verify_bundle(root / "slots" / "a", load_trust(release.trust)).manifest.bundle_version == 1
    assert sorted(os.listdir(root)) == ROOT_ENTRIES and os.listdir(root / "slots") == ["a"]
    assert installed_version(root) == 1
    text = runtime(release, "status", "--root", root).stdout
    assert f"active: slot a: model tiny, bundle version 1, signed by key {release.key.key_id}, installed " in text
    assert "previous: none" in text
    assert_refused(runtime(release, "rollback", "--root", root), 1,
                   "no previous slot to roll back to (slot a is active, and the other slot holds no installed bundle)")


def test_upgrade_switches_slots_and_rollback_returns(release, root):
    state = status(release, root)  # version 1 installed, then version 2
    assert (state["active"], state["previous"]) == ("b", "a")
    assert (state["slots"]["a"]["bundle_version"], state["slots"]["b"]["bundle_version"]) == (1, 2)
    proc = runtime(release, "verify", root / "slots" / "b", "--root", root)
    assert proc.returncode == 0 and "bundle version 2 (installed: 2)" in proc.stdout, proc.stdout + proc.stderr

    proc = runtime(release, "rollback", "--root", root)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("rolled back: slot a is active: model tiny, bundle version 1; "
                                   "slot b (model tiny, bundle version 2) is previous")
    assert (status(release, root)["active"], installed_version(root)) == ("a", 1)
    text = runtime(release, "status", "--root", root).stdout
    assert "active: slot a: model tiny, bundle version 1" in text and "previous: slot b: model tiny, bundle version 2" in text

    assert runtime(release, "rollback", "--root", root).returncode == 0  # and forward again
    state = status(release, root)
    assert (state["active"], state["previous"], installed_version(root)) == ("b", "a", 2)


def test_older_version_refused_unless_allowed(release, versions, root):
    before = status(release, root)
    assert_refused(runtime(release, "install", versions[1], "--root", root), 1,
                   "manifest.bundle_version is 1, lower than the installed bundle's 2: an older bundle is refused")
    assert_still_active(release, root, before)

    proc = runtime(release, "install", versions[1], "--root", root, "--allow-downgrade")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("installed: slot a is active: model tiny, bundle version 1; slot b (model tiny, "
                                   "bundle version 2) is previous: `rollback` returns to it")
    assert "note: downgrade allowed (--allow-downgrade): manifest.bundle_version is 1" in proc.stderr
    state = status(release, root)
    assert (state["active"], state["slots"]["a"]["bundle_version"], state["previous"]) == ("a", 1, "b")


def _other_key(release: Release) -> SigningKey:
    private, _, _ = generate_keys(release.work / "other-keys", "other")
    return load_private_key(private)


def _arch(bundle: Path) -> None:
    m = json.loads((bundle / "manifest.json").read_text())
    m["arch"] = "aarch64"
    (bundle / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("case", ["unsigned", "unknown-key", "changed-manifest", "tampered-member", "other-arch"])
def test_untrusted_bundles_are_refused(release, versions, root, tmp_path, case):
    before = status(release, root)
    if case == "unsigned":
        archive, needle = release.archive("unsigned", 3, unsigned=True), "manifest.sig: missing: the bundle is not signed"
    elif case == "unknown-key":
        other = _other_key(release)
        archive = release.archive("other-key", 3, key=other)
        needle = f"manifest.sig: signed by key {other.key_id}, which this device does not trust (it trusts {release.key.key_id})"
    elif case == "changed-manifest":  # the signed manifest edited afterwards: another model name
        with tarfile.open(versions[3]) as tar:
            text = tar.extractfile("bundle/manifest.json").read().replace(b'"name": "tiny"', b'"name": "tinx"')
        archive = rewritten(versions[3], tmp_path / "a.tar.gz", change={"bundle/manifest.json": text})
        needle = "manifest.sig: does not verify with key"
    elif case == "tampered-member":  # a segment's bytes changed, its size kept
        with tarfile.open(versions[3]) as tar:
            data = bytearray(tar.extractfile("bundle/segments/s0.so").read())
        data[len(data) // 2] ^= 0xFF
        archive = rewritten(versions[3], tmp_path / "a.tar.gz", change={"bundle/segments/s0.so": bytes(data)})
        needle = "1 file(s) do not match the manifest: segments/s0.so: sha256 does not match the manifest"
    else:
        archive, needle = release.archive("aarch64", 3, change=_arch), "manifest.arch is aarch64, but this device is"
    assert_refused(runtime(release, "install", archive, "--root", root), 1, f"{archive}: {needle}")
    assert_still_active(release, root, before)
    assert sorted(os.listdir(root)) == ROOT_ENTRIES  # the unpacked bundle was removed
    after = status(release, root)
    if case == "tampered-member":  # only the unpacked files show it: the free slot was given up for them
        assert after["previous"] is None
    else:  # refused on the archive's signed manifest, before any slot was touched: rollback still possible
        assert after["previous"] == before["previous"] == "a" and after["slots"]["a"] == before["slots"]["a"]
        verify_bundle(root / "slots" / "a", load_trust(release.trust))


def _member(name: str, kind: bytes = tarfile.REGTYPE, **fields) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    for k, v in fields.items():
        setattr(info, k, v)
    return info


@pytest.mark.parametrize("case", ["absolute", "dot-dot", "symlink", "hardlink", "fifo", "device", "too-large"])
def test_unsafe_archives_are_refused(release, versions, root, tmp_path, case):
    before = status(release, root)
    escaped = tmp_path / "escaped"
    members = {
        "absolute": (_member(str(escaped)), b"x", f"refuses member '{escaped}' (absolute path or '..')"),
        "dot-dot": (_member("bundle/../../../escaped"), b"x", "refuses member 'bundle/../../../escaped' (absolute path"),
        "symlink": (_member("bundle/segments/s1.so", tarfile.SYMTYPE, linkname=str(escaped)), None,
                    "refuses member 'bundle/segments/s1.so' (a link or special file)"),
        "hardlink": (_member("bundle/segments/s1.so", tarfile.LNKTYPE, linkname="bundle/manifest.json"), None,
                     "(a link or special file)"),
        "fifo": (_member("bundle/segments/fifo", tarfile.FIFOTYPE), None, "'bundle/segments/fifo' (a link or special"),
        "device": (_member("bundle/null", tarfile.CHRTYPE, devmajor=1, devminor=3), None, "'bundle/null' (a link or"),
    }
    if case == "too-large":
        args, needle = [versions[3], "--max-bytes", "1000"], "takes the archive past 1,000 bytes unpacked"
    else:
        info, data, needle = members[case]
        args = [rewritten(versions[3], tmp_path / "a.tar.gz", extra=[(info, data)])]
    assert_refused(runtime(release, "install", *args, "--root", root), 1, needle)
    assert not escaped.exists() and not list(tmp_path.rglob("escaped"))
    assert_still_active(release, root, before)
    assert sorted(os.listdir(root)) == ROOT_ENTRIES


def _wrong_golden(bundle: Path) -> None:
    outputs = dict(np.load(bundle / "golden" / "outputs.npz"))
    savez(bundle / "golden" / "outputs.npz", {k: v * 2 + 1 for k, v in outputs.items()})


def _unreadable_golden(bundle: Path) -> None:
    (bundle / "golden" / "inputs.npz").write_bytes(b"not an npz file")


@pytest.mark.parametrize("change, needle", [
    (_wrong_golden, "error: slot a: the self-test failed: segment s0 output y: max abs error"),
    (_unreadable_golden, "error: slot a: the self-test failed: it crashed (exit 1): "),
], ids=["fails", "crashes"])
def test_failing_selftest_leaves_the_active_slot(release, root, change, needle):
    archive = release.archive(change.__name__, 3, change=change)  # validly signed: only the self-test can tell
    before = status(release, root)
    proc = runtime(release, "install", archive, "--root", root)
    assert_refused(proc, 1, needle)
    assert "hint: the bundle does not run correctly on this device; slot b (model tiny, bundle version 2) is still active" \
        in proc.stderr
    assert_still_active(release, root, before)
    state = status(release, root)
    assert state["previous"] is None and sorted(state["slots"]) == ["b"]  # slot a was given to the refused bundle


# --- interruption --------------------------------------------------------------------------------


# what a kill at a step leaves beside the active slot: the step is where the hook says it is
_LEFT_BY_KILL = {
    "forget-previous": lambda root, state: state["previous"] == "a",
    "remove-slot": lambda root, state: state["previous"] is None and (root / "slots" / "a").is_dir(),
    "unpack": lambda root, state: not (root / "slots" / "a").exists() and not (root / "staging").exists(),
    "verify": lambda root, state: (root / "staging" / "bundle" / "manifest.json").is_file(),
    "selftest": lambda root, state: _version(root / "slots" / "a") == 3 and not (root / "staging").exists(),
    "switch": lambda root, state: json.loads((root / "state.json.tmp").read_text())["active"] == "a",
}


def _version(bundle: Path) -> int:
    return json.loads((bundle / "manifest.json").read_text())["bundle_version"]


@pytest.mark.parametrize("step", STEPS)
def test_killed_at_every_step_the_previous_stays_active(release, versions, root, step):
    before = status(release, root)
    proc = runtime(release, "install", versions[3], "--root", root, env={CRASH_ENV: step})
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert_still_active(release, root, before)
    if step in _LEFT_BY_KILL:
        assert _LEFT_BY_KILL[step](root, status(release, root)), sorted(p.name for p in root.iterdir())

    proc = runtime(release, "install", versions[3], "--root", root)  # the next install cleans up and succeeds
    assert proc.returncode == 0, proc.stderr
    state = status(release, root)
    assert (state["active"], state["slots"]["a"]["bundle_version"], state["previous"]) == ("a", 3, "b")
    assert sorted(os.listdir(root)) == ROOT_ENTRIES


def test_a_full_disk_during_install_leaves_the_previous_slot(release, versions, root):
    """A write that fails as on a full disk (a file size limit below the bundle's largest file) while the
    new bundle is unpacked: refused, nothing of it kept, the previous bundle active and intact."""
    before = status(release, root)
    largest = max(m.size for m in tarfile.open(versions[3]).getmembers())
    proc = runtime(release, "install", versions[3], "--root", root, max_file_bytes=largest // 2)
    assert_refused(proc, 1, "cannot be unpacked into")
    assert "File too large" in proc.stderr
    assert_still_active(release, root, before)
    assert sorted(os.listdir(root)) == ROOT_ENTRIES  # the staging directory was removed
    assert runtime(release, "install", versions[3], "--root", root).returncode == 0  # with room, it installs


def test_unknown_crash_step_is_refused(release, versions, root):
    before = status(release, root)
    assert_refused(runtime(release, "install", versions[3], "--root", root, env={CRASH_ENV: "nowhere"}), 2,
                   f"{CRASH_ENV}='nowhere' is not a step of install")
    assert_still_active(release, root, before)


def test_a_second_installer_is_refused_by_the_lock(release, versions, root):
    before = status(release, root)
    with open(root / "install.lock", "r+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write("4242\n")
        lock.flush()
        for args in (["install", versions[3]], ["rollback"]):
            assert_refused(runtime(release, *args, "--root", root), 1,
                           f"{root / 'install.lock'}: held by another install or rollback (pid 4242)")
    assert_still_active(release, root, before)
    assert runtime(release, "install", versions[3], "--root", root).returncode == 0  # released: it goes ahead


def test_rollback_refuses_a_damaged_previous_slot(release, root):
    before = status(release, root)
    seg = root / "slots" / "a" / "segments" / "s0.so"
    data = bytearray(seg.read_bytes())
    data[100] ^= 0xFF
    seg.write_bytes(bytes(data))
    assert_refused(runtime(release, "rollback", "--root", root), 1,
                   "slot a: 1 file(s) do not match the manifest: segments/s0.so: sha256 does not match")
    assert_still_active(release, root, before)


def test_bad_invocations_exit_2(release, versions, tmp_path):
    assert_refused(runtime(release, "status", "--root", tmp_path / "none"), 2, f"--root {tmp_path / 'none'}: not a directory")
    root = tmp_path / "root"
    root.mkdir()
    assert_refused(runtime(release, "install", versions[1], "--root", root), 2, f"--root {root}: no trust/ directory, so no key to check a bundle with")
    assert os.listdir(root) == []  # no key: refused before the lock, nothing written


# --- archives and bundles padded with directories ----------------------------------------------------


def _directories(*names: str) -> list[tuple[tarfile.TarInfo, None]]:
    return [(_member(name, tarfile.DIRTYPE, mode=0o755), None) for name in names]


def test_directories_the_manifest_does_not_need_are_refused_before_anything_is_written(release, versions, root,
                                                                                        tmp_path):
    """A genuine signed archive padded with empty directories: an empty `tflite_runtime/interpreter/`
    would be importable from the slot. Refused by the installer and by the unpacking `edgesdk verify`
    shares, before a byte is written."""
    from edgesdk.errors import UserError
    from edgesdk.verify import verify

    pads = [f"bundle/pad/{i}" for i in range(4)]
    archive = rewritten(versions[3], tmp_path / "a.tar.gz",
                        extra=_directories("bundle/tflite_runtime", "bundle/tflite_runtime/interpreter", *pads))
    before = status(release, root)
    proc = runtime(release, "install", archive, "--root", root)
    assert_refused(proc, 1, f"error: {archive}: member 'bundle/tflite_runtime/' is a directory the manifest lists "
                   "no file in")
    assert_still_active(release, root, before)
    assert sorted(os.listdir(root)) == ROOT_ENTRIES and not list(root.rglob("tflite_runtime"))
    (tmp_path / "dest").mkdir()
    with pytest.raises(UnpackError) as e:
        unpack(archive, tmp_path / "dest", 1 << 30)
    assert e.value.code == "bundle.unlisted-member" and not list((tmp_path / "dest").iterdir())
    with pytest.raises(UserError, match="member 'bundle/tflite_runtime/' is a directory the manifest lists no file"):
        verify(archive, run_selftest=False)
    # the directories a bundle needs pass: the archive as edgesdk wrote it unpacks
    assert verify_bundle(unpack(versions[3], tmp_path / "dest", 1 << 30), load_trust(release.trust))


def test_an_archive_of_too_many_members_is_refused_before_anything_is_written(versions, tmp_path, monkeypatch):
    with tarfile.open(versions[1]) as tar:
        count = len(tar.getmembers())
    monkeypatch.setattr(unpack_module, "MAX_MEMBERS", count)  # the real bound (10,000) costs 10,000 members
    (tmp_path / "dest").mkdir()
    assert unpack(versions[1], tmp_path / "dest", 1 << 30).is_dir()  # at the bound: unpacked
    shutil.rmtree(tmp_path / "dest")
    (tmp_path / "dest").mkdir()
    archive = rewritten(versions[1], tmp_path / "a.tar.gz", extra=_directories("bundle/x"))
    with pytest.raises(UnpackError, match=f"holds more than {count:,} members; a bundle holds its files") as e:
        unpack(archive, tmp_path / "dest", 1 << 30)
    assert e.value.code == "bundle.too-many-members" and not list((tmp_path / "dest").iterdir())


def test_an_empty_directory_the_manifest_does_not_need_fails_a_bundle(release, root, tmp_path):
    """In a bundle directory under verification, by the device's verifier and the host's."""
    from edgesdk.errors import UserError
    from edgesdk.verify import verify

    bundle = tmp_path / "bundle"
    shutil.copytree(root / "slots" / "b", bundle)
    (bundle / "tflite_runtime" / "interpreter").mkdir(parents=True)
    proc = runtime(release, "verify", bundle, "--root", root)
    assert_refused(proc, 1, "error: not trusted: 1 file(s) do not match the manifest: tflite_runtime/interpreter: "
                   "a directory the manifest lists no file in")
    with pytest.raises(UserError, match="1 file"):
        verify(bundle, run_selftest=False)
    (bundle / "tflite_runtime" / "interpreter").rmdir()
    (bundle / "tflite_runtime").rmdir()
    assert runtime(release, "verify", bundle, "--root", root).returncode == 0


# --- a root with links, a damaged root ---------------------------------------------------------------


def _tree(path: Path) -> dict[str, object]:
    """Everything under `path`: each regular file's bytes, each link's target, every entry's mode."""
    seen: dict[str, object] = {}
    for p in sorted(path.rglob("*")):
        mode = p.lstat().st_mode
        content = os.readlink(p) if p.is_symlink() else p.read_bytes() if stat.S_ISREG(mode) else None
        seen[p.relative_to(path).as_posix()] = (mode, content)
    return seen


@pytest.mark.parametrize("entry", ["slots", "staging", "state.json"])
def test_a_link_in_the_root_is_refused_and_nothing_outside_it_changes(release, versions, root, tmp_path, entry):
    """A root whose `slots` (or `staging`, or `state.json`) is a link: install, rollback and status
    refuse it before anything is moved, removed or written, and where it leads stays byte for byte."""
    victim = tmp_path / "victim"
    if entry == "slots":  # another bundle's slots: the link would have them removed and written over
        shutil.copytree(root / "slots", victim)
        shutil.rmtree(root / "slots")
    elif entry == "staging":
        victim.mkdir()
        (victim / "keep.txt").write_text("someone else's\n")
    else:
        victim.mkdir()
        (root / "state.json").rename(victim / "state.json")
    target = victim / "state.json" if entry == "state.json" else victim
    (root / entry).symlink_to(target)
    seen, root_seen = _tree(victim), _tree(root)
    for args in (["install", versions[3]], ["rollback"], ["status"]):
        proc = runtime(release, *args, "--root", root)
        assert_refused(proc, 1, f"error: {root / entry}: is a link (to {target}); every entry of an install root "
                       "is inside it, and install, rollback and status follow no link there")
        noun = {"slots": "directory", "staging": "leftover", "state.json": "state file"}[entry]
        assert f"hint: put the {noun} itself at {root / entry}, or remove the link; nothing changed" in proc.stderr
        assert _tree(victim) == seen and _tree(root) == root_seen


def test_a_state_file_linked_to_dev_zero_is_refused(release, root, tmp_path):
    (root / "state.json").unlink()
    (root / "state.json").symlink_to("/dev/zero")
    assert_refused(runtime(release, "status", "--root", root, timeout=60), 1,
                   f"error: {root / 'state.json'}: is a link (to /dev/zero)")
    proc = runtime(release, "verify", root / "slots" / "b", "--root", root, timeout=60)
    assert_refused(proc, 1, f"error: {root / 'state.json'}: a link, not a regular file")
    assert "hint: the install root is damaged: restore state.json from a backup" in proc.stderr


_DAMAGED_STATES = {
    "not-json": (b"{\"active\": ", "not valid JSON (Expecting value: line 1 column 12 (char 11))"),
    "version-true": ({"bundle_version": True}, "slots.b.bundle_version is true, not an integer from 0 to 9223372036854775807"),
    "version-negative": ({"bundle_version": -7}, "slots.b.bundle_version is -7, not an integer from 0 to"),
    "version-past-int64": ({"bundle_version": 2**63}, "slots.b.bundle_version is 9223372036854775808, not an integer"),
    "active-a-list": ({"active": ["b"]}, 'active is ["b"], not one of a, b or null'),
    "slot-c": ({"slots": {"c": {"bundle_version": 1}}}, "slots holds 'c', not one of a, b"),
    "floor-text": ({"floor": "high"}, 'floor is "high", not an integer from 0 to 9223372036854775807 or null'),
    "model-number": ({"model": 7}, "slots.b.model is 7, not a string"),
    "a-fifo": (None, "not a regular file (a FIFO)"),
}


@pytest.mark.parametrize("case", _DAMAGED_STATES)
def test_a_damaged_state_file_is_said_by_every_command(release, versions, root, case, capsys):
    """state.json with a wrong type, a value out of range, an unknown slot, or a FIFO in its place: the
    device's verify, status, install and rollback, and the host's `edgesdk verify --root`, each refuse
    it (exit 1) and change nothing."""
    damage, needle = _DAMAGED_STATES[case]
    path = root / "state.json"
    state = json.loads(path.read_text())
    if isinstance(damage, bytes):
        path.write_bytes(damage)
    elif damage is None:
        path.unlink()
        os.mkfifo(path)
    else:
        if set(damage) <= {"bundle_version", "model"}:
            state["slots"]["b"].update(damage)
        elif "slots" in damage:
            state["slots"].update(damage["slots"])
        else:
            state.update(damage)
        path.write_text(json.dumps(state))
    seen = _tree(root)
    for args in (["verify", root / "slots" / "b"], ["status"], ["install", versions[3]], ["rollback"]):
        proc = runtime(release, *args, "--root", root, timeout=60)
        assert_refused(proc, 1, f"error: {path}: ")
        assert needle in proc.stderr and "hint: the install root is damaged: restore state.json from a backup" \
            in proc.stderr, proc.stderr
    proc = host_verify(capsys, root / "slots" / "b", "--root", root)
    assert_refused(proc, 1, f"error: {path}: ")
    assert needle in proc.stderr and "hint: the install root is damaged" in proc.stderr
    pid = "install.lock"  # the one write: the pid of the last command that held the lock
    assert {k: v for k, v in _tree(root).items() if k != pid} == {k: v for k, v in seen.items() if k != pid}


def test_a_state_file_of_an_older_installer_keeps_its_floor(release, versions, root):
    """A state.json written before the floor was recorded: its floor is the newest version its slots hold."""
    assert runtime(release, "rollback", "--root", root).returncode == 0  # slot a (version 1) active, b (2) previous
    state = json.loads((root / "state.json").read_text())
    state.pop("floor", None)
    (root / "state.json").write_text(json.dumps(state))
    before = status(release, root)
    assert_refused(runtime(release, "install", versions[1], "--root", root), 1,
                   "manifest.bundle_version is 1, lower than 2, the newest version this device has installed: an "
                   "older bundle is refused (rollback protection); --allow-downgrade installs it on purpose")
    assert_still_active(release, root, before)
    assert status(release, root)["floor"] == 2


def test_the_floor_stays_after_a_rollback(release, versions, tmp_path, capsys):
    """Install 1, then 3, roll back (1 runs again), install 2: refused, as 3 was installed here once."""
    root = _empty_root(release, tmp_path / "root")
    for v in (1, 3):
        assert runtime(release, "install", versions[v], "--root", root).returncode == 0
    assert runtime(release, "rollback", "--root", root).returncode == 0
    before = status(release, root)
    needle = ("manifest.bundle_version is 2, lower than 3, the newest version this device has installed: an older "
              "bundle is refused (rollback protection); --allow-downgrade installs it on purpose")
    assert_refused(runtime(release, "install", versions[2], "--root", root), 1, needle)
    assert_still_active(release, root, before)
    assert (before["active"], before["slots"]["a"]["bundle_version"], before["floor"]) == ("a", 1, 3)
    assert "floor: bundle version 3, the newest installed here" in runtime(release, "status", "--root", root).stdout
    assert status(release, root)["previous"] == "b"  # refused on its signed manifest: rollback still possible
    (tmp_path / "v2").mkdir()
    bundle = unpack(versions[2], tmp_path / "v2", 1 << 30)
    assert_refused(runtime(release, "verify", bundle, "--root", root), 1, needle)
    assert_refused(host_verify(capsys, bundle, "--root", root), 1, "manifest.bundle_version is 2, lower than the "
                   "installed bundle's 3: an older bundle is refused")
    proc = runtime(release, "install", versions[2], "--root", root, "--allow-downgrade")
    assert proc.returncode == 0, proc.stderr
    assert "note: downgrade allowed (--allow-downgrade): manifest.bundle_version is 2, lower than 3" in proc.stderr
    assert status(release, root)["floor"] == 3  # an allowed downgrade does not lower it either
    proc = runtime(release, "verify", bundle, "--root", root, "--allow-downgrade")
    assert proc.returncode == 0 and "bundle version 2 (installed: 2; floor: 3)" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("value", ["inf", "1e300", "nan", "0", "-1", "86401"])
def test_an_absurd_selftest_timeout_is_a_bad_invocation(release, versions, root, value):
    seen = _tree(root)
    proc = runtime(release, "install", versions[3], "--root", root, "--selftest-timeout", value)
    assert_refused(proc, 2, f"argument --selftest-timeout: {value!r} is not a number of seconds above 0 and at "
                   "most 86400")
    assert _tree(root) == seen


def _read_only(monkeypatch, root: Path) -> None:
    """The kernel's answer for a root on a read-only file system: every open of a file in it to write
    fails with EROFS (as root, a test cannot make a directory unwritable otherwise)."""
    real = os.open

    def open_(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and str(path).startswith(str(root)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)


def test_a_read_only_root_is_said_and_status_still_reads_it(release, versions, root, monkeypatch, capsys):
    from edgesdk.runtime import install as installer

    _read_only(monkeypatch, root)
    seen = _tree(root)
    common = {"root": str(root), "trust": None}
    for command, handler, extra in (
            ("install", installer._install_command, {"archive": str(versions[3]), "allow_downgrade": False,
                                                     "max_bytes": None, "selftest_timeout": 900.0}),
            ("rollback", installer._rollback_command, {})):
        code = handler(argparse.Namespace(command=command, **common, **extra))
        err = capsys.readouterr().err
        assert code == 2, err
        assert err.splitlines() == [
            f"error: --root {root}: not writable (Read-only file system), and {command} writes there (install.lock, "
            "state.json, slots/)", "hint: remount it read-write, or run as the user who owns it; nothing changed"]
    assert installer._status_command(argparse.Namespace(command="status", root=str(root), json=False)) == 0
    assert "active: slot b: model tiny, bundle version 2" in capsys.readouterr().out
    assert _tree(root) == seen


# --- manifests that are FIFOs, a self-test that hangs ----------------------------------------------------


@pytest.mark.parametrize("name", ["manifest.json", "manifest.sig"])
def test_a_fifo_in_place_of_a_bundles_manifest_is_refused(release, root, tmp_path, name):
    bundle = tmp_path / "bundle"
    shutil.copytree(root / "slots" / "b", bundle)
    (bundle / name).unlink()
    os.mkfifo(bundle / name)
    proc = runtime(release, "verify", bundle, "--root", root, timeout=60)
    assert_refused(proc, 1, f"error: not trusted: {name}: not a regular file (a FIFO)")


def test_rollback_to_a_slot_whose_manifest_is_a_fifo_is_refused_and_releases_the_lock(release, versions, root):
    before = status(release, root)
    (root / "slots" / "a" / "manifest.json").unlink()
    os.mkfifo(root / "slots" / "a" / "manifest.json")
    assert_refused(runtime(release, "rollback", "--root", root, timeout=60), 1,
                   "error: not trusted: slot a: manifest.json: not a regular file (a FIFO)")
    assert_still_active(release, root, before)
    assert runtime(release, "install", versions[3], "--root", root, timeout=60).returncode == 0  # not locked


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed and waiting to be reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_hanging_selftest_is_killed_with_every_process_it_started(release, root, tmp_path):
    """A validly signed bundle whose self-test starts a child, then hangs: at --selftest-timeout the
    installer kills the self-test's whole process group, and the previous slot stays active."""
    pids = tmp_path / "pids"

    def hanging_selftest(bundle: Path) -> None:
        (bundle / "runtime" / "selftest.py").write_text(
            "import os, subprocess, sys, time\n\n\n"
            "def main(argv):\n"
            "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            f"    with open({str(pids) + '.tmp'!r}, 'w') as f:\n"
            "        f.write(f'{os.getpid()} {child.pid}')\n"
            f"    os.rename({str(pids) + '.tmp'!r}, {str(pids)!r})\n"
            "    time.sleep(600)\n")

    archive = release.archive("hanging-selftest", 3, change=hanging_selftest)
    before = status(release, root)
    try:
        proc = runtime(release, "install", archive, "--root", root, "--selftest-timeout", "5", timeout=120)
        assert_refused(proc, 1, "error: slot a: the self-test failed: it did not finish in 5 s (--selftest-timeout)")
        assert "hint: the bundle does not run correctly on this device; slot b (model tiny, bundle version 2) is " \
               "still active" in proc.stderr
        assert_still_active(release, root, before)
        started = [int(p) for p in pids.read_text().split()]  # the self-test and its child
        assert len(started) == 2 and not [p for p in started if _alive(p)]
    finally:
        for pid in map(int, pids.read_text().split() if pids.exists() else []):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# --- unpack on its own -----------------------------------------------------------------------------


def test_unpack_writes_through_no_link_planted_in_dest(versions, tmp_path):
    dest, outside = tmp_path / "dest", tmp_path / "outside"
    dest.mkdir()
    outside.mkdir()
    (dest / "bundle").symlink_to(outside)
    with pytest.raises(UnpackError, match="cannot be unpacked into") as e:
        unpack(versions[1], dest, 1 << 30)
    assert e.value.code == "bundle.unpack-failed" and not list(outside.iterdir())


def test_unpack_refuses_a_file_used_as_a_directory(versions, tmp_path):
    archive = rewritten(versions[1], tmp_path / "a.tar.gz", extra=[(_member("bundle/plan.json/x"), b"x")])
    (tmp_path / "dest").mkdir()
    with pytest.raises(UnpackError, match="member 'bundle/plan.json' is a file, and member 'bundle/plan.json/x'"):
        unpack(archive, tmp_path / "dest", 1 << 30)


@pytest.mark.qemu
def test_install_runs_on_the_devices_python(release, versions, tmp_path):
    """Debian bookworm's Python 3.11.2 (no tarfile extraction filters) with the rootfs's `cryptography`,
    under qemu-user: install refuses the x86 bundle for its architecture before touching the root; the
    runtime's own unpacking writes the archive there, which then verifies with the device's key; an
    unsafe archive is refused with nothing written."""
    from edgesdk.backends import qemu

    rootfs = qemu.find_rootfs()
    if rootfs is None:
        pytest.fail("the arm64 root file system is missing: `make rootfs` prepares it (make test does)")
    root = _empty_root(release, tmp_path / "root")
    env = {"PYTHONPATH": str(release.bundle)}
    proc = qemu.run_python(rootfs, ["-B", "-m", "runtime", "install", str(versions[1]), "--root", str(root)],
                           cwd=tmp_path, env=env, timeout=300)
    assert_refused(proc, 1, "manifest.arch is x86_64, but this device is aarch64")
    assert sorted(os.listdir(root)) == ["install.lock", "trust"]
    fifo = rewritten(versions[1], tmp_path / "a.tar.gz", extra=[(_member("bundle/f", tarfile.FIFOTYPE), None)])
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from runtime.unpack import unpack, UnpackError\n"
        "from runtime.trust import load_trust, verify_bundle\n"
        "dest = Path(sys.argv[3]); dest.mkdir()\n"
        "print(verify_bundle(unpack(Path(sys.argv[1]), dest, 1 << 30), load_trust(Path(sys.argv[4]))).manifest.bundle_version)\n"
        "bad = dest.parent / 'bad'; bad.mkdir()\n"
        "try:\n"
        "    unpack(Path(sys.argv[2]), bad, 1 << 30)\n"
        "except UnpackError as e:\n"
        "    print(e.code, e.problem, sorted(p.name for p in bad.iterdir()))\n")
    proc = qemu.run_python(rootfs, ["-B", "-c", script, str(versions[1]), str(fifo), str(tmp_path / "unpacked"),
                                    str(release.trust)], cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "1", "bundle.unsafe-member refuses member 'bundle/f' (a link or special file) []"]
