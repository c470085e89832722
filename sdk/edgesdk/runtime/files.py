"""Small files a user or another machine hands the runtime (keys, manifests, state), read safely.

A path given on a command line may name a FIFO (an open for reading blocks until a writer comes), a
device (`/dev/zero` never ends) or a huge file. `read_regular_file` opens without blocking, asks the
open file itself what it is (fstat: no race between a check and the open), and reads at most the bound
the caller states. Links are followed: a key provisioned as a link (as secret mounts do) is read
through it, and what it reaches must be a regular file. Standard library only: it runs on the device.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class UnreadableFile(ValueError):
    """A file that cannot be read as asked: missing, unreadable, not a regular file, or over its bound.
    The message names what it is for and the path (`public key keys/x.pub: a FIFO, not a regular file`)."""


def read_regular_file(path: Path | str, max_bytes: int, what: str) -> bytes:
    """The bytes of the regular file at `path`, at most `max_bytes` of them; `UnreadableFile` for
    anything else. `what` names the file's role in the message ("public key", "signing key")."""
    path = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise UnreadableFile(f"{what} {path}: cannot be read ({e.strerror or e})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "a special file")
            raise UnreadableFile(f"{what} {path}: {kind}, not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise UnreadableFile(f"{what} {path}: cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise UnreadableFile(f"{what} {path}: larger than {max_bytes:,} bytes, more than such a file holds")
    return data
