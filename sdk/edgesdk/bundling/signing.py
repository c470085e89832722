"""Keys and signatures on the build side (docs/trust.md): `edgesdk keys generate`, the signature a build
or `edgesdk sign` puts on a bundle, and detached signatures of release files (SHA256SUMS).

A bundle's signature is `manifest.sig`: the raw 64-byte ed25519 signature of the exact bytes of
`manifest.json`, whose `signing.key_id` names the key and whose file table holds every other file's
sha256, so the signature covers every byte of the bundle but its own. ed25519 signatures are
deterministic: the same key and the same bundle give the same bytes, so a signed build stays
reproducible. The private key never enters a bundle, a stage cache or a log; only its id does.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError, UserError
from ..runtime import trust
from ..runtime.manifest import Manifest, ManifestError
from .archive import write_tarball

ENV_KEY = "EDGESDK_SIGN_KEY"
ENV_PASSPHRASE = "EDGESDK_SIGN_KEY_PASSPHRASE"


@dataclass(frozen=True)
class SigningKey:
    key_id: str
    path: Path
    key: object  # cryptography's Ed25519PrivateKey

    def sign(self, data: bytes) -> bytes:
        return self.key.sign(data)


def generate_keys(out_dir: Path, name: str = "edgesdk") -> tuple[Path, Path, str]:
    """A new ed25519 key pair: OUT/NAME.key (PKCS#8 PEM, mode 0600, encrypted when
    EDGESDK_SIGN_KEY_PASSPHRASE is set) and OUT/NAME.pub (the public key for the devices' trust
    directories). Refuses to overwrite either. Returns (private, public, key id)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if not name or "/" in name or name.startswith("."):
        raise UsageError("keys.bad-name", f"--name {name!r} is not a file name", "give a plain name like vendor-2026")
    out_dir = Path(out_dir)
    private, public = out_dir / f"{name}.key", out_dir / f"{name}.pub"
    for p in (private, public):
        if p.exists():
            raise UserError("keys.exists", f"{p} already exists: a key is never overwritten",
                            "choose another --name or --out; a key devices trust cannot be made again")
    out_dir.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    passphrase = os.environ.get(ENV_PASSPHRASE, "").encode()
    encryption = (serialization.BestAvailableEncryption(passphrase) if passphrase else serialization.NoEncryption())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    # the private key is created with 0600 from its first byte (O_EXCL: never through an existing file)
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
    except BaseException:
        private.unlink(missing_ok=True)
        raise
    _write_atomic(public, pub, 0o644)
    return private, public, trust.key_id(key.public_key())


def load_private_key(path: Path | str, *, warn=lambda s: None) -> SigningKey:
    """The signing key at `path` (PEM, PKCS#8 or OpenSSH; encrypted ones with EDGESDK_SIGN_KEY_PASSPHRASE).
    A key readable by others than its owner is used with a warning."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(path)
    hint = "give the NAME.key that `edgesdk keys generate` wrote (--sign-key or EDGESDK_SIGN_KEY)"
    try:
        data = path.read_bytes()[: trust.MAX_KEY_FILE_BYTES + 1]
        mode = path.stat().st_mode
    except OSError as e:
        raise UsageError("keys.unreadable", f"signing key {path}: cannot be read ({e.strerror or e})", hint) from None
    if b"PRIVATE KEY" not in data:
        raise UsageError("keys.not-private", f"signing key {path}: not a private key"
                         + (" (this is a public key: devices hold it, builds sign with NAME.key)"
                            if b"PUBLIC KEY" in data else ""), hint)
    passphrase = os.environ.get(ENV_PASSPHRASE, "").encode() or None
    try:
        load = (serialization.load_ssh_private_key if b"OPENSSH" in data else serialization.load_pem_private_key)
        key = load(data, password=passphrase)
    except TypeError as e:  # encrypted without a passphrase, or a passphrase for a clear key
        raise UsageError("keys.passphrase", f"signing key {path}: {str(e)[:1].lower()}{str(e)[1:]}",
                         f"set {ENV_PASSPHRASE} to the key's passphrase (or unset it for a clear key)") from None
    except ValueError as e:
        raise UsageError("keys.bad-key", f"signing key {path}: cannot be read ({str(e).splitlines()[0][:120]})",
                         f"a wrong passphrase in {ENV_PASSPHRASE}, or not a key: {hint}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise UsageError("keys.not-ed25519", f"signing key {path}: a key of type {type(key).__name__.lstrip('_')}, not ed25519",
                         "edgesdk signs with ed25519 only: `edgesdk keys generate` makes one")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        warn(f"signing key {path} is readable by others than its owner (mode {stat.S_IMODE(mode):o}): "
             f"chmod 600 {path}")
    return SigningKey(trust.key_id(key.public_key()), path, key)


def stamp(bundle: Path, *, version: int | None = None, key: SigningKey | None = None,
          tarball: Path | None = None) -> Manifest:
    """Set the bundle's version and sign it: manifest.json rewritten with `bundle_version` (when given)
    and `signing`, manifest.sig written (or removed when unsigned: an old signature no longer fits),
    and `tarball` written again from the directory. Every file must match the manifest first: a
    changed bundle is never signed. Each file is replaced by a rename."""
    bundle = Path(bundle)
    text, _ = trust.read_signed(bundle)
    try:
        manifest = Manifest.from_json(text)
    except ManifestError as e:
        raise UserError("bundle.bad-manifest", f"{bundle}: manifest.json is not valid: {e}",
                        "the bundle is damaged or was not written by this edgesdk; rebuild it") from None
    problems = trust.file_problems(bundle, manifest)
    if problems:
        raise UserError("sign.tampered", f"{bundle}: {len(problems)} file(s) do not match the manifest, so it is "
                        "not signed", "rebuild the bundle; never sign one whose files changed after the build",
                        notes=problems[:20])
    if version is not None:
        manifest = dataclasses.replace(manifest, bundle_version=version)
    manifest = dataclasses.replace(manifest, signing={"algorithm": "ed25519", "key_id": key.key_id} if key else {})
    data = manifest.to_json().encode()
    _write_atomic(bundle / "manifest.json", data, 0o644)
    if key is not None:
        _write_atomic(bundle / trust.SIGNATURE_FILE, key.sign(data), 0o644)
    else:
        (bundle / trust.SIGNATURE_FILE).unlink(missing_ok=True)
    if tarball is not None:
        write_tarball(bundle, tarball)
    return manifest


def sign_file(path: Path, key: SigningKey) -> Path:
    """PATH.sig: the raw ed25519 signature of PATH's bytes (release files: SHA256SUMS)."""
    path = Path(path)
    sig = path.with_name(path.name + ".sig")
    _write_atomic(sig, key.sign(path.read_bytes()), 0o644)
    return sig


def verify_file(path: Path, keys: list[trust.TrustedKey]) -> trust.TrustedKey:
    """The key whose PATH.sig signs PATH; `UserError` naming the file otherwise."""
    from cryptography.exceptions import InvalidSignature

    path = Path(path)
    sig = path.with_name(path.name + ".sig")
    if not sig.is_file():
        raise UserError("sign.missing", f"{sig}: missing: {path.name} is not signed",
                        "a release made without EDGESDK_SIGN_KEY is unsigned; fetch the signed release")
    data, signature = path.read_bytes(), sig.read_bytes()
    for k in keys:
        try:
            k.key.verify(signature, data)
            return k
        except InvalidSignature:
            continue
    raise UserError("sign.bad", f"{sig}: does not verify {path.name} with key {', '.join(k.key_id for k in keys)}",
                    f"{path.name} or its signature was changed, or another key signed it")


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
