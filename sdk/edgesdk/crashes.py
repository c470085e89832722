"""A native crash (a converter's, a kernel library's) reported where the user sees it.

faulthandler prints the Python frames a fatal signal arrived under. Two things hid them in a build: the
stages hold back what native code writes to fd 2 while it runs (`backends.tflite.convert._quiet`), and
importing TVM replaces the handler with its own (it prints "!!!!!!! Segfault encountered !!!!!!!" and a C
backtrace to fd 2, held back there). So the report goes to a copy of the real stderr made at start, and
the handler is taken back before each native step that may crash (`report_native_crashes` again)."""

from __future__ import annotations

import faulthandler
import os

_REPORT = None


def report_native_crashes() -> None:
    """From now on, a fatal signal prints the Python frames it arrived under to the stderr this process
    started with (the first call copies it); called again, takes the handler back from whatever replaced it."""
    global _REPORT
    if _REPORT is None:
        try:
            _REPORT = os.fdopen(os.dup(2), "w")
        except OSError:  # no stderr to report to
            return
    # enable() alone leaves a handler another library put in its place: faulthandler thinks it is still on
    faulthandler.disable()
    faulthandler.enable(file=_REPORT)
