"""How much of this process's CPUs other processes took while something was timed.

A time measured while other work shared the cores is not what a device, running the bundle alone, will
see; and it is not off by one factor for every candidate: onnxruntime's threads spin between kernels
and lose most when a core is taken from them (RoBERTa-small's onnxruntime candidate measured 6.4 ms
while two other builds shared the two cores, and TVM's cut won at about 3.1 ms; on a quiet host
onnxruntime measures 1.9 ms and TVM 3.2 ms). `others_share` reads the kernel's
per-CPU counters (`/proc/stat`) for the CPUs this process may run on, before and after, and subtracts
what this process and the children it waited for used: what is left is the others'. Where
`/proc/stat` cannot be read (not Linux) the share is unknown (None).

`EDGESDK_LOAD_CHECK=off` (`checking`) keeps times measured on a busy host like any other: a build farm
whose builds always share the cores, wanting the same bytes from every rebuild, sets it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import UsageError

# Above this share of the CPUs' time taken by other processes, a timing is "busy": measured, used for
# this build's choice, but not kept for the next build to replay (a quiet build measures it again).
# Measured on 2 cores: an idle host reads 0.000-0.002; one other build running, 0.84-0.90.
BUSY_SHARE = 0.15
CHECK_ENV = "EDGESDK_LOAD_CHECK"


def checking() -> bool:
    """False where EDGESDK_LOAD_CHECK=off: a busy host's times are kept as a quiet one's."""
    switch = os.environ.get(CHECK_ENV, "on").strip().lower()
    if switch not in ("on", "off"):
        raise UsageError("build.bad-env", f"{CHECK_ENV}={os.environ[CHECK_ENV]!r}: expected on or off",
                         f"unset {CHECK_ENV}, or set it to off to keep times measured while other processes "
                         "took the CPU")
    return switch == "on"


@dataclass
class Load:
    """What `others_share` measured: the share of the CPUs' time other processes took (0..1), or None."""

    others: float | None = None

    @property
    def busy(self) -> bool:
        return self.others is not None and self.others > BUSY_SHARE


@contextlib.contextmanager
def others_share() -> Iterator[Load]:
    """The share of this process's CPUs' time that other processes took while the block ran (`Load`)."""
    load = Load()
    cpus = _allowed_cpus()
    before, own_before = _busy_and_total(cpus), _own_seconds()
    try:
        yield load
    finally:
        after, own_after = _busy_and_total(cpus), _own_seconds()
        if before is not None and after is not None:
            tick = os.sysconf("SC_CLK_TCK")
            busy = (after[0] - before[0]) / tick
            total = (after[1] - before[1]) / tick
            if total > 0:
                load.others = round(min(1.0, max(0.0, busy - (own_after - own_before)) / total), 3)


def _allowed_cpus() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _busy_and_total(cpus: set[int] | None) -> tuple[int, int] | None:
    """Jiffies the CPUs in `cpus` (all, where None) spent busy and in all, from /proc/stat; None where it
    cannot be read. Fields: user nice system idle iowait irq softirq steal (guest time is in user)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            lines = f.read(1 << 20).splitlines()
    except OSError:
        return None
    busy = total = 0
    seen = False
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit():
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        values = [int(v) for v in fields[:8]]
        if len(values) < 8:
            return None
        busy += values[0] + values[1] + values[2] + values[5] + values[6] + values[7]
        total += sum(values)
        seen = True
    return (busy, total) if seen else None


def _own_seconds() -> float:
    """CPU seconds of this process and of the children it has waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system
