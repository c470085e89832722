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
from ..runtime.files import UnreadableFile, read_regular_file, staged, write_whole
from ..runtime.manifest import MAX_BUNDLE_VERSION, Manifest, ManifestError
from .archive import write_tarball

ENV_KEY = "EDGESDK_SIGN_KEY"
ENV_PASSPHRASE = "EDGESDK_SIGN_KEY_PASSPHRASE"
MAX_PASSPHRASE_BYTES = 1023  # the most OpenSSL's PEM encryption takes


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
    hint = "give a directory for NAME.key and NAME.pub with --out (it is made if missing)"
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError("keys.bad-out", f"--out {out_dir}: not a directory", hint)
    private, public = out_dir / f"{name}.key", out_dir / f"{name}.pub"
    for p in (private, public):
        if p.exists() or p.is_symlink():
            raise UserError("keys.exists", f"{p} already exists: a key is never overwritten",
                            "choose another --name or --out; a key devices trust cannot be made again")
    passphrase = _passphrase()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError("keys.bad-out", f"--out {out_dir}: cannot be made ({e.strerror or e})", hint) from None
    key = Ed25519PrivateKey.generate()
    encryption = (serialization.BestAvailableEncryption(passphrase) if passphrase else serialization.NoEncryption())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    # the private key is created with 0600 from its first byte; O_EXCL|O_NOFOLLOW: never through an
    # existing file or a link planted in its place
    try:
        fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise UsageError("keys.bad-out", f"{private}: cannot be written ({e.strerror or e})", hint) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        write_whole(public, lambda f: f.write(pub))
    except BaseException:
        private.unlink(missing_ok=True)
        raise
    return private, public, trust.key_id(key.public_key())


def _passphrase() -> bytes | None:
    """EDGESDK_SIGN_KEY_PASSPHRASE as bytes (None: unset or empty); one that is not UTF-8 text, or longer
    than OpenSSL takes, is a usage error."""
    raw = os.environb.get(ENV_PASSPHRASE.encode()) if os.supports_bytes_environ else None
    if raw is None:
        raw = os.environ.get(ENV_PASSPHRASE, "").encode("utf-8", "surrogateescape")
    if not raw:
        return None
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError("keys.passphrase", f"{ENV_PASSPHRASE} is not UTF-8 text",
                         "set it to the passphrase as UTF-8 text") from None
    if len(raw) > MAX_PASSPHRASE_BYTES:
        raise UsageError("keys.passphrase", f"{ENV_PASSPHRASE} is {len(raw):,} bytes long, more than the "
                         f"{MAX_PASSPHRASE_BYTES} a key's encryption takes", "choose a shorter passphrase")
    return raw


def load_private_key(path: Path | str, *, warn=lambda s: None) -> SigningKey:
    """The signing key at `path` (PEM, PKCS#8 or OpenSSH; encrypted ones with EDGESDK_SIGN_KEY_PASSPHRASE).
    A key readable by others than its owner is used with a warning."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(path)
    hint = "give the NAME.key that `edgesdk keys generate` wrote (--sign-key or EDGESDK_SIGN_KEY)"
    try:
        data = read_regular_file(path, trust.MAX_KEY_FILE_BYTES, "signing key")
        mode = path.stat().st_mode
    except UnreadableFile as e:
        raise UsageError("keys.unreadable", str(e), hint) from None
    except OSError as e:
        raise UsageError("keys.unreadable", f"signing key {path}: cannot be read ({e.strerror or e})", hint) from None
    if b"PRIVATE KEY" not in data:
        raise UsageError("keys.not-private", f"signing key {path}: not a private key"
                         + (" (this is a public key: devices hold it, builds sign with NAME.key)"
                            if b"PUBLIC KEY" in data else ""), hint)
    passphrase = _passphrase()
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
    changed bundle is never signed. The new manifest is checked against its schema and the new signature
    against the key before anything is written, so a bundle that verified is never replaced by one that
    does not; each file is then replaced by a rename."""
    if version is not None and not 0 <= version <= MAX_BUNDLE_VERSION:
        raise UsageError("sign.bad-version", f"bundle version {version}: outside the versions a manifest holds, "
                         f"0 to {MAX_BUNDLE_VERSION} (2^63 - 1, manifest.bundle_version)",
                         "give a version in that range")
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
    signature = key.sign(data) if key is not None else None
    try:  # what every verifier will do with the two files, done before either is written
        Manifest.from_json(data)
        if key is not None:
            trust.check_signature(data, signature, [trust.TrustedKey(key.key_id, key.path, key.key.public_key())])
    except (ManifestError, trust.TrustError) as e:
        raise UserError("sign.not-verifiable", f"{bundle}: the signed manifest would not verify ({e}), so nothing "
                        "was written", "the bundle is damaged or was not written by this edgesdk; rebuild it") from None
    # both files written in full first, then renamed one right after the other
    pending = [(staged(bundle / "manifest.json", lambda f: f.write(data)), bundle / "manifest.json")]
    try:
        if signature is not None:
            pending.append((staged(bundle / trust.SIGNATURE_FILE, lambda f: f.write(signature)), bundle / trust.SIGNATURE_FILE))
    except BaseException:
        pending[0][0].unlink(missing_ok=True)
        raise
    if signature is None:
        (bundle / trust.SIGNATURE_FILE).unlink(missing_ok=True)
    for tmp, dest in pending:
        os.replace(tmp, dest)
    if tarball is not None:
        write_tarball(bundle, tarball)
    return manifest


def sign_file(path: Path, key: SigningKey) -> Path:
    """PATH.sig: the raw ed25519 signature of PATH's bytes (release files: SHA256SUMS)."""
    path = Path(path)
    sig = path.with_name(path.name + ".sig")
    signature = key.sign(path.read_bytes())
    write_whole(sig, lambda f: f.write(signature))
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
