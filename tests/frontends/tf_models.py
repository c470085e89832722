"""Small TensorFlow-format models for the frontend tests, built offline from a fixed seed.

Each builder writes files under a directory the caller gives and returns their paths. TensorFlow
is imported inside the builders, so collecting the tests stays cheap.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

IMAGE = (16, 16, 3)


def conv_net():
    """Conv, depthwise conv, batch norm (with statistics set), ReLU6, a residual Add, a strided
    conv, global pooling and a dense layer: the layers of a mobile classifier, 10 logits."""
    import keras

    keras.utils.set_random_seed(0)
    image = keras.Input(IMAGE, name="image")
    x1 = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(image)
    x2 = keras.layers.DepthwiseConv2D(3, padding="same")(x1)
    x2 = keras.layers.BatchNormalization()(x2)
    x2 = keras.layers.ReLU(6.0)(x2)
    x = keras.layers.Add()([x1, x2])
    x = keras.layers.Conv2D(16, 3, strides=2, padding="same", activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    logits = keras.layers.Dense(10, name="logits")(x)
    model = keras.Model(image, logits)
    _set_batchnorm_statistics(model, (32,) + IMAGE)
    return model


def _set_batchnorm_statistics(model, shape) -> None:
    """weights=None / fresh layers leave BatchNorm at mean 0, variance 1; one training-mode pass
    with momentum 0 gives it the statistics a trained network has on such inputs."""
    import keras
    import tensorflow as tf

    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.momentum = 0.0
    model(tf.random.stateless_uniform(shape, seed=(1, 2), minval=-1, maxval=1), training=True)


def save_keras_formats(model, out: Path) -> dict[str, Path]:
    """The model as .keras, .h5 and a SavedModel directory (model.export: signatures serve and
    serving_default)."""
    paths = {"keras": out / "net.keras", "h5": out / "net.h5", "savedmodel": out / "net_savedmodel"}
    model.save(paths["keras"])
    model.save(paths["h5"])
    model.export(str(paths["savedmodel"]), verbose=False)
    return paths


def representative(shape, n: int = 32, seed: int = 0):
    rng = np.random.default_rng(seed)

    def data():
        for _ in range(n):
            yield [rng.uniform(-1, 1, (1,) + tuple(shape)).astype(np.float32)]

    return data


def tflite_variants(model, out: Path) -> dict[str, Path]:
    """float32, float16 (fp16 weights + DEQUANTIZE), full int8 per-channel and per-tensor."""
    import tensorflow as tf

    def convert(name, configure):
        converter = tf.lite.TFLiteConverter.from_keras_model(model)
        configure(converter)
        path = out / f"net_{name}.tflite"
        path.write_bytes(converter.convert())
        return path

    def float16(c):
        c.optimizations = [tf.lite.Optimize.DEFAULT]
        c.target_spec.supported_types = [tf.float16]

    def int8(per_channel):
        def configure(c):
            c.optimizations = [tf.lite.Optimize.DEFAULT]
            c.representative_dataset = representative(IMAGE)
            c.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
            c.inference_input_type = c.inference_output_type = tf.int8
            c._experimental_disable_per_channel = not per_channel
        return configure

    return {"float32": convert("float32", lambda c: None), "float16": convert("float16", float16),
            "int8-per-channel": convert("int8_per_channel", int8(True)),
            "int8-per-tensor": convert("int8_per_tensor", int8(False))}


def mobilenet_v2_keras(out: Path) -> Path:
    import keras

    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(input_shape=(96, 96, 3), alpha=0.35, weights=None,
                                           classifier_activation=None)
    _set_batchnorm_statistics(model, (8, 96, 96, 3))
    path = out / "mobilenet_v2_96_0.35.keras"
    model.save(path)
    return path


class _Unconvertible:
    """Igamma, Zeta and BesselI0e: TF ops tf2onnx 1.17 has no handler for."""

    def __init__(self):
        import tensorflow as tf

        @tf.function(input_signature=[tf.TensorSpec((None, 8), tf.float32, name="x")])
        def serve(x):
            a = tf.math.igamma(tf.abs(x) + 1.0, tf.abs(x) + 0.5)
            z = tf.math.zeta(tf.abs(x) + 2.0, tf.abs(x) + 1.0)
            return {"y": a + z + tf.math.special.bessel_i0e(x) + tf.nn.relu(x)}

        self.serve = serve


def unsupported_savedmodel(out: Path) -> Path:
    import tensorflow as tf

    module = tf.Module()
    module.serve = _Unconvertible().serve
    path = out / "unsupported_savedmodel"
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})
    return path


def custom_op_tflite(out: Path) -> Path:
    """The same three ops in a TFLite file: with allow_custom_ops they become CUSTOM ops."""
    import tensorflow as tf

    serve = _Unconvertible().serve
    converter = tf.lite.TFLiteConverter.from_concrete_functions([serve.get_concrete_function()])
    converter.allow_custom_ops = True
    path = out / "custom_ops.tflite"
    path.write_bytes(converter.convert())
    return path


def stateful_tflite(out: Path) -> Path:
    """A counter: a tf.Variable that the converted function assigns (count += x, y = 2 * count).
    TFLite keeps it as a resource variable: VAR_HANDLE, READ_VARIABLE and ASSIGN_VARIABLE in the
    main subgraph, and CALL_ONCE of a second subgraph that initializes the variable."""
    import tensorflow as tf

    class Counter(tf.Module):
        def __init__(self):
            super().__init__()
            self.count = tf.Variable(tf.zeros((1, 4)), name="count")

        @tf.function(input_signature=[tf.TensorSpec((1, 4), tf.float32, name="x")])
        def __call__(self, x):
            self.count.assign_add(x)
            return {"y": 2.0 * self.count}

    counter = Counter()
    converter = tf.lite.TFLiteConverter.from_concrete_functions([counter.__call__.get_concrete_function()], counter)
    path = out / "counter.tflite"
    path.write_bytes(converter.convert())
    return path


def several_signatures_savedmodel(out: Path) -> Path:
    import tensorflow as tf

    module = tf.Module()
    module.double = tf.function(lambda x: {"y": 2.0 * x}, input_signature=[tf.TensorSpec((None, 4), tf.float32)])
    module.half = tf.function(lambda x: {"y": 0.5 * x}, input_signature=[tf.TensorSpec((None, 4), tf.float32)])
    path = out / "two_signatures"
    tf.saved_model.save(module, str(path), signatures={"double": module.double, "half": module.half})
    return path


def transpose_conv_tflites(out: Path) -> tuple[Path, Path]:
    """One model twice: with TFLite's builtin TRANSPOSE_CONV (bias fused), and with each of those
    ops rewritten into MediaPipe's custom Convolution2DTransposeBias (inputs x, w, b; options
    int32 padding 1 SAME / 2 VALID, stride_w, stride_h), as MediaPipe's segmentation models hold it.
    Two ops: SAME (8x8 -> 16x16) and VALID with kernel 3 > stride 2 (8x8 -> 17x17)."""
    import tensorflow as tf
    from tensorflow.lite.python import schema_py_generated as schema
    from tensorflow.lite.tools import flatbuffer_utils

    rng = np.random.default_rng(0)
    w_same, b_same = rng.normal(0, 0.3, (3, 3, 6, 4)).astype(np.float32), rng.normal(0, 1, 6).astype(np.float32)
    w_valid, b_valid = rng.normal(0, 0.3, (3, 3, 2, 4)).astype(np.float32), rng.normal(0, 1, 2).astype(np.float32)

    @tf.function(input_signature=[tf.TensorSpec((1, 8, 8, 4), tf.float32, name="x")])
    def serve(x):
        same = tf.nn.conv2d_transpose(x, w_same, [1, 16, 16, 6], 2, padding="SAME") + b_same
        valid = tf.nn.conv2d_transpose(x, w_valid, [1, 17, 17, 2], 2, padding="VALID") + b_valid
        return {"same": same, "valid": valid}

    builtin = out / "transpose_conv_builtin.tflite"
    builtin.write_bytes(tf.lite.TFLiteConverter.from_concrete_functions([serve.get_concrete_function()]).convert())

    model = flatbuffer_utils.read_model(str(builtin))
    code = schema.OperatorCodeT()
    code.builtinCode = code.deprecatedBuiltinCode = schema.BuiltinOperator.CUSTOM
    code.customCode = b"Convolution2DTransposeBias"
    code.version = 1
    model.operatorCodes.append(code)
    patched = 0
    for op in model.subgraphs[0].operators:
        if model.operatorCodes[op.opcodeIndex].builtinCode != schema.BuiltinOperator.TRANSPOSE_CONV:
            continue
        _, w, x, b = op.inputs  # TRANSPOSE_CONV: output_shape, weights (OHWI), input, bias
        options = op.builtinOptions
        op.opcodeIndex = len(model.operatorCodes) - 1
        op.inputs = np.array([x, w, b], np.int32)
        op.builtinOptionsType, op.builtinOptions = schema.BuiltinOptions.NONE, None
        op.customOptions = np.frombuffer(struct.pack("<3i", options.padding + 1, options.strideW, options.strideH), np.uint8)
        patched += 1
    assert patched == 2, f"expected 2 TRANSPOSE_CONV ops with a fused bias, found {patched}"
    custom = out / "transpose_conv_custom.tflite"
    flatbuffer_utils.write_model(model, str(custom))
    return custom, builtin


def builtin_transpose_conv(custom: Path, out: Path) -> Path:
    """The reverse of `transpose_conv_tflites`' rewrite, for a real MediaPipe model: every
    Convolution2DTransposeBias becomes TFLite's builtin TRANSPOSE_CONV with its bias input and an
    output_shape constant, so that the TFLite interpreter (which has no such custom op) runs it."""
    from tensorflow.lite.python import schema_py_generated as schema
    from tensorflow.lite.tools import flatbuffer_utils

    model = flatbuffer_utils.read_model(str(custom))
    code = schema.OperatorCodeT()
    code.builtinCode = code.deprecatedBuiltinCode = schema.BuiltinOperator.TRANSPOSE_CONV
    code.version = 3  # the version that takes a bias input
    model.operatorCodes.append(code)
    custom_index = {i for i, c in enumerate(model.operatorCodes) if c.customCode == b"Convolution2DTransposeBias"}
    for graph in model.subgraphs:
        for op in graph.operators:
            if op.opcodeIndex not in custom_index:
                continue
            x, w, b = op.inputs
            padding, stride_w, stride_h = struct.unpack_from("<3i", bytes(op.customOptions))
            shape = schema.BufferT()
            shape.data = np.array(graph.tensors[op.outputs[0]].shape, np.int32).tobytes()
            model.buffers.append(shape)
            tensor = schema.TensorT()
            tensor.shape, tensor.type = np.array([4], np.int32), schema.TensorType.INT32
            tensor.buffer, tensor.name = len(model.buffers) - 1, b"edgesdk_output_shape_%d" % len(graph.tensors)
            graph.tensors.append(tensor)
            options = schema.TransposeConvOptionsT()
            options.padding, options.strideW, options.strideH = padding - 1, stride_w, stride_h
            op.opcodeIndex = len(model.operatorCodes) - 1
            op.inputs = np.array([len(graph.tensors) - 1, w, x, b], np.int32)
            op.customOptions = None
            op.builtinOptionsType, op.builtinOptions = schema.BuiltinOptions.TransposeConvOptions, options
    path = out / f"{custom.stem}_builtin.tflite"
    flatbuffer_utils.write_model(model, str(path))
    return path
