"""The valid range of each index input: the values an integer model input may take because it
indexes a table (token ids into an embedding).

ONNX defines an index into an axis of N entries on [-N, N-1] (a negative one counts from the end) and
nothing outside it: onnxruntime refuses such an index, a compiled kernel reads outside the table or
crashes. An integer graph input x whose values reach the `indices` of an index consumer
(INDEX_CONSUMERS) as x itself may therefore take only values in [-N, N-1]; one that reaches several
gets the intersection, [-min N, min N - 1]. The runtime refuses a feed outside it before any segment
runs (runtime/inputs.py).

"As x itself" is decided by evaluating what the consumer receives as a function of x, once for each
sign of x (x < 0, x = 0, x > 0): on each, the ops between them (EVALUATE) give an affine a*x + b or a
known truth value; comparisons of x with 0 are decided by the sign. The consumer must receive x for
x >= 0 and, for x < 0, x or x + N: the second is an embedding's own normalization of negative ids
(Keras 3 adds N where x < 0; tf2onnx lowers that Select to Less, Cast, Mul and Add), which keeps the
range [-N, N-1]. Anything else gives no range from that path, because the table bounds the result of
the arithmetic (ids + 1), not the input: that index is not checked, and `unchecked` says why.

A cast on the way is exact for the values that pass the check (|x| <= N) when N is within the
narrower type (2^24 for float32, 2^31-1 for int32); a larger table bounds nothing through it.

Needs: shapes inferred (import guarantees them); an index consumer whose indexed size is not static
bounds nothing and says so.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Union

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from . import model as irm

Range = tuple[int, int]
SIGNS = (-1, 0, 1)

_INTEGER = {TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64,
            TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64}


@dataclass(frozen=True)
class IndexRange:
    """What the graph says about one integer input: its valid range (None: no consumer bounds it),
    the consumers that bound it, and why other index consumers it reaches do not."""

    input: str
    valid_range: Range | None
    bounded_by: tuple[str, ...]  # "Gather 'emb' (100 along axis 0)"
    unchecked: tuple[str, ...]  # "Gather 'pos' takes ids + 1, not ids itself"

    def describe(self) -> str:
        parts = []
        if self.valid_range is not None:
            parts.append(f"valid range [{self.valid_range[0]}, {self.valid_range[1]}] from "
                         f"{', '.join(self.bounded_by)}, checked at run time")
        parts.extend(f"{why}: not checked" for why in self.unchecked)
        return f"input '{self.input}': " + "; ".join(parts)


# --- what a tensor is, as a function of the input x on one sign of x ---------------------------------

@dataclass(frozen=True)
class Affine:
    """a*x + b, exact while |x| <= exact_to (None: always; a cast narrows it)."""

    a: float
    b: float
    exact_to: int | None = None


@dataclass(frozen=True)
class Truth:
    value: bool


Value = Union[Affine, Truth, None]  # None: not known (the op is not followed, or depends on more than x)


def _identity(node, args, sign):
    # ops that move or copy elements: every output value is one of input 0's, whatever the shape operands
    return args[0]


def _cast(node, args, sign):
    v, to = args[0], _attr(node, "to", 0)
    np_type = np.dtype(helper.tensor_dtype_to_np_dtype(to))
    if np_type.kind not in "biuf":
        return None
    if isinstance(v, Truth):
        return Truth(v.value) if np_type.kind == "b" else Affine(0, int(v.value))
    if not isinstance(v, Affine):
        return None
    if np_type.kind == "b":
        return Truth(v.b != 0) if v.a == 0 else None
    if np_type.kind == "u":
        return v if v.a == 0 and v.b >= 0 else None  # a negative x would wrap
    limit = 2 ** (np.finfo(np_type).nmant + 1) if np_type.kind == "f" else int(np.iinfo(np_type).max)
    if v.a == 0:
        return Affine(0, int(v.b) if np_type.kind == "i" else v.b)
    return Affine(v.a, v.b, limit if v.exact_to is None else min(v.exact_to, limit))


def _affine(combine: Callable[..., Affine | None], arity: int = 2):
    def evaluate(node, args, sign):
        if len(args) != arity or not all(isinstance(a, Affine) for a in args):
            return None
        out = combine(*args)
        if out is None:
            return None
        limits = [a.exact_to for a in args if a.exact_to is not None]
        return Affine(out.a, out.b, min(limits) if limits else None)
    return evaluate


def _mul(p: Affine, q: Affine) -> Affine | None:
    if p.a == 0:
        return Affine(p.b * q.a, p.b * q.b)
    if q.a == 0:
        return Affine(q.b * p.a, q.b * p.b)
    return None  # x * x is not affine


def _compare(test: Callable[[float], bool]):
    """p OP q as the sign of p - q = a*x + b: known when a = 0, or when b = 0 (the sign of a*x)."""
    def evaluate(node, args, sign):
        if len(args) != 2 or not all(isinstance(a, Affine) for a in args):
            return None
        a, b = args[0].a - args[1].a, args[0].b - args[1].b
        if a == 0:
            return Truth(test(b))
        if b == 0:
            return Truth(test(float(np.sign(a) * sign)))
        return None
    return evaluate


def _logic(combine: Callable[..., bool]):
    def evaluate(node, args, sign):
        return Truth(combine(*(a.value for a in args))) if all(isinstance(a, Truth) for a in args) else None
    return evaluate


def _where(node, args, sign):
    cond, then, other = args
    return (then if cond.value else other) if isinstance(cond, Truth) else None


# op type -> its value on one sign of x, from its inputs' values (None where an input is not known)
EVALUATE: dict[str, Callable] = {
    **{op: _identity for op in ("Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Expand", "Transpose")},
    "Cast": _cast,
    "Add": _affine(lambda p, q: Affine(p.a + q.a, p.b + q.b)),
    "Sub": _affine(lambda p, q: Affine(p.a - q.a, p.b - q.b)),
    "Mul": _affine(_mul),
    "Neg": _affine(lambda p: Affine(-p.a, -p.b), arity=1),
    "Less": _compare(lambda d: d < 0), "LessOrEqual": _compare(lambda d: d <= 0),
    "Greater": _compare(lambda d: d > 0), "GreaterOrEqual": _compare(lambda d: d >= 0),
    "Equal": _compare(lambda d: d == 0),
    "Not": _logic(lambda p: not p), "And": _logic(lambda p, q: p and q), "Or": _logic(lambda p, q: p or q),
    "Where": _where,
}


# --- index consumers ------------------------------------------------------------------------------

def _gather(node: onnx.NodeProto, shapes: dict) -> tuple[int | None, str]:
    """Gather and GatherElements: the size of `data` along `axis`."""
    data = shapes.get(node.input[0])
    if data is None:
        return None, "the shape of its data is not known"
    axis = _attr(node, "axis", 0)
    return data[axis], f"{data[axis]} along axis {axis % len(data)}"


def _gather_nd(node: onnx.NodeProto, shapes: dict) -> tuple[int | None, str]:
    """GatherND: component j of the indices' last axis indexes data axis batch_dims + j. One range
    for the input is exact only when every indexed axis has the same size."""
    data, indices = shapes.get(node.input[0]), shapes.get(node.input[1])
    if data is None or indices is None:
        return None, "the shape of its data or indices is not known"
    b, k = _attr(node, "batch_dims", 0), indices[-1]
    sizes = set(data[b:b + k])
    if len(sizes) != 1:
        return None, f"its index components address axes of sizes {tuple(data[b:b + k])}"
    n = sizes.pop()
    return n, f"{n} along axes {b}..{b + k - 1}"


# op type -> the size N that bounds its `indices` (input 1) to [-N, N-1], or None with the reason.
INDEX_CONSUMERS: dict[str, Callable[[onnx.NodeProto, dict], tuple[int | None, str]]] = {
    "Gather": _gather,
    "GatherElements": _gather,
    "GatherND": _gather_nd,
}


def infer(model: onnx.ModelProto) -> dict[str, IndexRange]:
    """IndexRange per integer graph input that reaches an index consumer (others are left out)."""
    g = model.graph
    shapes = irm.static_shapes(model)
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in g.node:
        for name in node.input:
            if name:
                consumers[name].append(node)
    constants = _scalar_constants(g)
    initializers = {i.name for i in g.initializer}
    out: dict[str, IndexRange] = {}
    for vi in g.input:
        if vi.name in initializers or vi.type.tensor_type.elem_type not in _INTEGER:
            continue
        r = _trace(vi.name, g, shapes, constants, consumers)
        if r.bounded_by or r.unchecked:
            out[vi.name] = r
    return out


def _trace(name: str, g: onnx.GraphProto, shapes: dict, constants: dict, consumers: dict) -> IndexRange:
    """Evaluate every node that depends on `name` on each sign of it (graph order is topological);
    an index consumer reached bounds it when it receives the index itself. Where evaluation stops, any
    index consumer further on is recorded as unchecked."""
    values: dict[str, dict[int, Value]] = {name: {s: Affine(1, 0) for s in SIGNS}}
    sizes, bounded, unchecked = [], [], []
    for node in g.node:
        if not any(i in values for i in node.input):
            continue
        label = _label(node)
        if node.op_type in INDEX_CONSUMERS and node.input[1] in values:
            n, why = INDEX_CONSUMERS[node.op_type](node, shapes)
            problem = f"bounds nothing ({why})" if n is None else _not_the_index(values[node.input[1]], n, name)
            if problem:
                unchecked.append(f"{label} {problem}")
            else:
                sizes.append(n)
                bounded.append(f"{label} ({why})")
            continue
        args = {s: [values[i][s] if i in values else constants.get(i) for i in node.input] for s in SIGNS}
        evaluate = EVALUATE.get(node.op_type)
        result = {s: evaluate(node, args[s], s) for s in SIGNS} if evaluate and len(node.output) == 1 else None
        if result is None or any(v is None for v in result.values()):
            unchecked.extend(f"{label} changes its values before {c}" for c in _index_consumers_after(node, consumers))
            continue
        values[node.output[0]] = result
    n = min(sizes, default=None)
    return IndexRange(name, (-n, n - 1) if n is not None else None, tuple(bounded), tuple(dict.fromkeys(unchecked)))


def _not_the_index(forms: dict[int, Value], n: int, name: str) -> str:
    """Why a consumer indexing N entries does not receive `name` itself ('' when it does): x for
    x >= 0, and x or x + N for x < 0, exact for every |x| <= N."""
    if all(isinstance(v, Affine) for v in forms.values()):
        neg, zero, pos = forms[-1], forms[0], forms[1]
        if (pos.a, pos.b) == (1, 0) and zero.b == 0 and neg.a == 1 and neg.b in (0, n):
            limits = [v.exact_to for v in forms.values() if v.exact_to is not None]
            if not limits or min(limits) >= n:
                return ""
            return f"indexes {n} entries through a cast exact only up to {min(limits)}"
        if (neg.a, neg.b) == (pos.a, pos.b):
            return f"takes {_show(pos, name)}, not {name} itself"
        return f"takes {_show(neg, name)} where {name} < 0 and {_show(pos, name)} where {name} >= 0, not {name} itself"
    return f"takes a value of {name} that is not known at build time"


def _show(v: Affine, name: str) -> str:
    a = "" if v.a == 1 else "-" if v.a == -1 else f"{v.a:g}*"
    b = f" + {v.b:g}" if v.b > 0 else f" - {-v.b:g}" if v.b < 0 else ""
    return f"{a}{name}{b}" if v.a else f"{v.b:g}"


def _index_consumers_after(start: onnx.NodeProto, consumers: dict) -> list[str]:
    """The index consumers reachable from `start`'s outputs at their `indices`, in breadth-first order."""
    found, seen, frontier = [], set(start.output), list(start.output)
    while frontier:
        tensor = frontier.pop(0)
        for node in consumers.get(tensor, ()):
            if node.op_type in INDEX_CONSUMERS and node.input[1] == tensor:
                found.append(_label(node))
            for o in node.output:
                if o and o not in seen:
                    seen.add(o)
                    frontier.append(o)
    return found


def _scalar_constants(g: onnx.GraphProto) -> dict[str, Value]:
    """Initializers and Constant nodes holding one number (an offset, a 0 to compare with) or one bool."""
    arrays = {i.name: irm.array(i) for i in g.initializer if int(np.prod(i.dims)) == 1}
    for node in g.node:
        if node.op_type == "Constant" and node.attribute:
            value = helper.get_attribute_value(node.attribute[0])
            array = numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else np.asarray(value)
            if array.size == 1:
                arrays[node.output[0]] = array
    return {k: Truth(bool(v.item())) if v.dtype == bool else Affine(0, v.item())
            for k, v in arrays.items() if v.dtype.kind in "biuf"}


def _label(node: onnx.NodeProto) -> str:
    return f"{node.op_type} '{node.name or node.output[0]}'"


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default
