"""TVM backend: an ONNX segment compiled by Apache TVM Relax into a shared library.

Every build-side TVM call of edgesdk lives in this package (compilation here, tuning in
`tuning.py`), so a TVM API rename costs one place (TVM 0.27: Relax only, MetaSchedule under `tvm.s_tir.meta_schedule`, targets as
JSON dicts). The bundle runtime loads the library with `tvm.runtime.load_module` and
runs its Relax VM function `main`.

One lowering (`_lower`) serves both tuning and compilation. MetaSchedule finds tuning
records by the structural hash of each fused TIR function, so the functions that
`tune_onnx` measures must be exactly those that `compile_onnx` later looks up.

    compile: ONNX --from_onnx--> Relax (weights as constants) --_lower--> fused TIR
             functions --MetaScheduleApplyDatabase--> tuned ones --dlight (GPU) or fixed
             MetaSchedule decisions (CPU)--> all scheduled --VM codegen, LLVM / CUDA C-->
             .so (cross-linked for aarch64)
    tune:    the same fused TIR functions --MetaSchedule (evolutionary search, XGBoost
             cost model, measured here or on boards over RPC)--> records in a JSON
             database, one per target (tuning.py)
"""

from __future__ import annotations

import math
import os
import platform
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from ...errors import UserError
from ...runtime.manifest import TensorSpec

_ARCHES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


@dataclass(frozen=True)
class TvmResult:
    """What `compile_onnx` built: the VM's interface and how much of it is tuned."""

    inputs: tuple[TensorSpec, ...]  # ONNX names, key = str(position in the VM's main function)
    outputs: tuple[TensorSpec, ...]
    tasks: int  # tunable TIR functions in the module
    tuned: int  # how many of them got a schedule from the tuning database
    target: dict  # the target as compiled (`mcpu: native` resolved to this host's CPU and features)
    # untuned functions that got the fixed default schedule (CPU: `_cpu_default_schedules`)
    default_scheduled: int = 0


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


def importer_ops() -> frozenset[str]:
    """The ONNX op types (default domain) that TVM's Relax ONNX importer converts.

    An op in this set may still be refused for an attribute the converter lacks; one
    outside it is refused for certain (the importer names all of them in one error).
    """
    from tvm.relax.frontend.onnx import onnx_frontend

    # `If` and `Constant` are converted by the graph walker itself, not through the map.
    return frozenset(onnx_frontend._get_convert_map()) | {"If", "Constant"}


def compile_onnx(
    model: onnx.ModelProto, target: dict, out_path: Path, *, tuning_db: Path | None = None
) -> TvmResult:
    """Compile an ONNX segment for `target` into the shared library `out_path`.

    Needs: static input shapes, an opset the Relax importer reads (>= 11), ops it supports.
    Guarantees: `out_path` is written atomically (a complete library or no file); the
    library's VM function `main` takes the inputs in `TvmResult.inputs` order and returns
    one tensor (one output) or a tuple (several), in `TvmResult.outputs` order. Functions
    with a record in `tuning_db` (a database tuned for this same target) use the tuned
    schedule; on CPU the others get a fixed heuristic schedule (parallel, vectorized,
    register-blocked; see `_cpu_default_schedules`), on CUDA dlight's rule-based GPU
    schedules. aarch64 targets are linked by `aarch64-linux-gnu-gcc`.
    CUDA needs no GPU here: the library carries the kernels as CUDA source, which the GPU
    host compiles when it loads the library (nvcc checks them here when installed).
    """
    import tvm
    from tvm import relax

    target, tvm_target = _resolve_target(target)
    mod = _lower(_import(model), tvm_target)
    inputs, outputs = _interface(model, mod)
    tasks = _count_unscheduled(mod)
    with tvm_target, tvm.transform.PassContext(opt_level=3):
        if tuning_db is not None:
            database = _open_database(Path(tuning_db), target, must_exist=True)
            mod = _apply_database(mod, database)
        tuned = tasks - _count_unscheduled(mod)
        if "gpu" in tvm_target.keys:
            mod = _gpu_default_schedules(mod)
            default_scheduled = tasks - tuned - _count_unscheduled(mod)
        else:
            mod, default_scheduled = _cpu_default_schedules(mod, target)
        backend = _backend_pipeline(tvm_target)
        finish = tvm.transform.Sequential(
            backend.dataflow_lower_passes(tvm_target) + backend.finalize_passes(tvm_target)
        )
        executable = tvm.compile(mod, target=tvm_target, relax_pipeline=finish)
    if tvm_target.kind.name == "cuda":
        _check_cuda_kernels(executable, str(tvm_target.attrs["arch"]))
    _export(executable, target, Path(out_path))
    return TvmResult(
        inputs=inputs, outputs=outputs, tasks=tasks, tuned=tuned, target=target, default_scheduled=default_scheduled
    )


# --- import and lowering -------------------------------------------------------------


def _import(model: onnx.ModelProto) -> Any:
    """The Relax module of `model`, weights embedded as constants, inputs static."""
    from tvm.error import OpNotImplemented
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
        with warnings.catch_warnings():
            # the importer warns once per tensor name with a dot in it ("Renaming name ..."): noise
            warnings.filterwarnings("ignore", message="Renaming name")
            return from_onnx(model, shape_dict=shapes, dtype_dict=dtypes, keep_params_in_input=False)
    except OpNotImplemented as exc:
        # The importer checks every node before converting and names all unsupported ops
        # in this one error.
        raise UserError(
            "tvm.unsupported-op",
            f"tvm's onnx importer cannot convert this segment: {exc}",
            hint="place these ops on the onnxruntime backend",
        ) from exc


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


def _gpu_default_schedules(mod: Any) -> Any:
    """Give every unscheduled function of `mod` dlight's rule-based GPU schedule.

    A GPU kernel without thread bindings does not compile, so nothing may stay
    unscheduled. Rules are tried per function, most specific first: a rule whose pattern
    matches may still fail to schedule a fused function (dlight's Matmul asserts on a
    conv2d fused with a clip, as in MobileNetV2), and then the next rule gets it;
    `Fallback` schedules any function.
    """
    import tvm
    from tvm import tirx
    from tvm.s_tir import dlight as dl

    rules = [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
    for gvar, func in list(mod.functions_items()):
        if not isinstance(func, tirx.PrimFunc) or func.attrs.get("tirx.is_scheduled", False):
            continue
        for rule in rules:
            try:
                scheduled = dl.ApplyDefaultSchedule(rule)(tvm.IRModule({gvar: func}))[gvar]
            except Exception:  # noqa: BLE001 -- dlight asserts where a rule does not fit
                continue
            if scheduled.attrs.get("tirx.is_scheduled", False):
                mod[gvar] = scheduled
                break
    return mod


# MetaSchedule sizes parallel loops by the target's core count (16 jobs per core at most).
# A target without `num-cores` gets this fixed count, not the build host's, so that the
# same target builds the same library on any host.
_DEFAULT_NUM_CORES = 4
# The vector block of the innermost spatial loop and the register block of the output
# channels (floats): 4 x 8 accumulators fill 4 AVX2 or 8 NEON registers.
_VECTOR_BLOCK = 8
_REGISTER_BLOCK = 4
_UNROLL = 64


def _cpu_default_schedules(mod: Any, target: dict) -> tuple[Any, int]:
    """Give every unscheduled function of `mod` a fixed, untuned CPU schedule.

    The schedule is MetaSchedule's own design space for the function (its default LLVM
    rules: inlining, multi-level tiling of reductions, parallel/vectorize/unroll) with
    each sampled decision replaced by a fixed heuristic instead of a search: the outer
    spatial tiles run in parallel, the reduction loops sit outside a register block of
    `_REGISTER_BLOCK` x `_VECTOR_BLOCK` outputs (output channels x the last spatial axis
    for a convolution, rows x columns for a matrix product), and the innermost spatial
    tile is vectorized. Nothing is measured, so the same function and
    target always give the same schedule. A function the rules fail on stays unscheduled
    (TVM's default loop nest). Returns the module and how many functions got a schedule.
    """
    import tvm
    from tvm import tirx
    from tvm.s_tir import meta_schedule as ms

    tvm_target = tvm.target.Target({**target, "num-cores": target.get("num-cores", _DEFAULT_NUM_CORES)})

    todo = [
        (gvar, func)
        for gvar, func in mod.functions_items()
        if isinstance(func, tirx.PrimFunc) and not func.attrs.get("tirx.is_scheduled", False)
    ]
    if todo:
        _tensor_intrin_importer()()  # the default rules import it; this way costs ~4 s, not 20
    scheduled = 0
    for gvar, func in todo:
        try:
            new = _cpu_default_schedule(func, tvm_target)
        except Exception:  # noqa: BLE001 -- a rule that does not fit leaves the loop nest
            new = None
        if new is not None:
            mod[gvar] = new
            scheduled += 1
    return mod, scheduled


def _apply_database(mod: Any, database: Any, top_k: int = 8) -> Any:
    """Give each function with records the schedule of its fastest sound record.

    This is MetaSchedule's `MetaScheduleApplyDatabase`, plus a check: TVM 0.27's search can
    produce a schedule that leaves part of a block's iteration domain unrun (a convolution fused
    with the next layer's padding, computed per output tile, leaves the padding's border
    unwritten). It measures fast and computes garbage, so a record whose schedule does not run
    every instance of every block is passed over for the next best.
    """
    from tvm import s_tir, tirx
    from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

    for gvar, func in list(mod.functions_items()):
        if not isinstance(func, tirx.PrimFunc) or func.attrs.get("tirx.is_scheduled", False):
            continue
        workload = _normalize_mod(func)
        if not database.has_workload(workload):
            continue
        for record in database.get_top_k(database.commit_workload(workload), top_k):
            sch = s_tir.Schedule(workload)
            try:
                record.trace.apply_to_schedule(sch, remove_postproc=False)
            except Exception:  # noqa: BLE001 -- a trace that no longer replays
                continue
            if not _runs_every_instance(sch.copy()):
                continue
            new = sch.mod["main"]
            if "global_symbol" not in (func.attrs or {}):  # as MetaScheduleApplyDatabase keeps it
                new = new.without_attr("global_symbol")
            mod[gvar] = new.with_attr("tirx.is_scheduled", True)
            break
    return mod


def _cpu_default_postprocs() -> list:
    """Fresh postprocessors for one function: the tuning context initializes them."""
    from tvm.s_tir import meta_schedule as ms

    return [
        ms.postproc.DisallowDynamicLoop(),
        ms.postproc.RewriteParallelVectorizeUnroll(),
        ms.postproc.RewriteReductionBlock(),
    ]


def _cpu_default_schedule(func: Any, tvm_target: Any) -> Any:
    """`func` scheduled by `_cpu_default_schedules`' heuristic, or None."""
    sch = _cpu_default_sch(func, tvm_target, _cpu_default_postprocs)
    return None if sch is None else sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _cpu_default_sch(func: Any, tvm_target: Any, postprocs: Callable[[], list]) -> Any:
    """The schedule (with its trace, so it can be a tuning record) of `_cpu_default_schedule`, or None."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    context = ms.TuneContext(
        mod=tvm.IRModule({"main": func}),
        target=tvm_target,
        space_generator=ms.space_generator.PostOrderApply(postprocs=postprocs(), mutator_probs={}),
        rand_state=1,
    )
    spaces = context.generate_design_space()
    if not spaces:
        return None
    # MultiLevelTiling's variants: the epilogue a loop nest of its own (the first), or
    # computed per output tile while it is in cache (the others; innermost first, ~25%
    # faster on MobileNetV2). TVM 0.27 leaves the border of a padding epilogue (a conv2d
    # fused with the next layer's pad) unwritten in the latter, so a schedule that does
    # not run every block instance is refused for the next variant.
    fused = [s for s in spaces if any(i.kind.name == "ReverseComputeAt" for i in s.trace.insts)]
    for space in fused[:1] + spaces[:1]:
        sch = _replay(func, space.trace)
        if not _runs_every_instance(sch.copy()):  # a copy: its queries stay out of the trace
            continue
        # the marker MetaSchedule puts before postprocessing: a search that mutates this trace
        # (it is a tuning record too) replays the decisions and postprocesses afresh
        sch.enter_postproc()
        if all(p.apply(sch) for p in context.space_generator.postprocs):
            return sch
    return None


def _replay(func: Any, trace: Any) -> Any:
    """`func` scheduled by `trace` with `_cpu_default_schedules`' fixed decisions."""
    import tvm
    from tvm import s_tir

    roles = iter(_tile_roles(trace))

    def decide(inst: Any, inputs: list, attrs: list, decision: Any) -> Any:
        kind = inst.kind.name
        if kind == "SamplePerfectTile":
            return _tile(int(sch.get(inputs[0]).extent), int(attrs[0]), next(roles))
        if kind == "SampleCategorical":  # the unroll limit
            values = [int(v) for v in attrs[0]]
            return values.index(_UNROLL) if _UNROLL in values else decision
        if kind == "SampleComputeLocation":
            return -1  # at the root: computed once, never recomputed per tile
        return decision

    sch = s_tir.Schedule(tvm.IRModule({"main": func}), seed=1)
    trace.apply_to_schedule(sch, remove_postproc=True, decision_provider=decide)
    return sch


def _runs_every_instance(sch: Any) -> bool:
    """Whether the loops around each block of `sch` run at least its whole iteration domain."""
    root = sch.get_sblock("root", func_name="main")
    for block in sch.get_child_blocks(root):
        runs = math.prod(int(sch.get(loop).extent) for loop in sch.get_loops(block))
        domain = math.prod(int(v.dom.extent) for v in sch.get(block).iter_vars)
        if runs < domain:
            return False
    return True


def _tile_roles(trace: Any) -> list[str]:
    """The role of each SamplePerfectTile of `trace`, in order: "vector" (a tiled block's
    last spatial loop), "register" (the spatial loop blocked in registers), "spatial"
    (other spatial loops), "reduction" (a tiled block's reduction loops) or "other".

    MultiLevelTiling samples the tiles of one block back to back (each followed by its
    split), spatial loops (4 tiles on CPU) before reduction loops (2 tiles).
    """
    groups: list[list[int]] = []  # the tile counts of each block's loops
    previous = None
    for inst in trace.insts:
        kind = inst.kind.name
        if kind == "SamplePerfectTile":
            if previous != "Split" or not groups:
                groups.append([])
            groups[-1].append(int(inst.attrs[0]))
        previous = kind
    roles: list[str] = []
    for group in groups:
        spatial = [i for i, n in enumerate(group) if n == 4]
        # The register block's axis: the output channel of a 2-D convolution (NCHW: the
        # third from last of four or more), the row of a matrix product (the one before
        # the last). Blocking channels reuses each input vector for `_REGISTER_BLOCK`
        # outputs; blocking image rows reuses nothing (MobileNetV2 224: 2x slower).
        register = spatial[-3] if len(spatial) >= 4 else spatial[-2] if len(spatial) >= 2 else None
        for i, n in enumerate(group):
            if n != 4:
                roles.append("reduction" if spatial else "other")
            elif i == spatial[-1]:
                roles.append("vector")
            elif i == register:
                roles.append("register")
            else:
                roles.append("spatial")
    return roles


def _tile(extent: int, n: int, role: str) -> list[int]:
    """Tile sizes (outermost first, product `extent`) of a loop split in `n` by `role`."""

    def divisor(limit: int) -> int:
        return max(d for d in range(1, min(limit, extent) + 1) if extent % d == 0)

    if n == 4 and role == "vector":
        inner = divisor(_VECTOR_BLOCK)
        return [extent // inner, 1, 1, inner]
    if n == 4 and role == "register":
        inner = divisor(_REGISTER_BLOCK)
        return [extent // inner, 1, inner, 1]
    if n == 4:
        return [extent, 1, 1, 1]
    return [extent] + [1] * (n - 1)


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
        _spec(name, param.ty, str(i)) for i, (name, param) in enumerate(zip(input_names, main.params, strict=True))
    )
    ret = main.ret_ty  # TVM 0.27 calls struct_info `ty`
    fields = list(ret.fields) if isinstance(ret, tvm.ir.TupleType) else [ret]
    output_names = [v.name for v in model.graph.output]
    outputs = tuple(_spec(name, info, str(i)) for i, (name, info) in enumerate(zip(output_names, fields)))
    return inputs, outputs


def _spec(name: str, info: Any, key: str) -> TensorSpec:
    return TensorSpec(name=name, shape=tuple(int(d) for d in info.shape.values), dtype=str(info.dtype), key=key)


# --- targets and export --------------------------------------------------------------


# What `mcpu: native` means, when set: a CPU name LLVM knows (haswell, znver3) taken as this host's.
# On an AVX-512 host, EDGESDK_HOST_CPU=haswell builds what an AVX2-only host would, so that host's
# numerics can be checked here. Features the named CPU has and this host lacks stay off.
HOST_CPU_ENV = "EDGESDK_HOST_CPU"


def host_cpu() -> tuple[str, list[str]]:
    """This host's CPU as LLVM names it (or as EDGESDK_HOST_CPU forces it) and the `mattr` that
    makes the name's features this host's own.

    A CPU name implies a feature set, and a virtual machine may hide some of it: a KVM guest on
    Zen 5 reports `znver5`, whose movdiri, pku or wbnoinvd its hypervisor masks, and a Zen 4 name
    under a hypervisor that masks AVX-512 would give code that dies with SIGILL. The host's
    features (`_host_features`: what the guest may really execute) decide instead: `mattr` turns
    on what the host has beyond the name and off what the name has beyond the host; with a
    forced CPU it only turns off.
    """
    import tvm
    from tvm.target import codegen

    forced = os.environ.get(HOST_CPU_ENV, "").strip()
    triple = str(codegen.llvm_get_system_triple())
    if forced and not codegen.llvm_is_valid_cpu(forced, triple):
        raise UserError(
            "tvm.bad-host-cpu",
            f"{HOST_CPU_ENV}={forced} is not a cpu llvm knows for {triple}",
            hint=f"name one such as haswell or znver3, or unset {HOST_CPU_ENV}",
        )
    name = forced or str(codegen.llvm_get_system_cpu())
    host = _host_features()
    named = codegen.llvm_get_cpu_features(tvm.target.Target({"kind": "llvm", "mcpu": name})) & host.keys()
    has = {f for f, on in host.items() if on}
    wanted = has & named if forced else has
    flags = [f"+{f}" for f in wanted - named] + [f"-{f}" for f in named - wanted]
    return name, sorted(flags, key=lambda flag: flag[1:])


# Instruction-set extensions that compiled kernels use (vector, FMA, bit manipulation, crypto),
# by prefix of LLVM's feature names. A CPU name's system features (pku, movdiri, invpcid, ...)
# never appear in a kernel, and hypervisors often hide them: they do not make code unrunnable.
_KERNEL_ISA = ("sse", "ssse3", "avx", "fma", "f16c", "amx", "bmi", "lzcnt", "popcnt", "aes", "vaes", "pclmul",
               "vpclmulqdq", "gfni", "sha", "neon", "fp-armv8", "fullfp16", "dotprod", "i8mm", "bf16", "sve", "sme")


def missing_host_features(target: dict) -> list[str]:
    """The instruction-set extensions that code built for `target` may use and this host lacks:
    such code may die here with SIGILL. None for a foreign architecture, which this host does
    not run."""
    import tvm
    from tvm.target import codegen

    if target_arch(target) != _ARCHES.get(platform.machine().lower()):
        return []
    cpu = target.get("host", {"kind": "llvm"}) if target.get("kind") == "cuda" else target
    cpu, _ = _resolve_target(cpu)
    host = _host_features()
    used = codegen.llvm_get_cpu_features(tvm.target.Target(cpu))
    return sorted(f for f in used if f in host and not host[f] and f.startswith(_KERNEL_ISA))


# LLVM's name of an x86 feature -> Linux's flag in /proc/cpuinfo, for the features that kernels use
# and the system features that CPU names imply and hypervisors or kernels hide.
_CPUINFO_FLAG = {
    "sse3": "pni", "ssse3": "ssse3", "sse4.1": "sse4_1", "sse4.2": "sse4_2", "sse4a": "sse4a", "avx": "avx",
    "avx2": "avx2", "fma": "fma", "f16c": "f16c", "bmi": "bmi1", "bmi2": "bmi2", "lzcnt": "abm", "popcnt": "popcnt",
    "movbe": "movbe", "aes": "aes", "pclmul": "pclmulqdq", "vaes": "vaes", "vpclmulqdq": "vpclmulqdq", "gfni": "gfni",
    "sha": "sha_ni", "adx": "adx", "rdrnd": "rdrand", "rdseed": "rdseed", "avx512f": "avx512f",
    "avx512cd": "avx512cd", "avx512bw": "avx512bw", "avx512dq": "avx512dq", "avx512vl": "avx512vl",
    "avx512ifma": "avx512ifma", "avx512vbmi": "avx512vbmi", "avx512vbmi2": "avx512_vbmi2",
    "avx512vnni": "avx512_vnni", "avx512bitalg": "avx512_bitalg", "avx512vpopcntdq": "avx512_vpopcntdq",
    "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16", "avx512vp2intersect": "avx512_vp2intersect",
    "avxvnni": "avx_vnni", "amx-tile": "amx_tile", "amx-int8": "amx_int8", "amx-bf16": "amx_bf16",
    "movdiri": "movdiri", "movdir64b": "movdir64b", "wbnoinvd": "wbnoinvd", "pku": "pku", "mwaitx": "mwaitx",
    "rdpru": "rdpru", "clwb": "clwb", "clflushopt": "clflushopt", "invpcid": "invpcid", "fsgsbase": "fsgsbase",
}


def _host_features() -> dict[str, bool]:
    """LLVM's feature map of this host's CPU (every feature LLVM knows for it, on or off), less
    what the kernel turned off.

    LLVM reads CPUID and XGETBV; Linux clears the flags it does not let programs rely on (a
    `clearcpuid=` boot option, an erratum: this Zen 5 build host's kernel hides the RDSEED that
    CPUID reports), and /proc/cpuinfo has the last word on x86 Linux.
    """
    import tvm

    features = {str(k): bool(v) for k, v in tvm.get_global_func("tvm.codegen.llvm.GetHostCPUFeatures")().items()}
    flags = cpuinfo_flags()
    if flags:
        for feature, flag in _CPUINFO_FLAG.items():
            if features.get(feature) and flag not in flags:
                features[feature] = False
    return features


def cpuinfo_flags() -> set[str]:
    """The CPU flags of /proc/cpuinfo on x86 Linux, or an empty set (elsewhere; aarch64 lists
    `Features`, which LLVM's host map is read from there)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def _resolve_target(target: dict) -> tuple[dict, Any]:
    """The target dict with `mcpu: native` replaced by this host's CPU and features (`host_cpu`),
    and its tvm Target.

    LLVM refuses `-mcpu=native` with the triple TVM's LLVM was built for, so "native" is
    resolved here; the resolved name and `mattr` are what the build records. An `mattr` the
    target gives comes after the host's: an explicit setting wins.
    """
    import tvm

    def resolve(t: dict) -> dict:
        t = dict(t)
        if t.get("kind") == "llvm" and t.get("mcpu") == "native":
            t["mcpu"], flags = host_cpu()
            if flags or t.get("mattr"):
                t["mattr"] = [*flags, *t.get("mattr", [])]
        if isinstance(t.get("host"), dict):
            t["host"] = resolve(t["host"])
        return t

    target_arch(target)  # validates kind and architecture
    target = resolve(target)
    if target.get("kind") == "cuda":
        target.setdefault("host", {"kind": "llvm"})
        # The static shared memory a block may use: 48 KiB on every CUDA architecture.
        # dlight reads it from the target and warns once per function when it is absent.
        target.setdefault("max_shared_memory_per_block", 49152)
    try:
        return target, tvm.target.Target(target)
    except Exception as exc:
        raise UserError("tvm.bad-target", f"tvm does not accept target {target!r}: {exc}",
                        hint="see the tvm target dicts in targets/*.yaml") from exc


def _check_cuda_kernels(executable: Any, arch: str) -> None:
    """Compile the library's CUDA kernels with nvcc for `arch`, to fail at build time.

    Without a CUDA driver, TVM 0.27 keeps the kernels as CUDA source in the library
    (its "fallback" CUDA module); the GPU host compiles them when it loads the library
    (TVM's `tvm_callback_cuda_compile`: NVRTC via cuda-bindings, or nvcc). Compiling
    them here once catches codegen errors before the bundle ships; the result is not
    kept. Skipped when nvcc is not installed.
    """
    import subprocess

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return
    sources = [m.inspect_source("cuda") for m in _module_tree(executable.mod) if m.kind == "cuda"]
    sm = arch.removeprefix("sm_")
    with tempfile.TemporaryDirectory() as tmp:
        for i, source in enumerate(sources):
            cu = Path(tmp) / f"kernels{i}.cu"
            cu.write_text(source)
            command = [nvcc, "--cubin", "-O3", f"-arch=sm_{sm}", "-o", str(cu.with_suffix(".cubin")), str(cu)]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"nvcc rejects TVM's CUDA kernels for sm_{sm}:\n{done.stderr[-2000:]}")


def _module_tree(module: Any):
    yield module
    for imported in module.imports:
        yield from _module_tree(imported)


def _cross_compiler(target: dict) -> str | None:
    """The gcc that links a library for `target` when its CPU is not this host's; None when it is."""
    arch = target_arch(target)
    if arch == _ARCHES.get(platform.machine().lower()):
        return None
    compiler = f"{arch}-linux-gnu-gcc"
    if shutil.which(compiler) is None:
        raise UserError(
            "tvm.no-cross-compiler",
            f"linking for {arch} needs {compiler}, which is not on PATH",
            hint=f"install it: apt-get install gcc-{arch}-linux-gnu",
        )
    return compiler


def _export(executable: Any, target: dict, out_path: Path) -> None:
    """Link `executable` into `out_path` atomically, cross-linking for a foreign CPU."""
    from tvm.support import cc

    compiler = _cross_compiler(target)
    options: dict[str, Any] = {"fcompile": cc.cross_compiler(compiler)} if compiler else {}
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


def _open_database(path: Path, target: dict, *, must_exist: bool) -> Any:
    """The JSON tuning database in directory `path`, which belongs to one target.

    MetaSchedule looks records up by workload alone, not by target, so a database shared
    by two targets would hand one CPU's schedules to another. `target.json` in the
    directory names the target the records were measured for; another target is refused.
    A database that is named but absent is refused too when it must exist (a wrong path
    would otherwise build an untuned library without a word).
    """
    import json

    from tvm.s_tir import meta_schedule as ms

    owner = path / "target.json"
    if must_exist and not (path / "database_workload.json").exists():
        raise UserError(
            "tvm.no-tuning-db",
            f"tuning database {path} does not exist",
            hint="run the tune stage first, or build without a tuning database",
        )
    canonical = json.loads(json.dumps(target))
    if owner.exists() and json.loads(owner.read_text()) != canonical:
        raise UserError(
            "tvm.tuning-db-target",
            f"tuning database {path} holds records for target {owner.read_text().strip()}, "
            f"not {json.dumps(target, sort_keys=True)}",
            hint="use one tuning database directory per target",
        )
    path.mkdir(parents=True, exist_ok=True)
    if not owner.exists() and not must_exist:  # the tuning run that creates the records
        owner.write_text(json.dumps(target, sort_keys=True) + "\n")
    return ms.database.JSONDatabase(work_dir=str(path), allow_missing=True)


def _tensor_intrin_importer() -> Callable[[], None]:
    """A function that imports `tvm.s_tir.tensor_intrin` in ~4 s instead of 20-50 s.

    MetaSchedule needs the module (TuneContext and every build worker import it). It
    parses ~250 TVMScript functions, and each parse calls `inspect.stack()`, which looks
    up the module of every frame on the stack. The import machinery's frames
    (`<frozen importlib._bootstrap>`) have no file, so `inspect` never caches their module
    and scans all of `sys.modules` for each one: frames x modules per function, worse the
    more a process has imported. Recording in inspect's own cache which module those
    frames come from removes the scans. The function is built here, nested, so that
    cloudpickle ships it to MetaSchedule's worker processes by value.
    """

    def import_tensor_intrin() -> None:
        import importlib
        import inspect
        import os

        for name in ("importlib._bootstrap", "importlib._bootstrap_external"):
            # the key inspect.getmodule computes for such a frame (relative to the cwd)
            inspect.modulesbyfile.setdefault(os.path.normcase(os.path.abspath(f"<frozen {name}>")), name)
        importlib.import_module("tvm.s_tir.tensor_intrin")

    return import_tensor_intrin


# The tuning half of this backend, re-exported (it uses the lowering above, so it comes last).
from .tuning import Boards, Progress, check_boards, repair_database, tune_onnx  # noqa: E402

__all__ = ["HOST_CPU_ENV", "Boards", "Progress", "TvmResult", "check_boards", "compile_onnx", "host_cpu",
           "importer_ops", "missing_host_features", "repair_database", "target_arch", "tune_onnx"]
