"""The converter child's reader of TensorFlow SavedModel directories.

The serving signature is frozen by tf2onnx's large-model path with every weight a placeholder
(`_frozen`), and converted with each weight made a constant of tf2onnx's graph just before it is
optimized, as for a Keras model.
"""

from __future__ import annotations

from ..errors import UserError
from . import tf2onnx_patches
from .tf2onnx_steps import finish, reading, static_shape, tensorflow, view, weights_in


def convert(request: dict) -> dict:
    tf, tf2onnx, failures = tensorflow()
    from tf2onnx.convert import _convert_common

    notes: list[str] = []
    values: dict = {}  # a weight's placeholder in the frozen graph -> its value

    def convert_frozen():
        frozen, inputs, outputs, renamed, name = _frozen(tf, request, notes, values)
        with tf.device("/cpu:0"):
            return _convert_common(frozen, name=name, continue_on_error=True, opset=request["opset"],
                                   input_names=[*inputs, *values], output_names=outputs, large_model=True,
                                   tensors_to_rename=renamed)

    # tf2onnx's large-model path without its weights: the serving signature is frozen with each weight a
    # placeholder (`_frozen`), so that neither the frozen GraphDef nor TensorFlow's graph tf2onnx imports
    # holds one (their copies held VGG16's 528 MiB of weights 3 times at the converter's peak); each
    # becomes a constant of tf2onnx's own graph just before it is optimized, as for a Keras model, and is
    # written beside the ONNX graph from tf2onnx's storage (`finish`). A retry (`lean_first`) freezes again.
    with tf2onnx_patches.weights_stored() as stored:
        proto = tf2onnx_patches.lean_first(tf2onnx, lambda: convert_frozen()[0], before=lambda graph: weights_in(graph, values),
                                           after=values.clear)
    return finish(proto, request, tf2onnx, failures.failed, notes, stored[-1])


def _frozen(tf, request: dict, notes: list[str], values: dict):
    """The SavedModel's serving signature frozen, with its input and output names, tf2onnx's renames and
    its name. Each weight of 1 KiB or more is a placeholder of the frozen graph, its value put in `values`
    under the placeholder's name (`_frozen_without_weights`). The SavedModel is let go before it returns:
    what is left of it is the weights the signature reads (Keras's `export` holds each weight twice)."""
    import gc

    from tf2onnx import tf_loader
    from tf2onnx.convert import tensor_names_from_structed

    loaded = reading("savedmodel", lambda: tf.saved_model.load(request["source"]))
    signatures = dict(getattr(loaded, "signatures", {}) or {})
    del notes[:]
    key = _serving_key(signatures, notes)
    fn = signatures[key]
    args, kwargs = fn.structured_input_signature
    if args:
        raise UserError("import.savedmodel-signature", f"signature '{key}' takes positional inputs",
                        "signatures take named inputs; export it again with tf.saved_model.save")
    names = list(kwargs)
    specs = [tf.TensorSpec(static_shape(n, tuple(kwargs[n].shape), request), kwargs[n].dtype, name=n) for n in names]

    @tf.function(input_signature=specs)
    def serve(*inputs):
        return fn(**dict(zip(names, inputs)))  # noqa: F821 - ruff takes the `del fn` below for its scope

    concrete = serve.get_concrete_function(*specs)
    inputs = [t.name for t in concrete.inputs if t.dtype != tf.dtypes.resource]
    outputs = [t.name for t in concrete.outputs if t.dtype != tf.dtypes.resource]
    renamed = tensor_names_from_structed(concrete, inputs, outputs)
    with tf.device("/cpu:0"):
        frozen = _frozen_without_weights(tf_loader, concrete, inputs, outputs, values)
    name = concrete.name
    del loaded, signatures, fn, serve, concrete
    gc.collect()  # the restored objects' reference cycles: the variables the signature does not read go with them
    return frozen, inputs, outputs, renamed, name


def _serving_key(signatures: dict, notes: list[str]) -> str:
    """The signature to convert: serving_default (a note where others are left out), else the only one."""
    if "serving_default" in signatures:
        if set(signatures) - {"serving_default", "serve"}:  # model.export() writes serve as a twin of serving_default
            notes.append(f"the SavedModel has signatures {', '.join(sorted(signatures))}: converted serving_default")
        return "serving_default"
    if len(signatures) == 1:
        return next(iter(signatures))
    if not signatures:
        raise UserError("import.savedmodel-signature", "the SavedModel has no signature to convert",
                        "export it with model.export(path) or tf.saved_model.save(obj, path, signatures=fn)")
    raise UserError("import.savedmodel-signature", f"the SavedModel has {len(signatures)} signatures and none is "
                    "serving_default", "export the one to deploy as serving_default "
                    "(tf.saved_model.save(obj, path, signatures={'serving_default': fn}))",
                    notes=[f"signature '{k}'" for k in sorted(signatures)])


_WEIGHT_MARK = b"edgesdk-weight:"


def _frozen_without_weights(tf_loader, concrete, inputs: list[str], outputs: list[str], values: dict):
    """`concrete` frozen (tf2onnx's large-model freeze) with each weight of 1 KiB or more a placeholder of
    the frozen GraphDef, its value (the variable's buffer, not a copy) put in `values` under `name:0`.

    TensorFlow's freeze copies each variable's value into a TensorProto of the GraphDef, and tf2onnx
    imports the GraphDef into a TensorFlow graph: both copies lived beside the variables. Here the freeze
    gets a marked, empty TensorProto for each weight (`make_tensor_proto`), and each constant so marked
    becomes a placeholder of the same name, dtype and shape (`_placeholders`). Where the freeze put a weight
    anywhere else (in a function of the graph's library, which tf2onnx converts too), it runs again as
    TensorFlow has it."""
    import numpy as np
    from tensorflow.core.framework import tensor_pb2
    from tensorflow.python.framework import convert_to_constants, dtypes, tensor_shape, tensor_util
    from tensorflow.python.ops import variables

    make_tensor_proto = tensor_util.make_tensor_proto
    converter = convert_to_constants._FunctionConverterDataInEager
    evaluate = converter._eval
    left_out: list = []

    def viewing(self, tensor):
        return view(tensor.read_value()) if isinstance(tensor, variables.Variable) else evaluate(self, tensor)

    def leaving_out(array, dtype=None, shape=None, *args, **kwargs):
        if not isinstance(array, np.ndarray) or array.nbytes < 1024 or array.dtype == object:
            return make_tensor_proto(array, dtype, shape, *args, **kwargs)
        proto = tensor_pb2.TensorProto(dtype=dtypes.as_dtype(array.dtype).as_datatype_enum,
                                       tensor_shape=tensor_shape.as_shape(array.shape).as_proto(),
                                       tensor_content=_WEIGHT_MARK + str(len(left_out)).encode())
        left_out.append(array)
        return proto

    tensor_util.make_tensor_proto, converter._eval = leaving_out, viewing
    try:
        graph_def = tf_loader.from_function(concrete, inputs, outputs, large_model=True)
    finally:
        tensor_util.make_tensor_proto, converter._eval = make_tensor_proto, evaluate
    marked = [node for node in graph_def.node
              if node.op == "Const" and node.attr["value"].tensor.tensor_content.startswith(_WEIGHT_MARK)]
    if len(marked) != len(left_out):
        del graph_def, marked, left_out[:]
        return tf_loader.from_function(concrete, inputs, outputs, large_model=True)
    _placeholders(marked, left_out, values)
    return graph_def


def _placeholders(marked: list, left_out: list, values: dict) -> None:
    """Each marked Const node of the frozen GraphDef made a placeholder of its name, dtype and shape, the
    value the freeze left out put in `values` under `name:0`."""
    from tensorflow.python.framework import tensor_shape

    for node in marked:
        tensor = node.attr["value"].tensor
        value = left_out[int(tensor.tensor_content[len(_WEIGHT_MARK):])]
        dtype, shape = tensor.dtype, tensor_shape.TensorShape(tensor.tensor_shape).as_proto()
        name = node.name
        node.Clear()
        node.name, node.op = name, "Placeholder"
        node.attr["dtype"].type = dtype
        node.attr["shape"].shape.CopyFrom(shape)
        values[f"{name}:0"] = value
