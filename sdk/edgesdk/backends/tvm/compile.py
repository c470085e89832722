"""Compilation: an ONNX segment imported into Relax, lowered to fused TIR functions, scheduled
(tuning records first, then the default schedules) and built into a shared library.

`_lowered` (`_import`, then `_lower`) serves tuning too (tuning.py): MetaSchedule finds records
by the structural hash of each fused TIR function, so the functions tuning measures must be
those compilation looks up.

x86-64 CPU targets compute convolutions channels-last (`_channels_last_convs`): the ONNX segment's
zero Pads are folded into the convolutions after them, and ConvertLayout turns every conv2d into
NHWC activations and HWIO weights (the weight transposes are constants, folded at compile time, so
no weight is transformed at run time). Channels-last makes the output channels the innermost axis:
the default schedule vectorizes them, one weight vector serving a row of output pixels
(`_tile_roles`). Weights are not stored in a schedule's own blocked order (TVM's layout-free
buffers and RewriteLayout): that computed wrong results on PP-OCRv4 det (`_lower`).

The weights (every constant of 1 KiB or more, as the passes left them: folded, transposed) leave the
module before it is built (`_weights_as_parameters`): `main` takes them after its inputs, and they are
written to a file beside the library (`tvm_runner.save_weights`), which the runner maps. Linked into
the library, they were serialized and copied into LLVM's module on export (3.7x the weights above the
compile's own peak, measured on a 768 MiB MLP), copied again when the library loads, and past 2 GiB an
aarch64 library did not link.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from ...errors import UserError
from ...ir import model as irm
from ...runtime.backends.tvm_runner import save_weights, weights_path
from ...runtime.manifest import TensorSpec
from . import fast_math, sparse
from .database import _apply_database, _open_database
from .rewrites import integer_powers_as_products, narrow_rows_widened
from .schedules import _PIXEL_BLOCK, _cpu_default_schedules, _gpu_default_schedules
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
    sparse_kernels: int = 0  # pruned convolutions computed by sparse kernels (sparse.py)
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
    sparse.py where it is measured faster than the dense one on this host (times read from `kernel_times`,
    and new ones added to it with `keep_kernel_times`), or by policy where this host cannot run the
    target's code (`TvmResult.sparse_choices`).
    """
    import tvm
    from tvm import relax

    target, tvm_target = _resolve_target(target)
    rewritten, rewrites = _rewritten(model, tvm_target)
    choices: list[list[dict]] = []
    runs_here = tvm_target.kind.name == "llvm" and target_arch(target) == target_arch({"kind": "llvm"}) \
        and not missing_host_features(target)
    choose = sparse.Measured(target, kernel_times, tuning_db, keep=keep_kernel_times) if runs_here else sparse.by_policy
    choose = sparse.forced(_forced_kernels(model), choose)
    mod = _lower(_import(rewritten), tvm_target, choose, choices)
    inputs, outputs = _interface(model, mod)
    tasks = _count_unscheduled(mod)
    sparse_kernels = sum(1 for gvar in mod.functions if gvar.name_hint.startswith("sparse_conv2d"))
    with tvm_target, tvm.transform.PassContext(opt_level=3):
        if tuning_db is not None:
            database = _open_database(Path(tuning_db), target, must_exist=True)
            mod = _apply_database(mod, database)
        tuned = tasks - _count_unscheduled(mod)
        mod = sparse.schedule_rest(mod)  # the sparse kernels without a record: their default schedule
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


def _lowered(model: onnx.ModelProto, tvm_target: Any) -> Any:
    """`model` rewritten, imported and lowered for `tvm_target`, as compilation and tuning both see it."""
    return _lower(_import(_rewritten(model, tvm_target)[0]), tvm_target)


def _rewritten(model: onnx.ModelProto, tvm_target: Any) -> tuple[onnx.ModelProto, dict[str, int]]:
    """`model` as TVM compiles it for `tvm_target`, and how many of each rewrite it took (`rewrites.py`):
    on x86 a Pad folded into the Conv after it and prime-width rows computed wider; on CUDA integer
    powers as products."""
    done: dict[str, int] = {}
    if _channels_last_convs(tvm_target):
        model, done["prime-width rows widened"] = narrow_rows_widened(_fold_pads_into_convs(model), _PIXEL_BLOCK)
    if tvm_target.kind.name == "cuda":
        model, done["integer Pow as products (NVRTC's fast math: powf is NaN below 0)"] = \
            integer_powers_as_products(model)
    return model, {k: n for k, n in done.items() if n}


def _channels_last_convs(tvm_target: Any) -> bool:
    """Whether `tvm_target` computes convolutions channels-last (HWIO weights folded at compile time): x86-64.

    Measured there only (the module docstring); aarch64 and CUDA keep NCHW as imported.
    """
    import platform

    if tvm_target.kind.name != "llvm":
        return False
    triple = str(tvm_target.attrs.get("mtriple", "") or "")
    arch = triple.split("-")[0] if triple else platform.machine().lower()
    return arch in ("x86_64", "amd64")


def _fold_pads_into_convs(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with each zero Pad of a Conv's input folded into the Conv's own padding
    (onnxscript's rule). Relax imports a Pad as an opaque TIR function, which ConvertLayout
    cannot move into NHWC; a Conv's padding it can."""
    import onnx_ir as ir
    from onnx_ir.passes.common import ShapeInferencePass
    from onnxscript import rewriter
    from onnxscript.rewriter.rules.common import fuse_pad_into_conv_rule

    if not any(node.op_type == "Pad" for node in model.graph.node):
        return model
    graph = ir.serde.deserialize_model(model)
    # the rule needs the Pad input's rank; onnx_ir's inference leaves the weights out of what it serializes
    ShapeInferencePass(strict_mode=False, data_prop=False)(graph)
    return ir.serde.serialize_model(rewriter.rewrite(graph, pattern_rewrite_rules=[fuse_pad_into_conv_rule]))


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
        with warnings.catch_warnings(), _importer_reads_weights_in_place():
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


@contextlib.contextmanager
def _importer_reads_weights_in_place():
    """TVM's importer runs onnx.checker on the whole model first (and only warns on what it finds):
    that serializes every weight once more, and fails past protobuf's 2 GB. While it imports, the
    checker sees the model without its weights (`irm.weightless`), which import checked one by one;
    and it reads a mapped weight (`irm.is_mapped`) from its file by `irm.array`, where onnx's own
    `to_array` would refuse its absolute location."""
    check_model, to_array = onnx.checker.check_model, onnx.numpy_helper.to_array
    onnx.checker.check_model = lambda model, *args, **kwargs: check_model(irm.weightless(model)[0], *args, **kwargs)
    onnx.numpy_helper.to_array = lambda t, *args, **kwargs: (irm.array(t) if irm.is_mapped(t)
                                                             else to_array(t, *args, **kwargs))
    try:
        yield
    finally:
        onnx.checker.check_model, onnx.numpy_helper.to_array = check_model, to_array


def _dims_text(tensor_type: onnx.TypeProto.Tensor) -> str:
    if not tensor_type.HasField("shape"):
        return "(unknown rank)"
    dims = [str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?") for d in tensor_type.shape.dim]
    return "[" + ",".join(dims) + "]"


def _lower(mod: Any, tvm_target: Any, choose: Any = None, choices: list | None = None) -> Any:
    """Legalize and fuse `mod` into TIR functions, none of them scheduled yet.

    The same function feeds task extraction and compilation, so the fused functions, and
    with them the tuning database's workload keys, are identical in both.
    """
    import tvm
    from tvm import relax

    channels_last = _channels_last_convs(tvm_target)
    head = [
        # Inference form: batch norm becomes multiply-add that FoldConstant folds into
        # the weights.
        relax.transform.DecomposeOpsForInference(),
        relax.transform.CanonicalizeBindings(),
        # pruned convolutions (a constant weight mostly zeros) on the CPU: sparse kernels (sparse.py),
        # before ConvertLayout makes the dense ones channels-last
        *([_sparse_pass(channels_last, choose, choices)] if tvm_target.kind.name == "llvm" else []),
    ]
    layout = [
        # Clip as Relax ops, which ConvertLayout moves along with the convolutions
        _ClipAsRelaxOps(),
        # NHWC activations, HWIO weights: the weights' transposes fold below
        # (a transposed convolution stays NCHW: TVM legalizes it in NCHW only)
        relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "HWIO"],
                                       "relax.nn.conv2d_transpose": ["NCHW", "IOHW"]}),
        # a channels-last model's NHWC -> NCHW input transpose meets ConvertLayout's way back
        _CancelTransposePairs(),
    ]
    with tvm_target, tvm.transform.PassContext(opt_level=3):
        try:
            mod = tvm.transform.Sequential(head + (layout if channels_last else []))(mod)
        except (tvm.error.InternalError, tvm.error.DiagnosticError, RuntimeError):
            if not channels_last:
                raise
            # TVM 0.27's ConvertLayout fails on some graphs without a 2-D convolution (silero-vad's
            # STFT: a reflect Pad, a 1-D convolution, strided slices: std::bad_alloc): kept NCHW
            mod = tvm.transform.Sequential(head)(mod)
    passes = [
        *_backend_pipeline(tvm_target).library_dispatch_passes(tvm_target),
        # on a CPU, exp, sigmoid, tanh, erf and what is built on them as vectorizable polynomials
        relax.transform.LegalizeOps(fast_math.legalize_map() if tvm_target.kind.name == "llvm" else None),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        # Not AttachAttrLayoutFreeBuffers: with it, a schedule stores the weights as its loops read
        # them (RewriteLayout) and SplitLayoutRewritePreproc + FoldConstant fold that into the
        # constants; on PP-OCRv4 det that computed wrong results (3.9x the output's scale from a
        # depthwise block on; the last function returned another tensor), and MobileNetV2-class
        # graphs did not show it. The weights stay HWIO constants, transposed at compile time.
    ]
    with tvm_target, tvm.transform.PassContext(opt_level=3):
        return tvm.transform.Sequential(passes)(mod)


# a pruned layer's node may carry the kernel `edgesdk build --sparse-kernels` forces (compression/build.py)
KERNEL_META = "edgesdk.kernel"


def _forced_kernels(model: onnx.ModelProto) -> dict[str, str]:
    """The kernel forced on each Conv node marked KERNEL_META, by its weight's digest (sparse.weight_digest)."""
    weights = {t.name: t for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        kernel = next((p.value for p in node.metadata_props if p.key == KERNEL_META), None)
        if kernel is not None and node.op_type == "Conv" and len(node.input) > 1 and node.input[1] in weights:
            out[sparse.weight_digest(irm.array(weights[node.input[1]]))] = kernel
    return out


def _sparse_pass(channels_last: bool, choose: Any, choices: list | None) -> Any:
    """sparse.SparseConvs with `choose` (by policy when None), its choices appended to `choices`."""
    import tvm

    # Clip as Relax ops first, where the module has a sparse convolution: its ConvertLayout to CHWN moves them too
    inner = sparse.SparseConvs(channels_last, choose or sparse.by_policy, prepare=_ClipAsRelaxOps())

    @tvm.transform.module_pass(opt_level=0, name="SparseConvsRecorded")
    def transform(mod: Any, ctx: Any) -> Any:
        out = inner(mod)
        if choices is not None:
            choices.extend(inner.choices)
        return out

    return transform


def _ClipAsRelaxOps() -> Any:  # noqa: N802 -- a pass, named as TVM's are
    """Turn the ONNX importer's Clip (`call_tir` of TOPI's `maximum`, then `minimum`, against a
    scalar bound) into `R.maximum` / `R.minimum`: ConvertLayout cannot look into a `call_tir`,
    and leaves a transpose pair around each one it meets."""
    import tvm
    from tvm import relax

    call_tir = tvm.ir.Op.get("relax.call_tir")
    ops = {"maximum": relax.op.maximum, "minimum": relax.op.minimum}

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if call.op != call_tir or not isinstance(call.args[0], tvm.ir.GlobalVar):
                return call
            name = call.args[0].name_hint.rstrip("0123456789")  # "maximum", "maximum1", ...
            args = list(call.args[1].fields) if isinstance(call.args[1], relax.Tuple) else []
            if name not in ops or len(args) != 2 or getattr(args[1].ty, "ndim", -1) != 0:
                return call
            return ops[name](args[0], args[1])

    @tvm.transform.module_pass(opt_level=0, name="ClipAsRelaxOps")
    def transform(mod: Any, _ctx: Any) -> Any:
        rewriter = Rewriter(mod)
        for gvar, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                mod[gvar] = rewriter.visit_expr(func)
        return relax.transform.DeadCodeElimination()(mod)  # the TOPI functions left uncalled

    return transform


def _CancelTransposePairs() -> Any:  # noqa: N802 -- a pass, named as TVM's are
    """Replace `permute_dims(permute_dims(x, a), b)` by `x` where `b` undoes `a`."""
    import tvm
    from tvm import relax
    from tvm.relax.dpl import is_op, rewrite_call, wildcard

    x = wildcard()
    inner = is_op("relax.permute_dims")(x)
    outer = is_op("relax.permute_dims")(inner)

    def axes(call: Any) -> list[int]:
        rank = call.args[0].ty.ndim
        return list(range(rank))[::-1] if call.attrs.axes is None else [int(a) for a in call.attrs.axes]

    def cancel(call: Any, matches: Any) -> Any:
        a, b = axes(matches[inner]), axes(call)
        return matches[x] if [a[k] for k in b] == list(range(len(b))) else call

    @tvm.transform.module_pass(opt_level=0, name="CancelTransposePairs")
    def transform(mod: Any, _ctx: Any) -> Any:
        for gvar, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                mod[gvar] = rewrite_call(outer, cancel, func)
        return relax.transform.DeadCodeElimination()(mod)

    return transform


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
