"""runtime/trust.py on a real signed bundle (the x86 PP-OCR classifier): any change to a signed
manifest's bytes or to any listed file is refused, the key id is what the manifest claims, and the
version floor holds. The CLI's refusals are in tests/test_signing_e2e.py."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgesdk.bundling import signing
from edgesdk.runtime import trust
from edgesdk.runtime.manifest import Manifest


@pytest.fixture(scope="module")
def signed(x86_ppocr, tmp_path_factory):
    d = tmp_path_factory.mktemp("trust")
    private, public, key_id = signing.generate_keys(d / "keys")
    bundle = d / "bundle"
    shutil.copytree(x86_ppocr.bundle, bundle)
    signing.stamp(bundle, version=5, key=signing.load_private_key(private))
    return bundle, trust.load_trust(public), key_id


def test_a_signed_bundle_verifies_and_names_its_key(signed):
    bundle, keys, key_id = signed
    result = trust.verify_bundle(bundle, keys, installed_version=5)
    assert result.key.key_id == key_id == result.manifest.signing["key_id"] and result.notes == []
    raw = keys[0].key.public_bytes_raw()
    assert key_id == hashlib.sha256(raw).hexdigest()[:16]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_changed_byte_of_the_manifest_is_refused(signed, data):
    bundle, keys, _ = signed
    text, signature = trust.read_signed(bundle)
    at = data.draw(st.integers(0, len(text) - 1))
    flip = data.draw(st.integers(1, 255))
    changed = text[:at] + bytes([text[at] ^ flip]) + text[at + 1:]
    with pytest.raises(trust.TrustError) as e:
        trust.check_signature(changed, signature, keys)
    assert e.value.code in ("signature-bad", "key-unknown")
    sig_at = data.draw(st.integers(0, len(signature) - 1))
    bad_sig = signature[:sig_at] + bytes([signature[sig_at] ^ flip]) + signature[sig_at + 1:]
    with pytest.raises(trust.TrustError, match="manifest.sig: does not verify"):
        trust.check_signature(text, bad_sig, keys)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_changed_byte_of_any_file_is_refused(signed, data):
    bundle, keys, _ = signed
    files = sorted(Manifest.load(bundle).files)
    rel = data.draw(st.sampled_from(files))
    path = bundle / rel
    original = path.read_bytes()
    at = data.draw(st.integers(0, len(original) - 1))
    try:
        path.write_bytes(original[:at] + bytes([original[at] ^ 0x01]) + original[at + 1:])
        with pytest.raises(trust.TrustError) as e:
            trust.verify_bundle(bundle, keys)
        assert e.value.code == "files" and e.value.notes == [
            f"{rel}: sha256 does not match the manifest (the file was changed)"]
    finally:
        path.write_bytes(original)
    trust.verify_bundle(bundle, keys)  # restored, it verifies again


def test_version_floor(signed):
    bundle, keys, _ = signed
    m = trust.verify_bundle(bundle, keys).manifest
    assert trust.check_version(m, None, False) == [] and trust.check_version(m, 5, False) == []
    with pytest.raises(trust.TrustError, match="manifest.bundle_version is 5, lower than the installed bundle's 6"):
        trust.check_version(m, 6, False)
    assert trust.check_version(m, 6, True) == [
        "downgrade allowed (--allow-downgrade): manifest.bundle_version is 5, lower than the installed bundle's 6"]


def test_key_files(tmp_path):
    private, public, key_id = signing.generate_keys(tmp_path / "k")
    assert trust.load_public_key(public).key_id == key_id
    for bad, needle in ((private, "this is a private key"), (tmp_path / "none.pub", "no such file")):
        with pytest.raises(trust.KeyFileError, match=needle):
            trust.load_trust(bad)
    (tmp_path / "junk.pub").write_text("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
    with pytest.raises(trust.KeyFileError, match="junk.pub: not a PEM public key"):
        trust.load_public_key(tmp_path / "junk.pub")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    (tmp_path / "ec.pub").write_bytes(ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    with pytest.raises(trust.KeyFileError, match="not an ed25519 key"):
        trust.load_public_key(tmp_path / "ec.pub")


def test_key_files_are_read_as_small_regular_files(tmp_path):
    """A FIFO (whose open would wait for a writer), a device (/dev/zero never ends), a directory or a huge
    file given as a key, or found as a *.pub in a trust directory, is refused at once."""
    _, public, key_id = signing.generate_keys(tmp_path / "k")
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    (tmp_path / "huge.pub").write_bytes(b"-" * (trust.MAX_KEY_FILE_BYTES + 1))
    for bad, needle in ((fifo, f"public key {fifo}: not a regular file (a FIFO)"),
                        (Path("/dev/zero"), "public key /dev/zero: not a regular file (a character device)"),
                        (tmp_path / "huge.pub", "huge.pub: 16,385 bytes, more than the 16,384 such a file may hold")):
        with pytest.raises(trust.KeyFileError) as e:
            trust.load_trust(bad)
        assert needle in str(e.value)
    rotation = tmp_path / "trust"
    rotation.mkdir()
    shutil.copy(public, rotation)
    assert [k.key_id for k in trust.load_trust(rotation)] == [key_id]
    (rotation / "a-dir.pub").mkdir()
    with pytest.raises(trust.KeyFileError, match="a-dir.pub: not a regular file \\(a directory\\)"):
        trust.load_trust(rotation)
    (rotation / "a-dir.pub").rmdir()
    os.mkfifo(rotation / "planted.pub")
    with pytest.raises(trust.KeyFileError, match="planted.pub: not a regular file \\(a FIFO\\)"):
        trust.load_trust(rotation)
    (tmp_path / "link.pub").symlink_to(public)  # a key provisioned as a link is read through it
    assert trust.load_public_key(tmp_path / "link.pub").key_id == key_id


def test_a_signed_manifest_with_trailing_data_is_refused_as_not_json(tmp_path):
    private, public, key_id = signing.generate_keys(tmp_path / "k")
    keys, key = trust.load_trust(public), signing.load_private_key(private)
    for data, reason in ((b'{"signing": {"key_id": "%s"}}\n{}\n' % key_id.encode(), "Extra data: line 2 column 1"),
                         (b'{"signing": {"key_id": "%s"}' % key_id.encode(), "Expecting ',' delimiter"),
                         (b"\xff" + b"{}", "can't decode byte 0xff")):
        with pytest.raises(trust.TrustError) as e:
            trust.check_signature(data, key.sign(data), keys)
        assert e.value.code == "manifest"
        assert str(e.value).startswith(f"manifest.json: signed by key {key_id}, but not a JSON document (")
        assert reason in str(e.value)


def test_a_directory_that_holds_no_listed_file_is_refused(signed, tmp_path):
    """An empty unlisted directory (an empty package directory is importable) is said once, at its
    deepest; a directory holding an unlisted file is said by the file."""
    bundle, keys, _ = signed
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    (copy / "tflite_runtime" / "interpreter").mkdir(parents=True)
    (copy / "runtime" / "__pycache__").mkdir()
    (copy / "runtime" / "__pycache__" / "x.pyc").write_bytes(b"")
    (copy / "segments" / "empty").mkdir()
    with pytest.raises(trust.TrustError) as e:
        trust.verify_bundle(copy, keys)
    assert e.value.code == "files" and sorted(e.value.notes) == [
        "runtime/__pycache__/x.pyc: not listed in the manifest (compiled Python: run the runtime with `python -B`)",
        "segments/empty: a directory the manifest lists no file in",
        "tflite_runtime/interpreter: a directory the manifest lists no file in"]


@pytest.mark.parametrize("name", ["manifest.json", "manifest.sig"])
@pytest.mark.parametrize("kind", ["fifo", "link-to-dev-zero", "directory", "oversized"])
def test_a_manifest_or_signature_that_is_not_a_small_regular_file_is_refused(signed, tmp_path, name, kind):
    """Read with O_NONBLOCK|O_NOFOLLOW and judged by fstat: a FIFO is never waited on, a link never
    followed, a huge file never read whole."""
    bundle, keys, _ = signed
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    path = copy / name
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
        needle = "not a regular file (a FIFO)"
    elif kind == "link-to-dev-zero":
        path.symlink_to("/dev/zero")
        needle = "a link, not a regular file"
    elif kind == "directory":
        path.mkdir()
        needle = "not a regular file (a directory)"
    else:
        with open(path, "wb") as f:
            f.truncate(32 << 20)  # sparse: nothing written
        needle = "33,554,432 bytes, more than the "
    with pytest.raises(trust.TrustError, match=re.escape(f"{name}: {needle}")) as e:
        trust.read_signed(copy)
    assert e.value.code == ("manifest" if name == "manifest.json" else "signature-bad")
