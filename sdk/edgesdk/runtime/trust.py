"""Whether a device may trust a bundle: its signature, its files, its version (docs/trust.md).

A bundle is trusted when

1. `manifest.sig` is an ed25519 signature of the exact bytes of `manifest.json` by a key the device
   holds (`load_trust`: a public key file, or a directory of them for rotation). The key comes from
   the device, never from the bundle: the manifest only names which key it claims (`signing.key_id`),
   and a claim that does not match the key whose signature verifies is refused;
2. every file matches the manifest's table (its sha256 and size), no file is missing, and there is no
   file or link the manifest does not list, nor a directory that holds no file it lists, even an empty
   one (an empty package directory is importable) (`file_problems`). A rewritten hash in the manifest
   changes the manifest's bytes, so step 1 already refused it;
3. its `bundle_version` is not lower than the installed one (rollback protection), unless the caller
   allows a downgrade, which the result then states.

The signature is checked before the manifest is parsed beyond reading its claimed key id, so a hostile
manifest reaches the validating schema only once it is known to come from a trusted key. Runs on the
device: standard library, numpy-free, and the `cryptography` package (pinned in the bundle's
requirements.txt).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .files import UnreadableFile, read_bundle_file, read_regular_file
from .manifest import MAX_MANIFEST_BYTES, Manifest, ManifestError, path_problem

SIGNATURE_FILE = "manifest.sig"
SIGNATURE_BYTES = 64  # an ed25519 signature
MAX_SIGNATURE_FILE_BYTES = 4096  # read whole up to this, so that a wrong size is told as such
KEY_ID_CHARS = 16  # hex characters of sha256(raw public key) that name a key
MAX_KEY_FILE_BYTES = 16 << 10  # an ed25519 key file is under 1 KiB, encrypted or not
_KEY_ID = re.compile(r"^[0-9a-f]{16}$")


class TrustError(ValueError):
    """A bundle the device must not trust. `code` says why (`signature-missing`, `signature-bad`,
    `key-unknown`, `files`, `downgrade`, `manifest`); the message names the file or field; `notes`
    lists every file that does not match."""

    def __init__(self, code: str, message: str, notes: list[str] | None = None):
        super().__init__(message)
        self.code = code
        self.notes = notes or []


class KeyFileError(ValueError):
    """A key file or trust directory that cannot be used (a bad invocation, not a bad bundle)."""


@dataclass(frozen=True)
class TrustedKey:
    key_id: str
    path: Path
    key: object  # cryptography's Ed25519PublicKey


@dataclass
class Verified:
    """A bundle that passed: its manifest, the key that signed it (None: no key was asked for), and
    what the caller should be told (an allowed downgrade)."""

    manifest: Manifest
    key: TrustedKey | None
    notes: list[str] = field(default_factory=list)


def key_id(public_key) -> str:
    """The first 16 hex characters of sha256 of the raw 32-byte ed25519 public key."""
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:KEY_ID_CHARS]


def load_public_key(path: Path) -> TrustedKey:
    """An ed25519 public key from a PEM file (`edgesdk keys generate` writes NAME.pub)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    path = Path(path)
    try:
        data = read_regular_file(path, MAX_KEY_FILE_BYTES, "public key")
    except UnreadableFile as e:
        raise KeyFileError(str(e)) from None
    if b"PRIVATE KEY" in data:
        raise KeyFileError(f"public key {path}: this is a private key; a device holds only public keys (NAME.pub)")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as e:
        raise KeyFileError(f"public key {path}: not a PEM public key ({str(e).splitlines()[0][:120] if str(e) else 'unreadable'})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"public key {path}: a key of type {type(key).__name__.lstrip('_')}, not an ed25519 key")
    return TrustedKey(key_id(key), path, key)


def load_trust(path: Path) -> list[TrustedKey]:
    """The keys a device trusts: one public key file, or every *.pub file in a directory (a trust
    directory holds the old and the new key while a key is rotated). Every *.pub is read as a key:
    one that is not a regular file (a FIFO, a directory) is refused, never skipped or waited on."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".pub")
        if not files:
            raise KeyFileError(f"trust directory {path}: holds no public key (*.pub)")
        return [load_public_key(p) for p in files]
    if not path.exists():
        raise KeyFileError(f"public key {path}: no such file or directory")
    return [load_public_key(path)]


def check_signature(manifest_bytes: bytes, signature: bytes | None, keys: list[TrustedKey]) -> TrustedKey:
    """The trusted key whose signature `signature` is over `manifest_bytes`; else `TrustError`."""
    from cryptography.exceptions import InvalidSignature

    if signature is None:
        raise TrustError("signature-missing", f"{SIGNATURE_FILE}: missing: the bundle is not signed, and this "
                         "device trusts signed bundles only")
    claimed = _claimed_key(manifest_bytes)
    if len(signature) != SIGNATURE_BYTES:
        raise TrustError("signature-bad", f"{SIGNATURE_FILE}: {len(signature)} bytes, not an ed25519 signature "
                         f"({SIGNATURE_BYTES} bytes)")
    for k in keys:
        try:
            k.key.verify(signature, manifest_bytes)
        except InvalidSignature:
            continue
        if claimed is None and (problem := _not_json(manifest_bytes)):
            raise TrustError("manifest", f"manifest.json: signed by key {k.key_id}, but not a JSON document "
                             f"({problem}): no runtime can read it")
        if claimed != k.key_id:
            raise TrustError("signature-bad", f"manifest.signing.key_id is {claimed!r} but the signature is by "
                             f"key {k.key_id}: the manifest was changed")
        return k
    known = ", ".join(k.key_id for k in keys)
    if claimed is not None and claimed not in {k.key_id for k in keys}:
        raise TrustError("key-unknown", f"{SIGNATURE_FILE}: signed by key {claimed}, which this device does not "
                         f"trust (it trusts {known})")
    raise TrustError("signature-bad", f"{SIGNATURE_FILE}: does not verify with key {claimed or known}: "
                     "manifest.json or its signature was changed after signing")


def _claimed_key(manifest_bytes: bytes) -> str | None:
    """The key id the manifest claims (`signing.key_id`), read without trusting anything else in it."""
    try:
        claimed = json.loads(manifest_bytes).get("signing", {}).get("key_id")
    except (ValueError, AttributeError, RecursionError):
        return None
    return claimed if isinstance(claimed, str) and _KEY_ID.match(claimed) else None


def _not_json(manifest_bytes: bytes) -> str | None:
    """Why `manifest_bytes` is not one JSON document (trailing data after it, say); None when it is."""
    try:
        json.loads(manifest_bytes)
    except RecursionError:
        return "nested too deeply"
    except ValueError as e:
        return str(e)[:200]
    return None


def file_problems(bundle: Path, manifest: Manifest) -> list[str]:
    """What does not match the manifest: a listed file missing, changed, a link or outside the bundle;
    any file or link it does not list (compiled Python files included: a planted `__pycache__/*.pyc`
    would run instead of the checked source), and any directory that holds no file it lists (an empty
    `tflite_runtime/interpreter/` would be importable), said once for the deepest such directory that
    holds nothing else said."""
    bundle = Path(bundle)
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
    listed = set(manifest.files) | {"manifest.json", SIGNATURE_FILE}
    parents = {"/".join(rel.split("/")[:k]) for rel in listed for k in range(1, rel.count("/") + 1)}
    unlisted_dirs, said = [], []
    for top, dirs, files in os.walk(bundle):
        for name in sorted(dirs + files):
            p = Path(top) / name
            rel = p.relative_to(bundle).as_posix()
            if p.is_symlink():
                problems.append(f"{rel}: a link (a bundle holds none)")
                said.append(rel)
            elif name in files and rel not in listed:
                problems.append(f"{rel}: not listed in the manifest"
                                + (" (compiled Python: run the runtime with `python -B`)" if name.endswith(".pyc") else ""))
                said.append(rel)
            elif name in dirs and rel not in parents:
                unlisted_dirs.append(rel)
    for rel in sorted(unlisted_dirs, reverse=True):  # the deepest first: the directories above then hold it
        if not any(s.startswith(rel + "/") for s in said):
            problems.append(f"{rel}: a directory the manifest lists no file in")
            said.append(rel)
    return problems


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_signed(bundle: Path) -> tuple[bytes, bytes | None]:
    """The manifest's bytes and the signature's (None: no manifest.sig), each read only from a regular
    file of a bounded size: a FIFO, a device or a link there is refused, never waited on or followed."""
    bundle = Path(bundle)
    try:
        text = read_bundle_file(bundle / "manifest.json", MAX_MANIFEST_BYTES)
    except ValueError as e:
        raise TrustError("manifest", f"manifest.json: {e}") from None
    except OSError as e:
        raise TrustError("manifest", f"manifest.json: cannot be read ({e.strerror or e})") from None
    try:
        signature = read_bundle_file(bundle / SIGNATURE_FILE, MAX_SIGNATURE_FILE_BYTES)
    except FileNotFoundError:
        signature = None
    except ValueError as e:
        raise TrustError("signature-bad", f"{SIGNATURE_FILE}: {e}") from None
    except OSError as e:
        raise TrustError("signature-bad", f"{SIGNATURE_FILE}: cannot be read ({e.strerror or e})") from None
    return text, signature


def verify_bundle(bundle: Path, keys: list[TrustedKey] | None, *, installed_version: int | None = None,
                  allow_downgrade: bool = False, floor: str | None = None) -> Verified:
    """The bundle's manifest once it is trusted: signed by one of `keys` (None: the signature is not
    asked for), every file as listed, its version not below `installed_version` (`floor`: what that
    version is, for the message; see `check_version`). Else `TrustError`, naming the file or field at
    fault."""
    text, signature = read_signed(bundle)
    key = check_signature(text, signature, keys) if keys is not None else None
    try:
        manifest = Manifest.from_json(text)
    except ManifestError as e:
        raise TrustError("manifest", f"manifest.json: {e}") from None
    problems = file_problems(bundle, manifest)
    if problems:
        raise TrustError("files", f"{len(problems)} file(s) do not match the manifest: {problems[0]}", problems)
    notes = check_version(manifest, installed_version, allow_downgrade, floor)
    return Verified(manifest, key, notes)


def check_version(manifest: Manifest, installed_version: int | None, allow_downgrade: bool,
                  floor: str | None = None) -> list[str]:
    """Rollback protection: `TrustError` for a bundle older than `installed_version`, unless a downgrade
    is allowed, which the returned note then states. `floor` says what that version is, when it is not
    the installed bundle's (an install root's floor: the newest version it ever installed)."""
    if installed_version is None or manifest.bundle_version >= installed_version:
        return []
    what = (f"manifest.bundle_version is {manifest.bundle_version}, lower than "
            + (floor or f"the installed bundle's {installed_version}"))
    if not allow_downgrade:
        raise TrustError("downgrade", f"{what}: an older bundle is refused (rollback protection); "
                         "--allow-downgrade installs it on purpose")
    return [f"downgrade allowed (--allow-downgrade): {what}"]
