"""runtime/process.py: a child that does not finish in time is ended with every process it started."""

from __future__ import annotations

import subprocess
import sys

import pytest

from edgesdk.runtime.process import MAX_TIMEOUT_S, run_bounded
from tests.processes import ends


def test_a_timeout_ends_the_whole_process_group():
    # a shell that starts a child holding the same stdout, prints the child's pid and waits for it
    with pytest.raises(subprocess.TimeoutExpired) as e:
        run_bounded(["sh", "-c", "sleep 600 & echo $!; wait"], timeout=2, capture_output=True, text=True)
    child = int(e.value.output.split()[0])
    assert ends(child)


def test_what_a_finished_child_left_behind_is_ended():
    # the shell exits at once; its child keeps running, its output redirected (a daemon)
    done = run_bounded(["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"], timeout=60, capture_output=True, text=True)
    assert done.returncode == 0
    assert ends(int(done.stdout.split()[0]))


def test_results_as_subprocess_run_gives_them():
    done = run_bounded([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                       timeout=60, capture_output=True, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), MAX_TIMEOUT_S * 2])
def test_a_timeout_outside_its_range_is_refused(timeout):
    with pytest.raises(ValueError, match="a timeout of"):
        run_bounded(["true"], timeout=timeout)
