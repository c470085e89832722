"""Compilation: an ONNX segment lowered to fused TIR functions (lowering.py), scheduled (tuning records
first, then the default schedules) and built into a shared library.

The weights (every constant of 1 KiB or more, as the passes left them: folded, transposed) leave the
module before it is built (`_weights_as_parameters`): `main` takes them after its inputs, and they are
written to a file beside the library (`tvm_runner.save_weights`), which the runner maps. Linked into
the library, they were serialized and copied into LLVM's module on export (3.7x the weights above the
compile's own peak, measured on a 768 MiB MLP), copied again when the library loads, and past 2 GiB an
aarch64 library did not link.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from ...ir import model as irm
from ...runtime.backends.tvm_runner import save_weights, weights_path
from ...runtime.manifest import TensorSpec
from .database import _apply_database, _open_database
from .lowering import _backend_pipeline, _import, _lower, _rewritten
from .schedules import _cpu_default_schedules, _gpu_default_schedules
from .sparse_choice import by_policy, forced, weight_digest
from .sparse_measured import Measured
from .sparse_schedules import schedule_rest
from .targets import _export, _resolve_target, missing_host_features, target_arch


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
    rewrites: dict[str, int] = field(default_factory=dict)  # `_rewritten`'s rewrites of the graph, by kind
    sparse_kernels: int = 0  # pruned convolutions computed by sparse kernels (sparse_pass.py)
    sparse_choices: tuple[dict, ...] = ()  # each pruned convolution's kernel: sparse or dense, timed or by policy
    weights: int = 0  # tensors `main` takes after its inputs, from the weights file beside the library
    weight_bytes: int = 0  # that file's size (0: no file)


def importer_ops() -> frozenset[str]:
    """The ONNX op types (default domain) that TVM's Relax ONNX importer converts.

    An op in this set may still be refused for an attribute the converter lacks; one
    outside it is refused for certain (the importer names all of them in one error).
    """
    from tvm.relax.frontend.onnx import onnx_frontend

    # `If` and `Constant` are converted by the graph walker itself, not through the map.
    return frozenset(onnx_frontend._get_convert_map()) | {"If", "Constant"}


def compile_onnx(
    model: onnx.ModelProto, target: dict, out_path: Path, *, tuning_db: Path | None = None,
    kernel_times: Path | None = None, keep_kernel_times: bool = False,
) -> TvmResult:
    """Compile an ONNX segment for `target` into the shared library `out_path`.

    Needs: static input shapes, an opset the Relax importer reads (>= 11), ops it supports.
    Guarantees: `out_path` is written atomically (a complete library or no file), and so is its
    weights file (`tvm_runner.weights_path`: written where the segment has a constant of
    WEIGHT_MIN_BYTES or more, else absent); the library's VM function `main` takes the inputs in
    `TvmResult.inputs` order, then the file's `TvmResult.weights` tensors, and returns one tensor
    (one output) or a tuple (several), in `TvmResult.outputs` order. Functions
    with a record in `tuning_db` (a database tuned for this same target) use the tuned
    schedule; on CPU the others get a fixed heuristic schedule (parallel, vectorized,
    register-blocked; see `_cpu_default_schedules`), on CUDA dlight's rule-based GPU
    schedules. aarch64 targets are linked by `aarch64-linux-gnu-gcc`.
    CUDA needs no GPU here: the library carries the kernels as CUDA source, which the GPU
    host compiles when it loads the library (nvcc checks them here when installed).
    A CPU convolution whose constant weight is mostly zeros (a pruned model) gets the sparse kernel of
    sparse_kernels.py where it is measured faster than the dense one on this host (times read from `kernel_times`,
    and new ones added to it with `keep_kernel_times`), or by policy where this host cannot run the
    target's code (`TvmResult.sparse_choices`).
    """
    import tvm

    target, tvm_target = _resolve_target(target)
    rewritten, rewrites = _rewritten(model, tvm_target)
    choices: list[list[dict]] = []
    runs_here = tvm_target.kind.name == "llvm" and target_arch(target) == target_arch({"kind": "llvm"}) \
        and not missing_host_features(target)
    choose = Measured(target, kernel_times, tuning_db, keep=keep_kernel_times) if runs_here else by_policy
    choose = forced(_forced_kernels(model), choose)
    mod = _lower(_import(rewritten), tvm_target, choose, choices)
    inputs, outputs = _interface(model, mod)
    tasks = _count_unscheduled(mod)
    sparse_kernels = sum(1 for gvar in mod.functions if gvar.name_hint.startswith("sparse_conv2d"))
    with tvm_target, tvm.transform.PassContext(opt_level=3):
        if tuning_db is not None:
            database = _open_database(Path(tuning_db), target, must_exist=True)
            mod = _apply_database(mod, database)
        tuned = tasks - _count_unscheduled(mod)
        mod = schedule_rest(mod)  # the sparse kernels without a record: their default schedule
        sparse_defaults = tasks - tuned - _count_unscheduled(mod)
        if "gpu" in tvm_target.keys:
            mod = _gpu_default_schedules(mod)
            default_scheduled = tasks - tuned - _count_unscheduled(mod)
        else:
            mod, default_scheduled = _cpu_default_schedules(mod, target)
            default_scheduled += sparse_defaults
        mod, weights = _weights_as_parameters(mod)
        count, weights_file = len(weights), weights_path(Path(out_path))
        weight_bytes = save_weights(weights_file, weights) if weights else 0
        del weights  # the file holds them now; the build below never reads them
        if not count:
            weights_file.unlink(missing_ok=True)  # a previous build's
        try:
            backend = _backend_pipeline(tvm_target)
            finish = tvm.transform.Sequential(
                backend.dataflow_lower_passes(tvm_target) + backend.finalize_passes(tvm_target)
            )
            executable = tvm.compile(mod, target=tvm_target, relax_pipeline=finish)
            if tvm_target.kind.name == "cuda":
                _check_cuda_kernels(executable, str(tvm_target.attrs["arch"]))
            _export(executable, target, Path(out_path))
        except BaseException:
            weights_file.unlink(missing_ok=True)
            raise
    return TvmResult(
        inputs=inputs, outputs=outputs, tasks=tasks, tuned=tuned, target=target, default_scheduled=default_scheduled,
        rewrites=rewrites, sparse_kernels=sparse_kernels, sparse_choices=tuple(choices[0] if choices else ()),
        weights=count, weight_bytes=weight_bytes,
    )


# A constant this large or larger leaves the library for its weights file; smaller ones (scalars, short
# vectors) stay constants of the library, where they cost nothing worth a file's entry.
WEIGHT_MIN_BYTES = 1024


def _weights_as_parameters(mod: Any) -> tuple[Any, list]:
    """`mod` with each constant of `main` of WEIGHT_MIN_BYTES or more made a parameter of `main`, after its
    own, and those constants' values in parameter order (one parameter per distinct constant)."""
    from tvm import relax

    lifted: list = []  # (constant, its parameter)

    @relax.expr_functor.mutator
    class Lift(relax.PyExprMutator):
        def visit_generic_const_(self, const):
            value = const.value
            if int(np.prod(value.shape, dtype=np.int64)) * np.dtype(str(value.dtype)).itemsize < WEIGHT_MIN_BYTES:
                return const
            for seen, param in lifted:
                if seen.same_as(const):
                    return param
            param = relax.Var(f"weight{len(lifted)}", const.ty)
            lifted.append((const, param))
            return param

    main = mod["main"]
    body = Lift(mod).visit_expr(main.body)
    if not lifted:
        return mod, []
    mod["main"] = relax.Function([*main.params, *(p for _, p in lifted)], body, main.ret_ty, main.is_pure,
                                 main.attrs, main.span)
    values = [c.value for c, _ in lifted]
    lifted.clear()  # `Lift`, a class, lives in a reference cycle until the collector runs: not the weights with it
    return mod, values


# a pruned layer's node may carry the kernel `edgesdk build --sparse-kernels` forces (compression/build.py)
KERNEL_META = "edgesdk.kernel"


def _forced_kernels(model: onnx.ModelProto) -> dict[str, str]:
    """The kernel forced on each Conv node marked KERNEL_META, by its weight's digest (`weight_digest`)."""
    weights = {t.name: t for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        kernel = next((p.value for p in node.metadata_props if p.key == KERNEL_META), None)
        if kernel is not None and node.op_type == "Conv" and len(node.input) > 1 and node.input[1] in weights:
            out[weight_digest(irm.array(weights[node.input[1]]))] = kernel
    return out


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


def _check_cuda_kernels(executable: Any, arch: str) -> None:
    """Compile the library's CUDA kernels with nvcc for `arch`, to fail at build time.

    Without a CUDA driver, TVM 0.27 keeps the kernels as CUDA source in the library
    (its "fallback" CUDA module); the GPU host compiles them when it loads the library
    (TVM's `tvm_callback_cuda_compile`: NVRTC via cuda-bindings, or nvcc). Compiling
    them here once catches codegen errors before the bundle ships; the result is not
    kept. Skipped when nvcc is not installed.
    """
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
                # nvcc's errors, each with the lines after it, not its warnings (thousands, of unused variables)
                lines = done.stderr.splitlines()
                errors = ["\n".join(lines[k:k + 3]) for k, line in enumerate(lines) if re.search(r"\berror\b", line)]
                raise RuntimeError(f"nvcc rejects TVM's CUDA kernels for sm_{sm}:\n"
                                   + ("\n".join(errors[:5]) or done.stderr[-2000:]))


def _module_tree(module: Any):
    yield module
    for imported in module.imports:
        yield from _module_tree(imported)
