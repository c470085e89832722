"""tf2onnx's optimizers run first without catch_errors (`tf2onnx_patches.lean_first`): with it, tf2onnx deep-copies
the whole graph, weights and all, before each optimizer. Where one fails on that first pass, the model
is converted again with catch_errors, as tf2onnx does by default. The failure is FAULT INJECTION: an
optimizer added to tf2onnx's real list that raises once; the conversions are tf2onnx's own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from edgesdk.frontends import keras_file, savedmodel, tf2onnx_patches, tf2onnx_steps


@pytest.fixture
def tf2onnx_and_function():
    tf, tf2onnx, _ = tf2onnx_steps.tensorflow()
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    spec = [tf.TensorSpec((1, 4), tf.float32, name="x")]

    @tf.function(input_signature=spec)
    def f(x):
        return {"y": tf.nn.relu(tf.matmul(x, tf.constant(w)))}

    return tf2onnx, lambda: tf2onnx.convert.from_function(f, input_signature=spec, opset=17)[0]


def _run(proto: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def test_a_lean_pass_that_an_optimizer_fails_is_converted_again_with_catch_errors(tf2onnx_and_function, monkeypatch):
    tf2onnx, convert = tf2onnx_and_function
    seen = []

    class FailsWithoutCatch:  # FAULT INJECTION: an optimizer that fails on the lean pass only
        def __init__(self):
            pass

        def optimize(self, graph, iteration):
            seen.append(iteration)
            if len(seen) == 1:
                raise RuntimeError("injected")
            return graph

    optimizers = dict(tf2onnx.optimizer._optimizers)
    monkeypatch.setattr(tf2onnx.optimizer, "_optimizers", {**optimizers, "fails_once": FailsWithoutCatch})
    calls = []
    proto = tf2onnx_patches.lean_first(tf2onnx, convert, before=lambda graph: calls.append("before"),
                               after=lambda: calls.append("after"))
    assert calls == ["before", "before", "after"]  # the lean pass failed; the second, with catch_errors, did not
    x = np.array([[1.0, -2.0, 3.0, 0.5]], np.float32)
    want = np.maximum(x @ np.arange(12, dtype=np.float32).reshape(4, 3), 0)
    np.testing.assert_allclose(_run(proto, x), want, rtol=1e-6)
    assert tf2onnx.optimizer.optimize_graph.__module__ == "tf2onnx.optimizer"  # put back


def test_a_lean_pass_runs_once_where_no_optimizer_fails(tf2onnx_and_function):
    tf2onnx, convert = tf2onnx_and_function
    calls = []
    proto = tf2onnx_patches.lean_first(tf2onnx, convert, before=lambda graph: calls.append("before"),
                               after=lambda: calls.append("after"))
    assert calls == ["before", "after"]
    x = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    np.testing.assert_allclose(_run(proto, x), np.maximum(x @ np.arange(12, dtype=np.float32).reshape(4, 3), 0),
                               rtol=1e-6)


def _written(tmp_path: Path, converted) -> onnx.ModelProto:
    """A tf2onnx large-model conversion's (proto, storage) as the converter child writes it, read back."""
    tf2onnx = tf2onnx_steps.tensorflow()[1]
    path = tmp_path / "converted.onnx"
    tf2onnx_steps.finish(*converted[:1], {"onnx": str(path)}, tf2onnx, {}, storage=converted[1])
    return onnx.load(str(path))


def test_a_weight_read_through_its_variable_is_not_copied_into_a_new_constant(monkeypatch, tmp_path):
    """A frozen graph reads each weight through an Identity (the variable's read); tf2onnx folded that
    Identity into a new Const holding a copy of the weight (`tf2onnx_patches._constants_stay`; SavedModel import). The Identity's
    readers now take the weight's own Const: no Const of the weight's size is made, and the model
    computes what the function does."""
    tf, tf2onnx, _ = tf2onnx_steps.tensorflow()
    from tf2onnx import graph

    w = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    v = tf.Variable(w)
    spec = [tf.TensorSpec((1, 64), tf.float32, name="x")]

    @tf.function(input_signature=spec)
    def f(x):
        return {"y": tf.matmul(x, v)}

    made = []
    make_const = graph.Graph.make_const

    def spied(self, name, np_val=None, *args, **kwargs):
        made.append(np.size(np_val))
        return make_const(self, name, np_val, *args, **kwargs)

    monkeypatch.setattr(graph.Graph, "make_const", spied)
    # tf2onnx's large-model path, as SavedModel import takes it: no grappler pass folds the Identity first
    proto = _written(tmp_path, tf2onnx.convert.from_function(f, input_signature=spec, opset=17, large_model=True))
    assert w.size not in made
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    want = f(tf.constant(x))["y"].numpy()
    np.testing.assert_allclose(_run(proto, x), want, rtol=0, atol=1e-5 * np.abs(want).max())


def _fully_connected_tflite(tf, tmp_path: Path):
    """A 64x32 weight (past SHAPE_VALUES) in a TFLite FullyConnected with a Relu: the weight, the function
    and the .tflite file."""
    w = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    spec = [tf.TensorSpec((1, 64), tf.float32, name="x")]

    @tf.function(input_signature=spec)
    def f(x):
        return tf.nn.relu(tf.matmul(x, tf.constant(w)))

    path = tmp_path / "fc.tflite"
    path.write_bytes(tf.lite.TFLiteConverter.from_concrete_functions([f.get_concrete_function()], f).convert())
    return w, f, path


def test_a_new_nodes_shapes_are_inferred_without_the_weights_it_reads(tmp_path, monkeypatch):
    """tf2onnx infers each new node's shapes on a model of that node, its constant inputs as
    initializers: a Transpose it inserts on a TFLite FullyConnected's weight serialized and parsed the
    whole weight several times (`tf2onnx_patches._shapes_without_weights`). Only constants small enough to be
    shapes go in now, and the converted model computes what the TFLite model does."""
    tf, tf2onnx, _ = tf2onnx_steps.tensorflow()
    from tf2onnx import schemas

    w, f, path = _fully_connected_tflite(tf, tmp_path)
    largest = []
    infer_shapes = schemas.shape_inference.infer_shapes

    def spied(model, *args, **kwargs):
        largest.append(max((int(np.prod(t.dims)) for t in model.graph.initializer), default=0))
        return infer_shapes(model, *args, **kwargs)

    monkeypatch.setattr(schemas.shape_inference, "infer_shapes", spied)
    proto = tf2onnx.convert.from_tflite(str(path), opset=17)[0]
    assert largest and max(largest) <= tf2onnx_patches.SHAPE_VALUES < w.size
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    want = f(tf.constant(x)).numpy()
    np.testing.assert_allclose(_run(proto, x), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_a_tflite_weight_becomes_its_constant_from_one_copy(tmp_path, monkeypatch):
    """tf2onnx made each TFLite constant through a TensorFlow TensorProto, a numpy array, an ONNX tensor and
    the node's copy of it (five copies of VGG16's 392 MiB fc1 weight at once), and asked an interpreter with
    XNNPACK, which packs every weight once more, for the shapes (`tf2onnx_patches.tflite_read_lean`). No ONNX tensor
    of the weight's size is made apart from its node now, the interpreter runs without delegates, and the
    converted model computes what the TFLite model does."""
    tf, tf2onnx, _ = tf2onnx_steps.tensorflow()
    from onnx import numpy_helper

    w, f, path = _fully_connected_tflite(tf, tmp_path)
    made, resolvers = [], []
    from_array, interpreter = numpy_helper.from_array, tf.lite.Interpreter

    def spied_from_array(array, *args, **kwargs):
        made.append(np.size(array))
        return from_array(array, *args, **kwargs)

    def spied_interpreter(*args, **kwargs):
        resolvers.append(kwargs.get("experimental_op_resolver_type"))
        return interpreter(*args, **kwargs)

    monkeypatch.setattr(numpy_helper, "from_array", spied_from_array)
    monkeypatch.setattr(tf.lite, "Interpreter", spied_interpreter)
    with tf2onnx_patches.weights_stored() as stored, tf2onnx_patches.tflite_read_lean(tf2onnx.tflite_utils):
        proto = tf2onnx.convert.from_tflite(str(path), opset=17)[0]
    assert w.size not in made, made
    assert resolvers == [tf.lite.experimental.OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES]
    assert tf.lite.Interpreter is spied_interpreter and tf2onnx.tflite_utils.numpy_helper is numpy_helper  # restored
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    want = f(tf.constant(x)).numpy()
    got = _run(_written(tmp_path, (proto, stored[-1])), x)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_a_new_constant_is_made_from_one_copy(tmp_path):
    """tf2onnx made a new constant (a weight its folding transposed) from a flattened copy, a bytes copy,
    the tensor made from them and the node's copy of that (`tf2onnx_patches._constants_made_once`); and its large-model
    path stored a weight's bytes from a deep copy of the node's attribute, which the node kept
    (`tf2onnx_patches._values_moved`). Now no ONNX tensor of the weight is made apart from its node, the node's bytes
    move to the storage, and the written model holds the weight."""
    _, tf2onnx, _ = tf2onnx_steps.tensorflow()
    from onnx import TensorProto
    from tf2onnx import graph

    w = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    made = []
    from_array = graph.numpy_helper.from_array
    graph.numpy_helper.from_array = lambda array, *a, **k: made.append(np.size(array)) or from_array(array, *a, **k)
    try:
        g = graph.Graph([], opset=17)
        const = g.make_const("w", w)
    finally:
        graph.numpy_helper.from_array = from_array
    assert w.size not in made
    np.testing.assert_array_equal(const.get_tensor_value(as_list=False), w)
    g.make_node("Relu", [const.output[0]], outputs=["y"])
    g.add_graph_output("y", TensorProto.FLOAT, list(w.shape))
    storage = graph.ExternalTensorStorage()
    proto = g.make_model("test", external_tensor_storage=storage)
    assert not const.get_attr("value").t.raw_data  # moved, not copied
    assert [len(v) for v in storage.name_to_tensor_data.values()] == [w.nbytes]
    model = _written(tmp_path, (proto, storage))
    (value,) = model.graph.initializer
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(value, base_dir=str(tmp_path)), w)


def _loop_savedmodel(tf, path: Path):
    """A SavedModel whose signature reads a 16x16 weight inside a while loop and a 512-element bias
    outside it; returns the module, to compute what the signature does."""

    class Module(tf.Module):
        def __init__(self):
            rng = np.random.default_rng(0)
            self.w = tf.Variable(rng.standard_normal((16, 16)).astype(np.float32) / 4)
            self.b = tf.Variable(rng.standard_normal(512).astype(np.float32))

        @tf.function(input_signature=(tf.TensorSpec((1, 16), tf.float32, name="x"),))
        def serve(self, x):
            _, y = tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, tf.tanh(tf.matmul(y, self.w))),
                                 (tf.constant(0), x))
            return {"y": y + tf.reduce_sum(self.b)}

    module = Module()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})
    return module


def _constants(graph_def) -> list:
    nodes = [*graph_def.node, *(n for f in graph_def.library.function for n in f.node_def)]
    return [n for n in nodes if n.op == "Const"]


def test_a_savedmodel_is_frozen_with_each_weight_a_placeholder_viewing_its_variable(tmp_path):
    """TensorFlow's freeze copied each variable into the frozen GraphDef, and tf2onnx imported that into a
    TensorFlow graph: VGG16's converter peaked at 2.9 GiB for 528 MiB of weights. Now no constant of the
    frozen graph holds a weight: each is a placeholder whose value is a read-only view of its variable's
    buffer (`savedmodel._frozen_without_weights`), and the converted model computes what the signature does."""
    tf, _, _ = tf2onnx_steps.tensorflow()
    module = _loop_savedmodel(tf, tmp_path / "loop")
    values: dict = {}
    request = {"source": str(tmp_path / "loop"), "input_shapes": {}, "batch": 1, "opset": 17,
               "onnx": str(tmp_path / "loop.onnx"), "result": str(tmp_path / "result.json")}
    graph_def = savedmodel._frozen(tf, request, [], values)[0]
    assert max(len(n.attr["value"].tensor.tensor_content) for n in _constants(graph_def)) < 1024
    placeholders = {f"{n.name}:0": n for n in graph_def.node if n.op == "Placeholder"}
    assert set(values) <= set(placeholders) and len(values) == 2
    by_size = {v.size: v for v in values.values()}
    for variable in (module.w, module.b):
        value = by_size[variable.shape.num_elements()]
        assert not value.flags.owndata and not value.flags.writeable  # the variable's buffer, not a copy
        np.testing.assert_array_equal(value, variable.numpy())

    values.clear()
    savedmodel.convert(request)
    x = np.random.default_rng(1).standard_normal((1, 16)).astype(np.float32)
    want = module.serve(tf.constant(x))["y"].numpy()
    np.testing.assert_allclose(_run(onnx.load(request["onnx"]), x), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_a_weight_frozen_into_a_library_function_freezes_again_with_its_value(tmp_path, monkeypatch):
    """Where the freeze leaves a weight's constant in a function of the graph's library (FAULT INJECTION:
    the first freeze's result has one marked constant moved into a function), that weight would have no
    placeholder: the signature is frozen again as TensorFlow has it, every weight a constant."""
    tf, _, _ = tf2onnx_steps.tensorflow()
    from tf2onnx import tf_loader

    _loop_savedmodel(tf, tmp_path / "loop")
    freeze = tf_loader.from_function
    calls = []

    def moving_one(*args, **kwargs):
        graph_def = freeze(*args, **kwargs)
        calls.append(len(calls))
        if len(calls) == 1:
            marked = next(n for n in graph_def.node if n.attr["value"].tensor.tensor_content.startswith(b"edgesdk-weight:"))
            function = graph_def.library.function.add()
            function.signature.name = "moved"
            function.node_def.add().CopyFrom(marked)
            graph_def.node.remove(marked)
        return graph_def

    monkeypatch.setattr(tf_loader, "from_function", moving_one)
    values: dict = {}
    request = {"source": str(tmp_path / "loop"), "input_shapes": {}, "batch": 1}
    graph_def = savedmodel._frozen(tf, request, [], values)[0]
    assert calls == [0, 1] and values == {}
    sizes = sorted(len(n.attr["value"].tensor.tensor_content) for n in _constants(graph_def))
    assert sizes[-2:] == [16 * 16 * 4, 512 * 4]


def test_a_keras_files_weights_are_read_from_a_copy_on_disk_in_the_work_folder(conv_net_files, tmp_path, monkeypatch):
    """Keras read a .keras file's whole weights file into memory and the variables from that, where memory
    looked sufficient: VGG16's 528 MiB twice at once. In the converter the weights file is extracted to a
    temporary folder inside the build's work folder (never beside the user's model) and read from there;
    Keras is put back as it was, and the model loaded is the model saved."""
    import io
    import zipfile

    import keras
    from keras.src.saving import saving_lib

    with zipfile.ZipFile(conv_net_files["keras"]) as archive:
        weights_file = archive.getinfo("model.weights.h5").file_size
    in_memory = []
    monkeypatch.setattr(io, "BytesIO", lambda *a, real=io.BytesIO: in_memory.append(len(a[0]) if a else 0) or real(*a))
    extracted = []
    work = tmp_path / "work"
    work.mkdir()
    with keras_file._weights_read_from_disk(work):
        temporary = saving_lib.tempfile.TemporaryDirectory

        def spied(*args, **kwargs):
            folder = temporary(*args, **kwargs)
            extracted.append(Path(folder.name))
            return folder

        monkeypatch.setattr(saving_lib.tempfile, "TemporaryDirectory", spied, raising=False)
        model = keras.models.load_model(conv_net_files["keras"], compile=False)
    assert [p.parent for p in extracted] == [work] and not extracted[0].exists()  # used, then removed
    assert weights_file not in in_memory  # no BytesIO made from the weights file's bytes
    assert saving_lib.is_memory_sufficient.__module__ == saving_lib.__name__ and saving_lib.tempfile.__name__ == "tempfile"
    saved = keras.models.load_model(conv_net_files["keras"], compile=False)
    for mine, theirs in zip(model.weights, saved.weights, strict=True):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
