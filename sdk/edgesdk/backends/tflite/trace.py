"""Tracing a segment into one `tf.function` by the lowering table, and its feeds into TF layout.

The function's signature keys name the segment's ONNX tensors; constant subgraphs are folded at
build time; a 4-d input that feeds a layout-sensitive op is taken in NHWC (`_input_perm`) and
outputs keep their `p`, reported in `TensorSpec.perm` (the runtime transposes on the host).
"""

from __future__ import annotations

import math
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from ...errors import UserError
from ...ir import model as irm
from ...ir.memory import tensorflow_env
from ...runtime.manifest import TensorSpec
from .layout import _Ctx, _identity, _input_perm, _inv, _Value
from .lowering import Shapes, _fold, lowering_for

# What TensorFlow's native libraries print while they load, whatever TF_CPP_MIN_LOG_LEVEL says: absl's
# notice that it logs before it is set up, and INFO lines ("oneDNN custom operations are on"). Warnings
# and errors are not matched.
_LOAD_NOISE = re.compile(rb"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
                         rb"|I\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] ")


def _tensorflow():
    """TensorFlow, imported with `TENSORFLOW_ENV` set and what matches `_LOAD_NOISE` in what its first
    import writes to fd 2 kept off the user's terminal (the rest is written there after it). With
    TF_CPP_MIN_LOG_LEVEL=0 (`edgesdk --debug` sets it) nothing is held back."""
    tensorflow_env()
    if "tensorflow" in sys.modules or os.environ.get("TF_CPP_MIN_LOG_LEVEL") == "0":
        import tensorflow as tf

        return tf
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            import tensorflow as tf
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            rest = b"".join(line for line in held.read().splitlines(keepends=True) if not _LOAD_NOISE.match(line))
            while rest:
                rest = rest[os.write(2, rest):]
    return tf


NODE_SCOPE = re.compile(r"(?:^|[;/])n(\d+)\.[^/;]*/")  # a node's scope in a TFLite tensor's name: its index


def node_scope(index: int, node: onnx.NodeProto) -> str:
    """The TF name scope the ops of the segment's `index`-th node are made in: `n<index>.<its name>`.
    The converter names each TFLite tensor after the TF ops it fused into it (joined by ';'), so a
    tensor names the ONNX nodes it computes, exactly by index (`NODE_SCOPE`), and readably."""
    return f"n{index}." + re.sub(r"[^A-Za-z0-9_.-]", "_", node.name or node.output[0])[:64]


def _signature_key(name: str, used: set[str]) -> str:
    key = re.sub(r"[^0-9A-Za-z_]", "_", name)
    if not key or not key[0].isalpha():
        key = "t_" + key
    key, base, n = key[:120], key[:120], 2
    while key in used:
        key, n = f"{base}_{n}", n + 1
    used.add(key)
    return key


@dataclass
class _Lowered:
    function: Any  # tf.function
    module: Any  # tf.Module holding it (the converter takes signatures from it)
    inputs: list[TensorSpec]
    outputs: list[TensorSpec] = field(default_factory=list)
    # each ONNX activation the trace made: the `p` of its TF tensor (onnx == transpose(tf, p))
    layouts: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def release(self) -> None:
        """Let the traced function and its weights go (once saved for the converter): the specs stay."""
        self.function = self.module = None


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)


def _static_shapes(model: onnx.ModelProto) -> Shapes:
    shell, weights = irm.weightless(model)  # shape inference serializes what it is given: not the weights
    inferred = onnx.shape_inference.infer_shapes(shell, data_prop=True)
    inputs = [vi for vi in inferred.graph.input if vi.name not in {t.name for t in weights}]
    shapes: Shapes = {}
    for vi in [*inputs, *inferred.graph.value_info, *inferred.graph.output]:
        t = vi.type.tensor_type
        if t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
            shapes[vi.name] = tuple(d.dim_value for d in t.shape.dim)
    for init in model.graph.initializer:
        shapes[init.name] = tuple(init.dims)
    return shapes


def _check_model(model: onnx.ModelProto, cpu: bool = False) -> tuple[dict[str, np.ndarray], list]:
    """Constants of the graph and each node's lowering (`lowering_for`; None where it folds away);
    raises UserError listing every input or node we cannot take."""
    graph = model.graph
    consts = {i.name: irm.array(i) for i in graph.initializer}
    problems = []
    for vi in graph.input:
        if vi.name in consts:
            continue
        t = vi.type.tensor_type
        if t.elem_type != onnx.TensorProto.FLOAT:
            problems.append(f"input {vi.name} is {onnx.TensorProto.DataType.Name(t.elem_type).lower()}, not float32")
        if not t.HasField("shape") or not all(d.HasField("dim_value") and d.dim_value > 0 for d in t.shape.dim):
            problems.append(f"input {vi.name} has no static shape")
    if problems:
        raise UserError("tflite.bad-input", f"the segment's inputs cannot be lowered to tflite: {problems[0]}",
                        "fix the input shapes (e.g. --input-shape x=1x3x224x224) and keep float32 inputs",
                        notes=problems)
    shapes = _static_shapes(model)
    names = set(consts)
    lowerings = []
    for node in graph.node:
        lowering, reason = lowering_for(node, shapes, names, cpu=cpu)
        lowerings.append(lowering)
        if reason:
            problems.append(f"node {node.name or node.output[0]} ({node.op_type}): {reason}")
        elif node.op_type in ("Constant", "Shape") or (node.input and all(n in names for n in node.input if n)):
            names.update(o for o in node.output if o)
    if problems:
        raise UserError("tflite.unsupported-op", f"{len(problems)} node(s) of the segment cannot be lowered to tflite",
                        "place these nodes on the cpu (legalize does so when the target allows it)", notes=problems)
    return consts, lowerings


def _lower(model: onnx.ModelProto, *, cpu: bool = False) -> _Lowered:
    """Trace the segment into a tf.function whose signature keys name its ONNX tensors: with the Edge
    TPU's lowerings, and with `cpu` (LiteRT on the CPU) the CPU's behind them."""
    tf = _tensorflow()
    consts, lowerings = _check_model(model, cpu)
    graph = model.graph
    opset = _opset(model)
    used: set[str] = set()
    inputs = []
    for vi in graph.input:
        if vi.name in consts:
            continue
        shape = tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
        perm = _input_perm(graph, vi.name, len(shape))
        inputs.append(TensorSpec(vi.name, shape, "float32", key=_signature_key(vi.name, used),
                                 perm=None if perm == _identity(len(shape)) else perm))
    lowered = _Lowered(None, None, inputs)

    weights = _VariableWeights(tf, tf, [])

    def body(*args: Any) -> dict[str, Any]:
        weights._made[0] = 0  # a trace makes the same arrays in the same order: each reuses its variable
        cx = _Ctx(weights, opset, consts)
        out_used: set[str] = set()
        for node in graph.node:
            cx.producer.update((o, node) for o in node.output if o)
            for n in node.input:
                cx.uses[n] = cx.uses.get(n, 0) + 1
                cx.readers.setdefault(n, []).append(node)
        for vi in graph.output:
            cx.uses[vi.name] = cx.uses.get(vi.name, 0) + 1
            cx.outputs.add(vi.name)
        for spec, arg in zip(inputs, args):
            cx.set(spec.name, _Value(arg, spec.perm or _identity(len(spec.shape))))
        for k, (node, lowering) in enumerate(zip(graph.node, lowerings)):
            names = [n for n in node.input if n]
            if node.op_type != "Constant" and names and all(n in cx.consts for n in names):
                for name, v in zip(node.output, _fold(node, {n: cx.consts[n] for n in names}, opset)):
                    cx.set(name, v)
            else:
                with tf.name_scope(node_scope(k, node)):  # the TFLite tensors it makes are named after it
                    lowering.lower(cx, node)
                lowered.layouts.update((o, cx.values[o].perm) for o in node.output if o in cx.values)
        result, specs = {}, []
        for vi in graph.output:
            if vi.name not in cx.values:
                # legalize gives no accelerator a node that depends on no model input (support.CONSTANT), so
                # an Edge TPU segment never gets here; a LiteRT candidate for a CPU span that does is skipped
                raise RuntimeError(f"segment output {vi.name} depends on no model input: it folds to a constant, "
                                   "which a traced segment cannot give")
            v = cx.values[vi.name]
            key = _signature_key(vi.name, out_used)
            result[key] = tf.identity(v.tf, name=key)
            dtype = tf.as_dtype(v.tf.dtype).name
            specs.append(TensorSpec(vi.name, cx.shape(v), dtype, key=key,
                                    perm=None if v.perm == _identity(len(v.perm)) else v.perm))
        lowered.outputs = specs
        return result

    signature = [tf.TensorSpec([s.shape[i] for i in _inv(s.perm or _identity(len(s.shape)))], tf.float32,
                               name=s.key) for s in inputs]
    lowered.function = tf.function(body, input_signature=signature, autograph=False)
    lowered.module = tf.Module()
    lowered.module.f = lowered.function
    _check_sizes(lowered.function.get_concrete_function())  # trace now: lowering errors surface here
    lowered.module.weights = list(weights._store)  # tracked by the module: saved with the function
    return lowered


# TFLite sizes a tensor with an int32 element count: a larger one fails to prepare, and the converter's int8
# calibrator, which does not check that its interpreter prepared, then writes its samples through
# unallocated tensors (a segmentation fault that ended a build with nothing said)
MAX_TENSOR_ELEMENTS = 2**31 - 1


def _check_sizes(function: Any) -> None:
    """Refuse a traced segment with a tensor TFLite cannot size: a lowering's own mistake (an internal
    error naming the op), never a crash of the converter later."""
    for op in function.graph.get_operations():
        for out in op.outputs:
            dims = out.shape.as_list() if out.shape.rank is not None else []
            if dims and all(d is not None for d in dims) and math.prod(dims) > MAX_TENSOR_ELEMENTS:
                raise RuntimeError(f"the TFLite lowering made a tensor of shape {dims} ({op.type} {op.name}), more "
                                   f"elements than TFLite sizes ({MAX_TENSOR_ELEMENTS})")


WEIGHT_BYTES = 64 << 10  # arrays from this size on are weights held as variables


class _VariableWeights:
    """`tf` as the lowerings see it (`cx.tf`): every numpy array of WEIGHT_BYTES or more given to an op
    (a kernel, a table; `tf.constant` of one) is held as a variable of the module instead of a constant
    of the traced graph.

    Constants travel inside every copy of the graph the converter makes (the function, its SavedModel,
    the GraphDef it reloads, grappler's), about 42 bytes per byte of weights; a variable is written once
    to the SavedModel's checkpoint and read once by its importer, about 3 to 6 (convert.py). The converter
    freezes the variables into the flatbuffer's constant buffers: the .tflite has the same ops and weights
    and computes the same outputs bit for bit (MobileNetV2, checked), a few bytes of metadata apart. A trace makes
    the same arrays in the same order, so a later trace of the function reuses the variables of the
    first (tf.function allows variables to be made on the first trace only): `_made` counts this trace's."""

    def __init__(self, tf: Any, target: Any, store: list, made: list | None = None):
        self._tf, self._target, self._store = tf, target, store
        self._made = made if made is not None else [0]  # shared by the submodule views (tf.nn, tf.math)

    def __getattr__(self, name: str) -> Any:
        import types

        attr = getattr(self._target, name)
        if isinstance(attr, types.ModuleType):
            return _VariableWeights(self._tf, attr, self._store, self._made)
        if not callable(attr) or isinstance(attr, type):
            return attr
        weight = self._weight

        def call(*args: Any, **kwargs: Any) -> Any:
            return attr(*(weight(a) for a in args), **{k: weight(v) for k, v in kwargs.items()})
        if name == "constant":
            return lambda value, *a, **k: weight(value) if _big(value) and not a and not k else attr(value, *a, **k)
        return call

    def _weight(self, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return type(value)(self._weight(v) for v in value)
        if not _big(value):
            return value
        index = self._made[0]
        self._made[0] += 1
        if index < len(self._store):
            return self._store[index]
        with self._tf.init_scope():
            variable = self._tf.Variable(value, trainable=False)
        self._store.append(variable)
        return variable


def _big(value: Any) -> bool:
    return isinstance(value, np.ndarray) and value.nbytes >= WEIGHT_BYTES


def _to_tf_layout(lowered: _Lowered, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    sample = []
    for spec in lowered.inputs:
        if spec.name not in feed:
            raise UserError("compress.calibration-input", f"calibration sample lacks input {spec.name}",
                            "give every segment input in each calibration sample")
        x = np.asarray(feed[spec.name], np.float32)
        if x.shape != spec.shape:
            raise UserError("compress.calibration-shape",
                            f"calibration input {spec.name} has shape {x.shape}, the segment wants {spec.shape}",
                            "give calibration inputs in the model's own layout and shape")
        sample.append(np.asarray(np.transpose(x, _inv(spec.perm)) if spec.perm else x, order="C"))
    return sample
