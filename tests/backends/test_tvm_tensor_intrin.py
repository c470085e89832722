"""The fast import of TVM's tensor intrinsics (backends/tvm/tensor_intrin.py): a target kind's intrinsics
registered, the others only when asked for, MetaSchedule's own import of the package a no-op after it,
`inspect` left as it was and giving the same answers meanwhile. In a fresh process: a pytest worker may
have imported the intrinsics already."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # a fresh process imports TVM and its intrinsics

CHILD = textwrap.dedent("""
    import inspect, sys
    assert "tvm.s_tir.tensor_intrin" not in sys.modules
    scan, stack = inspect.getmodule, inspect.stack

    # a frame of code with no file, as TVMScript's parser and the import machinery make: what inspect
    # answers for it before, during and after the import must be the same
    seen = []
    def look():
        frame = sys._getframe(1)
        seen.append((inspect.getmodule(frame, frame.f_code.co_filename), inspect.getsourcefile(frame),
                     inspect.getframeinfo(frame).code_context))
    exec(compile("look()", "<ast>", "exec"), {"look": look})

    during = []
    def first_stack(*a, **k):  # TVMScript calls inspect.stack() as it parses each function
        if not during:
            exec(compile("look()", "<ast>", "exec"), {"look": look})
            during.append(inspect.getmodule is not scan)
        return stack(*a, **k)
    inspect.stack = first_stack

    from edgesdk.backends.tvm.tensor_intrin import _tensor_intrin_importer
    importer = _tensor_intrin_importer()
    importer()
    importer()  # a second call does nothing
    inspect.stack = stack
    assert during == [True], during  # the lookup was the fast one during the import
    assert inspect.getmodule is scan  # and is inspect's own after it
    exec(compile("look()", "<ast>", "exec"), {"look": look})
    assert seen[0] == seen[1] == seen[2], seen

    # the intrinsics MetaSchedule's CPU rules look up, on x86 and on ARM
    import tvm
    from tvm.s_tir import TensorIntrin, meta_schedule as ms
    for name in ("dot_16x4_vnni", "dot_16x4_avx512", "dot_4x4_i8i8s32_neon"):
        TensorIntrin.get(name)
    # a tuning context imports the package: after the CPU families, that costs nothing and adds none
    ms.TuneContext(target=tvm.target.Target({"kind": "llvm", "num-cores": 2}))
    assert "tvm.s_tir.tensor_intrin.cuda" not in sys.modules
    try:
        TensorIntrin.get("wmma_sync_16x16x16_f16f16f32")
        raise AssertionError("CUDA's intrinsics registered for a CPU target")
    except ValueError:
        pass
    _tensor_intrin_importer("cuda")()  # a CUDA target's, when one is tuned
    TensorIntrin.get("wmma_sync_16x16x16_f16f16f32")
    print("ok")
    """)


def test_the_fast_import_registers_the_intrinsics_and_leaves_inspect_as_it_was():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"
