"""Memory on the build machine: what a process holds, what the machine has left, and how a step that
needs more than is left fails before it starts (or while it runs) instead of meeting the kernel's
out-of-memory killer, which picks a process (often not the one at fault) and says nothing useful.

Linux only (/proc); elsewhere nothing is known and nothing is refused.
"""

from __future__ import annotations

import os

GiB, MiB = 1 << 30, 1 << 20


def resident_bytes(pid: int | str = "self") -> int:
    """A process's resident memory (0 once it is gone, or where /proc is not)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def available_bytes() -> int | None:
    """The kernel's estimate of memory available without swapping (MemAvailable); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def shown(n: float) -> str:
    """Bytes for a message: GiB with two decimals from 1 GiB, else MiB."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


# for a process that imports TensorFlow, set before it does: oneDNN's allocator keeps every tensor it
# frees for its own reuse, so a conversion's weights stayed held after it (and a Keras model's after
# its export); the system allocator hands them back
TENSORFLOW_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ONEDNN_USE_SYSTEM_ALLOCATOR": "1"}


def tensorflow_env(env: dict | None = None) -> None:
    """`TENSORFLOW_ENV` into `env` (this process's environment by default), where not already set."""
    target = os.environ if env is None else env
    for key, value in TENSORFLOW_ENV.items():
        target.setdefault(key, value)


def give_back() -> None:
    """Collect garbage and hand the heap's free pages back to the system (glibc's malloc_trim): after a
    compiler has run in this process, what it freed otherwise stays counted against the build."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
