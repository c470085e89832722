"""The Relax pass that computes pruned convolutions with the sparse kernels (`SparseConvs`).

Every `relax.nn.conv2d` (NCHW/OIHW, one group, float32, static shapes) whose weight is a constant with at
least `MIN_SPARSITY` zeros becomes layout edges (to CHWN and padded, and back) around a `call_tir` of its
kernel (sparse_kernels.py); what is left to fuse fuses as before. The pass runs in three steps, each a
visitor whose state is its own fields:

    _KernelChoices  each sparse convolution's kernel, sparse or dense, asked of the choice once per distinct
                    convolution, in graph order (sparse_choice.py, sparse_measured.py)
    _ConvKernels    after ConvertLayout made every convolution CHWN: each one as its kernel (sparse, a depthwise
                    one in CHWN, or the dense convolution in its own layout between two transposes)
    _LayoutKernels  each transpose into or out of CHWN as `transpose`'s kernel

TVM is imported at the top here, unlike the rest of this backend: the pass and the visitors are TVM classes.
Import this module only where TVM is needed anyway (lowering.py imports it inside `_sparse_pass`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np
import tvm
from tvm import relax

from .sparse_choice import MIN_SPARSITY, Choice, by_policy
from .sparse_format import ConvShape, pack
from .sparse_kernels import conv_kernel, depthwise_kernel, row_input, row_lanes, transpose

DEPTHWISE_MIN_BATCH = 4  # a depthwise convolution inside a CHWN run gets its own CHWN kernel from this batch on

_CONV2D = tvm.ir.Op.get("relax.nn.conv2d")
_PERMUTE_DIMS = tvm.ir.Op.get("relax.permute_dims")


@tvm.transform.module_pass(opt_level=0, name="SparseConvs")
class SparseConvs:
    """Give each sparse constant-weight `relax.nn.conv2d` (one group, float32, static shapes) its sparse
    kernel, in CHWN with the layout changes only at the edges of sparse runs: TVM's ConvertLayout first
    makes every convolution CHWN (the elementwise operators, pooling and residual additions between them
    follow), then each sparse one becomes its kernel (a zero pad and a `call_tir`) and each dense one goes
    back to its own layout between two transposes (NHWC where `channels_last`, else NCHW), which TVM's
    ConvertLayout and `_CancelTransposePairs` treat as before. A convolution with a sparse weight keeps the
    dense kernel where `choose` (`by_policy`, or `Measured`: timed on this host) says so; a module where no
    convolution gets the sparse kernel is returned as it is. The pass's `choices` list (the caller's, where
    it passes one) gets, per run, each such convolution's choice (its shape, kernel, times and why).
    `prepare`, a pass, runs first on a module that gets a sparse kernel (lowering.py: Clip as Relax ops,
    which ConvertLayout moves along)."""

    def __init__(self, channels_last: bool, choose: Choice = by_policy, min_sparsity: float = MIN_SPARSITY,
                 prepare: Any = None, choices: list[list[dict]] | None = None):
        self.channels_last, self.choose, self.min_sparsity, self.prepare = channels_last, choose, min_sparsity, prepare
        self.choices: list[list[dict]] = [] if choices is None else choices

    def transform_module(self, mod: Any, _ctx: Any) -> Any:
        finder = _KernelChoices(self.choose, self.min_sparsity)
        for func in mod.functions.values():
            if isinstance(func, relax.Function):
                finder.visit_expr(func)
        decided = finder.decided
        self.choices.append(list(decided.values()))
        if not any(c["kernel"] == "sparse" for c in decided.values()):
            return mod
        if self.prepare is not None:
            mod = self.prepare(mod)
        mod = relax.transform.ConvertLayout({"relax.nn.conv2d": ["CHWN", "OIHW"]})(mod)
        mod = _each_function(mod, _ConvKernels(mod, decided, self.min_sparsity, self.channels_last))
        mod = _each_function(mod, _LayoutKernels(mod))
        return relax.transform.DeadCodeElimination()(mod)


def _each_function(mod: Any, mutator: Any) -> Any:
    """`mod` with each of its Relax functions rewritten by `mutator` (made on `mod`)."""
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gvar, mutator.visit_expr(func))
    return mutator.builder_.get()


def sparse_weight(call: Any, min_sparsity: float) -> np.ndarray | None:
    """The weight of `call` where it is a convolution the sparse kernel computes: a `relax.nn.conv2d` with one
    group, a float32 input of static shape and a constant float32 OIHW weight with at least `min_sparsity`
    zeros; else None."""
    if call.op != _CONV2D:
        return None
    weight = call.args[1]
    if not isinstance(weight, tvm.ir.expr.Constant) or int(call.attrs.groups) != 1:
        return None
    dims = getattr(call.args[0].ty, "shape", None)
    if str(call.args[0].ty.dtype) != "float32" or dims is None or \
            not all(isinstance(d, tvm.tirx.IntImm) for d in dims.values):
        return None
    w = weight.value.numpy()
    if call.attrs.kernel_layout != "OIHW" or w.dtype != np.float32:
        return None
    return w if np.count_nonzero(w) <= (1.0 - min_sparsity) * w.size else None


def conv_shape(call: Any, w: np.ndarray) -> ConvShape:
    """The ConvShape of the convolution `call` (NCHW, or CHWN after ConvertLayout) with weight `w`."""
    dims = [int(d) for d in call.args[0].ty.shape.values]
    n, ci, h, wd = dims if call.attrs.data_layout == "NCHW" else (dims[3], dims[0], dims[1], dims[2])
    return ConvShape(n, ci, h, wd, w.shape[0], w.shape[2], w.shape[3], tuple(int(v) for v in call.attrs.padding),
                     tuple(int(v) for v in call.attrs.strides), tuple(int(v) for v in call.attrs.dilation))


def _identity(shape: ConvShape, w: np.ndarray) -> str:
    """A convolution's key in the choices: its shape and weight, the same before and after ConvertLayout."""
    return hashlib.sha256(repr(dataclasses.astuple(shape)).encode() + w.tobytes()).hexdigest()


@relax.expr_functor.visitor
class _KernelChoices(relax.PyExprVisitor):
    """Each sparse convolution's kernel chosen, in graph order: `decided` maps each distinct convolution
    (`_identity`) to its choice, with its shape and share of zeros."""

    def __init__(self, choose: Choice, min_sparsity: float):
        self.choose, self.min_sparsity = choose, min_sparsity
        self.decided: dict[str, dict] = {}

    def visit_call_(self, call):
        super().visit_call_(call)
        w = sparse_weight(call, self.min_sparsity)
        if w is None or call.attrs.data_layout != "NCHW":
            return
        shape = conv_shape(call, w)
        key = _identity(shape, w)
        if key not in self.decided:
            self.decided[key] = {"shape": dataclasses.asdict(shape),
                                 "zeros": round(1 - np.count_nonzero(w) / w.size, 4), **self.choose(shape, w)}


@relax.expr_functor.mutator
class _ConvKernels(relax.PyExprMutator):
    """Each CHWN convolution as its kernel: the sparse kernel where `decided` (`_KernelChoices`) says so, a
    depthwise kernel in CHWN where it is one with a batch, else the dense convolution in its own layout."""

    def __init__(self, mod: Any, decided: dict[str, dict], min_sparsity: float, channels_last: bool):
        super().__init__(mod)
        self.decided, self.min_sparsity, self.channels_last = decided, min_sparsity, channels_last

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if call.op != _CONV2D or call.attrs.data_layout != "CHWN":
            return call
        w = sparse_weight(call, self.min_sparsity)
        if w is None or self.decided[_identity(conv_shape(call, w), w)]["kernel"] != "sparse":
            return self._dense(call)
        return self._sparse(call, w)

    def _sparse(self, call, w):
        attrs = call.attrs
        ci, h, wd, n = (int(d) for d in call.args[0].ty.shape.values)
        pads = tuple(int(v) for v in attrs.padding)
        shape = ConvShape(n, ci, h, wd, w.shape[0], w.shape[2], w.shape[3], pads,
                          tuple(int(v) for v in attrs.strides), tuple(int(v) for v in attrs.dilation))
        ell = pack(w)
        gvar = self.builder_.add_func(conv_kernel(shape, ell.values.shape[1], ell.values.shape[2]), "sparse_conv2d")
        data = call.args[0]
        top, left, bottom, right = pads
        if any(pads):
            data = relax.op.nn.pad(data, [0, 0, top, bottom, left, right, 0, 0])
        offsets = shape.offsets(ell)
        if row_lanes(shape):
            data, offsets = row_input(data, shape), shape.row_offsets(ell)
        oh, ow = shape.out
        return relax.call_tir(gvar, [data, relax.const(ell.values), relax.const(offsets)],
                              relax.TensorType((shape.co, oh, ow, n), "float32"))

    def _dense(self, call):
        data, weight = call.args
        attrs = call.attrs
        depthwise = self._depthwise(call)
        if depthwise is not None:
            return depthwise
        layout, kernel_layout, axes = ("NHWC", "HWIO", [3, 1, 2, 0]) if self.channels_last else \
            ("NCHW", "OIHW", [3, 0, 1, 2])
        if self.channels_last and isinstance(weight, tvm.ir.expr.Constant):
            weight = relax.const(weight.value.numpy().transpose(2, 3, 1, 0))
        else:
            layout, kernel_layout, axes = "NCHW", "OIHW", [3, 0, 1, 2]
        back = [axes.index(k) for k in range(4)]
        out = relax.op.nn.conv2d(relax.op.permute_dims(data, axes), weight, strides=attrs.strides,
                                 padding=attrs.padding, dilation=attrs.dilation, groups=attrs.groups,
                                 data_layout=layout, kernel_layout=kernel_layout, out_layout=layout,
                                 out_dtype=attrs.out_dtype)
        return relax.op.permute_dims(out, back)

    def _depthwise(self, call):
        """A depthwise convolution (one channel per group) with a batch, computed in CHWN where it is (a
        kernel of its own), so that a MobileNet's depthwise layers do not leave a sparse run."""
        data, weight = call.args
        dims = [int(d) for d in data.ty.shape.values]
        groups = int(call.attrs.groups)
        if not isinstance(weight, tvm.ir.expr.Constant) or groups == 1 or dims[3] < DEPTHWISE_MIN_BATCH:
            return None
        w = weight.value.numpy()
        if w.dtype != np.float32 or groups != dims[0] or w.shape[:2] != (groups, 1):
            return None
        ci, h, wd, n = dims
        pads = tuple(int(v) for v in call.attrs.padding)
        shape = ConvShape(n, ci, h, wd, ci, w.shape[2], w.shape[3], pads,
                          tuple(int(v) for v in call.attrs.strides), tuple(int(v) for v in call.attrs.dilation))
        top, left, bottom, right = pads
        if any(pads):
            data = relax.op.nn.pad(data, [0, 0, top, bottom, left, right, 0, 0])
        gvar = self.builder_.add_func(depthwise_kernel(shape), "depthwise_chwn")
        oh, ow = shape.out
        return relax.call_tir(gvar, [data, relax.const(w[:, 0])], relax.TensorType((ci, oh, ow, n), "float32"))


@relax.expr_functor.mutator
class _LayoutKernels(relax.PyExprMutator):
    """Each 4-D float32 transpose into or out of CHWN as `transpose`'s kernel."""

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if call.op != _PERMUTE_DIMS or call.attrs.axes is None:
            return call
        ty = call.args[0].ty
        dims = getattr(ty, "shape", None)
        if str(ty.dtype) != "float32" or dims is None or len(dims.values) != 4 or \
                not all(isinstance(d, tvm.tirx.IntImm) for d in dims.values):
            return call
        axes = [int(a) for a in call.attrs.axes]
        shape = tuple(int(d) for d in dims.values)
        gvar = self.builder_.add_func(transpose(shape, axes), "layout_transpose")
        return relax.call_tir(gvar, [call.args[0]], relax.TensorType([shape[a] for a in axes], "float32"))
