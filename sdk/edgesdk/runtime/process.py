"""A child process that ends, with everything it started, within a stated time.

`subprocess.run(..., timeout=T)` kills only the child it started: a self-test's own children (a worker
process, the emulator's guest processes under qemu-user) keep running, and holding the pipes open they
can keep the caller waiting too. `run_bounded` starts the child in a session of its own, so its process
group holds everything it forks, and ends the group on a timeout, on an interruption, and once the child
has exited. Standard library only: the installer on the device uses it as the SDK does.
"""

from __future__ import annotations

import os
import signal
import subprocess

# poll() and select() take at most 2^31 - 1 ms (24.8 days); a longer wait is refused, never overflowed
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def run_bounded(command: list[str], *, timeout: float, input: bytes | str | None = None,
                capture_output: bool = False, **popen) -> subprocess.CompletedProcess:
    """`subprocess.run(command, timeout=timeout, ...)` whose timeout ends the child's whole process
    group: `subprocess.TimeoutExpired` is raised once every process of it was killed. Any process the
    child left behind is killed when it exits too. `popen` goes to `subprocess.Popen`."""
    if not 0 < timeout <= MAX_TIMEOUT_S:
        raise ValueError(f"a timeout of {timeout:g} s: expected more than 0 and at most {MAX_TIMEOUT_S:g} s")
    if capture_output:
        popen.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if input is not None:
        popen["stdin"] = subprocess.PIPE
    proc = subprocess.Popen(command, start_new_session=True, **popen)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except BaseException:  # the timeout, or an interruption of the caller: nothing of the child survives
        _end_group(proc.pid)  # before the child is reaped, so its id still names its group
        proc.kill()
        proc.wait()
        raise
    finally:
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    # The child exited and was reaped; a process it left in its group still holds the group's id, which
    # the kernel reuses for no new process while that group exists.
    _end_group(proc.pid)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _end_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
