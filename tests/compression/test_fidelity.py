"""Fidelity of a pruned model to the dense one, the im2col rows weight correction fits on, the CG solve
against `numpy.linalg.lstsq`, and the correction's guarantees (residuals never grow, zeros stay zero,
end-to-end cosine does not drop)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from onnx import helper

from edgesdk.compression import compare, correct_weights, fidelity, parse_method, prunable, prune_model, select_layers
from tests.compression.test_prune import build, conv_net, infer, initializer

# the package re-exports the function `fidelity`, which hides the module of that name as an attribute
fidelity_module = importlib.import_module("edgesdk.compression.fidelity")


def samples(count: int, shape: tuple[int, ...] = (1, 3, 12, 12), seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(count)]


def test_compare_identical_outputs():
    a = np.random.default_rng(0).standard_normal((4, 10))
    assert compare(a, a.copy()) == {"cosine": 1.0, "max_abs_error": 0.0, "max_error_of_scale": 0.0,
                                    "top1_agreement": 1.0}


def test_compare_measures_the_difference():
    dense = np.array([[1.0, 3.0, 2.0], [4.0, 0.0, -4.5]])
    pruned = np.array([[1.0, 2.0, 2.5], [4.0, 0.0, -4.5]])
    got = compare(dense, pruned)
    assert got["max_abs_error"] == pytest.approx(1.0)
    assert got["max_error_of_scale"] == pytest.approx(1.0 / 4.5)
    assert got["top1_agreement"] == 0.5  # row 0's arg max moved from 1 to 2
    assert got["cosine"] == pytest.approx(dense.ravel() @ pruned.ravel()
                                          / np.linalg.norm(dense) / np.linalg.norm(pruned))
    assert got["cosine"] < 1


@pytest.mark.parametrize("shape", [(5,), (3, 1), ()])
def test_compare_has_no_top1_without_a_class_axis(shape):
    assert compare(np.ones(shape), np.ones(shape))["top1_agreement"] is None


def test_compare_refuses_different_shapes():
    with pytest.raises(ValueError, match="shapes differ"):
        compare(np.ones((2, 3)), np.ones((3, 2)))


def test_fidelity_of_a_model_to_itself_is_perfect():
    model = conv_net()
    got = fidelity(model, model, samples(3), ["c2", "c3"])
    assert got["samples"] == 3
    assert set(got["end_to_end"]) == {"logits"} and set(got["layers"]) == {"c2", "c3"}
    for result in [*got["end_to_end"].values(), *got["layers"].values()]:
        assert result["cosine"] == 1.0 and result["max_abs_error"] == 0.0
    assert got["end_to_end"]["logits"]["top1_agreement"] == 1.0


def test_fidelity_of_a_pruned_model_is_below_one():
    model = conv_net()
    layers = select_layers(prunable(model), None)
    pruned, _ = prune_model(model, parse_method("1:4"), layers)
    got = fidelity(model, pruned, samples(4), [x.output for x in layers])
    assert set(got["layers"]) == {"c2", "c3"}
    assert all(r["cosine"] < 0.999 and r["max_abs_error"] > 0 for r in got["layers"].values())
    assert got["end_to_end"]["logits"]["cosine"] < 0.999
    assert 0 <= got["end_to_end"]["logits"]["top1_agreement"] <= 1
    # the joined outputs: 4 samples of (1, 5) make 4 rows; a layer output is compared whole
    assert got["end_to_end"]["logits"]["max_error_of_scale"] > 0


@pytest.mark.parametrize("attrs", [
    {"pads": [1, 0, 2, 1], "strides": [2, 1]},
    {"dilations": [2, 1], "pads": [2, 1, 2, 1]},
    {"auto_pad": "SAME_UPPER", "strides": [2, 1]},  # width: a total pad of 1, at the end
    {"auto_pad": "SAME_LOWER", "strides": [2, 1]},  # at the start
    {"auto_pad": "VALID", "strides": [1, 2], "dilations": [1, 2]},
])
def test_im2col_rows_times_the_weight_are_the_conv(attrs):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 3, 3, 2)).astype(np.float32)
    model = build([helper.make_node("Conv", ["x", "w"], ["logits"], name="conv", **attrs)], {"w": w}, (2, 3, 7, 8))
    x = rng.standard_normal((2, 3, 7, 8)).astype(np.float32)
    [want] = infer(model, {"x": x})
    rows = fidelity_module._im2col(x, model.graph.node[0], (3, 2), max_rows=10**6)
    got = (rows @ w.reshape(4, -1).T).reshape(want.shape[0], *want.shape[2:], 4)
    np.testing.assert_allclose(np.moveaxis(got, -1, 1), want, rtol=1e-5, atol=1e-5)


def test_im2col_of_a_conv1d_and_the_row_subsample():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 3, 3)).astype(np.float32)
    model = build([helper.make_node("Conv", ["x", "w"], ["logits"], name="conv", pads=[1, 1])], {"w": w}, (2, 3, 9))
    x = rng.standard_normal((2, 3, 9)).astype(np.float32)
    [want] = infer(model, {"x": x})
    rows = fidelity_module._im2col(x, model.graph.node[0], (3,), max_rows=5)
    got = rows @ w.reshape(4, -1).T
    # every subsampled row is one output pixel (n, l) of the conv, each a different one
    pixels = np.moveaxis(want, 1, -1).reshape(-1, 4)
    matches = [np.flatnonzero(np.all(np.abs(pixels - row) < 1e-4, axis=1)) for row in got]
    assert len(got) == 5 and all(len(m) == 1 for m in matches)
    assert len({int(m[0]) for m in matches}) == 5
    np.testing.assert_array_equal(rows, fidelity_module._im2col(x, model.graph.node[0], (3,), max_rows=5))


def test_fit_is_the_damped_least_squares_solution(monkeypatch):
    # enough CG steps to converge: the answer must be lstsq's on the kept columns, row by row
    monkeypatch.setattr(fidelity_module, "ITERATIONS", 300)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 12)) @ rng.standard_normal((12, 12))  # correlated columns
    keep = rng.random((12, 5)) < 0.5
    dense = rng.standard_normal((12, 5))
    removed = dense * ~keep
    delta = fidelity_module._fit(x, removed, keep)
    assert np.all(delta[~keep] == 0)
    damp = fidelity_module.DAMP * np.mean(np.sum(x * x, axis=0))
    for o in range(5):
        s = np.flatnonzero(keep[:, o])
        # min ||X e - X_S d||^2 + damp ||d||^2 as one stacked least-squares problem
        a = np.vstack([x[:, s], np.sqrt(damp) * np.eye(len(s))])
        b = np.concatenate([x @ removed[:, o], np.zeros(len(s))])
        want = np.linalg.lstsq(a, b, rcond=None)[0]
        np.testing.assert_allclose(delta[s, o], want, rtol=1e-6, atol=1e-8)


def test_correct_weights_lowers_residuals_keeps_zeros_and_end_to_end_cosine():
    model = conv_net(seed=1)
    layers = select_layers(prunable(model), "all")
    pruned, records = prune_model(model, parse_method("2:4"), layers)
    calibration = samples(16, seed=4)
    corrected, report = correct_weights(model, pruned, layers, records, calibration)

    assert set(report) == {"conv1", "conv2", "c3", "fc"}
    for name, r in report.items():
        assert r["residual_after"] <= r["residual_before"], name
        assert r["residual_before"] > 0
    assert report["conv1"]["rows"] == 16 * 144 and report["fc"]["rows"] == 16
    assert sum(r["residual_after"] < 0.9 * r["residual_before"] for r in report.values()) >= 3

    for layer in layers:
        before, after = initializer(pruned, layer.weight), initializer(corrected, layer.weight)
        assert np.all(after[before == 0] == 0), layer.name
        assert not np.array_equal(after, before), layer.name
    assert initializer(model, "w2").dtype == initializer(corrected, "w2").dtype

    was = fidelity(model, pruned, calibration, [])["end_to_end"]["logits"]["cosine"]
    now = fidelity(model, corrected, calibration, [])["end_to_end"]["logits"]["cosine"]
    assert now > was  # "does not decrease", and here it clearly rises (0.92 -> 0.98)
    # seeded subsampling: the same inputs give the same bytes
    again, _ = correct_weights(model, pruned, layers, records, calibration, max_rows=100)
    assert again.SerializeToString() == correct_weights(model, pruned, layers, records, calibration,
                                                        max_rows=100)[0].SerializeToString()


def test_correct_weights_takes_masks_and_leaves_other_layers_alone():
    model = conv_net(seed=2)
    layers = select_layers(prunable(model), None)
    pruned, _ = prune_model(model, parse_method("magnitude:0.7"), layers)
    keep = initializer(pruned, "w2") != 0
    corrected, report = correct_weights(model, pruned, layers, {"conv2": keep}, samples(8, seed=5), max_rows=50)
    assert set(report) == {"conv2"} and report["conv2"]["rows"] == 50
    np.testing.assert_array_equal(initializer(corrected, "w3"), initializer(pruned, "w3"))
    assert np.all(initializer(corrected, "w2")[~keep] == 0)
    assert report["conv2"]["residual_after"] < report["conv2"]["residual_before"]


@pytest.mark.parametrize(("op", "attrs", "x_shape"), [
    ("MatMul", {}, (1, 5, 8)),  # rows: every leading position, 5 per sample
    ("Gemm", {"transA": 1}, (8, 5)),  # rows: the columns of x, 5 per sample
])
def test_correct_weights_fits_a_weight_stored_in_out(op, attrs, x_shape):
    w = np.random.default_rng(6).standard_normal((8, 3)).astype(np.float32)
    model = build([helper.make_node(op, ["x", "w"], ["logits"], name="fc", **attrs)], {"w": w}, x_shape)
    layers = prunable(model)
    pruned, records = prune_model(model, parse_method("2:4"), layers)
    calibration = samples(4, x_shape, seed=7)
    corrected, report = correct_weights(model, pruned, layers, records, calibration)
    assert report["fc"]["rows"] == 20
    assert report["fc"]["residual_after"] < report["fc"]["residual_before"]
    np.testing.assert_array_equal(initializer(corrected, "w") == 0, initializer(pruned, "w") == 0)
    was = fidelity(model, pruned, calibration, [])["end_to_end"]["logits"]["cosine"]
    assert fidelity(model, corrected, calibration, [])["end_to_end"]["logits"]["cosine"] > was


def test_a_row_the_fit_makes_worse_keeps_its_pruned_weights(monkeypatch):
    # a fit that overshoots every row by far must be undone, row by row, and reported as no gain
    monkeypatch.setattr(fidelity_module, "_fit", lambda x, removed, keep: 1e3 * keep)
    model = conv_net(seed=3)
    layers = select_layers(prunable(model), None)
    pruned, records = prune_model(model, parse_method("2:4"), layers)
    corrected, report = correct_weights(model, pruned, layers, records, samples(2))
    assert all(r["residual_after"] == r["residual_before"] for r in report.values())
    assert corrected.SerializeToString() == pruned.SerializeToString()


def test_a_weight_several_pruned_nodes_share_is_not_corrected():
    rng = np.random.default_rng(8)
    inits = {"ws": rng.standard_normal((4, 4, 1, 1)).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", "ws"], ["c1"], name="conv1"),
             helper.make_node("Conv", ["c1", "ws"], ["logits"], name="conv2")]
    model = build(nodes, inits, (1, 4, 3, 3))
    layers = prunable(model)
    pruned, records = prune_model(model, parse_method("2:4"), layers)
    corrected, report = correct_weights(model, pruned, layers, records, samples(2, (1, 4, 3, 3)))
    assert all("skipped" in r and r["residual_after"] == r["residual_before"] > 0 for r in report.values())
    assert corrected.SerializeToString() == pruned.SerializeToString()
