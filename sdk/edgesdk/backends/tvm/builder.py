"""The builder of tuning candidates: shared libraries built by worker processes that live as long as
the tuning run, cross-linked for a foreign CPU so that a board needs no compiler."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from . import popen_worker
from .schedules import _runs_every_instance
from .tensor_intrin import _tensor_intrin_importer


_BUILD_TIMEOUT_S = 60.0


def _build_job(mod: Any, target: Any, params: Any, compiler: str | None) -> str:
    """Build one candidate into a shared library, linked by `compiler` when the target's CPU is
    not this host's. Runs in a builder worker process; a library, not TVM's default .tar, so
    that a board needs no compiler."""
    import tvm
    from tvm import s_tir
    from tvm.support import cc

    try:
        sound = _runs_every_instance(s_tir.Schedule(mod))
    except Exception:  # noqa: BLE001 -- not a block-structured function: the build decides
        sound = True
    if not sound:
        # TVM 0.27 can leave a fused padding's border unwritten: fast and wrong (see _apply_database)
        raise RuntimeError("the candidate does not run every instance of a block (TVM 0.27 leaves part "
                           "of a fused epilogue unwritten): refused")
    with target:  # the relax VM-free build MetaSchedule does: the function alone
        lib = tvm.compile(mod, target=target)
    path = os.path.join(tempfile.mkdtemp(prefix="edgesdk-tune-"), "candidate.so")
    lib.export_library(path, **({"fcompile": cc.cross_compiler(compiler)} if compiler else {}))
    return path


def _build_jobs(build_inputs: list) -> list[tuple]:
    """What each builder worker gets (a seam for tests that inject a failing candidate)."""
    return [(b.mod, b.target, None) for b in build_inputs]


def _pooled_builder(max_workers: int, compiler: str | None, kind: str = "llvm") -> Any:
    """A MetaSchedule builder whose worker processes live as long as the tuning run; libraries
    are linked by `compiler` (`_cross_compiler`; None: this host's); `kind`: the TVM target kind.

    TVM's LocalBuilder starts fresh workers for every measured batch, and each worker's
    first build imports `tvm.s_tir.tensor_intrin` (see `_tensor_intrin_importer`). These
    workers import it once per tuning run, while the tuning process prepares the search.
    A candidate that fails or times out gets its error message; the others are built.
    """
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.builder import BuilderResult, PyBuilder
    from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

    popen_worker.use()  # the builder workers without torch

    @derived_object
    class _PooledBuilder(PyBuilder):
        def __init__(self) -> None:
            super().__init__()
            self.pool = PopenPoolExecutor(
                max_workers=max_workers, timeout=_BUILD_TIMEOUT_S, initializer=_tensor_intrin_importer(kind)
            )
            for _ in range(max_workers):  # start the workers now: their import overlaps ours
                self.pool.submit(int)

        def build(self, build_inputs):
            results = []
            for result in self.pool.map_with_error_catching(lambda job: _build_job(*job, compiler),
                                                           _build_jobs(build_inputs)):
                if result.status == StatusKind.COMPLETE:
                    results.append(BuilderResult(result.value, None))
                elif result.status == StatusKind.TIMEOUT:
                    results.append(BuilderResult(None, f"build timed out after {_BUILD_TIMEOUT_S:g} s"))
                else:
                    results.append(BuilderResult(None, f"build failed: {result.value}"))
            return results

        def shutdown(self) -> None:
            self.pool.shutdown()

    return _PooledBuilder()


def _remove(path: str) -> None:
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
