"""The culprit search (compression/culprits.py, backends/tflite/layers.py): a planted culprit is named by
its ONNX node name with its cause, and the layers after it, which only inherit its error, are not.
Inputs are crops of a photograph (matplotlib's sample of Grace Hopper's portrait)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk.compression import culprits
from edgesdk.compression.accuracy import View

SIZE = 16


def photo_crops(count: int, *, seed: int, gain: float = 1.0) -> list[dict[str, np.ndarray]]:
    """`count` crops of the photograph, SIZE x SIZE, NCHW in [0, gain] (a gain under 1: darker)."""
    import matplotlib
    from PIL import Image

    image = Image.open(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg").convert("RGB")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        s = rng.uniform(0.3, 0.9)
        w, h = int(image.width * s), int(image.height * s)
        x0, y0 = rng.integers(0, image.width - w + 1), rng.integers(0, image.height - h + 1)
        crop = np.asarray(image.crop((x0, y0, x0 + w, y0 + h)).resize((SIZE, SIZE)), np.float32) / 255.0
        out.append({"x": (gain * crop).transpose(2, 0, 1)[None].copy()})
    return out


def _model(nodes: list, output: str, channels: int, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.4).astype(np.float32), "w1"),
             numpy_helper.from_array((rng.standard_normal(8) * 0.1).astype(np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((channels, 8, 3, 3)) * 0.2).astype(np.float32), "w2"),
             numpy_helper.from_array(np.zeros(1, np.float32), "zero"),
             numpy_helper.from_array(np.full((1, 8, 1, 1), 0.25, np.float32), "slope")]
    used = {i for n in nodes for i in n.input}
    inits = [i for i in inits if i.name in used]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, SIZE, SIZE])],
                              [helper.make_tensor_value_info(output, TensorProto.FLOAT, [1, channels, SIZE, SIZE])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


CONV_RELU_CONV = [helper.make_node("Conv", ["x", "w1", "b1"], ["a"], name="stem/conv", pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", ["a"], ["r"], name="stem/relu"),
                  helper.make_node("Conv", ["r", "w2"], ["y"], name="head/conv", pads=[1, 1, 1, 1])]


def _int8(values: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """`values` as an int8 tensor of range [lo, hi] holds them."""
    scale = (hi - lo) / 255
    zero = round(-128 - lo / scale)
    return ((np.clip(np.round(values / scale) + zero, -128, 127) - zero) * scale).astype(np.float32)


def _simulated(model: onnx.ModelProto, feeds: list[dict], clip_to: float | None, shared: tuple[str, ...] = ()) -> dict:
    """The int8 side of `model` as a converter would make it: every tensor int8 over the range fp32 takes
    on `feeds`, but `a` (the stem's output) over [-clip_to, clip_to] where given, each computed from the
    one before."""
    from edgesdk.compression.fidelity import run_samples

    fp32 = run_samples(model, feeds, ["a", "r"])
    span = {t: (min(float(s[t].min()) for s in fp32), max(float(s[t].max()) for s in fp32)) for t in ("a", "r", "y")}
    w2 = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "w2"))
    head = helper.make_model(helper.make_graph(
        [CONV_RELU_CONV[2]], "head", [helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, 8, SIZE, SIZE])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(w2, "w2")]),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    out = {t: {"node": k, "op": op, "values": [], "at_limits": [], "step": None, "representable": None, "shared": []}
           for k, (t, op) in enumerate((("a", "CONV_2D"), ("r", "RELU"), ("y", "CONV_2D")))}
    out["a"]["shared"] = list(shared)
    ranges = {"a": (-clip_to, clip_to) if clip_to else span["a"], "r": (0.0, span["r"][1]), "y": span["y"]}
    for t, (lo, hi) in ranges.items():
        out[t]["representable"], out[t]["step"] = [lo, hi], (hi - lo) / 255
    for s in fp32:
        a = _int8(s["a"], *ranges["a"])
        r = _int8(np.maximum(a, 0), *ranges["r"])
        y = _int8(run_samples(head, [{"r": r}])[0]["y"], *ranges["y"])
        for t, v in (("a", a), ("r", r), ("y", y)):
            out[t]["values"].append(v)
    return out


def test_a_layer_clipped_by_its_range_is_named_and_what_follows_is_not():
    model = _model(CONV_RELU_CONV, "y", 4)
    feeds = photo_crops(3, seed=5)
    found = culprits.rank(model, _simulated(model, feeds, clip_to=0.3), feeds, segment="s0")
    assert found and found[0].node == "stem/conv" and found[0].cause == "calibration-clipping", found
    first = found[0]
    assert first.segment == "s0" and first.op == "Conv" and first.int8_op == "CONV_2D" and first.tensor == "a"
    assert first.added_error > 0.3 and first.added_snr_db < 15, first
    assert "the range int8 represents there" in first.why and "[-0.3, 0.3]" in first.why
    # the head reads the clipped values as they are: it adds little of its own (its error is the stem's)
    head = next((c for c in culprits.compare(model, _simulated(model, feeds, clip_to=0.3), feeds, segment="s0",
                                             parts={}) if c.node == "head/conv"))
    assert head.added_error < 0.02 < head.error, head
    # the same range kept by an op that shares it between its input and output (MINIMUM)
    shared = culprits.rank(model, _simulated(model, feeds, clip_to=0.3, shared=("MINIMUM",)), feeds, segment="s0")
    assert shared[0].node == "stem/conv" and shared[0].cause == "shared-quantization"
    assert shared[0].why.startswith("MINIMUM keeps one quantization for its input and output")
    # the ranges the photograph's crops take: no culprit at all
    assert culprits.rank(model, _simulated(model, feeds, clip_to=None), feeds, segment="s0") == []


def test_where_no_layer_adds_enough_the_ones_adding_the_most_are_ranked_when_asked():
    """A loss spread over many layers, none adding MIN_ADDED of its range, is no culprit by default; asked
    with `least=0` (the accuracy remedy, when the gate failed and nothing else is named), rank gives those
    that add the most, in order."""
    model = _model(CONV_RELU_CONV, "y", 4)
    feeds = photo_crops(3, seed=5)
    int8 = _simulated(model, feeds, clip_to=None)
    assert culprits.rank(model, int8, feeds, segment="s0") == []
    spread = culprits.rank(model, int8, feeds, segment="s0", least=0.0)
    assert spread and all(0 < c.added_error < culprits.MIN_ADDED for c in spread), spread
    assert [c.added_error for c in spread] == sorted((c.added_error for c in spread), reverse=True)


def test_an_approximations_nodes_are_named_by_the_node_it_replaced():
    model = _model([helper.make_node("Conv", ["x", "w1", "b1"], ["a"], name="approx0/shift", pads=[1, 1, 1, 1]),
                    helper.make_node("Relu", ["a"], ["r"], name="stem/relu"),
                    helper.make_node("Conv", ["r", "w2"], ["y"], name="head/conv", pads=[1, 1, 1, 1])], "y", 4)
    feeds = photo_crops(2, seed=6)
    found = culprits.rank(model, _simulated(model, feeds, clip_to=0.3), feeds, segment="s1",
                          approximations=[{"prefix": "approx0/", "nodes": ["/act/Mish"], "output": "r"}])
    assert found[0].node == "/act/Mish" and found[0].cause == "approximation", found


@pytest.fixture(scope="module")
def concat_int8(tmp_path_factory):
    """A convolution's small activations concatenated with a wide tensor, converted to full int8 on crops
    of the photograph: TFLite's CONCATENATION gives its inputs its output's quantization, so the
    convolution's output, read by nothing else, gets the wide tensor's step (a YOLO head's scores
    concatenated with its boxes in pixels)."""
    from edgesdk.backends.tflite import convert_int8

    # weights 500 times the stem's: activations in the hundreds, as a box's pixels beside a score
    w3 = numpy_helper.from_array((np.random.default_rng(3).standard_normal((8, 3, 3, 3)) * 200).astype(np.float32))
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c"], name="/stem/conv/Conv", pads=[1, 1, 1, 1]),
             helper.make_node("Constant", [], ["w3"], name="/wide/w", value=w3),
             helper.make_node("Conv", ["x", "w3"], ["big"], name="/wide/conv/Conv", pads=[1, 1, 1, 1]),
             helper.make_node("Concat", ["c", "big"], ["y"], name="/cat/Concat", axis=1)]
    model = _model(nodes, "y", 16)
    path = tmp_path_factory.mktemp("concat") / "s0.tflite"
    result = convert_int8(model, photo_crops(12, seed=1), path)
    record = {"artifact": "s0.tflite", "layouts": {k: list(v) for k, v in result.layouts.items()},
              **{side: [json.loads(json.dumps(dataclasses.asdict(t))) for t in getattr(result, side)]
                 for side in ("inputs", "outputs")}}
    return model, path, record


def test_the_convolution_a_concatenation_coarsens_is_named_with_its_onnx_name(concat_int8):
    from edgesdk.backends import LayersJob, backend

    model, path, record = concat_int8
    feeds = photo_crops(2, seed=2)
    layers = backend("tflite").int8_layers(LayersJob(model, path, record, feeds))
    # every ONNX tensor with an int8 tensor of its own, in ONNX layout, read from the converter's names
    assert {"c", "y", "x"} <= set(layers), sorted(layers)
    assert layers["c"]["op"] == "CONV_2D" and layers["c"]["values"][0].shape == (1, 8, SIZE, SIZE)
    assert "CONCATENATION" in layers["c"]["shared"] and layers["c"]["step"] > 1.0, layers["c"]
    found = culprits.rank(model, layers, feeds, segment="s0", parts={"y": [View("y", "values")]})
    assert found[0].node == "/stem/conv/Conv" and found[0].cause == "shared-quantization", found
    assert found[0].int8_op == "CONV_2D" and "CONCATENATION" in found[0].why
    assert found[0].added_error > 0.2
