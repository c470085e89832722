"""Transpose pairs merge; transposes sink through elementwise chains until they meet."""

from __future__ import annotations

import numpy as np
import onnx

from tests.passes.harness import EXACT, assert_same, check_does_not_fire, check_fires, f32, model, node, ops, optimized

NCHW = {"x": [1, 3, 4, 5]}
TO_NHWC, TO_NCHW = [0, 2, 3, 1], [0, 3, 1, 2]
rng = np.random.default_rng(2)


def test_inverse_pair_cancels():
    m = model([node("Transpose", ["x"], ["a"], perm=TO_NHWC), node("Transpose", ["a"], ["b"], perm=TO_NCHW),
               node("Relu", ["b"], ["y"])], NCHW, ["y"])
    out = check_fires(m, "merge-transpose-pair", gone=("Transpose",))
    assert ops(out) == {"Relu": 1}


def test_pair_that_is_not_inverse_becomes_one_transpose():
    m = model([node("Transpose", ["x"], ["a"], perm=TO_NHWC), node("Transpose", ["a"], ["y"], perm=TO_NHWC)],
              NCHW, ["y"])
    out = check_fires(m, "merge-transpose-pair")
    assert ops(out) == {"Transpose": 1}


def sandwich(middle, inits, first=TO_NHWC, second=TO_NCHW, outputs=("y",)) -> onnx.ModelProto:
    return model([node("Transpose", ["x"], ["t"], perm=first), *middle,
                  node("Transpose", ["e"], ["y"], perm=second)], NCHW, list(outputs), inits)


CHAIN = [node("Relu", ["t"], ["a"]), node("Add", ["a", "bias"], ["b"]), node("Mul", ["scale", "b"], ["c"]),
         node("Clip", ["c", "lo", "hi"], ["d"]), node("Sub", ["d", "plane"], ["e"])]


def chain_inits() -> dict:
    # bias per channel (last axis in NHWC), a scalar, and a (H, W, 1) plane: each broadcasts differently.
    return {"bias": rng.standard_normal(3).astype(np.float32), "scale": f32(1.5), "lo": f32(-1.0), "hi": f32(2.0),
            "plane": rng.standard_normal((4, 5, 1)).astype(np.float32)}


def test_transposes_around_an_elementwise_chain_cancel():
    m = sandwich(CHAIN, chain_inits())
    out = check_fires(m, "sink-transpose", gone=("Transpose",))
    assert ops(out) == {"Relu": 1, "Add": 1, "Mul": 1, "Clip": 1, "Sub": 1}
    assert [o.name for o in out.graph.output] == ["y"]


def test_transposes_that_do_not_cancel_become_one():
    m = sandwich(CHAIN, chain_inits(), second=TO_NHWC)
    out = check_fires(m, "sink-transpose")
    assert ops(out)["Transpose"] == 1


def test_transpose_without_a_partner_stays_put():
    # No ping-pong: a lone transpose is never moved, so a second optimization changes nothing.
    m = model([node("Transpose", ["x"], ["t"], perm=TO_NHWC), node("Relu", ["t"], ["y"])], NCHW, ["y"])
    out = check_does_not_fire(m, "sink-transpose", kept=("Transpose",))
    again, record = optimized(out)
    assert not any(record["rules"].values())
    assert again.graph.node[0].op_type == "Transpose"


def test_chain_value_that_is_a_graph_output_stays():
    m = sandwich(CHAIN, chain_inits(), outputs=("y", "c"))
    check_does_not_fire(m, "sink-transpose", kept=("Transpose",))


def test_chain_value_used_twice_stays():
    middle = [*CHAIN[:-1], node("Sub", ["d", "plane"], ["e"]), node("Add", ["a", "a"], ["unused_twice"])]
    m = sandwich(middle, chain_inits(), outputs=("y", "unused_twice"))
    check_does_not_fire(m, "sink-transpose", kept=("Transpose",))


def test_non_constant_operand_stays():
    m = model([node("Transpose", ["x"], ["t"], perm=TO_NHWC), node("Add", ["t", "z"], ["e"]),
               node("Transpose", ["e"], ["y"], perm=TO_NCHW)], {**NCHW, "z": [3]}, ["y"])
    check_does_not_fire(m, "sink-transpose", kept=("Transpose",))


def test_constant_of_higher_rank_stays():
    m = sandwich([node("Add", ["t", "big"], ["e"])], {"big": np.ones((2, 1, 4, 5, 3), np.float32)},
                 second=[0, 1, 4, 2, 3])
    check_does_not_fire(m, "sink-transpose", kept=("Transpose",))


def test_sinking_is_exact():
    m = sandwich(CHAIN, chain_inits())
    out, _ = optimized(m)
    for seed in range(3):
        assert_same(m, out, seed=seed, **EXACT)


def qdq_sandwich(scale: np.ndarray) -> onnx.ModelProto:
    # tf2onnx's form of an int8 TFLite model: NHWC<->NCHW transposes around quantize/dequantize.
    axis = {"axis": 3} if scale.ndim else {}
    return sandwich([node("QuantizeLinear", ["t", "scale", "zp"], ["q"], **axis),
                     node("DequantizeLinear", ["q", "scale", "zp"], ["e"], **axis)],
                    {"scale": scale, "zp": np.zeros(scale.shape, np.int8)})


def test_transposes_around_per_tensor_quantization_cancel():
    m = qdq_sandwich(f32(0.05))
    out = check_fires(m, "sink-transpose", gone=("Transpose",))
    assert ops(out) == {"QuantizeLinear": 1, "DequantizeLinear": 1}


def test_transposes_around_per_axis_quantization_stay():
    # A per-channel scale is tied to its axis attribute: moving the transpose would change the axis.
    m = qdq_sandwich(f32([0.05, 0.1, 0.2]))
    check_does_not_fire(m, "sink-transpose", kept=("Transpose",))


def attention_value(p1=(0, 3, 2, 4, 1), shape=(1, 8, 1, 2, 4), reshaped=(2, 4, 8), p2=(0, 2, 1)) -> onnx.ModelProto:
    """tf2onnx's Keras attention value: x (1, T, 1, H, D) -> Transpose to (1, H, 1, D, T) -> Reshape
    (H, D, T) -> Transpose (H, T, D)."""
    return model([node("Transpose", ["x"], ["t"], perm=list(p1)), node("Reshape", ["t", "s"], ["r"]),
                  node("Transpose", ["r"], ["y"], perm=list(p2))], {"x": list(shape)}, ["y"],
                 {"s": np.array(reshaped, np.int64)})


def test_two_transposes_around_a_unit_axis_reshape_become_one():
    m = attention_value()
    out = check_fires(m, "transpose-through-unit-reshape")
    assert ops(out) == {"Reshape": 1, "Transpose": 1}
    assert [list(a.ints) for n in out.graph.node for a in n.attribute if a.name == "perm"] == [[1, 0, 2]]


def test_transposes_that_compose_to_the_identity_leave_a_reshape():
    # (1, 8, 1, 4) -> (1, 1, 4, 8) -> (4, 8) -> (8, 4): x's kept axes come out in their own order
    m = attention_value(p1=(0, 2, 3, 1), shape=(1, 8, 1, 4), reshaped=(4, 8), p2=(1, 0))
    out = check_fires(m, "transpose-through-unit-reshape", gone=("Transpose",))
    assert ops(out) == {"Reshape": 1}


def test_a_reshape_that_merges_axes_stops_it():
    m = attention_value(shape=(1, 8, 1, 2, 4), reshaped=(8, 8), p2=(1, 0))  # (2, 4) merged: not a unit-axis drop
    check_does_not_fire(m, "transpose-through-unit-reshape", kept=("Transpose",))
