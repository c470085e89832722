"""Signed bundles end to end: `edgesdk keys generate`, `build --sign-key`, `edgesdk sign`,
and every case `edgesdk verify` and the device's `python -m runtime verify` refuse, on a real bundle (the
PP-OCR classifier for x86, `x86_ppocr`) with real ed25519 keys; `--check-reproducible` and `make release`
on a one-convolution model. The device's verifier is a genuine runtime outside the bundle it checks (as
the device's active slot holds it): a bundle never verifies itself.

An attacker here can edit anything in the bundle, the manifest included, but holds no private key the
device trusts: each refusal below is one such edit."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk.bundling import signing
from edgesdk.bundling.archive import write_tarball
from edgesdk.runtime import trust
from tests.test_cli import assert_user_facing, edgesdk

pytestmark = pytest.mark.slow  # real bundles, signed and verified, some under qemu

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("keys")
    vendor, vendor_pub, _ = signing.generate_keys(d, "vendor")
    other, other_pub, _ = signing.generate_keys(d, "other")
    trust_dir = d / "trust"
    trust_dir.mkdir()
    shutil.copy(vendor_pub, trust_dir)
    return {"key": vendor, "pub": vendor_pub, "other": other, "other_pub": other_pub, "trust": trust_dir}


@pytest.fixture()
def signed(x86_ppocr, keys, tmp_path) -> Path:
    """A copy of the x86 PP-OCR bundle, signed by `vendor` at version 7."""
    bundle = tmp_path / "bundle"
    shutil.copytree(x86_ppocr.bundle, bundle)
    signing.stamp(bundle, version=7, key=signing.load_private_key(keys["key"]))
    return bundle


@pytest.fixture(scope="module")
def device_runtime(tmp_path_factory) -> Path:
    """A directory holding `runtime/`, a genuine copy of the SDK's runtime: what a device already trusts
    (its active slot's runtime, or the one its image installs), never the bundle being verified."""
    d = tmp_path_factory.mktemp("device-runtime")
    shutil.copytree(REPO / "sdk" / "edgesdk" / "runtime", d / "runtime",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return d


def runtime_command(runtime: Path, *args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -B -m runtime ARGS` with `runtime` alone on the import path (nothing of the SDK), run from
    `cwd` (default: `runtime`, outside every bundle)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PYTHONPATH=str(runtime), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-B", "-m", "runtime", *args], env=env, cwd=cwd or runtime,
                          capture_output=True, text=True, timeout=timeout)


def device_verify(runtime: Path, bundle: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -B -m runtime verify BUNDLE` as a device runs it: by the trusted runtime `runtime`, from
    outside the bundle, with nothing of the SDK on the path."""
    return runtime_command(runtime, "verify", str(bundle), *args)


def restamp(bundle: Path, rel: str) -> None:
    """Rewrite the manifest's hash of `rel` to its current content (what an attacker would)."""
    m = json.loads((bundle / "manifest.json").read_text())
    data = (bundle / rel).read_bytes()
    m["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (bundle / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")


# --- keys ---------------------------------------------------------------------------------------------


def test_keys_generate_writes_a_0600_private_key_and_never_overwrites(tmp_path):
    proc = edgesdk("keys", "generate", "--out", str(tmp_path / "k"), "--name", "line1")
    assert proc.returncode == 0, proc.stderr
    private, public = tmp_path / "k" / "line1.key", tmp_path / "k" / "line1.pub"
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert b"PRIVATE KEY" in private.read_bytes() and b"PUBLIC KEY" in public.read_bytes()
    key_id = trust.load_public_key(public).key_id
    assert key_id in proc.stdout and signing.load_private_key(private).key_id == key_id
    again = edgesdk("keys", "generate", "--out", str(tmp_path / "k"), "--name", "line1")
    assert_user_facing(again, 1, "line1.key already exists")
    assert signing.load_private_key(private).key_id == key_id  # untouched


def test_an_encrypted_key_needs_its_passphrase(tmp_path, monkeypatch):
    monkeypatch.setenv(signing.ENV_PASSPHRASE, "correct horse")
    private, _, key_id = signing.generate_keys(tmp_path, "enc")
    assert b"ENCRYPTED" in private.read_bytes()
    assert signing.load_private_key(private).key_id == key_id
    monkeypatch.setenv(signing.ENV_PASSPHRASE, "wrong")
    with pytest.raises(signing.UsageError, match="could not decrypt"):
        signing.load_private_key(private)
    monkeypatch.delenv(signing.ENV_PASSPHRASE)
    with pytest.raises(signing.UsageError, match="encrypted") as e:
        signing.load_private_key(private)
    assert signing.ENV_PASSPHRASE in e.value.hint


@pytest.mark.parametrize("case, needle", [("public", "this is a public key"), ("junk", "not a private key"),
                                          ("missing", "cannot be read")])
def test_bad_signing_keys_are_refused_before_the_build(keys, tmp_path, case, needle):
    key = {"public": keys["pub"], "missing": tmp_path / "nope.key"}.get(case, tmp_path / "junk.key")
    if case == "junk":
        key.write_text("hello")
    proc = edgesdk("build", str(tmp_path / "model.onnx"), "-t", "x86", "-o", str(tmp_path / "out"),
                   "--sign-key", str(key))
    assert_user_facing(proc, 2, str(key.name), needle)
    assert not (tmp_path / "out").exists()


# --- signing --------------------------------------------------------------------------------------------


def test_signed_bundle_verifies_on_the_host_and_with_the_devices_runtime(signed, keys, device_runtime):
    proc = edgesdk("verify", str(signed), "--public-key", str(keys["pub"]), "--no-selftest")
    assert proc.returncode == 0, proc.stderr
    key_id = trust.load_public_key(keys["pub"]).key_id
    assert f"signature: verified: signed by key {key_id}" in proc.stdout and "bundle version 7" in proc.stdout
    dev = device_verify(device_runtime, signed, "--trust", str(keys["trust"]))
    assert dev.returncode == 0, dev.stderr
    assert f"signed by key {key_id}" in dev.stdout
    m = json.loads((signed / "manifest.json").read_text())
    assert m["signing"] == {"algorithm": "ed25519", "key_id": key_id} and m["bundle_version"] == 7
    # the private key is nowhere in the bundle
    secret = keys["key"].read_bytes()
    assert not any(secret in p.read_bytes() for p in signed.rglob("*") if p.is_file())


def test_without_a_key_verify_says_the_signature_was_not_checked(signed, x86_ppocr):
    proc = edgesdk("verify", str(signed), "--no-selftest")
    assert proc.returncode == 0 and "NOT checked" in proc.stdout
    proc = edgesdk("verify", str(x86_ppocr.bundle), "--no-selftest")
    assert proc.returncode == 0 and "unsigned" in proc.stdout


def test_sign_a_built_directory_and_its_tarball(x86_ppocr, keys, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(x86_ppocr.bundle, out / "bundle")
    shutil.copy(x86_ppocr.bundle.parent / "bundle.tar.gz", out / "bundle.tar.gz")
    proc = edgesdk("sign", str(out / "bundle"), "--key", str(keys["key"]), "--bundle-version", "12")
    assert proc.returncode == 0, proc.stderr
    assert "bundle.tar.gz" in proc.stdout
    for path in (out / "bundle", out / "bundle.tar.gz"):
        ok = edgesdk("verify", str(path), "--public-key", str(keys["pub"]), "--no-selftest")
        assert ok.returncode == 0 and "bundle version 12" in ok.stdout, ok.stderr
    # signing is deterministic (ed25519): the tarball signed again is the same bytes
    first = (out / "bundle.tar.gz").read_bytes()
    assert edgesdk("sign", str(out / "bundle.tar.gz"), "--key", str(keys["key"])).returncode == 0
    assert (out / "bundle.tar.gz").read_bytes() == first


def test_a_changed_bundle_is_never_signed(x86_ppocr, keys, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(x86_ppocr.bundle, bundle)
    with open(bundle / "plan.json", "a") as f:
        f.write(" ")
    proc = edgesdk("sign", str(bundle), "--key", str(keys["key"]))
    assert_user_facing(proc, 1, "not signed", "plan.json")
    assert not (bundle / "manifest.sig").exists()


# --- what verification refuses --------------------------------------------------------------------------


def _tamper(bundle: Path, case: str, keys) -> None:
    if case == "missing-signature":
        (bundle / "manifest.sig").unlink()
    elif case == "bad-signature":
        sig = bytearray((bundle / "manifest.sig").read_bytes())
        sig[0] ^= 1
        (bundle / "manifest.sig").write_bytes(bytes(sig))
    elif case == "short-signature":
        (bundle / "manifest.sig").write_bytes(b"\x00junk signature")
    elif case == "unknown-key":
        signing.stamp(bundle, key=signing.load_private_key(keys["other"]))
    elif case == "claimed-key":  # signed by vendor, but the manifest claims another key
        m = json.loads((bundle / "manifest.json").read_text())
        m["signing"]["key_id"] = trust.load_public_key(keys["other_pub"]).key_id
        data = (json.dumps(m, indent=2, sort_keys=True) + "\n").encode()
        (bundle / "manifest.json").write_bytes(data)
        (bundle / "manifest.sig").write_bytes(signing.load_private_key(keys["key"]).sign(data))
    elif case == "changed-file":
        with open(bundle / "plan.json", "a") as f:
            f.write(" ")
    elif case == "rewritten-hash":
        with open(bundle / "plan.json", "a") as f:
            f.write(" ")
        restamp(bundle, "plan.json")
    elif case == "extra-file":
        (bundle / "segments" / "extra.so").write_bytes(b"\x7fELF")
    elif case == "missing-file":
        (bundle / "requirements.txt").unlink()
    elif case == "raised-version":
        m = json.loads((bundle / "manifest.json").read_text())
        m["bundle_version"] = 99
        (bundle / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")
    else:
        raise AssertionError(case)


REFUSED = [  # case, what the message names (host and device alike)
    ("missing-signature", "manifest.sig: missing"),
    ("bad-signature", "manifest.sig: does not verify"),
    ("short-signature", "not an ed25519 signature"),
    ("unknown-key", "which this device does not trust"),
    ("claimed-key", "manifest.signing.key_id"),
    ("changed-file", "plan.json"),
    ("rewritten-hash", "manifest.sig: does not verify"),
    ("extra-file", "segments/extra.so: not listed"),
    ("missing-file", "requirements.txt: no such file"),
    ("raised-version", "manifest.sig: does not verify"),
]


@pytest.mark.parametrize("case, needle", REFUSED, ids=[c for c, _ in REFUSED])
def test_verify_refuses(signed, keys, device_runtime, case, needle):
    _tamper(signed, case, keys)
    host = edgesdk("verify", str(signed), "--public-key", str(keys["pub"]))
    assert_user_facing(host, 1, needle)
    device = device_verify(device_runtime, signed, "--public-key", str(keys["pub"]))
    assert device.returncode == 1 and needle in device.stderr, device.stderr
    assert "Traceback" not in device.stderr


def test_rollback_protection_and_its_stated_override(signed, keys):
    proc = edgesdk("verify", str(signed), "--public-key", str(keys["pub"]), "--installed-version", "8", "--no-selftest")
    assert_user_facing(proc, 1, "manifest.bundle_version is 7, lower than the installed bundle's 8")
    same = edgesdk("verify", str(signed), "--public-key", str(keys["pub"]), "--installed-version", "7", "--no-selftest")
    assert same.returncode == 0, same.stderr
    allowed = edgesdk("verify", str(signed), "--public-key", str(keys["pub"]), "--installed-version", "8",
                      "--allow-downgrade", "--no-selftest")
    assert allowed.returncode == 0 and "downgrade allowed (--allow-downgrade)" in allowed.stdout


def test_a_trust_directory_accepts_either_key_while_one_is_rotated(signed, keys, tmp_path):
    rotation = tmp_path / "trust"
    rotation.mkdir()
    shutil.copy(keys["pub"], rotation)
    shutil.copy(keys["other_pub"], rotation)
    assert edgesdk("verify", str(signed), "--trust", str(rotation), "--no-selftest").returncode == 0
    signing.stamp(signed, key=signing.load_private_key(keys["other"]))  # the new key signs from now on
    assert edgesdk("verify", str(signed), "--trust", str(rotation), "--no-selftest").returncode == 0
    (rotation / keys["other_pub"].name).unlink()  # the new key retired: refused
    assert_user_facing(edgesdk("verify", str(signed), "--trust", str(rotation), "--no-selftest"), 1,
                       "which this device does not trust")


@pytest.mark.parametrize("case, needle", [("private", "this is a private key"), ("empty-dir", "holds no public key"),
                                          ("missing", "no such file")])
def test_unusable_public_keys_are_invocation_errors(signed, keys, device_runtime, tmp_path, case, needle):
    given = {"private": keys["key"], "missing": tmp_path / "none.pub"}.get(case, tmp_path / "empty")
    if case == "empty-dir":
        given.mkdir()
    flag = "--trust" if case == "empty-dir" else "--public-key"
    assert_user_facing(edgesdk("verify", str(signed), flag, str(given), "--no-selftest"), 2, needle)
    device = device_verify(device_runtime, signed, flag, str(given))
    assert device.returncode == 2 and needle in device.stderr


def test_a_signed_archive_verifies_and_a_replaced_signature_member_does_not(signed, keys, tmp_path):
    archive = tmp_path / "signed.tar.gz"
    write_tarball(signed, archive)
    assert edgesdk("verify", str(archive), "--public-key", str(keys["pub"]), "--no-selftest").returncode == 0
    _tamper(signed, "bad-signature", keys)
    write_tarball(signed, archive)
    assert_user_facing(edgesdk("verify", str(archive), "--public-key", str(keys["pub"]), "--no-selftest"), 1,
                       "manifest.sig: does not verify")


def test_release_files_signatures(keys, tmp_path):
    sums = tmp_path / "SHA256SUMS"
    sums.write_text("0" * 64 + "  a.tar.gz\n")
    assert edgesdk("keys", "sign", str(sums), "--key", str(keys["key"])).returncode == 0
    ok = edgesdk("keys", "verify", str(sums), "--public-key", str(keys["pub"]))
    assert ok.returncode == 0 and "signed by key" in ok.stdout
    sums.write_text("1" * 64 + "  a.tar.gz\n")
    assert_user_facing(edgesdk("keys", "verify", str(sums), "--public-key", str(keys["pub"])), 1, "does not verify")


# --- who verifies: never the bundle itself -----------------------------------------------------------------


def _tamper_runtime(bundle: Path, marker: Path) -> None:
    """What an attacker who can edit the bundle does: runtime/trust.py passes every file (and leaves
    `marker` when it is imported, so a test sees whether it ran), and plan.json is changed."""
    with open(bundle / "runtime" / "trust.py", "a") as f:
        f.write(f"\n\nopen({str(marker)!r}, 'w').write('the tampered trust.py ran')\n\n"
                "def file_problems(bundle, manifest):\n    return []\n")
    with open(bundle / "plan.json", "a") as f:
        f.write(" ")


def test_a_bundle_never_verifies_itself(signed, keys, device_runtime, tmp_path):
    # the genuine runtime a bundle ships refuses to vouch for the bundle it was loaded from, however named
    for cwd, named in ((signed, "."), (tmp_path, str(signed))):
        own = runtime_command(signed, "verify", named, "--trust", str(keys["trust"]), cwd=cwd)
        assert own.returncode == 2, own.stdout + own.stderr
        lines = own.stderr.strip().splitlines()
        assert lines[0] == (f"error: {named} is the bundle this runtime was loaded from: a bundle cannot vouch for "
                            "itself (its own, unchecked code would check it)"), own.stderr
        assert lines[1].startswith("hint: verify it with the runtime the device already trusts, from outside the "
                                   "bundle: cd / && PYTHONPATH=ROOT/slots/<active> python3 -B -m runtime verify ")
        assert "verified" not in own.stdout
    missing = runtime_command(signed, "verify", "--trust", str(keys["trust"]), cwd=signed)  # no default bundle
    assert missing.returncode == 2 and "the following arguments are required: bundle" in missing.stderr

    marker = tmp_path / "tampered-trust-ran"
    _tamper_runtime(signed, marker)
    device = device_verify(device_runtime, signed, "--trust", str(keys["trust"]))
    assert device.returncode == 1, device.stdout + device.stderr
    assert device.stderr.startswith("error: not trusted: 2 file(s) do not match the manifest: plan.json: sha256 "
                                     "does not match the manifest"), device.stderr
    assert "runtime/trust.py: sha256 does not match the manifest (the file was changed)" in device.stderr
    host = edgesdk("verify", str(signed), "--trust", str(keys["trust"]))
    assert_user_facing(host, 1, f"{signed}: 2 file(s) do not match the manifest", "plan.json: sha256",
                       "runtime/trust.py: sha256")
    assert not marker.exists()  # nothing of the tampered bundle ran, on the device or on the host
    assert not [p for p in signed.rglob("*.pyc")]


def test_the_installed_sdks_runtime_verifies_too(signed, keys, tmp_path):
    """`python -m edgesdk.runtime verify`, where a device image installs edgesdk's package."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "sdk"), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-B", "-m", "edgesdk.runtime", "verify", str(signed), "--trust",
                           str(keys["trust"])], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "files match, bundle version 7" in proc.stdout, proc.stderr


# --- key files, temporary files, versions, passphrases --------------------------------------------------


def edgesdk_within(seconds: float, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`edgesdk ARGS` that must answer within `seconds` (a command stuck on a FIFO fails the test)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "sdk"), **(env or {})}
    return subprocess.run([sys.executable, "-m", "edgesdk.cli", *args], capture_output=True, text=True, env=env,
                          timeout=seconds)


@pytest.fixture()
def fifo(tmp_path) -> Path:
    path = tmp_path / "key.fifo"
    os.mkfifo(path)
    return path


def test_key_files_that_are_fifos_or_devices_are_refused_at_once(keys, device_runtime, fifo, tmp_path):
    """Each command that reads a key, once (the trust directory's and the size bound's cases are in
    tests/runtime/test_trust.py, the same code)."""
    not_regular = "not a regular file (a FIFO)"
    for args, needle in [
        (("verify", str(tmp_path), "--public-key", str(fifo)), f"public key {fifo}: {not_regular}"),
        (("keys", "verify", str(keys["pub"]), "--public-key", str(fifo)), f"public key {fifo}: {not_regular}"),
        (("sign", str(tmp_path), "--key", str(fifo)), f"signing key {fifo}: {not_regular}"),
        (("build", str(tmp_path / "m.onnx"), "-t", "x86", "-o", str(tmp_path / "out"), "--sign-key", "/dev/zero"),
         "signing key /dev/zero: not a regular file (a character device)"),
    ]:
        assert_user_facing(edgesdk_within(60, *args), 2, needle)
    assert not (tmp_path / "out").exists()
    for bad, needle in ((fifo, f"signing key {fifo}: {not_regular}"),  # keys sign --key, build --sign-key
                        (Path("/dev/zero"), "signing key /dev/zero: not a regular file (a character device)")):
        with pytest.raises(signing.UsageError, match=re.escape(needle)):
            signing.load_private_key(bad)
    device = device_verify(device_runtime, tmp_path, "--public-key", str(fifo))
    assert (device.returncode, device.stderr) == (2, f"error: public key {fifo}: {not_regular}\n")


def test_temporary_files_never_follow_a_planted_link(keys, x86_ppocr, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = tmp_path / "k"
    out.mkdir()
    for name in (".vendor.pub.tmp", ".vendor.key.tmp"):
        (out / name).symlink_to(victim)
    proc = edgesdk("keys", "generate", "--out", str(out), "--name", "vendor")
    assert proc.returncode == 0, proc.stderr
    assert trust.load_public_key(out / "vendor.pub").key_id == signing.load_private_key(out / "vendor.key").key_id
    sums = tmp_path / "SHA256SUMS"
    sums.write_text("0" * 64 + "  a.tar.gz\n")
    (tmp_path / ".SHA256SUMS.sig.tmp").symlink_to(victim)
    assert edgesdk("keys", "sign", str(sums), "--key", str(keys["key"])).returncode == 0
    assert edgesdk("keys", "verify", str(sums), "--public-key", str(keys["pub"])).returncode == 0
    built = tmp_path / "out"
    shutil.copytree(x86_ppocr.bundle, built / "bundle")
    shutil.copy(x86_ppocr.bundle.parent / "bundle.tar.gz", built / "bundle.tar.gz")
    (built / "bundle.tar.gz.tmp").symlink_to(victim)
    proc = edgesdk("sign", str(built / "bundle"), "--key", str(keys["key"]), "--bundle-version", "3")
    assert proc.returncode == 0, proc.stderr
    assert edgesdk("verify", str(built / "bundle.tar.gz"), "--public-key", str(keys["pub"]), "--no-selftest").returncode == 0
    assert victim.read_text() == "precious" and not victim.is_symlink()
    assert sorted(p.name for p in built.iterdir()) == ["bundle", "bundle.tar.gz", "bundle.tar.gz.tmp"]  # no temporary left


@pytest.mark.parametrize("version", [str(2**63), "-1"])
def test_out_of_range_bundle_versions_are_refused_before_anything_is_written(signed, keys, tmp_path, version):
    before = {p.name: p.read_bytes() for p in (signed / "manifest.json", signed / "manifest.sig")}
    needle = f"--bundle-version {version}: outside the versions a manifest holds, 0 to {2**63 - 1} (2^63 - 1, manifest.bundle_version)"
    assert_user_facing(edgesdk("sign", str(signed), "--key", str(keys["key"]), "--bundle-version", version), 2, needle)
    assert {p.name: p.read_bytes() for p in (signed / "manifest.json", signed / "manifest.sig")} == before
    out = tmp_path / "out"
    built = edgesdk("build", str(tmp_path / "m.onnx"), "-t", "x86", "-o", str(out), "--sign-key", str(keys["key"]),
                    "--bundle-version", version)
    assert_user_facing(built, 2, needle)
    from_env = edgesdk("build", str(tmp_path / "m.onnx"), "-t", "x86", "-o", str(out),
                       env={"EDGESDK_BUNDLE_VERSION": version})
    assert_user_facing(from_env, 2, needle)
    assert not out.exists()
    with pytest.raises(signing.UsageError, match="outside the versions a manifest holds"):
        signing.stamp(signed, version=int(version), key=signing.load_private_key(keys["key"]))
    assert (signed / "manifest.json").read_bytes() == before["manifest.json"]
    ok = edgesdk("verify", str(signed), "--public-key", str(keys["pub"]), "--no-selftest")
    assert ok.returncode == 0 and "bundle version 7" in ok.stdout


def test_a_build_signed_at_version_0_warns_as_sign_does(signed, keys, capsys):
    """What `build --sign-key` says as it publishes the bundle it signed (`cli._stamped`)."""
    from edgesdk import cli

    key = signing.load_private_key(keys["key"])
    warning = "warning: bundle version 0: devices cannot tell this bundle from an older one; give --bundle-version"
    signing.stamp(signed, version=0, key=key)
    assert cli._stamped(signed, quiet=False) == key.key_id
    assert capsys.readouterr().err.splitlines() == [f"bundle version 0, signed by key {key.key_id} (manifest.sig)",
                                                    warning]
    signing.stamp(signed, version=5, key=key)
    cli._stamped(signed, quiet=False)
    assert "warning" not in capsys.readouterr().err


def test_a_signed_manifest_with_trailing_data_is_refused_for_what_it_is(signed, keys, device_runtime):
    data = (signed / "manifest.json").read_bytes() + b"{}\n"
    (signed / "manifest.json").write_bytes(data)
    (signed / "manifest.sig").write_bytes(signing.load_private_key(keys["key"]).sign(data))
    key_id = trust.load_public_key(keys["pub"]).key_id
    needle = f"manifest.json: signed by key {key_id}, but not a JSON document (Extra data: line "
    assert_user_facing(edgesdk("verify", str(signed), "--public-key", str(keys["pub"])), 1, needle,
                       "hint: the bundle is damaged or was not written by this edgesdk; rebuild it")
    device = device_verify(device_runtime, signed, "--public-key", str(keys["pub"]))
    assert device.returncode == 1 and f"error: not trusted: {needle}" in device.stderr, device.stderr


def test_keys_generate_refusals_are_usage_errors(tmp_path):
    file = tmp_path / "file"
    file.write_text("not a directory")
    assert_user_facing(edgesdk("keys", "generate", "--out", str(file)), 2, f"--out {file}: not a directory",
                       "hint: give a directory for NAME.key and NAME.pub")
    assert file.read_text() == "not a directory"
    out = tmp_path / "k"
    for passphrase, needle in [(b"\xff\xfe secret", "EDGESDK_SIGN_KEY_PASSPHRASE is not UTF-8 text"),
                               (b"p" * 1024, "EDGESDK_SIGN_KEY_PASSPHRASE is 1,024 bytes long, more than the 1023")]:
        env = {k: v for k, v in os.environ.items() if k != signing.ENV_PASSPHRASE}
        env.update(PYTHONPATH=str(REPO / "sdk"))
        env[signing.ENV_PASSPHRASE.encode()] = passphrase
        proc = subprocess.run([sys.executable, "-m", "edgesdk.cli", "keys", "generate", "--out", str(out)],
                              capture_output=True, text=True, env=env, timeout=120)
        assert_user_facing(proc, 2, needle)
        assert not out.exists()


def test_a_long_passphrase_is_refused_when_signing(keys, tmp_path):
    sums = tmp_path / "SHA256SUMS"
    sums.write_text("0" * 64 + "  a.tar.gz\n")
    proc = edgesdk("keys", "sign", str(sums), "--key", str(keys["key"]), env={signing.ENV_PASSPHRASE: "p" * 1024})
    assert_user_facing(proc, 2, "EDGESDK_SIGN_KEY_PASSPHRASE is 1,024 bytes long")
    assert not (tmp_path / "SHA256SUMS.sig").exists()


# --- build, reproducibility and release on a one-convolution model ---------------------------------------


@pytest.fixture(scope="module")
def conv_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("conv") / "conv.onnx"
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 3, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])],
        "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_build_signs_and_checks_reproducibility(conv_model, keys, tmp_path, tuning_db):
    out = tmp_path / "out"
    env = {"EDGESDK_SIGN_KEY": str(keys["key"]), "EDGESDK_BUNDLE_VERSION": "4"}
    # one whole-span candidate beside the schedule's cut: the rebuild replays its measurements all the same
    proc = edgesdk("build", str(conv_model), "-t", "x86", "-o", str(out), "--tuning-db", str(tuning_db / "x86"),
                   "--cpu-backends", "onnxruntime", "--check-reproducible", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["reproducible"]["identical"] and summary["reproducible"]["differences"] == []
    # the rebuild ran every stage but tune, whose measurements it replayed
    assert summary["reproducible"]["stages_rebuilt"] == ["import", "legalize", "schedule", "compress", "package"]
    assert summary["signed_by"] == trust.load_public_key(keys["pub"]).key_id
    ok = edgesdk("verify", str(out / "bundle.tar.gz"), "--public-key", str(keys["pub"]), "--no-selftest")
    assert ok.returncode == 0 and "bundle version 4" in ok.stdout


def test_reproducibility_names_the_difference(conv_model, tmp_path, monkeypatch):
    """A build whose package stage is not deterministic (a planted timestamp) is caught and named."""
    from edgesdk.bundling import bundle as packaging
    from edgesdk.pipeline import BuildOptions, build, check_reproducible

    options = BuildOptions(model=conv_model, target="x86", out=tmp_path / "out", cpu_backends=("planned",),
                           tuning_db=tmp_path / "db")
    first = build(options)
    real = packaging.requirements
    calls = iter(range(100))
    monkeypatch.setattr(packaging, "requirements", lambda *a, **k: real(*a, **k) + f"# built {next(calls)}\n")
    report = check_reproducible(options, first)
    assert not report["identical"] and not report["tarball_identical"]
    assert any(d.startswith("requirements.txt: differs") for d in report["differences"])
    assert any(d.startswith("manifest.json: differs in manifest.files.requirements.txt") for d in report["differences"])
    assert report["stages_differing"] == ["package"]


@pytest.mark.parametrize("signed_release", [True, False], ids=["signed", "unsigned"])
def test_make_release(conv_model, keys, tmp_path, signed_release):
    env = {**os.environ, "RELEASE_TARGETS": "x86", "RELEASE_MODEL": str(conv_model), "RELEASE_SHAPE": "x=1x3x16x16",
           "DIST": str(tmp_path / "dist"), "RELEASE_OUT": str(tmp_path / "out"), "RELEASE_WHEEL": "0",
           "EDGESDK": str(Path(sys.executable).parent / "edgesdk"), "SOURCE_DATE_EPOCH": "1700000000"}
    env.pop("EDGESDK_SIGN_KEY", None)
    if signed_release:
        env["EDGESDK_SIGN_KEY"] = str(keys["key"])
    proc = subprocess.run(["bash", str(REPO / "packaging" / "release.sh")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    dist = tmp_path / "dist"
    bundle = dist / "edgesdk-demo-x86.bundle.tar.gz"
    lines = (dist / "SHA256SUMS").read_text().splitlines()
    assert lines == [f"{hashlib.sha256(bundle.read_bytes()).hexdigest()}  {bundle.name}"]
    with tarfile.open(bundle) as tar:
        names = tar.getnames()
        manifest = json.load(tar.extractfile("bundle/manifest.json"))
    assert manifest["bundle_version"] == 1700000000  # the commit's time, by default
    if signed_release:
        assert "bundle/manifest.sig" in names and (dist / "SHA256SUMS.sig").exists()
        assert edgesdk("keys", "verify", str(dist / "SHA256SUMS"), "--public-key", str(keys["pub"])).returncode == 0
        assert edgesdk("verify", str(bundle), "--public-key", str(keys["pub"]), "--no-selftest").returncode == 0
    else:
        assert "UNSIGNED" in proc.stdout and "bundle/manifest.sig" not in names
        assert not (dist / "SHA256SUMS.sig").exists()
    assert not (tmp_path / "dist.tmp").exists()


@pytest.mark.qemu
def test_the_devices_python_verifies_signatures_under_qemu(arm_rec, keys, device_runtime, tmp_path):
    """The arm64 root file system's Python 3.11 with the `cryptography` wheel the bundle's requirements
    pin, running the device's trusted runtime: a signed aarch64 bundle verifies, and one whose manifest was
    changed after signing does not."""
    from edgesdk.backends import qemu

    rootfs = qemu.find_rootfs()
    if rootfs is None:
        pytest.fail("the arm64 root file system is missing: `make rootfs` prepares it (make test does)")
    bundle = tmp_path / "bundle"
    shutil.copytree(arm_rec.bundle, bundle)
    signing.stamp(bundle, version=3, key=signing.load_private_key(keys["key"]))
    assert "cryptography==" in (bundle / "requirements.txt").read_text()
    run = lambda: qemu.run_python(rootfs, ["-B", "-m", "runtime", "verify", str(bundle), "--trust", str(keys["trust"])],
                                  cwd=tmp_path, env={"PYTHONPATH": str(device_runtime)}, timeout=300)
    ok = run()
    assert ok.returncode == 0 and "bundle version 3" in ok.stdout, ok.stderr
    _tamper(bundle, "raised-version", keys)
    refused = run()
    assert refused.returncode == 1 and "manifest.sig: does not verify" in refused.stderr, refused.stderr
