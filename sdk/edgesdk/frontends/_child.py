"""The converter process: one TensorFlow-format model to ONNX with tf2onnx.

    python -m edgesdk.frontends._child REQUEST.json

Started by `conversion` (see there for why a child). Writes the ONNX file and the result file
that the request names; its stdout and stderr go to a log the user does not see. Every failure
becomes a result, never a traceback: {"ok": false, "kind": "user" | "usage", "code", "message",
"hint", "notes"}. Failures while reading the source are `import.bad-file`, failures inside
tf2onnx `import.convert-failed`.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import itertools
import json
import logging
import math
import sys
from pathlib import Path

from ..errors import EdgeSDKError, UsageError, UserError
from ..ir.memory import tensorflow_env
from .formats import DESCRIPTIONS


def main(argv: list[str]) -> int:
    faulthandler.enable()  # on a native crash, the Python frame goes to the log for the parent
    request = json.loads(Path(argv[1]).read_text())
    try:
        result = {"ok": True, **CONVERTERS[request["format"]](request)}
    except EdgeSDKError as e:
        result = {"ok": False, "kind": "usage" if isinstance(e, UsageError) else "user", "code": e.code,
                  "message": e.message, "hint": e.hint, "notes": e.notes}
    except BaseException as e:  # noqa: BLE001 - whatever it is, the parent reports it
        result = {"ok": False, "kind": "user", "code": "import.convert-failed",
                  "message": f"tf2onnx failed to convert it: {_first_line(e)}",
                  "hint": "the file may be damaged, or hold a construct tf2onnx 1.17 cannot convert; "
                          "`python -m tf2onnx.convert` on it shows the full error"}
    out = Path(request["result"])
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)
    return 0


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


def _reading(fmt: str, read, hint: str = ""):
    """Call `read()` (which loads the source file); a failure means the file is damaged, not what it
    claims, or (`hint`) needs something we do not have."""
    try:
        return read()
    except EdgeSDKError:
        raise
    except Exception as e:
        raise UserError("import.bad-file", f"cannot be read as {DESCRIPTIONS[fmt]}: {_first_line(e)}",
                        hint or f"the file may be truncated, damaged or not {DESCRIPTIONS[fmt]}; check that "
                        "TensorFlow loads it, or export it again") from None


# Keras files fail to load for two reasons besides damage: layers whose class lives in the user's
# code (custom layers), and Lambda layers, whose pickled Python safe_mode refuses to run.
KERAS_HINT = ("the file may be damaged, or need the model's own Python code (custom layers, Lambda layers), "
              "which edgesdk does not run: export it with model.export(path) and pass that SavedModel directory")


class _Failures(logging.Handler):
    """tf2onnx logs (rather than raises) a node it failed to convert: keep node name -> reason."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.failed: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("Failed to convert node") and record.args and record.exc_info:
            self.failed[str(record.args[0])] = _first_line(record.exc_info[1])


def _tensorflow():
    tensorflow_env()
    import tensorflow as tf
    import tf2onnx

    _number_nodes(tf2onnx.graph.Node)
    _fresh_protos(tf2onnx.graph.Node)
    _missing_ops()
    _numpy_2(tf2onnx.graph)
    _constants_stay(tf2onnx.tfonnx)
    _shapes_without_weights(tf2onnx.graph)
    _constants_made_once(tf2onnx.graph.Graph)
    _values_moved(tf2onnx.graph.Node)
    failures = _Failures()
    logging.getLogger("tf2onnx").addHandler(failures)
    return tf, tf2onnx, failures


def _constants_stay(tfonnx) -> None:
    """tf2onnx folds constants with TensorFlow's values of every foldable output and makes each a new
    Const node. A frozen graph reads every weight through an Identity (the variable's read), so every
    weight was held twice more (TensorFlow's value, the new node's tensor) beside the Const it already
    has, while the whole graph was converted. Here the values of constants and of their Identities are
    let go as soon as TensorFlow has folded with them, and an Identity of a Const hands its readers the
    Const itself: VGG16's SavedModel conversion peaked 1 GiB lower."""
    compute, fold = tfonnx.compute_const_folding_using_tf, tfonnx.fold_constants_using_tf
    if getattr(fold, "constants_stay", False):  # done already in this process
        return
    constant = ("Const", "ConstV2")

    def computed(g, const_node_values, graph_outputs):
        values, dtypes = compute(g, const_node_values, graph_outputs)
        for op in g.get_operations():
            if op.type in constant or (op.type == "Identity" and op.inputs[0].op.type in constant):
                values.pop(op.outputs[0].name, None)
        return values, dtypes

    def folded(g, outputs_to_values):
        for op in g.get_nodes():
            if (op.type == "Identity" and len(op.input) == 1 and op.inputs[0] is not None
                    and op.inputs[0].type == "Const" and op.output[0] not in g.outputs):
                g.replace_all_inputs(op.output[0], op.input[0])
        return fold(g, outputs_to_values)

    folded.constants_stay = True
    tfonnx.compute_const_folding_using_tf, tfonnx.fold_constants_using_tf = computed, folded


# a constant this small may be a shape, an axis or a slice bound, which shape inference reads
SHAPE_VALUES = 1024


def _shapes_without_weights(graph_module) -> None:
    """tf2onnx infers a new node's output shapes with ONNX's shape inference on a model of that node
    alone, its constant inputs included as initializers: a Transpose inserted on a weight (a TFLite
    FullyConnected's) serialized, inferred and parsed VGG16's 392 MiB fc1 weight four times over. Only
    constants that may carry shapes are included now; a larger one stays a typed input of that model."""
    infer = graph_module.infer_onnx_shape_dtype
    if getattr(infer, "without_weights", False):  # done already in this process
        return

    def inferred(node, opset_version, input_shapes, input_dtypes, initializers=None):
        small = [t for t in initializers or [] if math.prod(t.dims) <= SHAPE_VALUES]
        return infer(node, opset_version, input_shapes, input_dtypes, small)

    inferred.without_weights = True
    graph_module.infer_onnx_shape_dtype = inferred


def _constants_made_once(graph_class) -> None:
    """tf2onnx makes each new constant (a weight its constant folding transposed, a Keras or TFLite weight
    made a Const) from a copy of the value flattened to test its type, a copy in bytes, the tensor made from
    them, and a copy of that tensor in the node's attribute: five copies of VGG16's 392 MiB fc1 weight at
    once. A numeric value past SHAPE_VALUES is made here as a node with an empty tensor of its type and
    shape, then the value's bytes are set in the node's own tensor: two copies at once, one kept."""
    import numpy as np
    from onnx import TensorProto, helper

    make_const = graph_class.make_const
    if getattr(make_const, "made_once", False):  # done already in this process
        return

    def made_once(self, name, np_val, skip_conversion=False, raw=True):
        if not raw or not isinstance(np_val, np.ndarray) or np_val.dtype == object or np_val.size <= SHAPE_VALUES:
            return make_const(self, name, np_val, skip_conversion, raw)
        empty = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(np_val.dtype), dims=np_val.shape)
        node = self.make_node("Const", [], outputs=[name], name=name, attr={"value": empty},
                              skip_conversion=skip_conversion, dtypes=[empty.data_type], infer_shape_dtype=False)
        # tobytes lays a transposed view out in C order itself: one copy
        node.get_attr("value").t.raw_data = np_val.astype(np_val.dtype.newbyteorder("<"), copy=False).tobytes()
        self.set_shape(name, np_val.shape)
        self.set_dtype(name, empty.data_type)
        return node

    made_once.made_once = True
    graph_class.make_const = made_once


def _values_moved(node_class) -> None:
    """tf2onnx's large-model path stores a constant's bytes apart as the ONNX graph is made
    (`Node.get_value_attr`, with an ExternalTensorStorage), from a deep copy of its attribute: the node
    kept its own, so every weight was held twice (the node's and the storage's) and three times while it
    was copied. Here the bytes are moved: taken once into the storage and cleared from the node, whose
    graph only the model made from it is used after. A later call returns the attribute stored then."""
    import copy

    from onnx import AttributeProto, TensorProto

    get_value_attr = node_class.get_value_attr
    if getattr(get_value_attr, "moved", False):  # done already in this process
        return

    def moved(self, external_tensor_storage=None):
        storage = external_tensor_storage
        a = self._attr.get("value")
        if (storage is None or self in storage.node_to_modified_value_attr or a is None
                or a.type != AttributeProto.TENSOR or math.prod(a.t.dims) <= storage.external_tensor_size_threshold):
            return get_value_attr(self, external_tensor_storage)
        name = self.name.strip() + "_" + str(storage.name_counter)
        for c in '~"#%&*:<>?/\\{|}':  # as tf2onnx names it
            name = name.replace(c, "_")
        storage.name_counter += 1
        storage.name_to_tensor_data[name] = a.t.raw_data
        a.t.ClearField("raw_data")
        stored = copy.deepcopy(a)
        location = stored.t.external_data.add()
        location.key, location.value = "location", name
        stored.t.data_location = TensorProto.EXTERNAL
        storage.node_to_modified_value_attr[self] = stored
        return stored

    moved.moved = True
    node_class.get_value_attr = moved


def _numpy_2(graph_module) -> None:
    """tf2onnx 1.17's large-model path (SavedModel import) calls `np.product`, which numpy 2 removed:
    its module gets a numpy whose `product` is `prod`."""
    import types

    import numpy as np

    if not hasattr(graph_module.np, "product"):
        shim = types.ModuleType("numpy")
        shim.__dict__.update(np.__dict__)
        shim.product = np.prod
        graph_module.np = shim


def _missing_ops() -> None:
    """Conversions tf2onnx 1.17 lacks for ops common models use.

    Erfc: Keras 3 writes its default (exact) GELU as 0.5 * x * erfc(-x / sqrt 2). ONNX has Erf, and
    erfc(x) = 1 - erf(x); the subtraction loses erfc's relative precision where it is below float32's
    epsilon (x > ~3.9), which in GELU multiplies 0.5 * x into an absolute error below 1e-6."""
    import numpy as np
    from tf2onnx import utils
    from tf2onnx.handler import tf_op

    @tf_op("Erfc")
    class Erfc:  # noqa: F841 - registered by the decorator
        @classmethod
        def version_9(cls, ctx, node, **kwargs):
            dtype = utils.map_onnx_to_numpy_type(ctx.get_dtype(node.input[0]))
            one = ctx.make_const(utils.make_name(f"{node.name}_one"), np.array(1, dtype))
            node.type = "Erf"
            sub = ctx.insert_new_node_on_output("Sub", node.output[0], name=utils.make_name(node.name))
            ctx.replace_inputs(sub, [one.output[0], node.output[0]])


def _number_nodes(node_class) -> None:
    """Hash tf2onnx's graph nodes by creation order instead of by address.

    tf2onnx's optimizers walk sets of nodes when they fold constants and merge duplicates; with
    address hashes the walk order, hence which duplicate survives and how the counter behind its
    made-up names runs, changes from run to run. Creation order is the same in every run, so the
    same file converts to the same bytes (the bundle is deterministic from its inputs)."""
    counter = itertools.count()
    init = node_class.__init__

    def numbered_init(self, *args, **kwargs):
        self._edgesdk_number = next(counter)
        init(self, *args, **kwargs)

    node_class.__init__ = numbered_init
    node_class.__hash__ = lambda self: self._edgesdk_number


def _fresh_protos(node_class) -> None:
    """Rebuild each tf2onnx node's NodeProto in a new message when tf2onnx updates it.

    tf2onnx writes every node's attributes into its NodeProto again after each optimizer
    (`Node.update_proto`: clear, then extend), and protobuf's arena keeps the memory of a cleared field
    until the message itself goes: a constant's tensor was kept once per optimizer pass, and VGG16's
    conversion grew by its 553 MB of weights every two seconds. A new message frees the old one whole."""
    from onnx import NodeProto

    update = node_class.update_proto

    def fresh_update_proto(self, *args, **kwargs):
        old = self._op
        op = NodeProto(name=old.name, op_type=old.op_type, domain=old.domain, doc_string=old.doc_string)
        op.input.extend(old.input)
        op.output.extend(old.output)
        self._op = op
        if self.is_const():  # make_graph takes a constant's tensor from its attribute, never from the proto
            return None
        return update(self, *args, **kwargs)

    node_class.update_proto = fresh_update_proto


def _static(name: str, shape: tuple, request: dict) -> list[int | None]:
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


def _keras(request: dict) -> dict:
    tf, tf2onnx, failures = _tensorflow()
    import keras

    # compile=False: the optimizer and losses are not part of the function; safe_mode (the default)
    # refuses Lambda layers' pickled code, which a build tool must not run.
    with _weights_read_from_disk(Path(request["onnx"]).parent):
        model = _reading(request["format"], lambda: keras.models.load_model(request["source"], compile=False),
                         KERAS_HINT)
    specs = [tf.TensorSpec(_static(t.name, tuple(t.shape), request), t.dtype, name=t.name) for t in model.inputs]
    proto, storage = _keras_weights_apart(model, specs, request, tf, tf2onnx)
    return _finish(proto, request, tf2onnx, failures.failed, storage=storage)


@contextlib.contextmanager
def _weights_read_from_disk(folder: Path):
    """Keras reading a .keras file's weights from a copy on disk in `folder`, not from memory. Where memory
    looks sufficient, Keras reads the archive's whole weights file into memory and the variables from
    that: VGG16's 528 MiB twice at once, the converter's peak. Otherwise it extracts the file to a
    temporary folder beside the model, where a user's folder may be read-only: here, in `folder`."""
    import tempfile

    from keras.src.saving import saving_lib

    class InFolder:
        def __getattr__(self, name):
            return getattr(tempfile, name)

        @staticmethod
        def TemporaryDirectory(*args, dir=None, **kwargs):  # noqa: N802 - tempfile's name
            return tempfile.TemporaryDirectory(*args, dir=folder, **kwargs)

    with contextlib.ExitStack() as undo:
        for name, value in (("is_memory_sufficient", lambda model: False), ("tempfile", InFolder())):
            original = getattr(saving_lib, name)  # an AttributeError where Keras renamed it: loud
            undo.callback(setattr, saving_lib, name, original)
            setattr(saving_lib, name, value)
        yield


def _keras_weights_apart(model, specs: list, request: dict, tf, tf2onnx):
    """The converted model and tf2onnx's storage of its weights, its graph traced with the weights as inputs.

    tf2onnx's own path (`from_keras`) freezes every variable into a constant of the TensorFlow graph,
    which then passes through several GraphDef copies and grappler's constant folding: VGG16's 553 MB of
    weights took the converter past 24 GB. Here the function traced is the model's `stateless_call` with
    every variable an input, so no TensorFlow graph holds a weight. Each input becomes a constant of
    tf2onnx's own graph just before tf2onnx optimizes it (`optimize_graph`), read from its variable
    then, so that tf2onnx folds transposes and batch norms into the weights as it did before."""
    variables = [*model.trainable_variables, *model.non_trainable_variables]
    trainable = len(model.trainable_variables)
    inputs = len(specs)
    names = _weight_names([getattr(v, "path", "") for v in variables], {s.name for s in specs})
    weight_specs = [tf.TensorSpec(tuple(v.shape), v.dtype, name=n) for v, n in zip(variables, names)]
    output_names = list(getattr(model, "output_names", None) or [f"output_{i}" for i in range(len(model.outputs))])

    def serve(*args):
        x = list(args[:inputs]) if inputs > 1 else args[0]
        weights = list(args[inputs:])
        outputs, _ = model.stateless_call(weights[:trainable], weights[trainable:], x, training=False)
        return dict(zip(output_names, tf.nest.flatten(outputs)))

    signature = [*specs, *weight_specs]
    # each variable's value, read now: tf2onnx works inside a graph, where a variable cannot be read; a
    # view of the variable's buffer, not a copy (`_view`)
    values = {n: _view(tf.convert_to_tensor(v.value)) for n, v in zip(names, variables)}

    def let_go() -> None:
        # the graph holds the weights now: let TensorFlow free its own copy before tf2onnx writes the model
        values.clear()
        for variable in variables:
            if getattr(variable, "_value", None) is not None:  # Keras 3's handle on the tf.Variable
                variable._value = None

    with _weights_stored() as stored:
        proto = _lean_first(tf2onnx, lambda: tf2onnx.convert.from_function(
            tf.function(serve, input_signature=signature), input_signature=signature, opset=request["opset"])[0],
            before=lambda graph: _weights_in(graph, values), after=let_go)
    storage = stored[-1]
    by_name = {o.name: o for o in proto.graph.output}  # in the model's order (a dict's come sorted by key)
    if set(by_name) == set(output_names):
        ordered = [by_name[n] for n in output_names]
        del proto.graph.output[:]
        proto.graph.output.extend(ordered)
    return proto, storage


@contextlib.contextmanager
def _weights_stored():
    """tf2onnx's `Graph.make_model` with an ExternalTensorStorage, as its large-model path makes the model:
    each weight's bytes leave the graph's constants for the storage as the ONNX graph is made, so that the
    graph, then the model (onnx's `make_model` copies the graph), copy none of them; `_finish` writes them
    from the storage. Yields the list each call's storage is appended to. (tf2onnx's own large-model path
    for a TFLite file fails: it compresses a TensorFlow graph that file does not have.)"""
    from tf2onnx import graph

    make_model = graph.Graph.make_model
    stored: list = []

    def storing(self, *args, external_tensor_storage=None, **kwargs):
        stored.append(external_tensor_storage or graph.ExternalTensorStorage())
        return make_model(self, *args, external_tensor_storage=stored[-1], **kwargs)

    graph.Graph.make_model = storing
    try:
        yield stored
    finally:
        graph.Graph.make_model = make_model


@contextlib.contextmanager
def _tflite_read_lean(tflite_utils):
    """tf2onnx's reading of a TFLite file, each weight copied once.

    - It asks TFLite's interpreter for the tensors' shapes, and the interpreter's default XNNPACK delegate
      packed every weight into a layout of its own first: here the interpreter runs without delegates.
    - It made each constant from the buffer's bytes through a TensorFlow TensorProto, a numpy array, an
      ONNX tensor and the node's copy of it: five copies of VGG16's 392 MiB fc1 weight at once. Here the
      buffer's bytes (one copy of the file's) become the node's tensor directly (`_Content`, `_Pending`).
    """
    import types

    import numpy as np
    import tensorflow as tf
    from onnx import TensorProto

    real = {k: getattr(tflite_utils, k) for k in ("tensor_pb2", "tensor_util", "numpy_helper", "helper")}
    interpreter = tf.lite.Interpreter

    class _Dims(list):
        def add(self):
            self.append(types.SimpleNamespace(size=0))
            return self[-1]

    class _Content:
        """The fields of TensorFlow's TensorProto tflite_utils sets, the buffer's bytes kept as they are."""

        def __init__(self):
            self.tensor_content, self.dtype = b"", 0
            self.tensor_shape = types.SimpleNamespace(dim=_Dims())

    class _Pending:
        """An ONNX tensor to be: a view of one bytes object, which becomes the node's tensor's bytes."""

        def __init__(self, array, content: bytes, name):
            self.array, self.content, self.name = array, content, name

    def make_ndarray(t):
        if isinstance(t, _Content):
            try:
                dtype = np.dtype(tf.dtypes.as_dtype(t.dtype).as_numpy_dtype)
                if dtype.kind in "biufc" and dtype.isnative:
                    return np.frombuffer(t.tensor_content, dtype).reshape([d.size for d in t.tensor_shape.dim])
            except (TypeError, ValueError):
                pass
            proto = real["tensor_pb2"].TensorProto(tensor_content=t.tensor_content, dtype=t.dtype)
            for d in t.tensor_shape.dim:
                proto.tensor_shape.dim.add().size = d.size
            t = proto
        return real["tensor_util"].MakeNdarray(t)

    def from_array(array, name=None):
        owner = array
        while isinstance(owner, np.ndarray):
            owner = owner.base
        if (isinstance(owner, bytes) and len(owner) == array.nbytes and array.flags.c_contiguous
                and array.size > SHAPE_VALUES and array.dtype.isnative):
            return _Pending(array, owner, name)
        return real["numpy_helper"].from_array(array, name)

    def make_node(op_type, inputs, outputs, name=None, doc_string=None, domain=None, **kwargs):
        value = kwargs.get("value")
        if not isinstance(value, _Pending):
            return real["helper"].make_node(op_type, inputs, outputs, name, doc_string, domain, **kwargs)
        dtype = real["helper"].np_dtype_to_tensor_dtype(value.array.dtype)
        kwargs["value"] = TensorProto(name=value.name, data_type=dtype, dims=value.array.shape)
        node = real["helper"].make_node(op_type, inputs, outputs, name, doc_string, domain, **kwargs)
        next(a for a in node.attribute if a.name == "value").t.raw_data = value.content
        return node

    def forward(module, **own):  # the module's names, `own` in place of some
        return types.SimpleNamespace(**{**{k: getattr(module, k) for k in dir(module) if not k.startswith("__")},
                                        **own})

    tflite_utils.tensor_pb2 = types.SimpleNamespace(TensorProto=_Content)
    tflite_utils.tensor_util = types.SimpleNamespace(MakeNdarray=make_ndarray)
    tflite_utils.numpy_helper = forward(real["numpy_helper"], from_array=from_array)
    tflite_utils.helper = forward(real["helper"], make_node=make_node)
    tf.lite.Interpreter = lambda *args, **kwargs: interpreter(*args, **{
        "experimental_op_resolver_type": tf.lite.experimental.OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
        **kwargs})
    try:
        yield
    finally:
        for k, module in real.items():
            setattr(tflite_utils, k, module)
        tf.lite.Interpreter = interpreter


def _weights_in(graph, values: dict) -> None:
    """Each input of tf2onnx's graph named in `values` made a constant of its value (a numpy array), and
    the arithmetic on weights alone folded (`_fold_weight_arithmetic`); the numpy views of `values` may
    go once it returns: each constant holds its own bytes."""
    from onnx import numpy_helper

    for node in list(graph.inputs):
        name = node.output[0]
        if name in values:
            graph.inputs.remove(node)
            node.type = "Const"
            node.set_attr("value", numpy_helper.from_array(values[name], name))
    _fold_weight_arithmetic(graph)


def _lean_first(tf2onnx, convert, before=lambda graph: None, after=lambda: None):
    """`convert()` with tf2onnx's optimizers run without catch_errors, and only where one of them fails,
    again with it. With catch_errors, tf2onnx deep-copies the whole graph, weights and all, before each
    of its optimizers, to fall back on where one fails: 6 to 15 copies of the weights at the peak
    (tf2onnx's own large-model path goes without too). `before(graph)` runs on tf2onnx's graph just
    before it is optimized, `after()` once it is."""
    optimizer = tf2onnx.optimizer
    optimize_graph = optimizer.optimize_graph
    failed_in = []
    lean = [True]

    def optimize(graph, _catch_errors=True, *args, **kwargs):  # catch_errors: decided here
        before(graph)
        try:
            optimized = optimize_graph(graph, not lean[0], *args, **kwargs)
        except Exception:
            failed_in.append("optimize_graph")
            raise
        after()
        return optimized

    optimizer.optimize_graph = optimize
    try:
        try:
            return convert()
        except Exception:
            if not failed_in:
                raise
            lean[0] = False
            return convert()
    finally:
        optimizer.optimize_graph = optimize_graph


# Float arithmetic on constants only, as grappler folded it when the weights were constants of the
# TensorFlow graph: a batch norm's gamma * rsqrt(variance + epsilon), written as these ops by Keras.
_FOLDED = {"Add": "add", "Sub": "subtract", "Mul": "multiply", "Div": "divide", "Sqrt": "sqrt",
           "Reciprocal": "reciprocal", "Neg": "negative"}


def _fold_weight_arithmetic(graph) -> None:
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


def _weight_names(paths: list[str], taken: set[str]) -> list[str]:
    """A name for each variable's input: its Keras path where that is a valid, unused TensorFlow name."""
    import re

    names = []
    for i, path in enumerate(paths):
        name = re.sub(r"[^A-Za-z0-9_./-]", "_", path or "")
        if not re.fullmatch(r"[A-Za-z0-9.][A-Za-z0-9_./-]*", name) or name in taken:
            name = f"edgesdk_weight_{i}"
        taken.add(name)
        names.append(name)
    return names


def _savedmodel(request: dict) -> dict:
    tf, tf2onnx, failures = _tensorflow()
    from tf2onnx.convert import _convert_common

    notes: list[str] = []
    values: dict = {}  # a weight's placeholder in the frozen graph -> its value

    def convert():
        frozen, inputs, outputs, renamed, name = _frozen(tf, request, notes, values)
        with tf.device("/cpu:0"):
            return _convert_common(frozen, name=name, continue_on_error=True, opset=request["opset"],
                                   input_names=[*inputs, *values], output_names=outputs, large_model=True,
                                   tensors_to_rename=renamed)

    # tf2onnx's large-model path without its weights: the serving signature is frozen with each weight a
    # placeholder (`_frozen`), so that neither the frozen GraphDef nor TensorFlow's graph tf2onnx imports
    # holds one (their copies held VGG16's 528 MiB of weights 3 times at the converter's peak); each
    # becomes a constant of tf2onnx's own graph just before it is optimized, as for a Keras model, and is
    # written beside the ONNX graph from tf2onnx's storage (`_finish`). A retry (`_lean_first`) freezes again.
    with _weights_stored() as stored:
        proto = _lean_first(tf2onnx, lambda: convert()[0], before=lambda graph: _weights_in(graph, values),
                             after=values.clear)
    return _finish(proto, request, tf2onnx, failures.failed, notes, stored[-1])


def _frozen(tf, request: dict, notes: list[str], values: dict):
    """The SavedModel's serving signature frozen, with its input and output names, tf2onnx's renames and
    its name. Each weight of 1 KiB or more is a placeholder of the frozen graph, its value put in `values`
    under the placeholder's name (`_frozen_without_weights`). The SavedModel is let go before it returns:
    what is left of it is the weights the signature reads (Keras's `export` holds each weight twice)."""
    import gc

    from tf2onnx import tf_loader
    from tf2onnx.convert import tensor_names_from_structed

    loaded = _reading("savedmodel", lambda: tf.saved_model.load(request["source"]))
    signatures = dict(getattr(loaded, "signatures", {}) or {})
    del notes[:]
    if "serving_default" in signatures:
        key = "serving_default"
        if set(signatures) - {"serving_default", "serve"}:  # model.export() writes serve as a twin of serving_default
            notes.append(f"the SavedModel has signatures {', '.join(sorted(signatures))}: converted serving_default")
    elif len(signatures) == 1:
        key = next(iter(signatures))
    elif not signatures:
        raise UserError("import.savedmodel-signature", "the SavedModel has no signature to convert",
                        "export it with model.export(path) or tf.saved_model.save(obj, path, signatures=fn)")
    else:
        raise UserError("import.savedmodel-signature", f"the SavedModel has {len(signatures)} signatures and none is "
                        "serving_default", "export the one to deploy as serving_default "
                        "(tf.saved_model.save(obj, path, signatures={'serving_default': fn}))",
                        notes=[f"signature '{k}'" for k in sorted(signatures)])
    fn = signatures[key]
    args, kwargs = fn.structured_input_signature
    if args:
        raise UserError("import.savedmodel-signature", f"signature '{key}' takes positional inputs",
                        "signatures take named inputs; export it again with tf.saved_model.save")
    names = list(kwargs)
    specs = [tf.TensorSpec(_static(n, tuple(kwargs[n].shape), request), kwargs[n].dtype, name=n) for n in names]

    @tf.function(input_signature=specs)
    def serve(*inputs):
        return fn(**dict(zip(names, inputs)))

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


_WEIGHT_MARK = b"edgesdk-weight:"


def _view(tensor):
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


def _frozen_without_weights(tf_loader, concrete, inputs: list[str], outputs: list[str], values: dict):
    """`concrete` frozen (tf2onnx's large-model freeze) with each weight of 1 KiB or more a placeholder of
    the frozen GraphDef, its value (the variable's buffer, not a copy) put in `values` under `name:0`.

    TensorFlow's freeze copies each variable's value into a TensorProto of the GraphDef, and tf2onnx
    imports the GraphDef into a TensorFlow graph: both copies lived beside the variables. Here the freeze
    gets a marked, empty TensorProto for each weight (`make_tensor_proto`), and each constant so marked
    becomes a placeholder of the same name, dtype and shape. Where the freeze put a weight anywhere else
    (in a function of the graph's library, which tf2onnx converts too), it runs again as TensorFlow has it."""
    import numpy as np
    from tensorflow.core.framework import tensor_pb2
    from tensorflow.python.framework import convert_to_constants, dtypes, tensor_shape, tensor_util
    from tensorflow.python.ops import variables

    make_tensor_proto = tensor_util.make_tensor_proto
    converter = convert_to_constants._FunctionConverterDataInEager
    evaluate = converter._eval
    left_out: list = []

    def viewing(self, tensor):
        return _view(tensor.read_value()) if isinstance(tensor, variables.Variable) else evaluate(self, tensor)

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
    return graph_def


def _tflite(request: dict) -> dict:
    _, tf2onnx, failures = _tensorflow()
    from . import tflite_custom

    flatbuffer = _reading("tflite", lambda: _read_tflite(request["source"]))
    _refuse_state(flatbuffer["state"], flatbuffer["subgraphs"])
    done: dict[str, str] = {}
    refused: dict[str, str] = {}
    rewrite = tflite_custom.rewriter(flatbuffer["custom_ops"], done, refused)
    with _weights_stored() as stored, _tflite_read_lean(tf2onnx.tflite_utils):
        proto = _lean_first(tf2onnx, lambda: tf2onnx.convert.from_tflite(
            request["source"], opset=request["opset"], custom_rewriter=[rewrite] if rewrite else None)[0])
    storage = stored[-1]
    _rename_values(proto.graph, flatbuffer["signature_names"])
    notes = [f"TFLite custom op {code} ({count} node(s)) converted by edgesdk as {tflite_custom.HANDLERS[code][0]}"
             for code, count in sorted(collections.Counter(done.values()).items())]
    # A TFLite file fixes its shapes; only a -1 in shape_signature marks a batch that can change.
    notes += [f"TFLite input '{flatbuffer['signature_names'].get(name, name)}' has the static shape "
              f"{'x'.join(map(str, shape))} in the file: --batch {request['batch']} does not apply to it"
              for name, shape, signature in flatbuffer["inputs"]
              if shape and request["batch"] != shape[0] and (not signature or signature[0] != -1)]
    result = _finish(proto, request, tf2onnx, {**failures.failed, **refused}, notes, storage)
    result["custom_codes"] = sorted({op.code for op in flatbuffer["custom_ops"]})
    return result


# TFLite's resource-variable ops: a model that keeps state between invocations (a tf.Variable
# assigned inside the converted function). CALL_ONCE runs the subgraph that initializes the
# variables. tf2onnx 1.17 has no conversion for any of them and fails with an IndexError.
STATE_OPS = ("VAR_HANDLE", "READ_VARIABLE", "ASSIGN_VARIABLE", "CALL_ONCE")


def _read_tflite(path: str) -> dict:
    """From the flatbuffer: every custom op (code, output tensor, options), the main subgraph's
    inputs (name, shape, shape_signature), signature names for its input and output tensors
    (what the user called them), the number of subgraphs, and per subgraph the count of each
    state op (STATE_OPS) it holds."""
    from tf2onnx.tflite.BuiltinOperator import BuiltinOperator
    from tf2onnx.tflite.Model import Model

    from .tflite_custom import CustomOp

    model = Model.GetRootAsModel(bytearray(Path(path).read_bytes()), 0)
    builtin_names = {v: k for k, v in vars(BuiltinOperator).items() if not k.startswith("_")}
    custom_codes, op_names = {}, {}
    for i in range(model.OperatorCodesLength()):
        code = model.OperatorCodes(i)
        builtin = max(code.DeprecatedBuiltinCode(), code.BuiltinCode())
        op_names[i] = builtin_names.get(builtin, str(builtin))
        if builtin == BuiltinOperator.CUSTOM:
            custom_codes[i] = (code.CustomCode() or b"").decode(errors="replace")
    custom_ops = []
    state = []
    for s in range(model.SubgraphsLength()):
        graph = model.Subgraphs(s)
        ops = collections.Counter(op_names.get(graph.Operators(k).OpcodeIndex()) for k in range(graph.OperatorsLength()))
        if any(ops[name] for name in STATE_OPS):
            state.append((s, (graph.Name() or b"").decode(errors="replace"), {n: ops[n] for n in STATE_OPS if ops[n]}))
        for k in range(graph.OperatorsLength()):
            op = graph.Operators(k)
            if op.OpcodeIndex() in custom_codes and op.OutputsLength():
                options = b"" if op.CustomOptionsIsNone() else op.CustomOptionsAsNumpy().tobytes()
                custom_ops.append(CustomOp(custom_codes[op.OpcodeIndex()],
                                           graph.Tensors(op.Outputs(0)).Name().decode(errors="replace"), options))
    main = model.Subgraphs(0)
    inputs = []
    for j in range(main.InputsLength()):
        t = main.Tensors(main.Inputs(j))
        inputs.append((t.Name().decode(errors="replace"), [int(d) for d in t.ShapeAsNumpy()] if t.ShapeLength() else [],
                       [int(d) for d in t.ShapeSignatureAsNumpy()] if t.ShapeSignatureLength() else []))
    names = {}
    if model.SignatureDefsLength() == 1:
        signature = model.SignatureDefs(0)
        graph = model.Subgraphs(signature.SubgraphIndex())
        for tensors, count in ((signature.Inputs, signature.InputsLength()), (signature.Outputs, signature.OutputsLength())):
            for j in range(count):
                t = tensors(j)
                names[graph.Tensors(t.TensorIndex()).Name().decode(errors="replace")] = t.Name().decode(errors="replace")
    return {"custom_ops": custom_ops, "signature_names": names, "inputs": inputs,
            "subgraphs": model.SubgraphsLength(), "state": state}


def _refuse_state(state: list[tuple[int, str, dict[str, int]]], subgraphs: int) -> None:
    """A model with resource variables is refused before tf2onnx sees it, naming the ops: the
    compiled bundle is a function of its inputs, and tf2onnx would fail with an IndexError."""
    if not state:
        return
    present = {op for _, _, ops in state for op in ops}
    raise UserError(
        "import.tflite-stateful",
        f"the TFLite model keeps state in resource variables: ops {', '.join(n for n in STATE_OPS if n in present)} "
        f"in {len(state)} of its {subgraphs} subgraph(s); edgesdk converts stateless models only",
        "export the model without state: a function that only reads its variables converts with them frozen "
        "into constants; one that assigns them must take the state as an input and return the new state as an "
        "output (as an RNN cell does with h and c)",
        notes=[f"subgraph {i} '{name}': " + ", ".join(f"{op} x{n}" for op, n in ops.items())
               for i, name, ops in state])


def _rename_values(graph, names: dict[str, str]) -> None:
    """Rename graph inputs and outputs (and every use of them) where the new names are unused."""
    taken = {v for n in graph.node for v in list(n.input) + list(n.output)} | {i.name for i in graph.initializer}
    io = {v.name for v in list(graph.input) + list(graph.output)}
    names = {old: new for old, new in names.items() if old in io and old != new}
    if not names or len(set(names.values())) != len(names) or set(names.values()) & (taken - set(names)):
        return

    def rename(g):
        for v in [*g.input, *g.output, *g.value_info]:
            v.name = names.get(v.name, v.name)
        for n in g.node:
            n.input[:] = [names.get(v, v) for v in n.input]
            n.output[:] = [names.get(v, v) for v in n.output]
            for sub in _subgraphs(n):  # subgraphs may read outer values by name
                rename(sub)

    rename(graph)


def _subgraphs(node) -> list:
    return [g for a in node.attribute for g in ([a.g] if a.HasField("g") else []) + list(a.graphs)]


def _finish(proto, request: dict, tf2onnx, failed: dict[str, str], notes: list[str] | None = None,
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


CONVERTERS = {"keras": _keras, "h5": _keras, "savedmodel": _savedmodel, "tflite": _tflite}

if __name__ == "__main__":
    sys.exit(main(sys.argv))
