"""A file the user names to be written (`edgesdk run -o`, `edgesdk calibrate -o`, `python -B -m runtime
run IN OUT`): written at exactly that path, whole or not at all.

numpy.save and numpy.savez append their suffix to a name that lacks it (`-o y.out` wrote `y.out.npz`,
`-o /dev/full` created `/dev/full.npz`), so arrays are written through an open file, which they write
as it is, and the callers choose the format by the name's suffix (refusing any other). Where the
name cannot take a new file, it is refused before anything runs: an existing directory, an existing
file that is not a regular one (a device, a FIFO: writing there is not writing a file), a directory
that does not exist.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def refusal(path: Path, suffixes: tuple[str, ...] = ()) -> str | None:
    """Why `path` cannot be written as a new file there, said after its name (None: it can). A name must
    end in one of `suffixes` (any case) where they are given."""
    try:
        mode = os.stat(path).st_mode  # a link counts as what it leads to: the write replaces the link
    except (FileNotFoundError, NotADirectoryError):
        mode = None
    except OSError as e:
        return f"cannot be written ({e.strerror})"
    if mode is not None and stat.S_ISDIR(mode):
        return "is a directory"
    if mode is not None and not stat.S_ISREG(mode):
        return f"is {_kind(mode)}, not a regular file"
    if suffixes and path.suffix.lower() not in suffixes:
        return f"does not end in {' or '.join(suffixes)}"
    parent = path.parent
    if not parent.is_dir():
        return f"its directory {parent} does not exist" if not parent.exists() else f"{parent} is not a directory"
    return None


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a file"


def write_whole(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """`write(f)` into a new file beside `path`, then that file renamed to `path`: a reader finds the old
    file or the whole new one, and a failure leaves neither a part nor the temporary. The temporary is
    created with O_EXCL|O_NOFOLLOW under a random name, so it is never a file or link planted there."""
    path = Path(path)
    for _ in range(8):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"{path.parent}: no free temporary name beside {path.name}")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
