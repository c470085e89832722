"""`index_ranges.infer`: the valid range of an integer input that indexes a table, on inline graphs,
including the cases where no range may be inferred (the values change before the index consumer)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgesdk.ir.index_ranges import infer


def _model(nodes, inputs, outputs, tables: dict[str, tuple[int, ...]]) -> onnx.ModelProto:
    """A graph over float `tables` (initializers by name and shape), shapes inferred as import leaves them."""
    inits = [numpy_helper.from_array(np.zeros(s, np.float32), n) for n, s in tables.items()]
    g = helper.make_graph(nodes, "g", inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(m)


def _ids(shape=(1, 8), dtype=TensorProto.INT64, name="ids"):
    return helper.make_tensor_value_info(name, dtype, shape)


def _out(name="y"):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, None)


def _const(name: str, values) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(values, np.int64), name))


def test_gather_on_an_embedding_table():
    m = _model([helper.make_node("Gather", ["table", "ids"], ["y"], name="emb")], [_ids()], [_out()],
               {"table": (100, 16)})
    r = infer(m)["ids"]
    assert r.valid_range == (-100, 99)
    assert r.bounded_by == ("Gather 'emb' (100 along axis 0)",) and r.unchecked == ()


def test_through_value_preserving_ops():
    nodes = [helper.make_node("Cast", ["ids"], ["c"], to=TensorProto.INT32),
             _const("axes", [0]), helper.make_node("Unsqueeze", ["c", "axes"], ["u"]),
             _const("shape", [8]), helper.make_node("Reshape", ["u", "shape"], ["r"]),
             helper.make_node("Identity", ["r"], ["i"]),
             helper.make_node("Gather", ["table", "i"], ["y"], name="emb")]
    assert infer(_model(nodes, [_ids()], [_out()], {"table": (30, 4)}))["ids"].valid_range == (-30, 29)


def test_several_consumers_intersect():
    nodes = [helper.make_node("Gather", ["words", "ids"], ["a"], name="words"),
             helper.make_node("Flatten", ["ids"], ["f"]),
             helper.make_node("Gather", ["types", "f"], ["b"], name="types")]
    r = infer(_model(nodes, [_ids()], [_out("a"), _out("b")], {"words": (100, 4), "types": (50, 4)}))["ids"]
    assert r.valid_range == (-50, 49) and len(r.bounded_by) == 2


def test_axis_and_gather_elements():
    gather = helper.make_node("Gather", ["table", "ids"], ["y"], axis=-1)
    assert infer(_model([gather], [_ids((3,))], [_out()], {"table": (4, 30)}))["ids"].valid_range == (-30, 29)
    elements = helper.make_node("GatherElements", ["table", "ids"], ["y"], axis=1)
    assert infer(_model([elements], [_ids((4, 2))], [_out()], {"table": (4, 7)}))["ids"].valid_range == (-7, 6)


def test_gather_nd_only_when_every_indexed_axis_has_one_size():
    nd = helper.make_node("GatherND", ["table", "ids"], ["y"], name="nd")
    same = infer(_model([nd], [_ids((5, 2))], [_out()], {"table": (9, 9, 3)}))["ids"]
    assert same.valid_range == (-9, 8)
    mixed = infer(_model([nd], [_ids((5, 2))], [_out()], {"table": (3, 5, 2)}))["ids"]
    assert mixed.valid_range is None
    assert mixed.unchecked == ("GatherND 'nd' bounds nothing (its index components address axes of sizes (3, 5))",)


def test_no_range_when_the_values_change_first():
    """ids + 1 indexes the table: the table bounds the sum, not the input, so the input is not checked."""
    nodes = [_const("one", 1), helper.make_node("Add", ["ids", "one"], ["s"], name="shift"),
             helper.make_node("Gather", ["table", "s"], ["y"], name="emb")]
    r = infer(_model(nodes, [_ids()], [_out()], {"table": (100, 16)}))["ids"]
    assert r.valid_range is None and r.bounded_by == ()
    assert r.unchecked == ("Gather 'emb' takes ids + 1, not ids itself",)
    assert r.describe() == "input 'ids': Gather 'emb' takes ids + 1, not ids itself: not checked"


def test_no_range_where_evaluation_stops():
    """Mod, or arithmetic with another input: what reaches the table is not known at build time."""
    other = helper.make_tensor_value_info("other", TensorProto.INT64, (1, 8))
    for op, operand, inputs in (("Mod", "ten", [_ids()]), ("Add", "other", [_ids(), other])):
        nodes = [_const("ten", 10), helper.make_node(op, ["ids", operand], ["s"], name="op"),
                 helper.make_node("Gather", ["table", "s"], ["y"], name="emb")]
        r = infer(_model(nodes, inputs, [_out()], {"table": (100, 16)}))["ids"]
        assert r.valid_range is None and r.unchecked == (f"{op} 'op' changes its values before Gather 'emb'",)


def test_an_embeddings_own_normalization_of_negative_ids():
    """Keras 3's Embedding adds N where ids < 0 (a Select), in ONNX as Where or, from tf2onnx, as
    Cast(ids < 0) * (ids + N) + Cast(!(ids < 0)) * ids: the table still bounds ids to [-N, N-1]."""
    n = 1000
    where = [_const("n", n), _const("zero", 0), helper.make_node("Less", ["ids", "zero"], ["neg"]),
             helper.make_node("Add", ["ids", "n"], ["wrapped"]),
             helper.make_node("Where", ["neg", "wrapped", "ids"], ["i"]),
             helper.make_node("Gather", ["table", "i"], ["y"], name="emb")]
    ids32 = _ids(dtype=TensorProto.INT32)
    lowered = [numpy_helper.from_array(np.array(n, np.int32), "n"),
               numpy_helper.from_array(np.array(0, np.float32), "zero")]
    tf2onnx = [helper.make_node("Add", ["ids", "n"], ["add"]),
               helper.make_node("Cast", ["ids"], ["f"], to=TensorProto.FLOAT),
               helper.make_node("Less", ["f", "zero"], ["less"]),
               helper.make_node("Not", ["less"], ["not"]),
               helper.make_node("Cast", ["not"], ["keep"], to=TensorProto.INT32),
               helper.make_node("Mul", ["ids", "keep"], ["kept"]),
               helper.make_node("Cast", ["less"], ["wrap"], to=TensorProto.INT32),
               helper.make_node("Mul", ["wrap", "add"], ["wrapped"]),
               helper.make_node("Add", ["wrapped", "kept"], ["i"]),
               helper.make_node("Gather", ["table", "i"], ["y"], name="emb")]
    m = _model(tf2onnx, [ids32], [_out()], {"table": (n, 8)})
    m.graph.initializer.extend(lowered)
    for model in (_model(where, [_ids()], [_out()], {"table": (n, 8)}), m):
        r = infer(model)["ids"]
        assert r.valid_range == (-n, n - 1) and r.unchecked == ()
    other = infer(_model(where, [_ids()], [_out()], {"table": (2 * n, 8)}))["ids"]  # adds 1000 to a table of 2000
    assert other.valid_range is None
    assert other.unchecked == ("Gather 'emb' takes ids + 1000 where ids < 0 and ids where ids >= 0, not ids itself",)


def test_casts_on_the_way():
    """A float round trip is exact for every id that passes the check while the table fits float32's
    2^24; a larger table bounds nothing through it. A cast to unsigned wraps negative ids."""
    nodes = [helper.make_node("Cast", ["ids"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["f"], ["i"], to=TensorProto.INT64),
             helper.make_node("Gather", ["table", "i"], ["y"], name="emb")]
    assert infer(_model(nodes, [_ids()], [_out()], {"table": (100, 16)}))["ids"].valid_range == (-100, 99)
    huge = helper.make_tensor_value_info("table", TensorProto.FLOAT, (2**25, 1))  # a shape, no data
    r = infer(_model(nodes, [huge, _ids()], [_out()], {}))["ids"]
    assert r.valid_range is None
    assert r.unchecked == ("Gather 'emb' indexes 33554432 entries through a cast exact only up to 16777216",)
    unsigned = [helper.make_node("Cast", ["ids"], ["u"], to=TensorProto.UINT32, name="tounsigned"),
                helper.make_node("Gather", ["table", "u"], ["y"], name="emb")]
    r = infer(_model(unsigned, [_ids()], [_out()], {"table": (100, 16)}))["ids"]
    assert r.unchecked == ("Cast 'tounsigned' changes its values before Gather 'emb'",)


def test_a_checked_path_and_an_unchecked_one():
    nodes = [helper.make_node("Gather", ["words", "ids"], ["a"], name="words"),
             _const("one", 1), helper.make_node("Add", ["ids", "one"], ["s"], name="shift"),
             helper.make_node("Gather", ["pos", "s"], ["b"], name="pos")]
    r = infer(_model(nodes, [_ids()], [_out("a"), _out("b")], {"words": (100, 4), "pos": (10, 4)}))["ids"]
    assert r.valid_range == (-100, 99) and r.unchecked == ("Gather 'pos' takes ids + 1, not ids itself",)


def test_inputs_that_index_nothing_are_left_out():
    nodes = [helper.make_node("Gather", ["x", "idx"], ["y"]),  # x is the data, a float input
             _const("idx", [0, 1]),
             helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
             helper.make_node("Gather", ["n", "idx"], ["z"])]  # n is gathered from, not an index
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, (4, 3))
    m = _model(nodes, [x, _ids((4,), name="n")], [_out(), _out("z"), _out("nf")], {})
    assert infer(m) == {}


def test_unknown_table_size_bounds_nothing():
    table = helper.make_tensor_value_info("table", TensorProto.FLOAT, ("rows", 4))
    m = _model([helper.make_node("Gather", ["table", "ids"], ["y"], name="emb")], [table, _ids()], [_out()], {})
    r = infer(m)["ids"]
    assert r.valid_range is None and "the shape of its data is not known" in r.unchecked[0]
