"""The converter child's reader of Keras 3 files (`.keras`, and legacy `.h5`).

The model is loaded without compiling and converted from its `stateless_call` traced with every weight an
input (`_keras_weights_apart`), so that no TensorFlow graph holds a weight.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from . import tf2onnx_patches
from .tf2onnx_steps import finish, reading, static_shape, tensorflow, view, weights_in

# Keras files fail to load for two reasons besides damage: layers whose class lives in the user's
# code (custom layers), and Lambda layers, whose pickled Python safe_mode refuses to run.
KERAS_HINT = ("the file may be damaged, or need the model's own Python code (custom layers, Lambda layers), "
              "which edgesdk does not run: export it with model.export(path) and pass that SavedModel directory")


def convert(request: dict) -> dict:
    tf, tf2onnx, failures = tensorflow()
    import keras

    # compile=False: the optimizer and losses are not part of the function; safe_mode (the default)
    # refuses Lambda layers' pickled code, which a build tool must not run.
    with _weights_read_from_disk(Path(request["onnx"]).parent):
        model = reading(request["format"], lambda: keras.models.load_model(request["source"], compile=False),
                        KERAS_HINT)
    specs = [tf.TensorSpec(static_shape(t.name, tuple(t.shape), request), t.dtype, name=t.name) for t in model.inputs]
    with _xla_functions_inline(tf):
        proto, storage = _keras_weights_apart(model, specs, request, tf, tf2onnx)
    return finish(proto, request, tf2onnx, failures.failed, storage=storage)


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


@contextlib.contextmanager
def _xla_functions_inline(tf):
    """Keras's TensorFlow backend tracing the ops it wraps in `tf.function(jit_compile=True)` inline.

    TensorFlow's CPU kernels lack grouped convolutions (ConvNeXt's depthwise 7x7, RegNet's and ResNeXt's
    grouped 3x3), so Keras runs them as XLA functions; traced, each is a call of a function that
    tf2onnx does not convert ("PartitionedCall" left in the graph). The conversion only traces, never
    runs, the graph: traced inline, the convolution is TensorFlow's own Conv2D op, whose groups tf2onnx
    reads from its kernel's shape."""
    from keras.src.backend.tensorflow import nn

    class Inline:
        def __getattr__(self, name):
            return getattr(tf, name)

        @staticmethod
        def function(func=None, *args, jit_compile=None, **kwargs):
            if not jit_compile:
                return tf.function(func, *args, jit_compile=jit_compile, **kwargs)
            return func if func is not None else (lambda f: f)

    original = nn.tf  # an AttributeError where Keras renamed it: loud
    nn.tf = Inline()
    try:
        yield
    finally:
        nn.tf = original


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
    # view of the variable's buffer, not a copy (`view`)
    values = {n: view(tf.convert_to_tensor(v.value)) for n, v in zip(names, variables)}

    def let_go() -> None:
        # the graph holds the weights now: let TensorFlow free its own copy before tf2onnx writes the model
        values.clear()
        for variable in variables:
            if getattr(variable, "_value", None) is not None:  # Keras 3's handle on the tf.Variable
                variable._value = None

    function = tf.function(serve, input_signature=signature)
    # tensors the layers made when built (a Normalization layer's mean and variance, in keras.applications'
    # EfficientNets) are captured by the traced graph, not passed in: tf2onnx leaves each a graph input,
    # which the model's user was asked to feed. They become constants with the weights
    for outside, inside in function.get_concrete_function().graph.captures:
        if outside.dtype != tf.resource and hasattr(outside, "numpy"):
            values[inside.name] = outside.numpy()
    with tf2onnx_patches.weights_stored() as stored:
        proto = tf2onnx_patches.lean_first(tf2onnx, lambda: tf2onnx.convert.from_function(
            function, input_signature=signature, opset=request["opset"])[0],
            before=lambda graph: weights_in(graph, values), after=let_go)
    storage = stored[-1]
    by_name = {o.name: o for o in proto.graph.output}  # in the model's order (a dict's come sorted by key)
    if set(by_name) == set(output_names):
        ordered = [by_name[n] for n in output_names]
        del proto.graph.output[:]
        proto.graph.output.extend(ordered)
    return proto, storage


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
