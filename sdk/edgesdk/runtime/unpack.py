"""A bundle archive unpacked safely: on the device (`python -B -m runtime install`) and on the build host
(`edgesdk verify` of a .tar.gz).

An archive is unpacked only after every member passed: names UTF-8, relative with no `..`, no empty or
`.` part, no links or special files, no member twice, no member both a file and a directory, names of
sane length, at most MAX_MEMBERS of them; manifest.json read from the archive and valid; every other
member a file the manifest lists, with the size it lists (or manifest.sig, a signature that trust.py
judges), or a directory on the way to one (an empty directory, `tflite_runtime/interpreter/`, would be
importable); the total within `max_bytes`. So a 1 GiB member the manifest does not list, a member
declaring 100 GiB, or 100,000 empty directories, is refused before a byte is written. A listed member's contents are not checked here: `trust.verify_bundle` and
the build side's `check_hashes` hash every file once it is unpacked.

The members are written by this module, not by `TarFile.extractall`: the device's Python (Debian
bookworm's 3.11.2) has no extraction filters. Each directory is opened with O_NOFOLLOW from the one
above it and each file created in it with O_CREAT|O_EXCL|O_NOFOLLOW, so no write follows a link, not
even one planted in `dest` beforehand. Standard library only.
"""

from __future__ import annotations

import gzip
import os
import shutil
import tarfile
import zlib
from pathlib import Path

from .manifest import MAX_MANIFEST_BYTES, Manifest, ManifestError

DEFAULT_MAX_BYTES = 16 << 30
MAX_NAME_CHARS = 1024
MAX_PART_BYTES = 255  # a file name on ext4 and most file systems
MAX_SIGNATURE_BYTES = 4096  # an ed25519 signature is 64 bytes; trust.py refuses any other size
# A bundle holds tens of files (the runtime's modules, the segments, the goldens) and their directories:
# the bound only stops an archive that pads itself with members, each costing a header read and a write
MAX_MEMBERS = 10_000
SIGNATURE_FILE = "manifest.sig"


class UnpackError(ValueError):
    """An archive that is not unpacked. `code` says why: bundle.bad-archive, bundle.unsafe-member,
    bundle.too-large, bundle.too-many-members, bundle.no-manifest, bundle.bad-manifest (the
    `ManifestError` is `__cause__`), bundle.unlisted-member, bundle.tampered, or bundle.unpack-failed
    (the disk, not the archive)."""

    def __init__(self, code: str, problem: str):
        super().__init__(problem)
        self.code = code
        self.problem = problem


def max_bundle_bytes() -> int:
    """The most an archive may unpack to: EDGESDK_MAX_BUNDLE_BYTES, default 16 GiB."""
    value = os.environ.get("EDGESDK_MAX_BUNDLE_BYTES", "")
    return int(value) if value.isdigit() else DEFAULT_MAX_BYTES


def unpack(archive: Path, dest: Path, max_bytes: int) -> Path:
    """Unpack `archive` into the existing directory `dest` once every member passed; returns the
    bundle root (dest/bundle for an archive whose members are under bundle/, as edgesdk writes them).
    On an `UnpackError` raised after writing began, `dest` holds part of the archive: the caller
    removes it."""
    try:
        tar = tarfile.open(archive, "r:*")  # reads the first member's header
    except (tarfile.TarError, EOFError, zlib.error, OSError, ValueError) as e:
        # tarfile's own words for it ("file could not be opened successfully:") say nothing to a user
        why = ("neither a gzip-compressed nor a plain tar archive" if type(e) is tarfile.ReadError
               else f"{type(e).__name__}: {str(e).splitlines()[0][:200]}" if str(e) else type(e).__name__)
        raise UnpackError("bundle.bad-archive", f"not a bundle archive ({why})") from None
    try:
        with tar:
            members = _checked_members(tar, max_bytes)
            prefix = "bundle/" if members and all(n == "bundle" or n.startswith("bundle/") for n in members) else ""
            _check_against_manifest(tar, members, prefix)
            _write(tar, members, Path(dest))
            return Path(dest) / "bundle" if prefix else Path(dest)
    except UnpackError:
        raise
    # tarfile raises ValueError (not TarError) for some malformed headers: a GNU sparse map of non-numbers
    except (tarfile.TarError, EOFError, zlib.error, OSError, ValueError) as e:
        if isinstance(e, OSError) and not isinstance(e, gzip.BadGzipFile) and e.errno is not None:
            # the disk, not the archive: full, read-only, ...
            raise UnpackError("bundle.unpack-failed", f"cannot be unpacked into {dest} ({e.strerror})") from None
        raise UnpackError("bundle.bad-archive", f"not a complete bundle archive ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200] if str(e) else 'unexpected end'})") from None


def signed_manifest(archive: Path) -> tuple[bytes, bytes | None]:
    """The bytes of the archive's manifest.json and manifest.sig (None: no signature), read without
    unpacking anything, so that an installer can judge the signature, version and architecture before it
    touches a slot. Nothing else of the archive is checked here: `unpack` does that."""
    wanted = {"manifest.json": MAX_MANIFEST_BYTES, SIGNATURE_FILE: MAX_SIGNATURE_BYTES}
    found: dict[str, bytes] = {}
    try:
        with tarfile.open(archive, "r:*") as tar:
            for m in tar:
                rel = _member_name(m.name).removeprefix("bundle/")
                if rel in wanted and rel not in found:
                    if not m.isfile() or m.size > wanted[rel]:
                        raise UnpackError("bundle.unsafe-member", f"member '{m.name[:200]}' is not a regular file "
                                          f"of at most {wanted[rel]:,} bytes")
                    found[rel] = tar.extractfile(m).read(wanted[rel] + 1)
                    if len(found) == len(wanted):
                        break
    except UnpackError:
        raise
    except (tarfile.TarError, EOFError, zlib.error, OSError, ValueError) as e:
        raise UnpackError("bundle.bad-archive", f"not a bundle archive ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200] if str(e) else 'unexpected end'})") from None
    if "manifest.json" not in found:
        raise UnpackError("bundle.no-manifest", "no manifest.json in the archive, so this is not an edgesdk bundle")
    return found["manifest.json"], found.get(SIGNATURE_FILE)


def _checked_members(tar: tarfile.TarFile, limit: int) -> dict[str, tarfile.TarInfo]:
    """Every member by its normalized name, once each passed on its header alone; headers are read one
    by one, so a hostile size is refused before its data is read."""
    members: dict[str, tarfile.TarInfo] = {}
    total = 0
    for m in tar:
        if len(members) == MAX_MEMBERS:
            raise UnpackError("bundle.too-many-members", f"holds more than {MAX_MEMBERS:,} members; a bundle "
                              "holds its files and the directories on their way, tens of them")
        name = _member_name(m.name)
        parts = name.split("/")
        if not _is_utf8(m.name):  # tarfile keeps the bytes of a non-UTF-8 name as lone surrogates
            raise UnpackError("bundle.unsafe-member", f"refuses member '{_printable(m.name)[:200]}' (a name that is "
                              "not UTF-8)")
        if m.name.startswith("/") or ".." in parts or "\\" in m.name:
            raise UnpackError("bundle.unsafe-member", f"refuses member '{m.name[:200]}' (absolute path or '..')")
        if not (m.isfile() or m.isdir()):
            raise UnpackError("bundle.unsafe-member", f"refuses member '{m.name[:200]}' (a link or special file)")
        if len(name) > MAX_NAME_CHARS or any(len(x.encode()) > MAX_PART_BYTES for x in parts):
            raise UnpackError("bundle.unsafe-member", f"refuses member '{m.name[:60]}...' (a name of "
                              f"{len(m.name)} characters: a path part is at most {MAX_PART_BYTES} bytes)")
        if (name and any(x in ("", ".") for x in parts)) or (not name and m.isfile()):
            raise UnpackError("bundle.unsafe-member", f"refuses member '{m.name[:200]}' (an empty or '.' path part)")
        if name in members:
            raise UnpackError("bundle.unsafe-member", f"member '{name}' appears twice")
        total += m.size
        if m.size > limit or total > limit:
            raise UnpackError("bundle.too-large", f"member '{name}' takes the archive past {limit:,} bytes unpacked")
        members[name] = m
    files = {n for n, m in members.items() if m.isfile()}
    for name in members:
        parents = ["/".join(name.split("/")[:k]) for k in range(1, name.count("/") + 1)]
        clash = next((p for p in parents if p in files), None)
        if clash is not None:
            raise UnpackError("bundle.unsafe-member", f"member '{clash}' is a file, and member '{name}' puts it "
                              "in a directory of that name")
    return members


def _check_against_manifest(tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo], prefix: str) -> None:
    """manifest.json valid, every other file member listed in it with the size it lists, and every
    directory member the bundle's root or a directory on the way to a listed file."""
    manifest = members.get(f"{prefix}manifest.json")
    if manifest is None or not manifest.isfile():
        raise UnpackError("bundle.no-manifest", "no manifest.json in the archive, so this is not an edgesdk bundle")
    try:
        listed = Manifest.from_json(tar.extractfile(manifest).read(MAX_MANIFEST_BYTES + 1)).files
    except ManifestError as e:
        raise UnpackError("bundle.bad-manifest", f"manifest.json is not valid: {e}") from e
    for name, m in members.items():
        rel = name[len(prefix):] if name.startswith(prefix) else name
        if m.isdir() or rel == "manifest.json":
            continue
        if rel == SIGNATURE_FILE:
            if m.size > MAX_SIGNATURE_BYTES:
                raise UnpackError("bundle.tampered", f"member '{name}' is {m.size:,} bytes; a signature is at most "
                                  f"{MAX_SIGNATURE_BYTES:,}")
            continue
        if rel not in listed:
            raise UnpackError("bundle.unlisted-member", f"member '{name}' is not listed in the manifest")
        if m.size != listed[rel]["size"]:
            raise UnpackError("bundle.tampered", f"member '{name}' is {m.size:,} bytes; the manifest lists "
                              f"{listed[rel]['size']:,}")
    # checked once every file passed, so a planted file is named as such rather than its directory
    parents = {prefix.rstrip("/")} | {prefix + "/".join(rel.split("/")[:k])
                                      for rel in listed for k in range(1, rel.count("/") + 1)}
    for name, m in members.items():
        if m.isdir() and name not in parents:
            raise UnpackError("bundle.unlisted-member", f"member '{name}/' is a directory the manifest lists no "
                              "file in")


def _write(tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo], dest: Path) -> None:
    """Directories made, files created new (mode 0644) and copied from the archive, in archive order."""
    root = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name, m in members.items():
            parts = name.split("/") if name else []
            if m.isdir():
                os.close(_directory(root, parts))
                continue
            parent = _directory(root, parts[:-1])
            try:
                fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=parent)
            finally:
                os.close(parent)
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(tar.extractfile(m), out, 1 << 20)
    finally:
        os.close(root)


def _directory(root: int, parts: list[str]) -> int:
    """A descriptor of the directory `parts` below `root`, each level made when missing; none of them
    may be a link (O_NOFOLLOW: ELOOP)."""
    fd = os.dup(root)
    for part in parts:
        try:
            os.mkdir(part, 0o755, dir_fd=fd)
        except FileExistsError:
            pass
        try:
            child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        finally:
            os.close(fd)
        fd = child
    return fd


def _is_utf8(name: str) -> bool:
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return True


def _printable(name: str) -> str:
    """A member name for a message: the bytes that are not UTF-8 as \\x escapes."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _member_name(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name.rstrip("/")
