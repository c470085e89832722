"""What the rules ask of a value: is it a true constant (`ir.values.constant`, which the backends' own
rewrites share), is its shape static, what shape does a shape-only op (Reshape, Flatten, Squeeze,
Unsqueeze) give it.
"""

from __future__ import annotations

import math

import onnx_ir as ir

from ..ir.values import broadcast, constant, per_channel  # noqa: F401 (the rules import them from here)

FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE})


def static_shape(value: ir.Value | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    if value.shape is None:
        array = constant(value)
        return None if array is None else tuple(array.shape)
    dims = value.shape.dims
    if all(isinstance(d, int) and d >= 0 for d in dims):
        return tuple(dims)
    return None


def attr_int(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    if attr is None or attr.is_ref() or attr.type != ir.AttributeType.INT:
        return default
    return attr.as_int()


def opset(model: ir.Model) -> int:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))


def fresh_initializer_name(graph: ir.Graph | ir.Function, base: str) -> str:
    """A name no initializer of `graph` has (new weights never overwrite shared ones)."""
    if isinstance(graph, ir.Function):
        return base
    name, k = base, 1
    while name in graph.initializers:
        name, k = f"{base}_{k}", k + 1
    return name


def _axes(node: ir.Node) -> list[int] | None:
    """Squeeze/Unsqueeze axes: the input since opset 13, the attribute before; [] when absent."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        array = constant(node.inputs[1])
        return None if array is None else [int(a) for a in array.reshape(-1)]
    attr = node.attributes.get("axes")
    if attr is not None and attr.type == ir.AttributeType.INTS:
        return list(attr.as_ints())
    return []


def reshaped(node: ir.Node, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The static output shape of a shape-only node given its input's static shape, or None where
    the node's own constants do not fix it (or the node is invalid)."""
    op = node.op_type if node.domain in ("", "ai.onnx") else None
    rank = len(shape)
    if op == "Reshape":
        target = constant(node.inputs[1]) if len(node.inputs) > 1 else None
        if target is None or target.ndim != 1:
            return None
        allowzero = attr_int(node, "allowzero", 0)
        dims = [int(d) for d in target]
        if not allowzero:
            if any(d == 0 and i >= rank for i, d in enumerate(dims)):
                return None
            dims = [shape[i] if d == 0 else d for i, d in enumerate(dims)]
        if dims.count(-1) > 1 or any(d < -1 for d in dims):
            return None
        total, known = math.prod(shape), math.prod(d for d in dims if d != -1)
        if -1 in dims:
            if known == 0 or total % known:
                return None
            dims[dims.index(-1)] = total // known
        return tuple(dims) if math.prod(dims) == total else None
    if op == "Flatten":
        axis = attr_int(node, "axis", 1)
        axis = axis + rank if axis < 0 else axis
        if not 0 <= axis <= rank:
            return None
        return (math.prod(shape[:axis]), math.prod(shape[axis:]))
    if op == "Squeeze":
        axes = _axes(node)
        if axes is None:
            return None
        if not axes:
            return tuple(d for d in shape if d != 1)
        axes = {a + rank if a < 0 else a for a in axes}
        if any(not 0 <= a < rank or shape[a] != 1 for a in axes):
            return None
        return tuple(d for i, d in enumerate(shape) if i not in axes)
    if op == "Unsqueeze":
        listed = _axes(node)
        if listed is None:
            return None
        out_rank = rank + len(listed)
        axes = {a + out_rank if a < 0 else a for a in listed}
        if len(axes) != len(listed) or any(not 0 <= a < out_rank for a in axes):
            return None
        rest = iter(shape)
        return tuple(1 if i in axes else next(rest) for i in range(out_rank))
    return None


SHAPE_ONLY_OPS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")
