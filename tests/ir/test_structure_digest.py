"""`graph_structure_sha256`: the same computation under other tensor names digests the same; other weights,
attributes, input order or outputs do not. `scheduling.segments.shared` marks the later of two such
accelerator segments as standing for the earlier."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgesdk.ir.digest import graph_structure_sha256
from edgesdk.scheduling.plan import PlanSegment
from edgesdk.scheduling.segments import shared


def _graph(prefix: str, w: np.ndarray, *, stride: int = 1, outputs: tuple[str, ...] = ("r",)) -> onnx.ModelProto:
    p = prefix
    nodes = [helper.make_node("Conv", [f"{p}x", f"{p}w"], [f"{p}c"], name=f"{p}conv", strides=[stride, stride]),
             helper.make_node("Relu", [f"{p}c"], [f"{p}r"], name=f"{p}relu")]
    shape = {"c": [1, 4, 8 // stride, 8 // stride], "r": [1, 4, 8 // stride, 8 // stride]}
    g = helper.make_graph(nodes, f"{p}g", [helper.make_tensor_value_info(f"{p}x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info(f"{p}{o}", TensorProto.FLOAT, shape[o]) for o in outputs],
                          [numpy_helper.from_array(w, f"{p}w")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


W = np.random.default_rng(0).standard_normal((4, 3, 1, 1)).astype(np.float32)


def test_names_do_not_count_but_what_is_computed_does():
    a = graph_structure_sha256(_graph("frame0/", W))
    assert graph_structure_sha256(_graph("frame7/", W)) == a
    assert graph_structure_sha256(_graph("frame7/", W + 1e-3)) != a             # other weights
    assert graph_structure_sha256(_graph("frame7/", W, stride=2)) != a          # another attribute
    assert graph_structure_sha256(_graph("frame7/", W, outputs=("c", "r"))) != a  # another output


def test_input_order_counts():
    def two(order):
        n = helper.make_node("Sub", list(order), ["y"])
        g = helper.make_graph([n], "g", [helper.make_tensor_value_info(t, TensorProto.FLOAT, [2]) for t in "ab"],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])

    assert graph_structure_sha256(two("ab")) != graph_structure_sha256(two("ba"))


def test_shared_marks_later_accelerator_segments_of_one_kind_and_backend():
    def seg(sid, device, backend="tflite"):
        return PlanSegment(sid, device, backend, f"segments/{sid}.onnx", (sid,), (), (), 0.0, 0, 1.0)

    models = {"s0": _graph("a/", W), "s1": _graph("b/", W), "s2": _graph("c/", W), "s3": _graph("d/", W),
              "s4": _graph("e/", W + 1)}
    segments = (seg("s0", "cpu", "tvm"), seg("s1", "edgetpu:0"), seg("s2", "edgetpu:1"), seg("s3", "cpu", "tvm"),
                seg("s4", "edgetpu:0"))
    got = shared(segments, models)
    assert [s.same_as for s in got] == ["", "", "s1", "", ""]   # CPU segments are never shared
    assert PlanSegment.from_json(got[2].to_json()) == got[2] and "same_as" not in got[1].to_json()
