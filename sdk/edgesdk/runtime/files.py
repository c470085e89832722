"""Small files a user or another machine hands the runtime (keys, manifests, state), read safely.

A path given on a command line may name a FIFO (an open for reading blocks until a writer comes), a
device (`/dev/zero` never ends) or a huge file. Both readers here open without blocking, ask the open
file itself what it is (fstat: no race between a check and the open), and read at most the bound the
caller states. Files written for a user are written whole, through a temporary that nothing planted
can redirect (`staged`, `write_whole`). Standard library only: it runs on the device.

- `read_regular_file` follows links: a key provisioned as a link (as secret mounts do) is read through
  it, and what it reaches must be a regular file. Its message names the file's role and path.
- `read_bundle_file` follows none: a file of a bundle or an install root is the file itself, never
  one a link planted there points at. Its message gives the reason alone; the caller names the file.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class UnreadableFile(ValueError):
    """A file that cannot be read as asked: missing, unreadable, not a regular file, or over its bound.
    The message names what it is for and the path (`public key keys/x.pub: a FIFO, not a regular file`)."""


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def _read_bounded(fd: int, limit: int) -> bytes:
    """At most `limit` + 1 bytes of `fd`, so that a file that grew past its bound while read is told."""
    chunks, left = [], limit + 1
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_regular_file(path: Path | str, max_bytes: int, what: str) -> bytes:
    """The bytes of the regular file at `path` (links followed), at most `max_bytes` of them;
    `UnreadableFile` for anything else. `what` names the file's role in the message ("public key")."""
    path = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise UnreadableFile(f"{what} {path}: cannot be read ({e.strerror or e})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnreadableFile(f"{what} {path}: {_kind(mode)}, not a regular file")
        data = _read_bounded(fd, max_bytes)
    except OSError as e:
        raise UnreadableFile(f"{what} {path}: cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise UnreadableFile(f"{what} {path}: larger than {max_bytes:,} bytes, more than such a file holds")
    return data


def read_bundle_file(path: Path | str, limit: int) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes, never read through a link.

    Raises ValueError saying why (without the path: the caller names the file) for a link, a FIFO, a
    device, a directory, a socket or a larger file, and OSError as open raises it otherwise
    (FileNotFoundError for a missing file, PermissionError)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError("a link, not a regular file") from None
        if e.errno == errno.ENXIO:  # a socket is not opened at all
            raise ValueError("not a regular file (a socket)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"not a regular file ({_kind(st.st_mode)})")
        if st.st_size > limit:
            raise ValueError(f"{st.st_size:,} bytes, more than the {limit:,} it may hold")
        data = _read_bounded(fd, limit)
    finally:
        os.close(fd)
    if len(data) > limit:  # it grew while it was read
        raise ValueError(f"more than the {limit:,} bytes it may hold")
    return data


def staged(path: Path | str, write: Callable[[BinaryIO], object], mode: int = 0o644) -> Path:
    """A new temporary file beside `path`, filled by `write(f)`, fsynced, with `mode`; returned for the
    caller to rename onto `path` (several files can so be staged first, then renamed one after another).
    mkstemp creates it under a fresh name with O_EXCL (and never follows a link there), so neither a file
    nor a link planted where a temporary would go is ever written through. A failure removes it."""
    path = Path(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_whole(path: Path | str, write: Callable[[BinaryIO], object], mode: int = 0o644) -> None:
    """`path` replaced by a rename of a new file beside it that `write(f)` filled: a reader finds the old
    file or the whole new one, and a failure leaves neither a part nor the temporary (`staged`)."""
    tmp = staged(path, write, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
