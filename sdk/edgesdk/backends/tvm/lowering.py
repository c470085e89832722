"""Lowering: an ONNX segment rewritten for its target (rewrites.py), imported into Relax and lowered to fused
TIR functions, none of them scheduled yet (`_lowered`: `_rewritten`, `_import`, then `_lower`).

Compilation (compile.py) and tuning (tuning.py) both start here: MetaSchedule finds records by the
structural hash of each fused TIR function, so the functions tuning measures must be those compilation
looks up.

x86-64 CPU targets compute convolutions channels-last (`_channels_last_convs`): the ONNX segment's
zero Pads are folded into the convolutions after them, and ConvertLayout turns every conv2d into
NHWC activations and HWIO weights (the weight transposes are constants, folded at compile time, so
no weight is transformed at run time). Channels-last makes the output channels the innermost axis:
the default schedule vectorizes them, one weight vector serving a row of output pixels
(schedules.py's `_tile_roles`). Weights are not stored in a schedule's own blocked order (TVM's
layout-free buffers and RewriteLayout): that computed wrong results on PP-OCRv4 det (`_lower`).

On CPU targets a pruned convolution (a constant weight mostly zeros) gets a sparse kernel first
(sparse_pass.py), its kernel chosen by the `choose` the caller passes (sparse_choice.py's `by_policy`
by default).
"""

from __future__ import annotations

import contextlib
import platform
import re
import warnings
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from ...errors import UserError
from ...ir import model as irm
from . import fast_math
from .rewrites import integer_powers_as_products, narrow_rows_widened
from .schedules import _PIXEL_BLOCK
from .sparse_choice import Choice, by_policy


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
    if tvm_target.kind.name != "llvm":
        return False
    triple = str(tvm_target.attrs.get("mtriple", "") or "")
    arch = triple.split("-")[0] if triple else platform.machine().lower()
    return arch in ("x86_64", "amd64")


def _fold_pads_into_convs(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with each zero Pad of a Conv's input folded into the Conv's own padding
    (onnxscript's rule). Relax imports a Pad as an opaque TIR function, which ConvertLayout
    cannot move into NHWC; a Conv's padding it can."""
    # onnxscript takes half a second to import: not when the CLI imports this backend
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
        with warnings.catch_warnings(), _importer_reads_weights_in_place(), _c_names(model):
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
def _c_names(model: onnx.ModelProto):
    """While TVM imports `model`, its nodes and tensors are named as C identifiers: the importer renames a name
    with a dot, but not one with a slash, and a segment input's name becomes a CUDA kernel's parameter as it is
    (`.../convolution_dequant_ptr`: nvcc refused an int8 TFLite model's kernels). The names are given back
    afterwards (the segment's interface is read from them, by position)."""
    graph = model.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute):
        yield  # a subgraph reads outer names: they stay as they are
        return
    names = {n for node in graph.node for n in (*node.input, *node.output) if n} | {t.name for t in graph.initializer} \
        | {v.name for v in (*graph.input, *graph.output)}
    taken = set(names)
    renamed: dict[str, str] = {}
    for name in sorted(names):
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            continue
        new = base = re.sub(r"[^A-Za-z0-9_]", "_", name if name[:1].isalpha() else f"t_{name}")
        k = 1
        while new in taken:
            new, k = f"{base}_{k}", k + 1
        taken.add(new)
        renamed[name] = new

    def rename(mapping: dict[str, str]) -> None:
        for node in graph.node:
            node.input[:] = [mapping.get(n, n) for n in node.input]
            node.output[:] = [mapping.get(n, n) for n in node.output]
        for t in graph.initializer:
            t.name = mapping.get(t.name, t.name)
        for v in (*graph.value_info, *graph.input, *graph.output):
            v.name = mapping.get(v.name, v.name)

    rename(renamed)
    node_names = [node.name for node in graph.node]
    for node in graph.node:  # the importer names values it makes after their node
        node.name = re.sub(r"[^A-Za-z0-9_]", "_", node.name) if node.name else node.name
    try:
        yield
    finally:
        rename({new: old for old, new in renamed.items()})
        for node, name in zip(graph.node, node_names):
            node.name = name


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


def _lower(mod: Any, tvm_target: Any, choose: Choice | None = None, choices: list | None = None) -> Any:
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
        # pruned convolutions (a constant weight mostly zeros) on the CPU: sparse kernels (sparse_pass.py),
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
        # what FoldConstant would fold, in numpy where numpy computes it exactly: FoldConstant compiles each
        # operation it folds with LLVM, a third of a small model's compile time
        _MoveConstantsInNumpy(),
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


def _sparse_pass(channels_last: bool, choose: Choice | None, choices: list | None) -> Any:
    """sparse_pass.SparseConvs with `choose` (by policy when None), each run's choices appended to `choices`."""
    # imported here, not at the top: sparse_pass.py defines TVM classes, so importing it imports TVM, which
    # importing this backend must not (the CLI imports the backend registry)
    from .sparse_pass import SparseConvs

    # Clip as Relax ops first, where the module has a sparse convolution: its ConvertLayout to CHWN moves them too
    return SparseConvs(channels_last, choose or by_policy, prepare=_ClipAsRelaxOps(), choices=choices)


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


def _MoveConstantsInNumpy() -> Any:  # noqa: N802 -- a pass, named as TVM's are
    """Fold in numpy, bit for bit as FoldConstant's compiled code computes them, the operations on constants
    alone that a model's lowering makes most of: those that only move a constant's elements (transpose,
    reshape, added or removed axes: ConvertLayout's HWIO weights and their broadcast axes), `isnan` (the
    importer's NaN checks of constant bounds), `sqrt`, and add, subtract, multiply and where of constants of
    one type (IEEE arithmetic, correctly rounded in both). A constant's shape is left alone (it is not a
    tensor). The rest is FoldConstant's."""
    import tvm
    from tvm import relax

    def axes(call: Any, value: np.ndarray) -> list[int]:
        given = call.attrs.axes
        return list(range(value.ndim))[::-1] if given is None else [int(a) for a in given]

    def shape(call: Any) -> tuple[int, ...] | None:
        ty = call.ty  # the result's type: its static shape
        dims = getattr(ty, "shape", None)
        if dims is None or not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
            return None
        return tuple(int(d) for d in dims)

    def unary(name: str, call: Any, value: np.ndarray) -> np.ndarray | None:
        if name == "relax.permute_dims":
            return np.transpose(value, axes(call, value))
        if name in ("relax.expand_dims", "relax.reshape", "relax.squeeze"):
            to = shape(call)
            return None if to is None or int(np.prod(to)) != value.size else value.reshape(to)
        if name == "relax.isnan":
            return np.isnan(value)
        if name == "relax.sqrt" and value.dtype.kind == "f":  # correctly rounded in both
            return np.sqrt(value)
        return None

    # elementwise, in numpy's IEEE arithmetic as LLVM's compiled code does it (no fast math)
    arithmetic = {"relax.add": np.add, "relax.subtract": np.subtract, "relax.multiply": np.multiply,
                  "relax.where": np.where}

    @relax.expr_functor.mutator
    class Folder(relax.PyExprMutator):
        def visit_dataflow_var_(self, var):
            bound = self.lookup_binding(var)
            return bound if isinstance(bound, tvm.ir.expr.Constant) else super().visit_dataflow_var_(var)

        def visit_call_(self, call):
            call = super().visit_call_(call)
            if (not isinstance(call.op, tvm.ir.Op) or not call.args or not isinstance(call.args[0], tvm.ir.expr.Constant)
                    or not isinstance(call.ty, relax.TensorType)):  # a tensor of a known type, not a shape
                return call
            dtype = str(call.ty.dtype)
            if call.op.name in arithmetic:
                if not all(isinstance(a, tvm.ir.expr.Constant) for a in call.args):
                    return call
                values = [a.value.numpy() for a in call.args]
                if any(str(v.dtype) != dtype for v in values[-2:]):
                    return call  # mixed types: TVM's promotion, not numpy's
                out = arithmetic[call.op.name](*values)
            else:
                out = unary(call.op.name, call, call.args[0].value.numpy())
            if out is None or tuple(out.shape) != shape(call):
                return call
            return relax.const(np.array(out, dtype=dtype), dtype)  # a C-ordered copy that keeps a 0-d value 0-d

    @tvm.transform.module_pass(opt_level=0, name="MoveConstantsInNumpy")
    def transform(mod: Any, _ctx: Any) -> Any:
        folder = Folder(mod)
        for gvar, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                mod[gvar] = folder.visit_expr(func)
        return relax.transform.DeadCodeElimination()(mod)

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
