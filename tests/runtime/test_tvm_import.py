"""TVM imported without torch (runtime/backends/tvm_import.py): where torch is installed, TVM's FFI library
and Relax would import it in every process that imports TVM. In fresh processes: a test process may have
imported either already."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # fresh processes import TVM and torch


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_tvm_imports_without_torch_and_torch_imports_after():
    assert _run("""
        import sys
        import numpy as np
        from edgesdk.runtime.backends.tvm_import import install
        install()
        import tvm
        from tvm import relax
        import tvm.s_tir.meta_schedule
        assert "torch" not in sys.modules
        assert tvm.runtime.tensor(np.arange(3, dtype=np.float32)).numpy().tolist() == [0.0, 1.0, 2.0]
        import torch  # from the user's own code, later: as it would without the hook
        assert float(torch.ones(2).sum()) == 2.0
        print("ok")
        """) == "ok"


def test_where_torch_is_imported_first_tvm_imports_as_it_always_did():
    assert _run("""
        import sys
        import torch
        from edgesdk.runtime.backends.tvm_import import install
        install()
        import tvm_ffi
        import tvm.relax.base_py_module as m
        assert m.to_dlpack_legacy is not None  # TVM's torch interop, as without the hook
        print("ok")
        """) == "ok"


def test_without_the_hook_tvm_would_import_torch():
    """What the hook is for: the pinned TVM imports torch where it is installed (if it stops, drop the hook
    and popen_worker.py)."""
    assert _run("""
        import sys
        import tvm
        from tvm import relax
        print("torch" in sys.modules)
        """) == "True"


def test_tvms_worker_processes_start_without_torch():
    """MetaSchedule's builders and runners are TVM's PopenWorker processes: started by the backend's
    popen_worker module, they run TVM's worker loop with the hook (and still run what they are given)."""
    assert _run("""
        import sys
        from edgesdk.backends.tvm import popen_worker
        popen_worker.use()
        from tvm.support.popen_pool import PopenPoolExecutor
        pool = PopenPoolExecutor(max_workers=1)
        def probe():
            import sys, tvm
            return "torch" in sys.modules, float(tvm.runtime.tensor([1.0, 2.0]).numpy().sum())
        print(pool.submit(probe).result())
        """) == "(False, 3.0)"
