"""TVM's worker processes (MetaSchedule's builders and runners) started without torch.

TVM starts each worker as `python -m tvm.exec.popen_worker`, a fresh interpreter without edgesdk's import
hook (runtime/backends/tvm_import.py), so where torch is installed every worker imports it with TVM: ~3 s and
a few hundred MiB each, three workers per tuning run (a 16-trial tuning build of one convolution: 29.3 s
instead of 21.7 s). `use()` makes TVM start its workers as `python -m edgesdk.backends.tvm.popen_worker`,
which installs the hook and then runs TVM's own worker loop, with the same pipes. Written for the TVM
that constraints.txt pins (`PopenWorker._start` of apache-tvm 0.27).

    python -m edgesdk.backends.tvm.popen_worker READ_FD WRITE_FD
"""

from __future__ import annotations

import os
import subprocess
import sys


def use() -> None:
    """TVM's PopenWorker starts this module instead of tvm.exec.popen_worker (POSIX; once per process)."""
    from tvm.support import popen_pool

    worker = popen_pool.PopenWorker
    if sys.platform == "win32" or getattr(worker._start, "edgesdk", False):
        return

    def _start(self) -> None:  # PopenWorker._start of TVM 0.27 (POSIX), this module as the command
        if self._proc is not None:
            return
        main_read, worker_write = os.pipe()
        worker_read, main_write = os.pipe()
        cmd = [sys.executable, "-m", __name__, str(worker_read), str(worker_write)]
        self._proc = subprocess.Popen(cmd, pass_fds=(worker_read, worker_write), stdout=self._stdout,
                                      stderr=self._stderr)
        os.close(worker_read)
        os.close(worker_write)
        self._reader = os.fdopen(main_read, "rb")
        self._writer = os.fdopen(main_write, "wb")

    _start.edgesdk = True
    worker._start = _start


if __name__ == "__main__":
    from edgesdk.runtime.backends.tvm_import import install

    install()
    from tvm.exec.popen_worker import main

    main()
