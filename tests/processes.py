"""Helpers for tests about processes a command starts and must end."""

from __future__ import annotations

import time


def ends(pid: int) -> bool:
    """Whether process `pid` ends within 10 s (a SIGKILL sent to it takes effect when it is next scheduled;
    a zombie has ended)."""
    for _ in range(200):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False
