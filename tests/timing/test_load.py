"""The share of the CPU other processes took while something was timed (`timing.load`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from edgesdk.timing import load


def test_the_others_share_is_what_the_cpus_were_busy_with_less_this_process_and_its_children(monkeypatch):
    """Counters as /proc/stat gives them (jiffies) and os.times() (seconds), before and after: 4 s of CPU time
    passed, 2 s of it busy, 1 s of that this process's own: the others took a quarter."""
    tick = os.sysconf("SC_CLK_TCK")
    counters = iter([(100 * tick, 1000 * tick), (102 * tick, 1004 * tick)])
    own = iter([10.0, 11.0])
    monkeypatch.setattr(load, "_busy_and_total", lambda cpus: next(counters))
    monkeypatch.setattr(load, "_own_seconds", lambda: next(own))
    with load.others_share() as measured:
        pass
    assert measured.others == 0.25 and measured.busy


def test_unreadable_counters_leave_the_share_unknown_and_never_busy(monkeypatch):
    monkeypatch.setattr(load, "_busy_and_total", lambda cpus: None)
    with load.others_share() as measured:
        pass
    assert measured.others is None and not measured.busy


def test_processes_spinning_on_every_cpu_make_the_host_busy():
    """One process spinning per CPU this process may use, for the whole block, not this process's work."""
    cpus = len(os.sched_getaffinity(0))
    spin = "import time\nend = time.monotonic() + 1.5\nwhile time.monotonic() < end: pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(cpus)]
    try:
        time.sleep(0.2)  # the interpreters started
        with load.others_share() as measured:
            time.sleep(1.0)
    finally:
        for p in procs:
            p.wait()
    assert measured.busy and measured.others > 0.5, measured


def test_the_check_is_on_unless_switched_off_and_a_bad_switch_is_a_usage_error(monkeypatch):
    from edgesdk.errors import UsageError

    monkeypatch.delenv(load.CHECK_ENV, raising=False)
    assert load.checking()
    monkeypatch.setenv(load.CHECK_ENV, "off")
    assert not load.checking()
    monkeypatch.setenv(load.CHECK_ENV, "maybe")
    with pytest.raises(UsageError) as e:
        load.checking()
    assert e.value.code == "build.bad-env" and "expected on or off" in e.value.message
