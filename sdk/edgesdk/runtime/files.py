"""Small files a user or another machine hands the runtime (keys, manifests, state), read safely.

A path given on a command line may name a FIFO (an open for reading blocks until a writer comes), a
device (`/dev/zero` never ends) or a huge file. `open_regular` opens without blocking, asks the open
file itself what it is (fstat: no race between a check and the open), and `read_bounded` reads at most
the bound the caller states; the build side opens its larger files (calibration samples) with them too. Files written for a user are written whole, through a temporary that nothing planted
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


class NotRegularFile(ValueError):
    """What was found where a regular file of a bounded size was expected; the message gives the reason
    alone (`not a regular file (a FIFO)`, `a link, not a regular file`, `N bytes, more than the L such a
    file may hold`): the caller names the file."""


class UnreadableFile(ValueError):
    """A file that cannot be read as asked: missing, unreadable, not a regular file, or over its bound.
    The message names what it is for and the path (`public key keys/x.pub: not a regular file (a FIFO)`)."""


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def open_regular(path: Path | str, limit: int, *, follow_links: bool = True) -> BinaryIO:
    """`path` open for reading, if it is a regular file of at most `limit` bytes; `NotRegularFile` saying
    why not, or OSError as open raises it (FileNotFoundError, PermissionError).

    Opened with O_NONBLOCK, so that opening a FIFO returns at once instead of waiting for a writer, then
    judged by fstat of what was opened, so nothing swapped in between is read. With `follow_links` False
    (O_NOFOLLOW) a link is refused rather than followed. Read it with `read_bounded`: a file may grow."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_links:
            raise NotRegularFile("a link, not a regular file") from None
        if e.errno == errno.ENXIO:  # a socket is not opened at all
            raise NotRegularFile("not a regular file (a socket)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(f"not a regular file ({_kind(st.st_mode)})")
        if st.st_size > limit:
            raise NotRegularFile(f"{st.st_size:,} bytes, more than the {limit:,} such a file may hold")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(f: BinaryIO, limit: int) -> bytes:
    """All of `f`, refused (`NotRegularFile`) past `limit` bytes: a file that grew after it was judged."""
    data = f.read(limit + 1)
    if len(data) > limit:
        raise NotRegularFile(f"more than the {limit:,} bytes such a file may hold")
    return data


def read_regular_file(path: Path | str, max_bytes: int, what: str) -> bytes:
    """The bytes of the regular file at `path` (links followed), at most `max_bytes` of them;
    `UnreadableFile` for anything else. `what` names the file's role in the message ("public key")."""
    try:
        with open_regular(path, max_bytes) as f:
            return read_bounded(f, max_bytes)
    except NotRegularFile as e:
        raise UnreadableFile(f"{what} {path}: {e}") from None
    except OSError as e:
        raise UnreadableFile(f"{what} {path}: cannot be read ({e.strerror or e})") from None


def read_bundle_file(path: Path | str, limit: int) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes, never read through a link;
    `NotRegularFile` (the reason alone: the caller names the file) or OSError as open raises it."""
    with open_regular(path, limit, follow_links=False) as f:
        return read_bounded(f, limit)


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
