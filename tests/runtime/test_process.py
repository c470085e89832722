"""runtime/process.py: a child that does not finish in time is ended with every process it started."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from edgesdk.runtime.process import MAX_TIMEOUT_S, run_bounded


def _ends(pid: int) -> bool:
    """Whether process `pid` ends (a SIGKILL sent to it takes effect when it is next scheduled)."""
    for _ in range(200):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":  # a zombie has ended
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_timeout_ends_the_whole_process_group():
    # a shell that starts a child holding the same stdout, prints the child's pid and waits for it
    with pytest.raises(subprocess.TimeoutExpired) as e:
        run_bounded(["sh", "-c", "sleep 600 & echo $!; wait"], timeout=2, capture_output=True, text=True)
    child = int(e.value.output.split()[0])
    assert _ends(child)


def test_what_a_finished_child_left_behind_is_ended():
    # the shell exits at once; its child keeps running, its output redirected (a daemon)
    done = run_bounded(["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"], timeout=60, capture_output=True, text=True)
    assert done.returncode == 0
    assert _ends(int(done.stdout.split()[0]))


def test_results_as_subprocess_run_gives_them():
    done = run_bounded([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                       timeout=60, capture_output=True, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), MAX_TIMEOUT_S * 2])
def test_a_timeout_outside_its_range_is_refused(timeout):
    with pytest.raises(ValueError, match="a timeout of"):
        run_bounded(["true"], timeout=timeout)
