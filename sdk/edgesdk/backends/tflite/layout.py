"""The layout context of one trace: which TF tensor holds which ONNX tensor, in which layout.

ONNX convolutions are NCHW, TFLite's are NHWC. Every ONNX tensor is held as a TF tensor `t` with
a permutation `p` such that

    onnx_tensor == transpose(t, p)          (p == (0, 3, 1, 2): t is the NHWC form of NCHW)

so an ONNX Transpose only changes `p` and emits nothing; ops that need a layout ask for it with
`_Ctx.layout`, which emits a TF transpose only when the layout differs, and a reshape when only
unit axes move. `_input_perm` decides which segment inputs are taken in NHWC.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

NHWC = (0, 3, 1, 2)  # the `p` of an NCHW ONNX tensor held as NHWC


@dataclass
class _Value:
    """An ONNX activation as a TF tensor: onnx == transpose(tf, perm)."""

    tf: Any
    perm: tuple[int, ...]
    nonneg: bool = False  # known >= 0 (after Relu & co.): lets max-pool pad with zeros


def _inv(p: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argsort(p))


def _identity(rank: int) -> tuple[int, ...]:
    return tuple(range(rank))


class _Ctx:
    """The state of one trace: ONNX name → `_Value` (activations) or np.ndarray (constants)."""

    def __init__(self, tf: Any, opset: int, consts: dict[str, np.ndarray]):
        self.tf = tf
        self.opset = opset
        self.consts = dict(consts)
        self.values: dict[str, _Value] = {}
        self.producer: dict[str, onnx.NodeProto] = {}  # ONNX tensor → the node that makes it
        self.uses: dict[str, int] = {}  # ONNX tensor → number of consumers (graph outputs count)
        self.readers: dict[str, list[onnx.NodeProto]] = {}  # ONNX tensor → the nodes that read it
        self.outputs: set[str] = set()  # the segment's outputs

    def const(self, name: str) -> np.ndarray | None:
        return self.consts.get(name) if name else None

    def value(self, name: str) -> _Value:
        if name in self.values:
            return self.values[name]
        c = self.consts[name]
        return _Value(self.tf.constant(c), _identity(c.ndim))

    def item(self, name: str) -> _Value | np.ndarray:
        return self.values[name] if name in self.values else self.consts[name]

    def set(self, name: str, value: _Value | np.ndarray) -> None:
        if name:
            if isinstance(value, np.ndarray):
                self.consts[name] = value
            else:
                self.values[name] = value

    def shape(self, v: _Value | np.ndarray) -> tuple[int, ...]:
        """The ONNX shape of a value."""
        if isinstance(v, np.ndarray):
            return v.shape
        tf_shape = [int(d) for d in v.tf.shape]
        return tuple(tf_shape[i] for i in v.perm)

    def layout(self, v: _Value, perm: tuple[int, ...]) -> Any:
        """The TF tensor t with onnx == transpose(t, perm)."""
        if v.perm == tuple(perm):
            return v.tf
        # t' = transpose(onnx, inv(q)) = transpose(t, p[inv(q)])
        order = tuple(v.perm[i] for i in _inv(tuple(perm)))
        tf_shape = [int(d) for d in v.tf.shape]
        moved = [a for a in order if tf_shape[a] != 1]
        if moved == sorted(moved):  # only unit axes move: a reshape, not a data transpose
            return self.tf.reshape(v.tf, [tf_shape[a] for a in order])
        return self.tf.transpose(v.tf, order)

    def aligned(self, item: _Value | np.ndarray, perm: tuple[int, ...], dtype: Any = np.float32) -> Any:
        """`item` broadcast (ONNX rules) to rank len(perm) and laid out with `perm`."""
        rank = len(perm)
        if not isinstance(item, _Value):
            c = np.asarray(item, dtype)
            if c.ndim == 0:
                return c
            c = c.reshape((1,) * (rank - c.ndim) + c.shape)
            return np.ascontiguousarray(np.transpose(c, _inv(perm)))
        if len(item.perm) < rank:
            shape = self.shape(item)
            t = self.tf.reshape(self.layout(item, _identity(len(shape))), (1,) * (rank - len(shape)) + shape)
            item = _Value(t, _identity(rank))
        return self.layout(item, perm)


def _common_perm(cx: _Ctx, items: list[_Value | np.ndarray]) -> tuple[int, ...]:
    """The layout an elementwise op computes in: that of its first full-rank activation."""
    rank = max(len(cx.shape(i)) for i in items)
    for i in items:
        if isinstance(i, _Value) and len(i.perm) == rank:
            return i.perm
    return _identity(rank)


def _perm_without(perm: tuple[int, ...], dropped: set[int]) -> tuple[int, ...]:
    """The `p` left when ONNX axes `dropped` (and their TF axes) are removed."""
    kept = [i for i in range(len(perm)) if i not in dropped]
    order = sorted(perm[i] for i in kept)
    return tuple(order.index(perm[i]) for i in kept)


# Ops that want NHWC, and ops through which that wish reaches back to a segment input.
_LAYOUT_SENSITIVE = {"Conv", "ConvTranspose", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Resize"}
_LAYOUT_TRANSPARENT = {"Add", "Sub", "Mul", "Div", "Max", "Min", "Relu", "Sigmoid", "Tanh", "HardSigmoid",
                       "HardSwish", "Clip", "PRelu", "BatchNormalization", "Identity", "Dropout", "Pad", "Concat",
                       "Slice", "Split"}


def _input_perm(graph: onnx.GraphProto, name: str, rank: int) -> tuple[int, ...]:
    """NHWC for a 4-d input that reaches a layout-sensitive op through layout-transparent ones."""
    if rank != 4:
        return _identity(rank)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    todo, seen = [name], {name}
    while todo:
        for node in consumers.get(todo.pop(), []):
            if node.op_type in _LAYOUT_SENSITIVE:
                return NHWC
            if node.op_type in _LAYOUT_TRANSPARENT:
                for o in node.output:
                    if o and o not in seen:
                        seen.add(o)
                        todo.append(o)
    return _identity(rank)
