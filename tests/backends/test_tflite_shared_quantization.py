"""Full int8 and the ops whose input and output share one quantization.

The table `int8_ops.SHARED_QUANTIZATION_OPS` is measured here: one model holds one op of each kind,
the calibrated range of each op's output is made different from its input's, and the converter's
choice of scales is read back. Then each lowering that meets such an op: a small model on a real
photograph's convolution features (both signs), converted to full int8 and compared with
onnxruntime's fp32 within a stated number of int8 steps of each output. Last, a small PReLU network
(MediaPipe's face-landmark model in small) on crops of a real face photograph it was not calibrated on.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from edgesdk.backends import tflite
from edgesdk.backends.tflite import int8_ops
from edgesdk.devices import edgetpu
from edgesdk.legalization import exact
from tests.backends.test_tflite import make_model, run_ort, run_tflite

N = helper.make_node


# --- the table, measured -------------------------------------------------------------------------


def _cases(tf):
    """TFLite op -> (number of inputs, a TF function that converts to that op on its last step; a tuple
    where the op has several outputs, each a graph output: the converter left a split with an unused
    output float in some runs)."""
    rng = np.random.default_rng(1)
    w, dw = rng.standard_normal((3, 3, 4, 4)).astype(np.float32), rng.standard_normal((3, 3, 4, 1)).astype(np.float32)
    fc, tw = rng.standard_normal((256, 6)).astype(np.float32), rng.standard_normal((3, 3, 4, 4)).astype(np.float32)
    pads = [[0, 0], [1, 1], [2, 0], [0, 0]]
    alpha = np.array([[[0.25, -0.1, 0.5, 1.5]]], np.float32)
    return {
        # shared, and which way
        "MINIMUM": (2, lambda x, y: tf.minimum(x, y)),
        "MAXIMUM": (2, lambda x, y: tf.maximum(x, y)),
        "CONCATENATION": (2, lambda x, y: tf.concat([x, y], 3)),
        "PACK": (2, lambda x, y: tf.stack([x, y], 1)),
        "PAD": (1, lambda x: tf.pad(x, pads)),
        "PADV2": (1, lambda x: tf.pad(x, pads, constant_values=0.5)),
        "MIRROR_PAD": (1, lambda x: tf.pad(x, pads, mode="REFLECT")),
        "RESHAPE": (1, lambda x: tf.reshape(x, (1, 64, 4))),
        "TRANSPOSE": (1, lambda x: tf.transpose(x, (0, 3, 1, 2))),
        "MAX_POOL_2D": (1, lambda x: tf.nn.max_pool2d(x, 2, 2, "VALID")),
        "AVERAGE_POOL_2D": (1, lambda x: tf.nn.avg_pool2d(x, 2, 2, "VALID")),
        "SPACE_TO_DEPTH": (1, lambda x: tf.nn.space_to_depth(x, 2)),
        "DEPTH_TO_SPACE": (1, lambda x: tf.nn.depth_to_space(x, 2)),
        "GATHER": (1, lambda x: tf.gather(x, [3, 0, 2], axis=3)),
        "GATHER_ND": (1, lambda x: tf.gather_nd(x, [[0, 1], [0, 3]])),
        "STRIDED_SLICE": (1, lambda x: x[:, 1:7:2, :, 1:3]),
        "SLICE": (1, lambda x: tf.slice(x, [0, 1, 2, 0], [1, 4, 4, 2])),
        "SPLIT": (1, lambda x: tuple(tf.split(x, 2, axis=3))),
        "SPLIT_V": (1, lambda x: tuple(tf.split(x, [1, 3], axis=3))),
        "REDUCE_MAX": (1, lambda x: tf.reduce_max(x, axis=3)),
        "REDUCE_MIN": (1, lambda x: tf.reduce_min(x, axis=3)),
        "RESIZE_NEAREST_NEIGHBOR": (1, lambda x: tf.raw_ops.ResizeNearestNeighbor(images=x, size=[16, 16])),
        "RESIZE_BILINEAR": (1, lambda x: tf.raw_ops.ResizeBilinear(images=x, size=[16, 16])),
        "TILE": (1, lambda x: tf.tile(x, [1, 2, 1, 1])),
        "BROADCAST_TO": (1, lambda x: tf.broadcast_to(tf.reshape(x, (1, 1, 64, 4)), (1, 3, 64, 4))),
        "SPACE_TO_BATCH_ND": (1, lambda x: tf.space_to_batch_nd(x, [2, 2], [[0, 0], [0, 0]])),
        "BATCH_TO_SPACE_ND": (1, lambda x: tf.batch_to_space(tf.reshape(x, (4, 4, 4, 4)), [2, 2], [[0, 0], [0, 0]])),
        # each with a quantization of its own (or a fixed one)
        "ADD": (2, lambda x, y: x + y),
        "SUB": (2, lambda x, y: x - y),
        "MUL": (2, lambda x, y: x * y),
        "SQUARED_DIFFERENCE": (2, lambda x, y: tf.math.squared_difference(x, y)),
        "RELU": (1, lambda x: tf.nn.relu(x)),
        "RELU6": (1, lambda x: tf.nn.relu6(x)),
        "RELU_N1_TO_1": (1, lambda x: tf.minimum(tf.maximum(x, -1.0), 1.0)),
        "LEAKY_RELU": (1, lambda x: tf.nn.leaky_relu(x, 0.2)),
        "PRELU": (1, lambda x: tf.nn.relu(x) + (-alpha) * tf.nn.relu(-x)),
        "HARD_SWISH": (1, lambda x: x * tf.nn.relu6(x + 3.0) * (1.0 / 6.0)),
        "LOGISTIC": (1, lambda x: tf.math.sigmoid(x)),
        "TANH": (1, lambda x: tf.math.tanh(x)),
        "SOFTMAX": (1, lambda x: tf.nn.softmax(x)),
        "L2_NORMALIZATION": (1, lambda x: tf.math.l2_normalize(x, axis=3)),
        "MEAN": (1, lambda x: tf.reduce_mean(x, axis=3)),
        "SUM": (1, lambda x: tf.reduce_sum(x, axis=3)),
        "CONV_2D": (1, lambda x: tf.nn.conv2d(x, w, 1, "SAME")),
        "DEPTHWISE_CONV_2D": (1, lambda x: tf.nn.depthwise_conv2d(x, dw, (1, 1, 1, 1), "SAME")),
        "TRANSPOSE_CONV": (1, lambda x: tf.nn.conv2d_transpose(x, tw, (1, 16, 16, 4), 2, "SAME")),
        "FULLY_CONNECTED": (1, lambda x: tf.linalg.matmul(tf.reshape(x, (1, 256)), fc)),
        "BATCH_MATMUL": (2, lambda x, y: tf.linalg.matmul(x, y, transpose_b=True)),
        "DIV": (2, lambda x, y: x / (tf.abs(y) + 1.0)),
        "SQRT": (1, lambda x: tf.math.sqrt(tf.abs(x))),
    }


@pytest.fixture(scope="module")
def measured() -> dict[str, tuple[bool, bool]]:
    """TFLite op -> (its int8 inputs and output share one quantization, the shared one is the output's
    range rather than the input's). Every op's output range is calibrated 4 times wider (plus 1) than
    what it computes, so an op that keeps its own output quantization shows a different scale; where the
    scales are tied, the scale tells which side set it."""
    import tensorflow as tf
    from tensorflow.lite.python import convert
    from tensorflow.lite.python import schema_py_generated as schema
    from tensorflow.lite.tools import flatbuffer_utils

    cases = _cases(tf)
    shape = (1, 8, 8, 4)
    names = list(cases)
    signature = [tf.TensorSpec(shape, tf.float32, name=f"{op.lower()}_{i}") for op in names for i in range(cases[op][0])]

    def body(*args):
        out, k = {}, 0
        for op in names:
            n, fn = cases[op]
            y = fn(*args[k:k + n])
            for j, part in enumerate(y if isinstance(y, tuple) else (y,)):
                out[op.lower() + (f"_{j}" if j else "")] = part
            k += n
        return out

    rng = np.random.default_rng(0)
    # inputs in [-1, 3] and [-3, 9]: asymmetric, and the second input of each op wider than the first
    samples = [[rng.uniform(-1, 3, shape).astype(np.float32) * (1 + 2 * i) for op in names for i in range(cases[op][0])]
               for _ in range(4)]
    function = tf.function(body, input_signature=signature)
    converter = tf.lite.TFLiteConverter.from_concrete_functions([function.get_concrete_function()], tf.Module())
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = lambda: iter(samples)
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    converter._experimental_calibrate_only = True  # pylint: disable=protected-access
    calibrated = flatbuffer_utils.convert_bytearray_to_object(converter.convert())
    graph = calibrated.subgraphs[0]
    natural = {}
    for t in graph.inputs:
        q = graph.tensors[t].quantization
        natural[graph.tensors[t].name] = (max(q.max[0], 0) - min(q.min[0], 0)) / 255
    for t in graph.outputs:
        q = graph.tensors[t].quantization
        q.min, q.max = [q.min[0] * 4 - 1], [q.max[0] * 4 + 1]
    quantized = convert.mlir_quantize(bytes(flatbuffer_utils.convert_object_to_bytearray(calibrated)), False,
                                      input_data_type=tf.int8, output_data_type=tf.int8)
    model = flatbuffer_utils.convert_bytearray_to_object(quantized)
    graph = model.subgraphs[0]
    ops = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
    producer = {o: op for op in graph.operators for o in op.outputs}

    def quant(t):
        q = graph.tensors[t].quantization
        return float(q.scale[0]), int(q.zeroPoint[0])

    def activation(t):
        data = model.buffers[graph.tensors[t].buffer].data
        return data is None or len(data) == 0

    def name(node):
        code = model.operatorCodes[node.opcodeIndex]
        return ops[max(code.builtinCode, code.deprecatedBuiltinCode)]

    out_index = {o.name.decode(): o.tensorIndex for o in model.signatureDefs[0].outputs}
    result = {}
    for op in names:
        t = out_index[op.lower()]
        node = producer[t]
        if name(node) == "QUANTIZE":  # the graph output's widened range kept apart from the op's own by a requantize
            t = node.inputs[0]
            node = producer[t]
        assert name(node) == op, (op, name(node))
        ins = [t for t in node.inputs if t >= 0 and activation(t)]
        assert graph.tensors[t].quantization is not None and graph.tensors[t].quantization.scale is not None, (op, graph.tensors[t].type)
        out = quant(t)
        shared = all(quant(t) == out for t in ins)
        # the range of the graph inputs the op reads (through the RESHAPE some cases put first) as
        # calibrated: a tied scale well above it is the widened output's
        first = max(natural[graph.tensors[_source(t, producer)].name] for t in ins)
        result[op] = (shared, shared and out[0] > 1.5 * first)
    return result


def _source(t: int, producer: dict) -> int:
    """The graph input tensor `t` is computed from, following first inputs."""
    while t in producer:
        t = producer[t].inputs[0]
    return t


def test_shared_quantization_ops_are_what_the_converter_does(measured):
    """SHARED_QUANTIZATION_OPS and OUTPUT_RANGE_TO_INPUTS are exactly the measured ones among the ops
    tried, and every op the lowerings emit (the Edge TPU's, and LiteRT's on the CPU) was tried."""
    assert {op for op, (shared, _) in measured.items() if shared} == int8_ops.SHARED_QUANTIZATION_OPS
    assert {op for op, (_, inward) in measured.items() if inward} == int8_ops.OUTPUT_RANGE_TO_INPUTS
    emitted = {op for rule in edgetpu.OPS.values() for op in rule.tflite_ops} | {"DIV", "SQRT", "BATCH_MATMUL"}  # LiteRT on the cpu too
    assert emitted <= set(measured), emitted - set(measured)


# --- the lowerings, in int8 -----------------------------------------------------------------------

PHOTO = Path(importlib.util.find_spec("matplotlib").submodule_search_locations[0]) / "mpl-data/sample_data/grace_hopper.jpg"


def _patches(n: int, size: int = 16) -> list[dict[str, np.ndarray]]:
    """`n` RGB patches of a real photograph (matplotlib's Grace Hopper portrait), NCHW in [0, 1]."""
    from PIL import Image

    image = np.asarray(Image.open(PHOTO).convert("RGB"), np.float32) / 255
    rng = np.random.default_rng(3)
    out = []
    for _ in range(n):
        y, x = rng.integers(0, image.shape[0] - 4 * size), rng.integers(0, image.shape[1] - 4 * size)
        patch = image[y:y + 4 * size:4, x:x + 4 * size:4]
        out.append({"x": np.ascontiguousarray(patch.transpose(2, 0, 1)[None])})
    return out


def _features(*nodes, inits=None, outputs=("y",), opset=17) -> onnx.ModelProto:
    """x (a photo patch) -> 3x3 Conv with bias to 4 channels `c` (features of both signs, about [-4, 4])
    -> `nodes`."""
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((4, 3, 3, 3)) * 0.8).astype(np.float32)
    b = np.array([-0.8, 0.3, -0.2, 0.6], np.float32)
    conv = N("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1])
    return make_model([conv, *nodes], {"x": (1, 3, 16, 16)}, list(outputs), {"w": w, "b": b, **(inits or {})},
                      opset=opset)


def _int8(model: onnx.ModelProto, tmp_path: Path) -> tuple[dict[str, tuple[float, float]], dict[str, int]]:
    """Each output's largest |int8 - fp32| on the calibration patches (what the lowering costs, not what
    calibration does on other inputs) and its int8 step; the int8 model's ops."""
    feeds = _patches(8)
    path = tmp_path / "m.tflite"
    result = tflite.convert_int8(model, feeds, path)
    worst = {s.name: 0.0 for s in result.outputs}
    for f in feeds:
        got, want = run_tflite(path, result, f), run_ort(model, f)
        for name in worst:
            worst[name] = max(worst[name], float(np.abs(got[name] - want[name]).max()))
    return {s.name: (worst[s.name], s.quant.scale) for s in result.outputs}, result.op_counts


@pytest.fixture(scope="module")
def features_error(tmp_path_factory) -> float:
    """The int8 error of the features c alone (the convolution's, from its int8 input and weights):
    what every op after it inherits."""
    errors, _ = _int8(_features(N("Identity", ["c"], ["y"])), tmp_path_factory.mktemp("features"))
    return errors["y"][0]


def _within(errors: dict[str, tuple[float, float]], features_error: float, gain: dict[str, float] | None = None):
    """Each output within 2 of its int8 steps of fp32, beyond the features' own error times the output's
    `gain` (how much the op can enlarge an error of c: its largest slope, 1 where not given)."""
    for name, (error, step) in errors.items():
        bound = (gain or {}).get(name, 1.0) * features_error + 2 * step
        assert error <= bound, (name, error, bound, errors)


def test_prelu_is_tflites_prelu_and_keeps_both_halves(tmp_path, features_error):
    """PRelu after a convolution, per-channel slopes (one above 1, one negative): one PRELU, within 2
    int8 steps. As Relu(x) + Min(x, 0)*s, MINIMUM gave x its output's range [lo, 0], and the positive
    half of every value was lost (60 of 192 pixels of landmark error on MediaPipe's face model)."""
    slope = np.array([0.25, -0.1, 0.5, 1.5], np.float32).reshape(4, 1, 1)
    model = _features(N("PRelu", ["c", "s"], ["y"]), inits={"s": slope})
    errors, ops = _int8(model, tmp_path)
    _within(errors, features_error, {"y": 1.5})
    assert ops == {"CONV_2D": 1, "PRELU": 1}, ops


def test_leaky_relu_is_rewritten_to_prelu(tmp_path, features_error):
    """The Edge TPU lacks LEAKY_RELU: legalize makes it PRelu with the same slope, one PRELU in int8.
    Max(x, a*x) read x twice and gave it MAXIMUM's range [a*lo, hi]: x*a was then taken of a clipped x."""
    leaky = onnx.shape_inference.infer_shapes(_features(N("LeakyRelu", ["c"], ["y"], alpha=0.1)))
    model, counts = exact.apply(leaky, only=["leaky-relu-to-prelu"])
    assert counts == {"leaky-relu-to-prelu": 1}
    errors, ops = _int8(model, tmp_path)
    _within(errors, features_error)
    assert ops == {"CONV_2D": 1, "PRELU": 1}, ops


def test_clip_max_and_min_leave_their_inputs_range_to_their_other_readers(tmp_path, features_error):
    """c is read by a Clip, a Max, a Min and a Mul: the Mul's output keeps c's full range, and each of
    the others is within 2 int8 steps. With MAXIMUM and MINIMUM on c, c took their outputs' ranges."""
    model = _features(N("Clip", ["c", "lo", "hi"], ["clip"]), N("Max", ["c", "k"], ["max"]),
                      N("Min", ["c", "k"], ["min"]), N("Mul", ["c", "two"], ["y"]),
                      inits={"lo": np.float32(-0.5), "hi": np.float32(0.7), "k": np.float32(0.3),
                             "two": np.float32(2.0)}, outputs=("clip", "max", "min", "y"))
    errors, ops = _int8(model, tmp_path)
    _within(errors, features_error, {"y": 2.0})


def test_a_clip_read_alone_stays_maximum_and_minimum(tmp_path, features_error):
    """Where nothing else reads x, Clip is MAXIMUM and MINIMUM: the range they give x is the clip's own."""
    model = _features(N("Clip", ["c", "lo", "hi"], ["y"]), inits={"lo": np.float32(-0.5), "hi": np.float32(0.7)})
    errors, ops = _int8(model, tmp_path)
    assert ops == {"CONV_2D": 1, "MAXIMUM": 1, "MINIMUM": 1}, ops
    _within(errors, features_error)


def test_a_concatenation_leaves_a_narrow_input_its_steps(tmp_path, features_error):
    """c (about [-4, 4]) is concatenated with 50*c, which is computed from c too: both outputs within 2
    of their int8 steps. A CONCATENATION on c itself gave c the concatenation's range, 50 times
    wider, and 50*c was taken of that (measured before: 45 where 2.9 is allowed)."""
    model = _features(N("Mul", ["c", "fifty"], ["wide"]), N("Concat", ["c", "wide"], ["cat"], axis=1),
                      N("Mul", ["c", "two"], ["y"]), inits={"fifty": np.float32(50), "two": np.float32(2)},
                      outputs=("cat", "y"))
    errors, ops = _int8(model, tmp_path)
    _within(errors, features_error, {"cat": 50.0, "y": 2.0})
    assert ops["DEPTHWISE_CONV_2D"] == 1, ops  # the copy of c the concatenation reads


def test_a_pad_with_a_far_value_leaves_its_input_its_steps(tmp_path, features_error):
    """c padded with 400 and also read by a Mul: the Mul's output within 2 of its int8 steps. A PADV2 on
    c itself gave c the range [-4, 400]."""
    model = _features(N("Pad", ["c", "pads", "far"], ["pad"]), N("Mul", ["c", "two"], ["y"]),
                      inits={"two": np.float32(2), "far": np.float32(400),
                             "pads": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64)}, outputs=("pad", "y"))
    errors, ops = _int8(model, tmp_path)
    _within(errors, features_error, {"y": 2.0})
    assert ops["DEPTHWISE_CONV_2D"] == 1, ops


def test_max_pool_of_a_signed_tensor_with_pads_tf_cannot_say(tmp_path, features_error):
    """MaxPool 3x3 stride 2 with pads 1 on 16x16 (TF's SAME would pad 0 and 1): the edges are repeated
    (STRIDED_SLICE, CONCATENATION), not padded with the lowest float, which became c's int8 range."""
    model = _features(N("MaxPool", ["c"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]))
    errors, ops = _int8(model, tmp_path)
    _within(errors, features_error)
    assert "PADV2" not in ops and ops["MAX_POOL_2D"] == 1, ops


def test_hard_activations_keep_their_ranges(tmp_path, features_error):
    """HardSigmoid (MUL, ADD+RELU, MINIMUM on that sum alone), HardSwish ((x/6)*relu6(x+3)), Clip(0, 6)
    and Clip(-1, 1) (RELU6, RELU_N1_TO_1) on the same c: no shared-quantization op reaches c, each
    output within 2 int8 steps."""
    model = _features(N("HardSigmoid", ["c"], ["hs"], alpha=0.2, beta=0.5), N("HardSwish", ["c"], ["hw"]),
                      N("Clip", ["c", "zero", "six"], ["r6"]), N("Clip", ["c", "m1", "one"], ["r1"]),
                      inits={"zero": np.float32(0), "six": np.float32(6), "m1": np.float32(-1), "one": np.float32(1)},
                      outputs=("hs", "hw", "r6", "r1"))
    errors, ops = _int8(model, tmp_path)
    assert {"RELU6", "RELU_N1_TO_1"} <= set(ops) and "HARD_SWISH" not in ops, ops
    _within(errors, features_error, {"hw": 1.5})


# --- a PReLU network on a face photograph ---------------------------------------------------------


def _face_crops(n: int, seed: int, size: int = 64) -> list[dict[str, np.ndarray]]:
    """`n` crops of the face in the portrait, each turned, scaled, shifted and perhaps mirrored (as a face
    landmark model's detector hands them over), NCHW in [0, 1] as MediaPipe's face models take them."""
    from PIL import Image

    image = Image.open(PHOTO).convert("RGB")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        cx, cy, half = 262 + rng.uniform(-15, 15), 245 + rng.uniform(-15, 15), 150 * rng.uniform(0.9, 1.12)
        turned = image.rotate(rng.uniform(-12, 12), center=(cx, cy), resample=Image.BILINEAR)
        crop = turned.crop((int(cx - half), int(cy - half), int(cx + half), int(cy + half)))
        crop = crop.resize((size, size), Image.BILINEAR)
        if rng.uniform() < 0.5:
            crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
        pixels = np.asarray(crop, np.float32) / 255
        out.append({"x": np.ascontiguousarray(pixels.transpose(2, 0, 1)[None])})
    return out


def _prelu_face_model() -> onnx.ModelProto:
    """MediaPipe's face-landmark network in small: three convolutions, each followed by a PReLU with
    per-channel slopes (0.05-0.3, as trained ones are), then a 1x1 convolution to 4 maps. The first PReLU's
    output `p1` is an output too: there Relu(x) + Min(x, 0)*s clipped the positive half (MediaPipe's
    face-landmark model: the first convolution's int8 range [-5.84, 0.24] where fp32 reaches 3.75)."""
    rng = np.random.default_rng(7)
    inits, nodes, x = {}, [], "x"
    for k, (cin, cout, stride) in enumerate([(3, 16, 2), (16, 16, 1), (16, 32, 2)], start=1):
        inits[f"w{k}"] = (rng.standard_normal((cout, cin, 3, 3)) * np.sqrt(2 / (9 * cin))).astype(np.float32)
        inits[f"b{k}"] = (rng.standard_normal(cout) * 0.2).astype(np.float32)
        inits[f"s{k}"] = rng.uniform(0.05, 0.3, (cout, 1, 1)).astype(np.float32)
        nodes += [N("Conv", [x, f"w{k}", f"b{k}"], [f"c{k}"], pads=[1, 1, 1, 1], strides=[stride, stride]),
                  N("PRelu", [f"c{k}", f"s{k}"], [f"p{k}"])]
        x = f"p{k}"
    inits["wh"] = (rng.standard_normal((4, 32, 1, 1)) * np.sqrt(2 / 32)).astype(np.float32)
    nodes.append(N("Conv", [x, "wh"], ["y"]))
    return make_model(nodes, {"x": (1, 3, 64, 64)}, ["p1", "y"], inits, opset=17)


def test_a_prelu_network_in_int8_follows_fp32_on_face_crops_it_was_not_calibrated_on(tmp_path):
    """Calibrated on 8 crops of a real face photograph, run on 4 others: each output of the int8 model
    close to fp32 relative to its range, and the positive half of the first PReLU's output kept (its int8
    maximum within 5 % of fp32's). Lowered as Relu(x) + Min(x, 0)*s, MINIMUM gave each convolution's
    output the range [lo, 0] (measured before: the int8 p1's maximum 0.0 where fp32's is 1.56, p1 off by
    71 % of its range, y by 69 % with a cosine of -0.04)."""
    model = _prelu_face_model()
    path = tmp_path / "face.tflite"
    result = tflite.convert_int8(model, _face_crops(8, seed=0), path)
    held_out = _face_crops(4, seed=1)
    got = [run_tflite(path, result, f) for f in held_out]
    want = [run_ort(model, f) for f in held_out]
    # each int8 step of each layer adds up through four: the first PReLU within 2 % of its range, the last
    # convolution within 5 % (a few of its values; the map as a whole has a cosine of at least 0.995)
    for name, share in (("p1", 0.02), ("y", 0.05)):
        g, w = np.stack([o[name] for o in got]).ravel(), np.stack([o[name] for o in want]).ravel()
        error = float(np.abs(g - w).max()) / float(np.ptp(w))
        cosine = float(g @ w / np.linalg.norm(g) / np.linalg.norm(w))
        assert error <= share and cosine >= 0.995, (name, error, cosine)
    p1_int8, p1_fp32 = np.stack([o["p1"] for o in got]), np.stack([o["p1"] for o in want])
    assert p1_fp32.max() > 0.5 * np.ptp(p1_fp32)  # the positive half is most of the range: a test of it
    assert p1_int8.max() >= 0.95 * p1_fp32.max(), (p1_int8.max(), p1_fp32.max())
    ops = result.op_counts  # (the stride-2 convolutions' pads, which TF's SAME cannot say, are PADs of their own)
    assert ops["PRELU"] == 3 and not {"MINIMUM", "MAXIMUM"} & set(ops), ops
