"""A small detector with the head of an Ultralytics YOLOv8 export, written with onnx.helper.

Three scales of a few convolutions give box and class maps; the anchor grid is computed in the graph
as the exporter writes it (`make_anchors`): per scale, Range over the feature map's width and height
(read with Shape/Gather), +0.5, Expand to the grid, Concat to points, and the scale's stride as a
ConstantOfShape of h*w elements; the scales' Concat. Then the box decode (`dist2bbox`: Sub/Add with
the anchor points, the centre and size, Mul by the strides) and the Concat to [1, 4 + classes, anchors].
Nothing of the grid depends on the input's values: at `size` 80 the first scale's stride tensor has
1,600 elements (> 1,024) and the grid 2,100 anchors, as YOLOv8n's at 320x320.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

STRIDES = (2, 4, 8)  # the input's size over each scale's (YOLOv8: 8, 16, 32)


def model(size: int = 80, classes: int = 2, channels: int = 8, seed: int = 0, grid_from_shape: bool = True
          ) -> onnx.ModelProto:
    """The detector for a `size` x `size` input; `grid_from_shape` False reads each scale's height and width
    from initializers instead of the feature map's Shape: the grid then depends on no node of the network
    at all (what import leaves of it once Shape is folded), with no import run."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []

    def const(name: str, value) -> str:
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(op: str, inputs: list[str], output: str, **attrs) -> str:
        nodes.append(helper.make_node(op, inputs, [output], name=f"/{output}", **attrs))
        return output

    def conv(x: str, cin: int, cout: int, stride: int, name: str, act: bool = True) -> str:
        w = const(f"{name}.w", (rng.standard_normal((cout, cin, 3, 3)) / np.sqrt(9 * cin)).astype(np.float32))
        b = const(f"{name}.b", (rng.standard_normal(cout) * 0.1).astype(np.float32))
        y = node("Conv", [x, w, b], f"{name}.conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[stride, stride])
        if not act:
            return y
        return node("Mul", [y, node("Sigmoid", [y], f"{name}.sig")], f"{name}.silu")  # SiLU

    one, half = const("one", np.array(1.0, np.float32)), const("half", np.array(0.5, np.float32))
    zero = const("zero", np.array(0.0, np.float32))
    axes0 = const("axes0", np.array([0], np.int64))
    features, points, strides = [], [], []
    x, cin = "images", 3
    for k, stride in enumerate(STRIDES):
        x = conv(x, cin, channels, 2, f"stem{k}")
        cin = channels
        box = conv(conv(x, channels, channels, 1, f"box{k}.0"), channels, 4, 1, f"box{k}.1", act=False)
        cls = conv(conv(x, channels, channels, 1, f"cls{k}.0"), channels, classes, 1, f"cls{k}.1", act=False)
        cat = node("Concat", [box, cls], f"head{k}.cat", axis=1)
        features.append(node("Reshape", [cat, const(f"head{k}.shape", np.array([1, 4 + classes, -1], np.int64))],
                             f"head{k}.flat"))
        # make_anchors: the grid of this scale, from the feature map's shape
        shape = (node("Shape", [x], f"grid{k}.shape") if grid_from_shape else
                 const(f"grid{k}.shape", np.array([1, channels, size >> (k + 1), size >> (k + 1)], np.int64)))
        h = node("Cast", [node("Gather", [shape, const(f"grid{k}.i2", np.array(2, np.int64))], f"grid{k}.h64")],
                 f"grid{k}.h", to=TensorProto.FLOAT)
        w = node("Cast", [node("Gather", [shape, const(f"grid{k}.i3", np.array(3, np.int64))], f"grid{k}.w64")],
                 f"grid{k}.w", to=TensorProto.FLOAT)
        sx = node("Add", [node("Range", [zero, w, one], f"grid{k}.rx"), half], f"grid{k}.sx")
        sy = node("Add", [node("Range", [zero, h, one], f"grid{k}.ry"), half], f"grid{k}.sy")
        hw = node("Concat", [node("Unsqueeze", [node("Cast", [h], f"grid{k}.hi", to=TensorProto.INT64), axes0],
                                  f"grid{k}.h1"),
                             node("Unsqueeze", [node("Cast", [w], f"grid{k}.wi", to=TensorProto.INT64), axes0],
                                  f"grid{k}.w1")], f"grid{k}.hw", axis=0)
        gx = node("Expand", [node("Reshape", [sx, const(f"grid{k}.row", np.array([1, -1], np.int64))], f"grid{k}.sx2"),
                             hw], f"grid{k}.gx")
        gy = node("Expand", [node("Reshape", [sy, const(f"grid{k}.col", np.array([-1, 1], np.int64))], f"grid{k}.sy2"),
                             hw], f"grid{k}.gy")
        last = const(f"grid{k}.axes", np.array([-1], np.int64))
        xy = node("Concat", [node("Unsqueeze", [gx, last], f"grid{k}.gx3"), node("Unsqueeze", [gy, last], f"grid{k}.gy3")],
                  f"grid{k}.xy", axis=-1)
        points.append(node("Reshape", [xy, const(f"grid{k}.pts", np.array([-1, 2], np.int64))], f"grid{k}.points"))
        n = node("Mul", [node("Cast", [h], f"grid{k}.hn", to=TensorProto.INT64),
                         node("Cast", [w], f"grid{k}.wn", to=TensorProto.INT64)], f"grid{k}.n")
        size_hw1 = node("Concat", [node("Unsqueeze", [n, axes0], f"grid{k}.n1"), const(f"grid{k}.c1", np.array([1], np.int64))],
                        f"grid{k}.n_1", axis=0)
        strides.append(node("ConstantOfShape", [size_hw1], f"grid{k}.stride",
                            value=numpy_helper.from_array(np.array([float(stride)], np.float32))))
    anchors = node("Transpose", [node("Concat", points, "anchors.cat", axis=0)], "anchors", perm=[1, 0])  # [2, A]
    stride = node("Transpose", [node("Concat", strides, "strides.cat", axis=0)], "strides", perm=[1, 0])  # [1, A]
    head = node("Concat", features, "head", axis=2)
    box, cls = "box", "cls"
    nodes.append(helper.make_node("Split", ["head", const("split", np.array([4, classes], np.int64))], [box, cls],
                                  name="/split", axis=1))
    lt, rb = "lt", "rb"
    nodes.append(helper.make_node("Split", [box, const("split2", np.array([2, 2], np.int64))], [lt, rb],
                                  name="/split2", axis=1))
    x1y1 = node("Sub", [anchors, lt], "x1y1")
    x2y2 = node("Add", [anchors, rb], "x2y2")
    centre = node("Div", [node("Add", [x1y1, x2y2], "sum"), const("two", np.array(2.0, np.float32))], "centre")
    wh = node("Sub", [x2y2, x1y1], "wh")
    dbox = node("Mul", [node("Concat", [centre, wh], "xywh", axis=1), stride], "dbox")
    node("Concat", [dbox, node("Sigmoid", [cls], "scores")], "output0", axis=1)
    anchors_total = sum((size // s) ** 2 for s in STRIDES)
    graph = helper.make_graph(
        nodes, "yolov8_head",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [1, 4 + classes, anchors_total])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tests.yolo_head")
    m.ir_version = 8
    m = onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=True)
    onnx.checker.check_model(m, full_check=True)
    return m


PHOTOS_PREPROCESS = "color=RGB,scale=0.00392157,layout=NCHW"  # how written_with_photos' images become inputs


def written_with_photos(directory: Path) -> tuple[Path, Path]:
    """`model()` saved as `directory`/yolov8_head.onnx, and 12 of scikit-image's photographs at its 80x80
    input in `directory`/photos (tests.model_zoo.photos): the model and its real calibration images."""
    from PIL import Image

    from tests import model_zoo

    directory = Path(directory)
    path = directory / "yolov8_head.onnx"
    onnx.save(model(), path)
    calib = directory / "photos"
    calib.mkdir()
    for k, image in enumerate(model_zoo.photos()[:12]):
        Image.fromarray(image).resize((80, 80)).save(calib / f"photo{k:02d}.png")
    return path, calib
