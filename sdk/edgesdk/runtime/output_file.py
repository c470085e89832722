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
import stat
from pathlib import Path

from .files import write_whole  # noqa: F401 -- the writer of what these names may take


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
