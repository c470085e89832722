"""The support tables ask the device models (their own refusal, then their backends in order) and
give exactly what the kind-by-kind code before them gave: the same `edgesdk.capable` labels in the
same order, the same refusals (device, code, sentence), over every kind a target can combine."""

from __future__ import annotations

import itertools

import onnx
import pytest
from onnx import TensorProto, helper

from edgesdk.backends import tflite as tflite_backend
from edgesdk.backends import tvm as tvm_backend
from edgesdk.devices import edgetpu
from edgesdk.devices.edgetpu import Refusal
from edgesdk.legalization import support

# --- the tables as they were (legalization/support.py at c4e5e36) -------------------------------------

OLD_REASONS = {
    **edgetpu.REASONS,
    "gpu.tvm-unsupported": "TVM's ONNX importer has no converter for this op, so no GPU kernel is generated",
    "cpu.tvm-unsupported": "TVM's ONNX importer has no converter for this op: onnxruntime runs it on the CPU",
}


def _old_refusal(kind, node, shapes, consts, types, tvm_ops):
    if kind == "edgetpu":
        floats = [t for t in list(node.input) + list(node.output)
                  if t and t not in consts and types.get(t, onnx.TensorProto.FLOAT) != onnx.TensorProto.FLOAT]
        if floats:
            return Refusal("edgetpu.data-type", f"tensor '{floats[0]}' is not float32, and only float32 tensors "
                                                "are quantized to the edge tpu's int8")
        if r := edgetpu.unsupported_reason(node, shapes, consts):
            return r
        if why := tflite_backend.lowering_reason(node, shapes, consts):
            return Refusal("edgetpu.no-lowering", why)
        return None
    if kind == "gpu":
        return None if node.op_type in tvm_ops else Refusal("gpu.tvm-unsupported", OLD_REASONS["gpu.tvm-unsupported"])
    return None


def _old_node(kinds, node, shapes, consts, types, tvm_ops):
    capable, refusals = [], []
    for kind in ("edgetpu", "gpu"):
        if kind not in kinds:
            continue
        r = _old_refusal(kind, node, shapes, consts, types, tvm_ops)
        if r is None:
            capable.append(kind)
        else:
            refusals.append({"device": kind, "code": r.code, "reason": r.reason})
    if node.op_type in tvm_ops:
        capable.append("cpu/tvm")
    elif not node.domain or node.domain == "ai.onnx":
        capable.append("cpu/onnxruntime")
        refusals.append({"device": "cpu/tvm", "code": "cpu.tvm-unsupported", "reason": OLD_REASONS["cpu.tvm-unsupported"]})
    return capable, refusals


# --- nodes of every kind of answer --------------------------------------------------------------------


def _nodes(tvm_ops):
    standard = sorted({s.name for s in onnx.defs.get_all_schemas() if s.domain == ""})
    missing = [op for op in standard if op not in tvm_ops][:6]  # standard ops TVM lacks: onnxruntime's
    ops = ["Conv", "Relu", "Add", "Mul", "Div", "Erf", "Softmax", "MatMul", "Gemm", "ReduceMean", "Concat", "Pad",
           "Transpose", "LSTM", "Loop", "Constant", "Sigmoid", "Tanh", "Gelu", *missing]
    attrs = {"Conv": dict(dilations=[1, 2]), "Softmax": dict(axis=0), "Concat": dict(axis=1)}
    for op in ops:
        yield helper.make_node(op, ["x", "w"], ["y"], **attrs.get(op, {}))
        yield helper.make_node(op, ["x"], ["y"])
    yield helper.make_node("Foo", ["x"], ["y"], domain="com.example")
    yield helper.make_node("Add", ["w", "w"], ["y"])  # all inputs constant: folds away


SHAPES = [{"x": (1, 8, 8, 8), "w": (8, 8, 3, 3), "y": (1, 8, 8, 8)},
          {"x": (1, 2, 3, 4, 5), "w": (1, 2, 3, 4, 5), "y": (1, 2, 3, 4, 5)},   # rank beyond the Edge TPU's
          {"x": (1, 16), "w": (16, 4), "y": (1, 4)},
          {"w": (4,)}]                                                          # no static shape
TYPES = [{}, {"x": TensorProto.INT64}, {"y": TensorProto.FLOAT16}]
KINDS = [["cpu"], ["cpu", "edgetpu"], ["cpu", "gpu"], ["cpu", "edgetpu", "gpu"], ["gpu", "cpu", "edgetpu"]]


def _answer(f):
    try:
        return f()
    except Exception as e:  # noqa: BLE001 - an old crash must stay the same crash
        return type(e).__name__, str(e)


@pytest.mark.parametrize("kinds", KINDS, ids=",".join)
def test_the_tables_answer_as_before(kinds):
    tvm_ops = tvm_backend.importer_ops()
    tables = support.Tables(kinds)
    n = 0
    for node, shapes, types in itertools.product(list(_nodes(tvm_ops)), SHAPES, TYPES):
        consts = {"w"}
        old = _answer(lambda: _old_node(kinds, node, shapes, consts, types, tvm_ops))
        new = _answer(lambda: (lambda s: (s.capable, s.refusals))(tables.node(node, 0, shapes, consts, types)))
        assert new == old, (node.op_type, node.domain, shapes, types)
        n += 1
    assert n > 500


def test_labels():
    assert support.label("edgetpu", "tflite", ("tflite",)) == "edgetpu"
    assert support.label("cpu", "onnxruntime", ("tvm", "onnxruntime")) == "cpu/onnxruntime"
    assert support.kind_of("cpu/tvm") == "cpu" and support.kind_of("edgetpu") == "edgetpu"
