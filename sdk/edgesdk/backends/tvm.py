"""TVM backend: an ONNX segment compiled by Apache TVM Relax into a shared library.

Every build-side TVM call of edgesdk lives in this file, so a TVM API rename costs one
file (TVM 0.27: Relax only, MetaSchedule under `tvm.s_tir.meta_schedule`, targets as
JSON dicts). The bundle runtime loads the library with `tvm.runtime.load_module` and
runs its Relax VM function `main`.

One lowering (`_lower`) serves both tuning and compilation. MetaSchedule finds tuning
records by the structural hash of each fused TIR function, so the functions that
`tune_onnx` measures must be exactly those that `compile_onnx` later looks up.

    ONNX --from_onnx--> Relax (weights as constants) --_lower--> fused TIR functions
         --MetaScheduleApplyDatabase--> tuned functions --dlight (GPU only)--> every
         function scheduled --VM codegen + LLVM/CUDA--> .so (cross-linked for aarch64)
"""

from __future__ import annotations

import math
import os
import platform
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from ..errors import UserError
from ..runtime.manifest import TensorSpec

_ARCHES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


@dataclass(frozen=True)
class TvmResult:
    """What `compile_onnx` built: the VM's interface and how much of it is tuned."""

    inputs: tuple[TensorSpec, ...]  # ONNX names, key = str(position in the VM's main function)
    outputs: tuple[TensorSpec, ...]
    tasks: int  # tunable TIR functions in the module
    tuned: int  # how many of them got a schedule from the tuning database
    target: dict  # the target as compiled (`mcpu: native` resolved to the build host's CPU)


def target_arch(target: dict) -> str:
    """The CPU architecture that runs the library built for `target`: x86_64 or aarch64.

    A CUDA target's library runs on its host CPU. An LLVM target without `mtriple` is the
    build host itself.
    """
    host = target.get("host", {"kind": "llvm"}) if target.get("kind") == "cuda" else target
    if host.get("kind") != "llvm":
        raise UserError(
            "tvm.unsupported-target",
            f"tvm targets are llvm or cuda with an llvm host, got {target!r}",
            hint='use e.g. {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]}',
        )
    machine = str(host.get("mtriple") or platform.machine()).split("-")[0].lower()
    if machine not in _ARCHES:
        raise UserError(
            "tvm.unsupported-target",
            f"unsupported cpu architecture {machine!r} in target {target!r}",
            hint="edgesdk builds for x86_64 and aarch64",
        )
    return _ARCHES[machine]


def compile_onnx(
    model: onnx.ModelProto, target: dict, out_path: Path, *, tuning_db: Path | None = None
) -> TvmResult:
    """Compile an ONNX segment for `target` into the shared library `out_path`.

    Needs: static input shapes, an opset the Relax importer reads (>= 11), ops it supports.
    Guarantees: `out_path` is written atomically (a complete library or no file); the
    library's VM function `main` takes the inputs in `TvmResult.inputs` order and returns
    one tensor (one output) or a tuple (several), in `TvmResult.outputs` order. Functions
    with a record in `tuning_db` use the tuned schedule; on CUDA the others get dlight's
    default GPU schedules (so compiling needs no GPU; nvcc compiles the kernels); on CPU
    they keep TVM's default loop nests. aarch64 targets are linked by
    `aarch64-linux-gnu-gcc`.
    """
    import tvm
    from tvm import relax
    from tvm.s_tir import dlight as dl

    target, tvm_target = _resolve_target(target)
    mod = _lower(_import(model), tvm_target)
    inputs, outputs = _interface(model, mod)
    tasks = _count_unscheduled(mod)
    with tvm_target, tvm.transform.PassContext(opt_level=3):
        if tuning_db is not None:
            # allow_missing=False: a tuning database that is named but absent is a mistake
            # (a wrong path), not an empty database.
            database = _open_database(tuning_db, must_exist=True)
            with database:
                mod = relax.transform.MetaScheduleApplyDatabase()(mod)
        tuned = tasks - _count_unscheduled(mod)
        if "gpu" in tvm_target.keys:
            # A GPU kernel without thread bindings does not compile: every function the
            # database left unscheduled gets dlight's rule-based schedule.
            mod = dl.ApplyDefaultSchedule(
                dl.gpu.Matmul(),
                dl.gpu.GEMV(),
                dl.gpu.Reduction(),
                dl.gpu.GeneralReduction(),
                dl.gpu.Fallback(),
            )(mod)
        backend = _backend_pipeline(tvm_target)
        finish = tvm.transform.Sequential(
            backend.dataflow_lower_passes(tvm_target) + backend.finalize_passes(tvm_target)
        )
        if tvm_target.kind.name == "cuda":
            _compile_kernels_with_nvcc(str(tvm_target.attrs["arch"]))
        executable = tvm.compile(mod, target=tvm_target, relax_pipeline=finish)
    _export(executable, target, Path(out_path))
    return TvmResult(inputs=inputs, outputs=outputs, tasks=tasks, tuned=tuned, target=target)


def tune_onnx(
    model: onnx.ModelProto,
    target: dict,
    tuning_db: Path,
    *,
    trials: int,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    max_trials_per_task: int | None = None,
) -> dict:
    """Search schedules for the segment's TIR functions with MetaSchedule.

    The search is evolutionary, guided by an XGBoost cost model, and measures candidates
    on this machine (so it needs the target's CPU, or its GPU for CUDA). Records are
    appended to the JSON database in the directory `tuning_db` (created when absent), which
    persists between builds: a task that already holds `max_trials_per_task` records
    (default `trials`) is not searched again, so re-tuning a tuned workload costs no trials.
    `trials == 0` does nothing.

    Returns a summary: `tasks` (tunable functions), `searched` and `reused` (tasks searched
    now / skipped as already tuned), `trials` (records added now), `best_ms` (task name ->
    best measured latency in the database, ms), `seed`.
    """
    summary: dict[str, Any] = {"tasks": 0, "searched": 0, "reused": 0, "trials": 0, "best_ms": {}}
    summary["seed"] = seed
    if trials <= 0:
        return summary
    from tvm.s_tir import meta_schedule as ms

    target, tvm_target = _resolve_target(target)
    mod = _lower(_import(model), tvm_target)
    extracted = ms.relax_integration.extract_tasks(mod, tvm_target)
    summary["tasks"] = len(extracted)
    if not extracted:
        return summary
    per_task = max_trials_per_task or trials
    database = _open_database(Path(tuning_db), must_exist=False)
    todo = [t for t in extracted if _record_count(database, t) < per_task]
    summary["reused"] = len(extracted) - len(todo)
    summary["searched"] = len(todo)
    records_before = len(database)
    if todo:
        work_dir = str(tuning_db)
        contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(
            todo, work_dir=work_dir, seed=seed
        )
        callbacks = list(ms.MeasureCallback.create("default"))
        if progress is not None:
            callbacks.append(_progress_callback(progress, [t.task_name for t in todo]))
        ms.tune_tasks(
            tasks=contexts,
            task_weights=weights,
            work_dir=work_dir,
            max_trials_global=trials,
            max_trials_per_task=per_task,
            # One search round must not overshoot a small per-task budget.
            num_trials_per_iter=min(64, per_task),
            database=database,
            cost_model="xgb",
            measure_callbacks=callbacks,
        )
    summary["trials"] = len(database) - records_before
    for task in extracted:
        best = _best_record(database, task)
        if best is not None:
            summary["best_ms"][task.task_name] = best
    return summary


# --- import and lowering -------------------------------------------------------------


def _import(model: onnx.ModelProto) -> Any:
    """The Relax module of `model`, weights embedded as constants, inputs static."""
    from tvm.relax.frontend.onnx import from_onnx

    initializers = {t.name for t in model.graph.initializer}
    shapes: dict[str, list[int]] = {}
    dtypes: dict[str, str] = {}
    dynamic = []
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor_type = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in tensor_type.shape.dim]
        if not tensor_type.HasField("shape") or any(d <= 0 for d in dims):
            dynamic.append(f"{value.name} {_dims_text(tensor_type)}")
        shapes[value.name] = dims
        dtypes[value.name] = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type).name
    if dynamic:
        raise UserError(
            "tvm.dynamic-shape",
            f"tvm segments need static input shapes: {', '.join(dynamic)}",
            hint="fix the input shapes at import, e.g. --input-shape x=1x3x224x224",
        )
    try:
        return from_onnx(model, shape_dict=shapes, dtype_dict=dtypes, keep_params_in_input=False)
    except Exception as exc:
        # The importer checks every node before converting and lists all unsupported ops
        # in one error (tvm.error.OpNotImplemented).
        if type(exc).__name__ == "OpNotImplemented":
            raise UserError(
                "tvm.unsupported-op",
                f"tvm's onnx importer cannot convert this segment: {exc}",
                hint="place these ops on the onnxruntime backend",
            ) from exc
        raise


def _dims_text(tensor_type: onnx.TypeProto.Tensor) -> str:
    if not tensor_type.HasField("shape"):
        return "(unknown rank)"
    dims = [str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?") for d in tensor_type.shape.dim]
    return "[" + ",".join(dims) + "]"


def _lower(mod: Any, tvm_target: Any) -> Any:
    """Legalize and fuse `mod` into TIR functions, none of them scheduled yet.

    The same function feeds task extraction and compilation, so the fused functions, and
    with them the tuning database's workload keys, are identical in both.
    """
    import tvm
    from tvm import relax

    passes = [
        # Inference form: batch norm becomes multiply-add that FoldConstant folds into
        # the weights.
        relax.transform.DecomposeOpsForInference(),
        relax.transform.CanonicalizeBindings(),
        *_backend_pipeline(tvm_target).library_dispatch_passes(tvm_target),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ]
    with tvm_target, tvm.transform.PassContext(opt_level=3):
        return tvm.transform.Sequential(passes)(mod)


def _backend_pipeline(tvm_target: Any) -> Any:
    """TVM's pass lists for the target's backend (its module; TVM 0.27's package
    `__init__` does not re-export `dataflow_lower_passes`, so the module is imported)."""
    if tvm_target.kind.name == "cuda":
        from tvm.relax.backend.cuda import pipeline
    else:
        from tvm.relax.backend.cpu_generic import pipeline
    return pipeline


def _count_unscheduled(mod: Any) -> int:
    from tvm import tirx

    return sum(
        1
        for func in mod.functions.values()
        if isinstance(func, tirx.PrimFunc) and not bool(func.attrs.get("tirx.is_scheduled", False))
    )


def _interface(model: onnx.ModelProto, mod: Any) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """TensorSpecs of the VM's `main`: parameters by position, results in ONNX output order."""
    import tvm

    main = mod["main"]
    initializers = {t.name for t in model.graph.initializer}
    input_names = [v.name for v in model.graph.input if v.name not in initializers]
    inputs = tuple(
        _spec(name, param.ty, str(i)) for i, (name, param) in enumerate(zip(input_names, main.params))
    )
    ret = main.ret_ty  # TVM 0.27 calls struct_info `ty`
    fields = list(ret.fields) if isinstance(ret, tvm.ir.TupleType) else [ret]
    output_names = [v.name for v in model.graph.output]
    outputs = tuple(_spec(name, info, str(i)) for i, (name, info) in enumerate(zip(output_names, fields)))
    return inputs, outputs


def _spec(name: str, info: Any, key: str) -> TensorSpec:
    return TensorSpec(name=name, shape=tuple(int(d) for d in info.shape.values), dtype=str(info.dtype), key=key)


# --- targets and export --------------------------------------------------------------


def _resolve_target(target: dict) -> tuple[dict, Any]:
    """The target dict with `mcpu: native` replaced by this host's CPU, and its tvm Target.

    LLVM refuses `-mcpu=native` with the triple TVM's LLVM was built for, so "native" is
    resolved here; the resolved name is what the build records.
    """
    import tvm
    from tvm.target import codegen

    def resolve(t: dict) -> dict:
        t = dict(t)
        if t.get("kind") == "llvm" and t.get("mcpu") == "native":
            t["mcpu"] = codegen.llvm_get_system_cpu()
        if isinstance(t.get("host"), dict):
            t["host"] = resolve(t["host"])
        return t

    target_arch(target)  # validates kind and architecture
    target = resolve(target)
    if target.get("kind") == "cuda" and "host" not in target:
        target["host"] = {"kind": "llvm"}
    try:
        return target, tvm.target.Target(target)
    except Exception as exc:
        raise UserError("tvm.bad-target", f"tvm does not accept target {target!r}: {exc}",
                        hint="see the tvm target dicts in targets/*.yaml") from exc


def _compile_kernels_with_nvcc(arch: str) -> None:
    """Make TVM compile CUDA kernels with nvcc into a fatbin at build time.

    Without a registered `tvm_callback_cuda_compile` the library would keep CUDA source,
    and the device would need a CUDA compiler to load it; TVM's own callback defaults to
    NVRTC, which needs the cuda-bindings package. The fatbin carries SASS for `arch` and
    its PTX, which the driver JIT-compiles on newer GPUs.
    """
    import tvm_ffi
    from tvm.support import nvcc

    if shutil.which("nvcc") is None:
        raise UserError(
            "tvm.no-nvcc",
            "compiling a cuda segment needs nvcc, which is not on PATH",
            hint="install the CUDA toolkit (no GPU is needed to compile)",
        )
    sm = arch.removeprefix("sm_")
    gencode = ["-gencode", f"arch=compute_{sm},code=sm_{sm}", "-gencode", f"arch=compute_{sm},code=compute_{sm}"]

    @tvm_ffi.register_global_func("tvm_callback_cuda_compile", override=True)
    def _compile(code: str, *_: Any) -> bytes:
        return nvcc.compile_cuda(code, target_format="fatbin", arch=gencode, compiler="nvcc")


def _export(executable: Any, target: dict, out_path: Path) -> None:
    """Link `executable` into `out_path` atomically, cross-linking for a foreign CPU."""
    from tvm.support import cc

    arch = target_arch(target)
    options: dict[str, Any] = {}
    if arch != _ARCHES.get(platform.machine().lower()):
        compiler = f"{arch}-linux-gnu-gcc"
        if shutil.which(compiler) is None:
            raise UserError(
                "tvm.no-cross-compiler",
                f"linking for {arch} needs {compiler}, which is not on PATH",
                hint=f"install it: apt-get install gcc-{arch}-linux-gnu",
            )
        options["fcompile"] = cc.cross_compiler(compiler)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out_path.name + ".", suffix=".so", dir=out_path.parent)
    os.close(fd)
    try:
        executable.export_library(tmp, **options)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would follow the file into the bundle
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# --- tuning database -----------------------------------------------------------------


def _open_database(path: Path, *, must_exist: bool) -> Any:
    from tvm.s_tir import meta_schedule as ms

    if must_exist and not (path / "database_workload.json").exists():
        raise UserError(
            "tvm.no-tuning-db",
            f"tuning database {path} does not exist",
            hint="run the tune stage first, or build without a tuning database",
        )
    path.mkdir(parents=True, exist_ok=True)
    return ms.database.JSONDatabase(work_dir=str(path), allow_missing=True)


def _record_count(database: Any, task: Any) -> int:
    """Measured records (valid or not) that `database` holds for `task`."""
    import tvm

    mod = task.dispatched[0]
    if not database.has_workload(mod):
        return 0
    key = tvm.ir.structural_hash(database.commit_workload(mod).mod)
    return sum(1 for r in database.get_all_tuning_records() if tvm.ir.structural_hash(r.workload.mod) == key)


def _best_record(database: Any, task: Any) -> float | None:
    mod = task.dispatched[0]
    if not database.has_workload(mod):
        return None
    top = database.get_top_k(database.commit_workload(mod), 1)
    if not top or not top[0].run_secs:
        return None
    secs = [float(s) for s in top[0].run_secs]
    return round(1e3 * sum(secs) / len(secs), 6)


def _progress_callback(progress: Callable[[str], None], names: list[str]) -> Any:
    """A MetaSchedule measure callback that reports each measured batch to `progress`."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

    best: dict[int, float] = {}

    @derived_object
    class _Progress(PyMeasureCallback):
        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
            for result in runner_results:
                if result.run_secs:
                    ms_ = 1e3 * sum(float(s) for s in result.run_secs) / len(result.run_secs)
                    best[task_id] = min(best.get(task_id, math.inf), ms_)
            shown = f"{best[task_id]:.4f} ms" if task_id in best else "no valid candidate yet"
            progress(f"tune {names[task_id]}: {len(runner_results)} measured, best {shown}")

    return _Progress()
