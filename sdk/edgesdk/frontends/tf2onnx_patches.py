"""tf2onnx, patched where it copies weights, converts nondeterministically or lacks a conversion.

Each patch wraps or replaces one tf2onnx function (or a module attribute a function of it reads),
and each was written against one tf2onnx version, named by `written_for`: it fails the conversion with
`import.converter-version` before it changes anything where another version is installed, since the
code it wraps may no longer be what it was written around. constraints.txt pins that version.

- Process-wide, applied once by `apply` as the converter starts: `_number_nodes`, `_fresh_protos`,
  `_missing_ops`, `_numpy_2`, `_constants_stay`, `_shapes_without_weights`, `_constants_made_once`,
  `_values_moved`.
- Around one conversion (context managers, undone after it): `weights_stored`, `lean_first`,
  `tflite_read_lean`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import types

from ..errors import UsageError

# a constant this small may be a shape, an axis or a slice bound, which shape inference reads
SHAPE_VALUES = 1024


def written_for(version: str):
    """Mark a patch as written against tf2onnx `version`: applied to another version it raises
    `import.converter-version`, naming the patch, and patches nothing."""

    def mark(patch):
        @functools.wraps(patch)
        def checked(*args, **kwargs):
            import tf2onnx

            if tf2onnx.__version__ != version:
                raise UsageError("import.converter-version",
                                 f"tf2onnx {tf2onnx.__version__} is installed; edgesdk's patch {patch.__name__} of it "
                                 f"was written for tf2onnx {version}",
                                 f"install tf2onnx=={version}, the version edgesdk's constraints.txt pins")
            return patch(*args, **kwargs)

        checked.tf2onnx_version = version
        return checked

    return mark


def apply(tf2onnx) -> None:
    """The process-wide patches, in the order they were always applied."""
    _number_nodes(tf2onnx.graph.Node)
    _fresh_protos(tf2onnx.graph.Node)
    _missing_ops()
    _numpy_2(tf2onnx.graph)
    _constants_stay(tf2onnx.tfonnx)
    _shapes_without_weights(tf2onnx.graph)
    _constants_made_once(tf2onnx.graph.Graph)
    _values_moved(tf2onnx.graph.Node)


@written_for("1.17.0")
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


@written_for("1.17.0")
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


@written_for("1.17.0")
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


@written_for("1.17.0")
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


@written_for("1.17.0")
def _numpy_2(graph_module) -> None:
    """tf2onnx 1.17's large-model path (SavedModel import) calls `np.product`, which numpy 2 removed:
    its module gets a numpy whose `product` is `prod`."""
    import numpy as np

    if not hasattr(graph_module.np, "product"):
        shim = types.ModuleType("numpy")
        shim.__dict__.update(np.__dict__)
        shim.product = np.prod
        graph_module.np = shim


@written_for("1.17.0")
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


@written_for("1.17.0")
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


@written_for("1.17.0")
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


@written_for("1.17.0")
@contextlib.contextmanager
def weights_stored():
    """tf2onnx's `Graph.make_model` with an ExternalTensorStorage, as its large-model path makes the model:
    each weight's bytes leave the graph's constants for the storage as the ONNX graph is made, so that the
    graph, then the model (onnx's `make_model` copies the graph), copy none of them; `finish` writes them
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


@written_for("1.17.0")
def lean_first(tf2onnx, convert, before=lambda graph: None, after=lambda: None):
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


@written_for("1.17.0")
@contextlib.contextmanager
def tflite_read_lean(tflite_utils):
    """tf2onnx's reading of a TFLite file, each weight copied once.

    - It asks TFLite's interpreter for the tensors' shapes, and the interpreter's default XNNPACK delegate
      packed every weight into a layout of its own first: here the interpreter runs without delegates.
    - It made each constant from the buffer's bytes through a TensorFlow TensorProto, a numpy array, an
      ONNX tensor and the node's copy of it: five copies of VGG16's 392 MiB fc1 weight at once. Here the
      buffer's bytes (one copy of the file's) become the node's tensor directly (`_Content`, `_Pending`).
    """
    import tensorflow as tf

    real = {k: getattr(tflite_utils, k) for k in ("tensor_pb2", "tensor_util", "numpy_helper", "helper")}
    interpreter = tf.lite.Interpreter

    tflite_utils.tensor_pb2 = types.SimpleNamespace(TensorProto=_Content)
    tflite_utils.tensor_util = types.SimpleNamespace(MakeNdarray=functools.partial(_content_array, real))
    tflite_utils.numpy_helper = _forward(real["numpy_helper"], from_array=functools.partial(_pending_tensor, real))
    tflite_utils.helper = _forward(real["helper"], make_node=functools.partial(_node_of_pending, real))
    tf.lite.Interpreter = lambda *args, **kwargs: interpreter(*args, **{
        "experimental_op_resolver_type": tf.lite.experimental.OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
        **kwargs})
    try:
        yield
    finally:
        for k, module in real.items():
            setattr(tflite_utils, k, module)
        tf.lite.Interpreter = interpreter


class _Dims(list):
    """A `_Content`'s shape dimensions, added to as protobuf's repeated field is."""

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


def _content_array(real: dict, t):
    """tflite_utils' `tensor_util.MakeNdarray`: a `_Content` of a numeric dtype numpy has as a view of
    its bytes; any other through TensorFlow's TensorProto, as tf2onnx made it."""
    import numpy as np
    import tensorflow as tf

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


def _pending_tensor(real: dict, array, name=None):
    """tflite_utils' `numpy_helper.from_array`: a `_Pending` where `array` views the whole of one bytes
    object (a buffer's, from `_content_array`), else onnx's tensor of it."""
    import numpy as np

    owner = array
    while isinstance(owner, np.ndarray):
        owner = owner.base
    if (isinstance(owner, bytes) and len(owner) == array.nbytes and array.flags.c_contiguous
            and array.size > SHAPE_VALUES and array.dtype.isnative):
        return _Pending(array, owner, name)
    return real["numpy_helper"].from_array(array, name)


def _node_of_pending(real: dict, op_type, inputs, outputs, name=None, doc_string=None, domain=None, **kwargs):
    """tflite_utils' `helper.make_node`: a `_Pending` value made the node's tensor, its bytes set there."""
    from onnx import TensorProto

    value = kwargs.get("value")
    if not isinstance(value, _Pending):
        return real["helper"].make_node(op_type, inputs, outputs, name, doc_string, domain, **kwargs)
    dtype = real["helper"].np_dtype_to_tensor_dtype(value.array.dtype)
    kwargs["value"] = TensorProto(name=value.name, data_type=dtype, dims=value.array.shape)
    node = real["helper"].make_node(op_type, inputs, outputs, name, doc_string, domain, **kwargs)
    next(a for a in node.attribute if a.name == "value").t.raw_data = value.content
    return node


def _forward(module, **own):
    """A namespace with `module`'s names, `own` in place of some."""
    return types.SimpleNamespace(**{**{k: getattr(module, k) for k in dir(module) if not k.startswith("__")}, **own})
