"""Per-channel Mul/Add into Conv, MatMul+Add -> Gemm, activation chains -> one activation."""

from __future__ import annotations

import numpy as np
import pytest

from tests.passes.harness import (
    EXACT, REASSOCIATED, check_does_not_fire, check_fires, f32, model, node, ops, optimized, assert_same,
)

rng = np.random.default_rng(1)
X = {"x": [1, 3, 6, 6]}


def conv_inits(bias: bool = True) -> dict:
    inits = {"w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32)}
    if bias:
        inits["b"] = rng.standard_normal(4).astype(np.float32)
    return inits


def test_tf_style_conv_mul_add_becomes_one_conv():
    # tf2onnx writes a Keras BatchNormalization after a Conv as Mul and Add by per-channel constants.
    inits = {**conv_inits(bias=False), "s": rng.uniform(0.5, 2, (4, 1, 1)).astype(np.float32),
             "t": rng.standard_normal((1, 4, 1, 1)).astype(np.float32)}
    m = model([node("Conv", ["x", "w"], ["c"]), node("Mul", ["c", "s"], ["m"]), node("Add", ["m", "t"], ["y"])],
              X, ["y"], inits)
    out, record = optimized(m)
    assert record["rules"]["fold-scale-into-conv"] == 1 and record["rules"]["fold-bias-into-conv"] == 1
    assert ops(out) == {"Conv": 1}
    assert_same(m, out, **REASSOCIATED)


@pytest.mark.parametrize("op, args, rule", [
    ("Mul", ("s", "c"), "fold-scale-into-conv"),
    ("Div", ("c", "s"), "fold-scale-into-conv"),
    ("Add", ("s", "c"), "fold-bias-into-conv"),
    ("Sub", ("c", "s"), "fold-bias-into-conv"),
])
def test_per_channel_constant_folds_into_conv(op, args, rule):
    inits = {**conv_inits(), "s": rng.uniform(0.5, 2, (4, 1, 1)).astype(np.float32)}
    m = model([node("Conv", ["x", "w", "b"], ["c"]), node(op, list(args), ["y"])], X, ["y"], inits)
    check_fires(m, rule, gone=(op,), tolerance=REASSOCIATED)


def test_scalar_constant_folds_into_conv():
    m = model([node("Conv", ["x", "w", "b"], ["c"]), node("Mul", ["c", "s"], ["y"])], X, ["y"],
              {**conv_inits(), "s": f32(0.25)})
    check_fires(m, "fold-scale-into-conv", gone=("Mul",), tolerance=REASSOCIATED)


@pytest.mark.parametrize("shape", [(1, 1, 4, 4), (4, 4, 4), (2, 4, 1, 1)])
def test_constant_that_is_not_per_channel_stays(shape):
    # Varies along H/W, or broadcasts the output to a larger shape.
    m = model([node("Conv", ["x", "w", "b"], ["c"]), node("Add", ["c", "t"], ["y"])], X, ["y"],
              {**conv_inits(), "t": rng.standard_normal(shape).astype(np.float32)})
    check_does_not_fire(m, "fold-bias-into-conv", kept=("Add",))


def test_mul_by_a_non_constant_stays():
    m = model([node("Conv", ["x", "w", "b"], ["c"]), node("Mul", ["c", "s"], ["y"])],
              {**X, "s": [1, 4, 1, 1]}, ["y"], conv_inits())
    check_does_not_fire(m, "fold-scale-into-conv", kept=("Mul",))


def test_conv_whose_output_is_also_used_keeps_its_add():
    m = model([node("Conv", ["x", "w", "b"], ["c"]), node("Add", ["c", "t"], ["a"]), node("Mul", ["a", "c"], ["y"])],
              X, ["y"], {**conv_inits(), "t": rng.standard_normal((4, 1, 1)).astype(np.float32)})
    check_does_not_fire(m, "fold-bias-into-conv", kept=("Add",))


def test_shared_weights_are_not_overwritten():
    # Two Convs read the same weights; scaling one must leave the other's weights alone.
    m = model([node("Conv", ["x", "w", "b"], ["c"]), node("Mul", ["c", "s"], ["m"]),
               node("Conv", ["x", "w", "b"], ["d"]), node("Add", ["m", "d"], ["y"])],
              X, ["y"], {**conv_inits(), "s": rng.uniform(0.5, 2, (4, 1, 1)).astype(np.float32)})
    check_fires(m, "fold-scale-into-conv", gone=("Mul",), tolerance=REASSOCIATED)


@pytest.mark.parametrize("bias_first", [False, True])
def test_matmul_add_becomes_gemm(bias_first):
    args = ["bias", "mm"] if bias_first else ["mm", "bias"]
    m = model([node("MatMul", ["x", "w"], ["mm"]), node("Add", args, ["y"])], {"x": [3, 5]}, ["y"],
              {"w": rng.standard_normal((5, 4)).astype(np.float32), "bias": rng.standard_normal(4).astype(np.float32)})
    check_fires(m, "matmul-add-to-gemm", gone=("MatMul", "Add"), tolerance=REASSOCIATED)


def test_the_gemm_keeps_the_matmuls_name():
    """A layer's name is how a user picks it (`--prune-layers fc2`): the fused Gemm keeps the MatMul's."""
    m = model([node("MatMul", ["x", "w"], ["mm"], name="fc2"), node("Add", ["mm", "bias"], ["y"], name="fc2_add")],
              {"x": [3, 5]}, ["y"],
              {"w": rng.standard_normal((5, 4)).astype(np.float32), "bias": rng.standard_normal(4).astype(np.float32)})
    out = check_fires(m, "matmul-add-to-gemm", gone=("MatMul", "Add"), tolerance=REASSOCIATED)
    assert [(n.op_type, n.name) for n in out.graph.node] == [("Gemm", "fc2")]


def test_matmul_add_with_transposed_weights_becomes_one_gemm():
    m = model([node("Transpose", ["w"], ["wt"], perm=[1, 0]), node("MatMul", ["x", "wt"], ["mm"]),
               node("Add", ["mm", "bias"], ["y"])], {"x": [3, 5], "w": [4, 5]}, ["y"],
              {"bias": rng.standard_normal(4).astype(np.float32)})
    out = check_fires(m, "matmul-add-to-gemm", gone=("MatMul", "Add", "Transpose"), tolerance=REASSOCIATED)
    assert [(a.name, a.i) for a in out.graph.node[0].attribute] == [("transB", 1)]


def test_matmul_add_whose_bias_raises_the_rank_stays():
    # onnxscript's rule checks only the ranks of A and B: Gemm cannot produce the 3-D result.
    m = model([node("MatMul", ["x", "w"], ["mm"]), node("Add", ["mm", "bias"], ["y"])], {"x": [3, 5]}, ["y"],
              {"w": rng.standard_normal((5, 4)).astype(np.float32),
               "bias": rng.standard_normal((2, 3, 4)).astype(np.float32)})
    check_does_not_fire(m, "matmul-add-to-gemm", kept=("MatMul", "Add"))


def test_batched_matmul_add_stays():
    m = model([node("MatMul", ["x", "w"], ["mm"]), node("Add", ["mm", "bias"], ["y"])], {"x": [2, 3, 5]}, ["y"],
              {"w": rng.standard_normal((5, 4)).astype(np.float32), "bias": rng.standard_normal(4).astype(np.float32)})
    check_does_not_fire(m, "matmul-add-to-gemm", kept=("MatMul", "Add"))


A = {"x": [2, 3, 4]}


@pytest.mark.parametrize("outer, inner", [("Min", "Max"), ("Max", "Min")])
def test_min_max_becomes_clip(outer, inner):
    lo, hi = ("lo", "hi") if inner == "Max" else ("hi", "lo")
    m = model([node(inner, ["x", lo], ["a"]), node(outer, ["a", hi], ["y"])], A, ["y"], {"lo": f32(0.0), "hi": f32(6.0)})
    check_fires(m, "min-max-to-clip", gone=("Min", "Max"))


def test_min_of_max_with_crossed_bounds_is_still_clip():
    # Min(Max(x, 2), 1) is 1 everywhere, and so is Clip(x, 2, 1): the spec defines Clip with
    # min > max as Min(max, Max(x, min)).
    m = model([node("Max", ["x", "lo"], ["a"]), node("Min", ["a", "hi"], ["y"])], A, ["y"],
              {"lo": f32(2.0), "hi": f32(1.0)})
    check_fires(m, "min-max-to-clip", gone=("Min", "Max"))


def test_max_of_min_with_crossed_bounds_stays():
    # Max(Min(x, 1), 2) is 2 everywhere; Clip(x, 2, 1) would be 1.
    m = model([node("Min", ["x", "hi"], ["a"]), node("Max", ["a", "lo"], ["y"])], A, ["y"],
              {"lo": f32(2.0), "hi": f32(1.0)})
    check_does_not_fire(m, "min-max-to-clip", kept=("Min", "Max"))


def test_min_max_bounds_of_higher_rank_stay():
    m = model([node("Max", ["x", "lo"], ["a"]), node("Min", ["a", "hi"], ["y"])], A, ["y"],
              {"lo": np.zeros((1, 1, 1, 1), np.float32), "hi": f32(6.0)})
    check_does_not_fire(m, "min-max-to-clip", kept=("Min", "Max"))


def test_min_min_merges():
    m = model([node("Min", ["x", "a"], ["t"]), node("Min", ["t", "b"], ["y"])], A, ["y"],
              {"a": f32([1, 2, 3, 4]), "b": f32(2.5)})
    check_fires(m, "merge-min-min", gone=())
    assert ops(optimized(m)[0]) == {"Min": 1}


def test_relu_relu_merges():
    m = model([node("Relu", ["x"], ["a"]), node("Relu", ["a"], ["y"])], A, ["y"])
    out = check_fires(m, "merge-relu-relu")
    assert ops(out) == {"Relu": 1}


@pytest.mark.parametrize("order", ["relu-clip", "clip-relu"])
def test_relu_and_clip_merge(order):
    nodes = [node("Relu", ["x"], ["a"]), node("Clip", ["a", "lo", "hi"], ["y"])] if order == "relu-clip" else \
        [node("Clip", ["x", "lo", "hi"], ["a"]), node("Relu", ["a"], ["y"])]
    m = model(nodes, A, ["y"], {"lo": f32(-1.0), "hi": f32(6.0)})
    out = check_fires(m, "merge-relu-clip", gone=("Relu",))
    assert ops(out) == {"Clip": 1}


def test_clip_clip_merges():
    m = model([node("Clip", ["x", "a", "b"], ["t"]), node("Clip", ["t", "c", "d"], ["y"])], A, ["y"],
              {"a": f32(-1.0), "b": f32(6.0), "c": f32(0.0), "d": f32(8.0)})
    out = check_fires(m, "merge-clip-clip")
    assert ops(out) == {"Clip": 1}


def test_clips_with_disjoint_intervals_stay():
    # Clip(Clip(x, 0, 6), 7, 8) is 7 everywhere; onnxscript's merge makes Clip(x, 7, 6), which is 6.
    m = model([node("Clip", ["x", "a", "b"], ["t"]), node("Clip", ["t", "c", "d"], ["y"])], A, ["y"],
              {"a": f32(0.0), "b": f32(6.0), "c": f32(7.0), "d": f32(8.0)})
    check_does_not_fire(m, "merge-clip-clip", kept=("Clip",))


def test_relu_after_a_negative_clip_stays():
    m = model([node("Clip", ["x", "lo", "hi"], ["a"]), node("Relu", ["a"], ["y"])], A, ["y"],
              {"lo": f32(-5.0), "hi": f32(-1.0)})
    check_does_not_fire(m, "merge-relu-clip", kept=("Relu", "Clip"))


def hardswish_nodes(bias: str = "three") -> list:
    return [node("Add", ["x", bias], ["a"]), node("Clip", ["a", "zero", "six"], ["c"]),
            node("Mul", ["x", "c"], ["m"]), node("Div", ["m", "six"], ["y"])]


HS = {"three": f32(3.0), "zero": f32(0.0), "six": f32(6.0), "almost": f32(3.0003)}


def test_hardswish_is_fused():
    # HardSwish computes x * max(0, min(1, x/6 + 1/2)): the same function rounded differently.
    m = model(hardswish_nodes(), A, ["y"], HS)
    out = check_fires(m, "fuse-hardswish", tolerance=REASSOCIATED)
    assert ops(out) == {"HardSwish": 1}


def test_hardswish_is_not_fused_before_opset_14():
    m = model(hardswish_nodes(), A, ["y"], HS, opset=13)
    check_does_not_fire(m, "fuse-hardswish", kept=("Clip", "Mul", "Div"))


def test_hardswish_with_a_constant_near_3_is_not_fused():
    # onnxscript matches 3 and 6 with rel_tol 1e-4.
    m = model(hardswish_nodes("almost"), A, ["y"], HS)
    check_does_not_fire(m, "fuse-hardswish", kept=("Clip", "Mul", "Div"))


def test_hardsigmoid_is_fused():
    m = model([node("Add", ["x", "three"], ["a"]), node("Clip", ["a", "zero", "six"], ["c"]),
               node("Div", ["c", "six"], ["y"])], A, ["y"], HS)
    out = check_fires(m, "fuse-hardsigmoid", tolerance=REASSOCIATED)
    assert ops(out) == {"HardSigmoid": 1}


def test_hardsigmoid_times_input_becomes_hardswish():
    m = model([node("HardSigmoid", ["x"], ["h"], alpha=1 / 6, beta=0.5), node("Mul", ["h", "x"], ["y"])], A, ["y"])
    out = check_fires(m, "fuse-hardswish", tolerance=REASSOCIATED)
    assert ops(out) == {"HardSwish": 1}


def test_hardsigmoid_with_other_slope_times_input_stays():
    m = model([node("HardSigmoid", ["x"], ["h"], alpha=0.2, beta=0.5), node("Mul", ["h", "x"], ["y"])], A, ["y"])
    check_does_not_fire(m, "fuse-hardswish", kept=("HardSigmoid", "Mul"))


def test_exact_tolerance_is_kept_by_activation_merges():
    m = model([node("Clip", ["x", "a", "b"], ["t"]), node("Relu", ["t"], ["y"])], A, ["y"],
              {"a": f32(-1.0), "b": f32(6.0)})
    out, _ = optimized(m)
    assert_same(m, out, **EXACT)


def test_conv_transpose_bias_add_then_batchnorm_becomes_one_conv_transpose():
    # PP-OCRv4's detector head: ConvTranspose, Add(bias), BatchNormalization.
    c = 6
    inits = {"w": rng.standard_normal((4, 3, 2, 2)).astype(np.float32),
             "t": rng.standard_normal((c, 1, 1)).astype(np.float32),
             "scale": rng.uniform(0.5, 2, c).astype(np.float32), "bias": rng.standard_normal(c).astype(np.float32),
             "mean": rng.standard_normal(c).astype(np.float32), "var": rng.uniform(0.5, 2, c).astype(np.float32)}
    m = model([node("ConvTranspose", ["x", "w"], ["c"], group=2, strides=[2, 2]), node("Add", ["c", "t"], ["a"]),
               node("BatchNormalization", ["a", "scale", "bias", "mean", "var"], ["y"])],
              {"x": [1, 4, 5, 5]}, ["y"], inits)
    out, record = optimized(m)
    assert record["rules"]["fold-bias-into-conv"] == 1 and record["rules"]["fold-batchnorm-conv-transpose"] == 1
    assert ops(out) == {"ConvTranspose": 1}
    assert_same(m, out, **REASSOCIATED)


def test_scale_after_conv_transpose_stays():
    # ConvTranspose's weights are (C_in, C_out/group, ...): scaling their first axis would be wrong.
    m = model([node("ConvTranspose", ["x", "w"], ["c"]), node("Mul", ["c", "s"], ["y"])], {"x": [1, 4, 5, 5]}, ["y"],
              {"w": rng.standard_normal((4, 4, 3, 3)).astype(np.float32),
               "s": rng.uniform(0.5, 2, (4, 1, 1)).astype(np.float32)})
    check_does_not_fire(m, "fold-scale-into-conv", kept=("Mul",))
