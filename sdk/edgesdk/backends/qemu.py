"""The emulated aarch64 system: Python in an arm64 root file system, run by qemu-user.

An aarch64 bundle's self-test runs on an x86-64 build host under `qemu-aarch64-static`, with
`QEMU_LD_PREFIX` pointing at the root file system that `packaging/arm64_rootfs.sh` builds
(Debian bookworm arm64, Python 3.11, the device-side wheels in `/opt/edgesdk-site`). No chroot
and no binfmt registration: qemu executes the rootfs's own `python3` and resolves its absolute
library paths (`/lib/ld-linux-aarch64.so.1`, ...) inside the prefix. Emulated timings prove
that a bundle runs, not how fast the board is.

Build-side only: nothing here imports TVM, LiteRT or numpy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from ..errors import UserError
from ..runtime.process import run_bounded

QEMU = "qemu-aarch64-static"
SITE = "opt/edgesdk-site"  # where the script installs the aarch64 wheels, relative to the rootfs
# qemu 7.2's default CPU model makes LiteRT crash or compute wrong int8 results;
# a Cortex-A72 model (ARMv8.0-A + NEON, like the Cortex-A53 boards) computes them exactly.
QEMU_CPU = "cortex-a72"
# The only host variables the guest sees: the host's PYTHONPATH, PYTHONHOME, LD_LIBRARY_PATH or
# VIRTUAL_ENV name x86-64 files that would break or silently shadow the aarch64 ones.
_PASSED_THROUGH = ("HOME", "TMPDIR", "LANG", "LC_ALL", "TVM_NUM_THREADS", "OMP_NUM_THREADS", "TF_CPP_MIN_LOG_LEVEL")


def default_rootfs() -> Path:
    """Where the arm64 root file system lives (whether or not it has been built).

    `$EDGESDK_ARM64_ROOTFS` if set; else `<repo>/.cache/arm64-rootfs` in a source checkout
    (where `make rootfs` puts it); else, for an installed edgesdk, `~/.cache/edgesdk/arm64-rootfs`.
    """
    if env := os.environ.get("EDGESDK_ARM64_ROOTFS"):
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parents[3]  # sdk/edgesdk/backends/qemu.py -> repo root
    if (repo / "packaging" / "arm64_rootfs.sh").is_file():
        return repo / ".cache" / "arm64-rootfs"
    return Path.home() / ".cache" / "edgesdk" / "arm64-rootfs"


def find_rootfs() -> Path | None:
    """The default root file system if it can run Python now, else None.

    Guarantees: the returned rootfs was completely built (the script writes `.complete` last)
    and has `usr/bin/python3`, and `qemu-aarch64-static` is on PATH.
    """
    root = default_rootfs()
    complete = (root / ".complete").is_file() and (root / "usr" / "bin" / "python3").exists()
    return root if complete and shutil.which(QEMU) else None


def run_python(
    rootfs: Path,
    args: list[str],
    *,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """Run the rootfs's `python3 ARGS...` under qemu-user in `cwd`; stdout and stderr captured as text.

    The guest environment is built, not inherited: QEMU_LD_PREFIX=rootfs, QEMU_CPU=cortex-a72,
    TVM_USE_RUNTIME_LIB=1 (the rootfs has TVM's runtime library only), PYTHONDONTWRITEBYTECODE=1
    (a bundle directory stays byte-identical to what was hashed), PYTHONPATH = `env`'s PYTHONPATH
    followed by the rootfs's site, and a few harmless host variables (HOME, TMPDIR, locale, thread
    counts); `env`'s other entries are added last. The guest's `sys.executable` is an aarch64 binary
    that the host cannot exec directly: code run this way must not spawn Python subprocesses.
    Raises `subprocess.TimeoutExpired` after `timeout` seconds, once qemu and every process the guest
    started were killed (`runtime.process.run_bounded`); a non-zero exit is the caller's to read.
    """
    command, guest = guest_command(rootfs, args, env)
    return run_bounded(command, timeout=timeout, cwd=cwd, env=guest, capture_output=True, text=True,
                       errors="replace")


def start_python(rootfs: Path, args: list[str], *, cwd: Path, env: dict[str, str] | None = None,
                 **popen: object) -> subprocess.Popen:
    """`run_python`'s guest, started in the background (a server): a Popen in a new session, so
    that `os.killpg(proc.pid, ...)` stops it with everything it forked."""
    command, guest = guest_command(rootfs, args, env)
    return subprocess.Popen(command, cwd=cwd, env=guest, start_new_session=True, **popen)  # type: ignore[arg-type]


def guest_command(rootfs: Path, args: list[str], env: dict[str, str] | None) -> tuple[list[str], dict[str, str]]:
    """The host command that runs the rootfs's `python3 ARGS...` under qemu-user, and its environment
    (as `run_python` describes it)."""
    qemu = shutil.which(QEMU)
    if qemu is None:
        raise UserError(
            "qemu.not-found",
            f"{QEMU} is not on PATH, so aarch64 code cannot run on this host",
            hint="install it with `apt-get install qemu-user-static` (`make system` does)",
        )
    rootfs = Path(rootfs).resolve()
    python = rootfs / "usr" / "bin" / "python3"
    if not python.exists():
        raise UserError(
            "qemu.no-rootfs",
            f"{rootfs} is not an arm64 root file system with python3",
            hint="build it with `make rootfs` (packaging/arm64_rootfs.sh)",
        )
    extra = dict(env or {})
    paths = [p for p in extra.pop("PYTHONPATH", "").split(os.pathsep) if p] + [str(rootfs / SITE)]
    guest = {k: os.environ[k] for k in _PASSED_THROUGH if k in os.environ}
    guest.update(
        PATH="/usr/local/bin:/usr/bin:/bin",
        QEMU_LD_PREFIX=str(rootfs),
        QEMU_CPU=QEMU_CPU,
        PYTHONPATH=os.pathsep.join(paths),
        PYTHONDONTWRITEBYTECODE="1",
        TVM_USE_RUNTIME_LIB="1",
    )
    guest.update(extra)
    return [qemu, str(python), *args], guest
