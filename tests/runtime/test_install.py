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

import fcntl
import gzip
import hashlib
import io
import json
import os
import shutil
import signal
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


def runtime(release: Release, *args, env: dict[str, str] | None = None,
            max_file_bytes: int | None = None) -> subprocess.CompletedProcess:
    """`python -B -m runtime ARGS` as on a device: the runtime the built bundle ships, nothing else.
    `max_file_bytes`: no file may grow past it (RLIMIT_FSIZE: a write past it fails as on a full disk)."""
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", CRASH_ENV)}
    return subprocess.run([sys.executable, "-B", "-m", "runtime", *map(str, args)], capture_output=True, text=True,
                          env={**base, "PYTHONPATH": str(release.bundle), "PYTHONDONTWRITEBYTECODE": "1", **(env or {})},
                          cwd=release.work, timeout=300,
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
