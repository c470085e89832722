"""Pruning: method spelling, the three mask patterns (against plain-Python references, ties included),
layer discovery and selection, and pruned models that run and match weights zeroed by hand.

Tolerance for pruned-vs-hand-zeroed outputs: max |diff| <= 1e-5 * max |output|. Both models hold the
same weights, so only onnxruntime's choice of kernel could move a result, by rounding of sums whose
size scales with the output's magnitude.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings, strategies as st
from onnx import TensorProto, helper, numpy_helper

from edgesdk.compression import PruneMethod, mask, parse_method, prunable, prune_model, select_layers
from edgesdk.compression.prune import oriented
from edgesdk.errors import UsageError

FLOAT = TensorProto.FLOAT


# -- method spelling ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "method", "sparsity"), [
    ("2:4", PruneMethod("n:m", n=2, m=4), 0.5),
    ("1:4", PruneMethod("n:m", n=1, m=4), 0.75),
    ("15:16", PruneMethod("n:m", n=15, m=16), 1 / 16),
    (" 2:8 ", PruneMethod("n:m", n=2, m=8), 0.75),
    ("magnitude:0.75", PruneMethod("magnitude", sparsity=0.75), 0.75),
    ("magnitude:75%", PruneMethod("magnitude", sparsity=0.75), 0.75),
    ("magnitude:.5", PruneMethod("magnitude", sparsity=0.5), 0.5),
    ("magnitude:1e-2", PruneMethod("magnitude", sparsity=0.01), 0.01),
    ("column-combine", PruneMethod("column-combine", group=4), 0.75),
    ("column-combine:2", PruneMethod("column-combine", group=2), 0.5),
    ("column-combine:16", PruneMethod("column-combine", group=16), 15 / 16),
])
def test_parse_method_accepts(text, method, sparsity):
    parsed = parse_method(text)
    assert parsed == method
    assert parsed.expected_sparsity == pytest.approx(sparsity)
    assert parse_method(parsed.text) == parsed


@pytest.mark.parametrize("text", [
    "", "2", "2:4:8", "4:2", "2:2", "0:4", "2:17", "16:17", "2 : 4", "-1:4", "2:4x",
    "magnitude", "magnitude:", "magnitude:0", "magnitude:1", "magnitude:1.5", "magnitude:100%",
    "magnitude:0%", "magnitude:-0.5", "magnitude:nan", "magnitude:half",
    "column-combine:1", "column-combine:17", "column-combine:", "column-combine:x", "columncombine",
    "Magnitude:0.5", "random",
])
def test_parse_method_refuses(text):
    with pytest.raises(UsageError) as caught:
        parse_method(text)
    error = caught.value
    assert error.code == "prune.bad-method"
    assert f"'{text}'" in error.message
    assert error.message[0].islower() and not error.message.endswith(".")
    assert "2:4" in error.hint and "column-combine" in error.hint


# -- masks, against plain-Python references ----------------------------------------------------------

def reference_top(values: list[float], n: int) -> set[int]:
    """The indices of the n largest values, ties to the lower index."""
    return set(sorted(range(len(values)), key=lambda i: (-values[i], i))[:n])


def weights(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    # small integers: many ties, so the tie rule is exercised
    return np.random.default_rng(seed).integers(-3, 4, shape).astype(np.float32)


shapes = st.tuples(st.integers(1, 4), st.integers(1, 11), st.lists(st.integers(1, 3), max_size=2))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), shape=shapes, nm=st.sampled_from([(2, 4), (1, 4), (1, 2), (3, 8)]))
def test_n_of_m_keeps_the_largest_n_of_each_group(seed, shape, nm):
    co, ci, kernel = shape
    n, m = nm
    w = weights(seed, (co, ci, *kernel))
    keep = mask(w, PruneMethod("n:m", n=n, m=m))
    assert keep.shape == w.shape and keep.dtype == bool
    for position in np.ndindex(co, *kernel):
        a = np.abs(w[(position[0], slice(None), *position[1:])])
        got = keep[(position[0], slice(None), *position[1:])]
        for start in range(0, ci, m):
            group = list(a[start:start + m])
            assert got[start:start + m].sum() == min(n, len(group))
            assert set(np.flatnonzero(got[start:start + m])) == reference_top(group, n)


@pytest.mark.parametrize(("ci", "method", "counts"), [
    (6, "2:4", [2, 2]),  # a tail of 2 keeps both
    (3, "1:4", [1]),  # a lone partial group keeps 1
    (5, "2:4", [2, 1]),  # a tail of 1 keeps 1 (min(N, r))
    (7, "3:4", [3, 3]),
])
def test_n_of_m_tail_group_keeps_min_of_n_and_its_size(ci, method, counts):
    w = np.random.default_rng(1).standard_normal((4, ci, 3, 3)).astype(np.float32)
    keep = mask(w, parse_method(method))
    m = parse_method(method).m
    for start, count in zip(range(0, ci, m), counts, strict=True):
        per_position = keep[:, start:start + m].sum(axis=1)
        assert np.all(per_position == count)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), shape=shapes, sparsity=st.floats(0.01, 0.99))
def test_magnitude_keeps_the_right_count_of_the_largest(seed, shape, sparsity):
    co, ci, kernel = shape
    w = weights(seed, (co, ci, *kernel))
    keep = mask(w, PruneMethod("magnitude", sparsity=sparsity))
    count = max(1, round((1 - sparsity) * w.size))
    assert keep.sum() == count
    assert set(np.flatnonzero(keep)) == reference_top(list(np.abs(w).ravel()), count)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), shape=shapes, group=st.integers(2, 5))
def test_column_combine_keeps_the_max_norm_channel_of_each_group(seed, shape, group):
    co, ci, kernel = shape
    w = weights(seed, (co, ci, *kernel))
    keep = mask(w, PruneMethod("column-combine", group=group)).reshape(co, ci, -1)
    # a channel is kept or dropped as a whole, at every kernel position
    assert np.all(keep.all(axis=-1) == keep.any(axis=-1))
    norms = np.sqrt(np.sum(w.reshape(co, ci, -1).astype(np.float64) ** 2, axis=-1))
    for o in range(co):
        for start in range(0, ci, group):
            kept = np.flatnonzero(keep[o, start:start + group, 0])
            assert list(kept) == sorted(reference_top(list(norms[o, start:start + group]), 1))


def test_mask_refuses_a_rank_1_weight():
    with pytest.raises(ValueError, match="rank 2"):
        mask(np.ones(4, np.float32), PruneMethod("n:m", n=2, m=4))


# -- models ------------------------------------------------------------------------------------------

def build(nodes: list, inits: dict, x_shape: tuple[int, ...],
          outputs: tuple[str, ...] = ("logits",)) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "net", [helper.make_tensor_value_info("x", FLOAT, list(x_shape))],
                              [helper.make_tensor_value_info(o, FLOAT, None) for o in outputs],
                              [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    m = onnx.shape_inference.infer_shapes(m, strict_mode=True)  # fills in the outputs' shapes
    onnx.checker.check_model(m, full_check=True)
    return m


def conv_net(seed: int = 0, width: int = 8, classes: int = 5, size: int = 12) -> onnx.ModelProto:
    """Conv -> Relu -> Conv (stride 2) -> Relu -> Conv (dilation 2, no name) -> Relu -> GlobalAveragePool
    -> Flatten -> Gemm (transB=1)."""
    rng = np.random.default_rng(seed)

    def he(*shape):
        return rng.standard_normal(shape) * np.sqrt(2 / np.prod(shape[1:]))

    inits = {"w1": he(width, 3, 3, 3), "b1": rng.standard_normal(width) * 0.1,
             "w2": he(width, width, 3, 3), "b2": rng.standard_normal(width) * 0.1,
             "w3": he(width, width, 3, 3), "w4": he(classes, width), "b4": rng.standard_normal(classes) * 0.1}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 0, 1, 2], strides=[2, 2]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Conv", ["r2", "w3"], ["c3"], pads=[2, 2, 2, 2], dilations=[2, 2]),
             helper.make_node("Relu", ["c3"], ["r3"]),
             helper.make_node("GlobalAveragePool", ["r3"], ["gap"]),
             helper.make_node("Flatten", ["gap"], ["flat"]),
             helper.make_node("Gemm", ["flat", "w4", "b4"], ["logits"], name="fc", transB=1)]
    return build(nodes, inits, (1, 3, size, size))


def infer(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def zeroed_by_hand(model: onnx.ModelProto, keep: dict[str, np.ndarray]) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for init in out.graph.initializer:
        if init.name in keep:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * keep[init.name], init.name))
    return out


def assert_close_to_scale(got: np.ndarray, want: np.ndarray) -> None:
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


def initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == name))


def test_prunable_finds_conv_and_gemm_layers_in_graph_order():
    layers = prunable(conv_net())
    assert [(x.name, x.op, x.weight, x.shape) for x in layers] == [
        ("conv1", "Conv", "w1", (8, 3, 3, 3)), ("conv2", "Conv", "w2", (8, 8, 3, 3)),
        ("c3", "Conv", "w3", (8, 8, 3, 3)), ("fc", "Gemm", "w4", (5, 8))]
    # MACs: weight size times output positions (12x12, then 6x6 after stride 2, then 6x6, then one row)
    assert [x.macs for x in layers] == [8 * 27 * 144, 8 * 72 * 36, 8 * 72 * 36, 5 * 8]
    assert [x.transposed for x in layers] == [False, False, False, False]


def test_prunable_skips_grouped_conv_and_non_initializer_weights():
    inits = {"wd": np.ones((4, 1, 3, 3)), "wm": np.ones((4, 4, 4))}
    nodes = [helper.make_node("Conv", ["x", "wd"], ["d"], name="depthwise", group=4, pads=[1, 1, 1, 1]),
             helper.make_node("MatMul", ["d", "d"], ["dd"], name="activations"),
             helper.make_node("MatMul", ["dd", "wm"], ["logits"], name="batched")]
    assert prunable(build(nodes, inits, (1, 4, 4, 4))) == []


def test_default_selection_skips_the_first_and_the_last_layer():
    layers = prunable(conv_net())
    assert [x.name for x in select_layers(layers, None)] == ["conv2", "c3"]
    assert select_layers(layers[:2], None) == []


@pytest.mark.parametrize(("spec", "names"), [
    ("all", ["conv1", "conv2", "c3", "fc"]),
    ("*conv*", ["conv1", "conv2"]),
    ("fc, conv1", ["conv1", "fc"]),
    ("c3,c?", ["c3"]),
])
def test_select_layers_by_name_glob_or_all(spec, names):
    assert [x.name for x in select_layers(prunable(conv_net()), spec)] == names


def test_select_layers_names_every_entry_that_matches_nothing():
    with pytest.raises(UsageError) as caught:
        select_layers(prunable(conv_net()), "conv2,nope,*bn*")
    assert caught.value.code == "prune.unknown-layer"
    assert "'nope'" in caught.value.message and "'*bn*'" in caught.value.message
    assert "'conv2'" not in caught.value.message
    assert caught.value.hint == "prunable layers: conv1, conv2, c3, fc"


def test_select_layers_hint_lists_at_most_ten_names():
    layers = prunable(conv_net()) * 4
    with pytest.raises(UsageError) as caught:
        select_layers(layers, "nope")
    assert caught.value.hint.endswith("(and 6 more)") and caught.value.hint.count(",") == 9


@pytest.mark.parametrize("method", ["2:4", "1:4", "magnitude:0.6", "column-combine", "column-combine:3"])
def test_pruned_model_equals_weights_zeroed_by_hand(method):
    model = conv_net()
    before = model.SerializeToString()
    layers = select_layers(prunable(model), None)
    pruned, records = prune_model(model, parse_method(method), layers)
    assert model.SerializeToString() == before
    onnx.checker.check_model(pruned, full_check=True)

    keep = {x.weight: mask(initializer(model, x.weight), parse_method(method)) for x in layers}
    x = np.random.default_rng(2).standard_normal((1, 3, 12, 12)).astype(np.float32)
    [got] = infer(pruned, {"x": x})
    [want] = infer(zeroed_by_hand(model, keep), {"x": x})
    assert_close_to_scale(got, want)
    [dense] = infer(model, {"x": x})
    assert not np.allclose(got, dense)

    assert [r["layer"] for r in records] == ["conv2", "c3"]
    for r in records:
        weight = initializer(pruned, r["weight"])
        assert r["weight"] in ("w2", "w3") and r["op"] == "Conv" and r["shape"] == [8, 8, 3, 3]
        assert r["method"] == parse_method(method).text
        assert r["kept"] == int(keep[r["weight"]].sum()) and r["size"] == 576
        assert r["sparsity"] == pytest.approx(np.mean(weight == 0), abs=1e-6)
    # the first and the last layer stay dense
    for name in ("w1", "w4"):
        np.testing.assert_array_equal(initializer(pruned, name), initializer(model, name))


def test_pruning_is_deterministic():
    model = conv_net()
    layers = select_layers(prunable(model), "all")
    first, second = (prune_model(model, parse_method("column-combine"), layers) for _ in range(2))
    assert first[0].SerializeToString() == second[0].SerializeToString() and first[1] == second[1]


def test_two_to_four_halves_each_full_group():
    pruned, records = prune_model(conv_net(), parse_method("2:4"), select_layers(prunable(conv_net()), None))
    assert [r["sparsity"] for r in records] == [0.5, 0.5]
    assert [r["kept"] for r in records] == [288, 288]


@pytest.mark.parametrize("op", ["MatMul", "Gemm"])
def test_a_weight_stored_in_out_is_pruned_along_its_input_axis(op):
    # MatMul and Gemm with transB=0 read the weight as (in, out): groups run down its rows
    w = np.random.default_rng(3).standard_normal((8, 3))
    attrs = {"transB": 0} if op == "Gemm" else {}
    model = build([helper.make_node(op, ["x", "w"], ["logits"], name="fc", **attrs)], {"w": w}, (2, 8))
    [layer] = prunable(model)
    assert layer.transposed and layer.macs == 2 * 24
    pruned, _ = prune_model(model, parse_method("2:4"), [layer])
    nonzero = initializer(pruned, "w") != 0
    assert nonzero.reshape(2, 4, 3).sum(axis=1).tolist() == [[2, 2, 2], [2, 2, 2]]
    np.testing.assert_array_equal(nonzero, oriented(mask(oriented(w, layer), parse_method("2:4")), layer))


def shared_weight_net() -> onnx.ModelProto:
    """Three convs; the last two share one weight `ws`."""
    rng = np.random.default_rng(4)
    inits = {"w1": rng.standard_normal((8, 3, 1, 1)), "ws": rng.standard_normal((8, 8, 3, 3)) * 0.2}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "ws"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Conv", ["r2", "ws"], ["logits"], name="conv3", pads=[1, 1, 1, 1])]
    return build(nodes, inits, (1, 3, 6, 6))


def test_a_weight_shared_with_an_unselected_layer_is_copied():
    model = shared_weight_net()
    layers = select_layers(prunable(model), "conv2")
    pruned, [record] = prune_model(model, parse_method("2:4"), layers)
    assert record["weight"] == "ws__pruned"
    assert [n.input[1] for n in pruned.graph.node if n.op_type == "Conv"] == ["w1", "ws__pruned", "ws"]
    np.testing.assert_array_equal(initializer(pruned, "ws"), initializer(model, "ws"))
    keep = mask(initializer(model, "ws"), parse_method("2:4"))
    np.testing.assert_array_equal(initializer(pruned, "ws__pruned"), initializer(model, "ws") * keep)

    # the same function as conv2 alone given the hand-pruned weight
    by_hand = onnx.ModelProto()
    by_hand.CopyFrom(model)
    by_hand.graph.initializer.append(numpy_helper.from_array(initializer(model, "ws") * keep, "manual"))
    by_hand.graph.node[2].input[1] = "manual"
    x = np.random.default_rng(5).standard_normal((1, 3, 6, 6)).astype(np.float32)
    assert_close_to_scale(infer(pruned, {"x": x})[0], infer(by_hand, {"x": x})[0])


def test_a_weight_all_of_whose_users_are_selected_is_pruned_in_place():
    model = shared_weight_net()
    pruned, records = prune_model(model, parse_method("2:4"), select_layers(prunable(model), "conv2,conv3"))
    assert [r["weight"] for r in records] == ["ws", "ws"]
    assert sorted(i.name for i in pruned.graph.initializer) == ["w1", "ws"]
    keep = mask(initializer(model, "ws"), parse_method("2:4"))
    np.testing.assert_array_equal(initializer(pruned, "ws"), initializer(model, "ws") * keep)


def test_a_weight_two_layouts_share_gets_one_copy_each():
    # MatMul reads w as (in, out), Gemm transB=1 as (out, in): their masks differ
    w = np.random.default_rng(6).standard_normal((4, 4))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="mm"),
             helper.make_node("Gemm", ["a", "w"], ["logits"], name="gemm", transB=1)]
    model = build(nodes, {"w": w}, (2, 4))
    pruned, records = prune_model(model, parse_method("2:4"), prunable(model))
    assert [r["weight"] for r in records] == ["w__pruned", "w__pruned_2"]
    assert sorted(i.name for i in pruned.graph.initializer) == ["w__pruned", "w__pruned_2"]
    assert [n.input[1] for n in pruned.graph.node] == ["w__pruned", "w__pruned_2"]
    onnx.checker.check_model(pruned, full_check=True)
    x = np.random.default_rng(7).standard_normal((2, 4)).astype(np.float32)
    keep_matmul, keep_gemm = mask(w.T, parse_method("2:4")).T, mask(w, parse_method("2:4"))
    assert not np.array_equal(keep_matmul, keep_gemm)
    want = (x @ (w * keep_matmul)) @ (w * keep_gemm).T
    assert_close_to_scale(infer(pruned, {"x": x})[0], want.astype(np.float32))
