"""The steps every TensorFlow-format reader of the converter child shares.

A reader (`keras_file`, `savedmodel`, `tflite_file`) starts TensorFlow and a patched tf2onnx
(`tensorflow`), loads its file through `reading` (a failure there is `import.bad-file`), fixes the
input shapes it converts with (`static_shape`), and hands tf2onnx's result to `finish`, which writes
the ONNX file with its weights as external data. The Keras and SavedModel readers trace with every
weight an input of the graph and make each a constant again just before tf2onnx optimizes
(`weights_in`), from a view of the variable's buffer (`view`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import EdgeSDKError, UsageError, UserError
from ..ir.memory import tensorflow_env
from . import tf2onnx_patches
from .formats import DESCRIPTIONS


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


def reading(fmt: str, read, hint: str = ""):
    """Call `read()` (which loads the source file); a failure means the file is damaged, not what it
    claims, or (`hint`) needs something we do not have."""
    try:
        return read()
    except EdgeSDKError:
        raise
    except Exception as e:
        raise UserError("import.bad-file", f"cannot be read as {DESCRIPTIONS[fmt]}: {first_line(e)}",
                        hint or f"the file may be truncated, damaged or not {DESCRIPTIONS[fmt]}; check that "
                        "TensorFlow loads it, or export it again") from None


class Failures(logging.Handler):
    """tf2onnx logs (rather than raises) a node it failed to convert: keep node name -> reason."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.failed: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("Failed to convert node") and record.args and record.exc_info:
            self.failed[str(record.args[0])] = first_line(record.exc_info[1])


def tensorflow():
    """TensorFlow, tf2onnx with the process-wide patches (`tf2onnx_patches.apply`), and the `Failures`
    of tf2onnx's log."""
    tensorflow_env()
    import tensorflow as tf
    import tf2onnx

    tf2onnx_patches.apply(tf2onnx)
    failures = Failures()
    logging.getLogger("tf2onnx").addHandler(failures)
    return tf, tf2onnx, failures


def static_shape(name: str, shape: tuple, request: dict) -> list[int | None]:
    """The shape to convert with: --input-shape where given, else the batch fixed to --batch before
    conversion (a dynamic batch leaves Shape/Gather arithmetic in the graph)."""
    given = request["input_shapes"].get(name)
    if given is None:
        return [request["batch"] if d == 0 and s is None else s for d, s in enumerate(shape)]
    if len(given) != len(shape):
        raise UsageError("import.dynamic-shape", f"--input-shape gives rank {len(given)} for input '{name}', "
                         f"the model has rank {len(shape)}", f"the model's input '{name}' has shape {_dims(shape)}")
    wrong = [f"input '{name}': dimension {d} is {s} in the model, --input-shape says {v}"
             for d, (s, v) in enumerate(zip(shape, given)) if s is not None and s != v]
    if wrong:
        raise UsageError("import.dynamic-shape", f"--input-shape contradicts the model's input '{name}'",
                         f"the model's input '{name}' has shape {_dims(shape)}", notes=wrong)
    return list(given)


def _dims(shape) -> str:
    return "x".join("?" if s is None else str(s) for s in shape)


def view(tensor):
    """An eager tensor's value as a read-only numpy view of its buffer. TensorFlow's `numpy()` copies a
    buffer a variable shares (a variable's read); DLPack hands over the buffer itself and keeps it alive.
    A value DLPack cannot hand over (a GPU's, a dtype numpy lacks) is copied as `numpy()` does."""
    import numpy as np
    import tensorflow as tf

    class Exported:
        def __dlpack__(self, stream=None, **kwargs):
            return tf.experimental.dlpack.to_dlpack(tensor)

        def __dlpack_device__(self):
            return (1, 0)  # kDLCPU

    if tensor.device and not tensor.device.endswith("CPU:0"):
        return tensor.numpy()
    try:
        return np.from_dlpack(Exported())
    except Exception:  # noqa: BLE001 - any that cannot go this way goes the usual way
        return tensor.numpy()


def weights_in(graph, values: dict) -> None:
    """Each input of tf2onnx's graph named in `values` made a constant of its value (a numpy array), and
    the arithmetic on weights alone folded (`fold_weight_arithmetic`); the numpy views of `values` may
    go once it returns: each constant holds its own bytes."""
    from onnx import numpy_helper

    for node in list(graph.inputs):
        name = node.output[0]
        if name in values:
            graph.inputs.remove(node)
            node.type = "Const"
            node.set_attr("value", numpy_helper.from_array(values[name], name))
    fold_weight_arithmetic(graph)


# Float arithmetic on constants only, as grappler folded it when the weights were constants of the
# TensorFlow graph: a batch norm's gamma * rsqrt(variance + epsilon), written as these ops by Keras.
_FOLDED = {"Add": "add", "Sub": "subtract", "Mul": "multiply", "Div": "divide", "Sqrt": "sqrt",
           "Reciprocal": "reciprocal", "Neg": "negative"}


def fold_weight_arithmetic(graph) -> None:
    """Replace each `_FOLDED` node of tf2onnx's graph whose inputs are all float constants by the
    constant it computes, until none is left; tf2onnx's own optimizers (transposes, its constant
    folding) then see the weights as grappler left them. A chain of folds is computed in float64 and
    each constant rounded once to its type, so a folded batch norm is as exact as float32 holds it."""
    import numpy as np
    from tf2onnx import utils

    outputs = set(graph.outputs)
    exact: dict[str, np.ndarray] = {}  # a folded constant's value in float64, for the folds that read it
    changed = True
    while changed:
        changed = False
        for node in list(graph.get_nodes()):
            if node.type not in _FOLDED or node.output[0] in outputs or len(node.output) != 1:
                continue
            sources = node.inputs
            if not sources or not all(i is not None and i.is_const() for i in sources):
                continue
            args = [i.get_tensor_value(as_list=False) for i in sources]
            if not all(np.issubdtype(a.dtype, np.floating) for a in args) or len({a.dtype for a in args}) != 1:
                continue
            # computed in float64 from the float64 values of earlier folds, rounded once to the graph's type
            wide = [exact.get(i.output[0], a.astype(np.float64)) for i, a in zip(sources, args)]
            result = np.asarray(getattr(np, _FOLDED[node.type])(*wide))
            const = graph.make_const(utils.make_name(node.name), result.astype(args[0].dtype))
            if result.size <= 1 << 20:  # a batch norm's vectors; a whole kernel is not kept twice
                exact[const.output[0]] = result
            graph.replace_all_inputs(node.output[0], const.output[0])
            graph.remove_node(node.name)
            changed = True


def finish(proto, request: dict, tf2onnx, failed: dict[str, str], notes: list[str] | None = None,
           storage=None) -> dict:
    """Write the converted model, every tensor of 1 KiB or more as external data in one file beside it: a
    model of any size (protobuf stops at 2 GB). A tensor tf2onnx's large-model path left in `storage`
    (located by a key of its `name_to_tensor_data`) is written from there, and let go once written; one
    in the proto is moved out of it: no weight is ever copied whole into another buffer."""
    import onnx
    from onnx import external_data_helper

    proto.ir_version = min(proto.ir_version, 10)  # what onnxruntime 1.31 and every backend read
    data = Path(request["onnx"] + ".data")
    stored = storage.name_to_tensor_data if storage is not None else {}
    with open(data, "wb") as f:
        for tensor in external_data_helper._get_all_tensors(proto):
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                key = next(e.value for e in tensor.external_data if e.key == "location")
                value = stored.pop(key)
            elif tensor.HasField("raw_data"):
                value = tensor.raw_data  # a copy of the bytes: read once
                if len(value) < 1024:
                    continue
                tensor.ClearField("raw_data")
            else:
                continue
            offset = -(-f.tell() // 64) * 64
            f.seek(offset)
            f.write(value)
            del value
            del tensor.external_data[:]
            for key, text in (("location", data.name), ("offset", str(offset)), ("length", str(f.tell() - offset))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, text
            tensor.data_location = onnx.TensorProto.EXTERNAL
    if stored:
        raise RuntimeError(f"tf2onnx left {len(stored)} tensor(s) no node of the graph reads")
    Path(request["onnx"]).write_bytes(proto.SerializeToString())
    return {"converter": f"tf2onnx {tf2onnx.__version__}", "notes": notes or [], "failed": failed}
