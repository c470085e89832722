"""What a rewrite asks of an ONNX value, below the passes and the backends that both rewrite graphs: is it a
true constant, and which per-channel vector does a constant apply along axis 1.

A graph input that also has an initializer is a default the caller may override, so it is never a
constant here (onnxscript's `get_numpy_value` leaves that distinction to the caller).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


def constant(value: ir.Value | None) -> np.ndarray | None:
    """The value's array if it is an initializer or a Constant node's output, else None."""
    if value is None or value.is_graph_input():
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None:
        return None
    try:
        return tensor.numpy()
    except Exception:  # external data not loaded, string tensors: not a constant a rule can use
        return None


def broadcast(*shapes: tuple[int, ...]) -> tuple[int, ...] | None:
    """numpy's (and ONNX's multidirectional) broadcast, or None where the shapes do not broadcast."""
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        return None


def per_channel(array: np.ndarray, out_shape: tuple[int, ...]) -> np.ndarray | None:
    """The (C,) vector an elementwise constant applies along axis 1 of an NC... tensor, or None
    where it varies along another axis or would broadcast the tensor to a larger shape."""
    rank, channels = len(out_shape), out_shape[1] if len(out_shape) > 1 else None
    if channels is None or array.ndim > rank or broadcast(out_shape, array.shape) != out_shape:
        return None
    padded = array.reshape((1,) * (rank - array.ndim) + array.shape)
    if any(d != 1 for i, d in enumerate(padded.shape) if i != 1):
        return None
    return np.broadcast_to(padded.reshape(-1), (channels,)).copy()
