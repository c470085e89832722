"""TVM backend: an ONNX segment compiled by Apache TVM Relax into a shared library.

Every build-side TVM call of edgesdk lives in this package, so a TVM API rename costs one
place (TVM 0.27: Relax only, MetaSchedule under `tvm.s_tir.meta_schedule`, targets as JSON
dicts). The bundle runtime loads the library with `tvm.runtime.load_module`, maps the
segment's weights file beside it, and runs its Relax VM function `main` on the inputs and
the weights (runtime/backends/tvm_runner.py).

    compile.py        compile_onnx: lowering, scheduling, build
    lowering.py       an ONNX segment rewritten (rewrites.py, fast_math.py), imported, lowered to TIR
    targets.py        target architecture, `mcpu: native` and the host's CPU features, export
    schedules.py      the default schedules of untuned functions (CPU heuristic, GPU dlight)
    tiling.py         tile arithmetic and the target's vector registers, shared (imports nothing here)
    tensor_intrin.py  a fast import of the tensor intrinsics MetaSchedule needs
    popen_worker.py   TVM's worker processes started without torch
    tuning.py         tune_onnx (with search.py, builder.py, runner.py, database.py)
    sparse_*.py       pruned convolutions: the packed format (sparse_format), the TIR kernels
                      (sparse_kernels) and their schedules (sparse_schedules), the kernel choice by
                      policy (sparse_choice) or by timing (sparse_measured, timing.py), the Relax pass
                      (sparse_pass)
    layer_times.py    the prune plan's kernel and segment times; segment.py the registry's entry points

The modules import each other in one direction only (pyproject.toml's import-linter contract lists
them from top to bottom). TVM is imported inside the functions that use it, not at module top:
importing this package (the CLI does, to register the backend) must not import TVM, which takes
seconds. sparse_pass.py is the exception (its pass and visitors are TVM classes), and is itself
imported only inside a function.

TVM's FFI library would import torch wherever it is installed (seconds per process): the package installs
the runtime's hook against that before any of its modules imports TVM (runtime/backends/tvm_import.py).

One lowering (lowering.py's `_lower`) serves both tuning and compilation. MetaSchedule finds tuning
records by the structural hash of each fused TIR function, so the functions that
`tune_onnx` measures must be exactly those that `compile_onnx` later looks up.

    compile: ONNX --from_onnx--> Relax (weights as constants) --_lower--> fused TIR
             functions --MetaScheduleApplyDatabase--> tuned ones --dlight (GPU) or fixed
             MetaSchedule decisions (CPU)--> all scheduled --constants of 1 KiB or more made
             parameters of main, written to <segment>.weights--> --VM codegen, LLVM / CUDA C-->
             .so (cross-linked for aarch64)
    tune:    the same fused TIR functions --MetaSchedule (evolutionary search, XGBoost
             cost model, measured here or on boards over RPC)--> records in a JSON
             database, one per target (tuning.py)
"""

from __future__ import annotations

from ...runtime.backends.tvm_import import install

install()  # before any module here imports TVM

from .compile import TvmResult, compile_onnx, importer_ops  # noqa: E402
from .database import repair_database  # noqa: E402
from .runner import Boards, check_boards  # noqa: E402
from .search import Progress  # noqa: E402
from .targets import (HOST_CPU_ENV, cpuinfo_flags, host_cpu, missing_host_features, target_arch,  # noqa: E402
                      target_features)
# private names that tests/backends/test_tvm.py and test_tvm_tuning.py call
from .targets import _CPUINFO_FLAG, _cross_compiler, _host_features, _resolve_target  # noqa: E402, F401
from .tuning import tune_onnx  # noqa: E402

__all__ = ["HOST_CPU_ENV", "Boards", "Progress", "TvmResult", "check_boards", "compile_onnx", "cpuinfo_flags",
           "host_cpu", "importer_ops", "missing_host_features", "repair_database", "target_arch", "target_features",
           "tune_onnx"]
