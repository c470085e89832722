"""The accuracy gate's measures (compression/accuracy.py): the parts an output is judged by, found from the
graph; each part's figures on small arrays, relative to its own range; the verdict against thresholds."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk.compression.accuracy import SCORES, VALUES, Gate, View, judge, measure, views
from edgesdk.config import builtin_targets, load_target
from edgesdk.errors import EXIT_USAGE, UsageError

GATE = Gate(scores={"cosine": 0.9, "mean_error": 0.1, "top1": 0.9}, values={"cosine": 0.98, "mean_error": 0.02})


def _model(nodes, inputs: dict[str, list[int]], outputs: dict[str, list[int]], inits: dict[str, np.ndarray]):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs.items()],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _detector_head(transpose: bool):
    """A YOLOv8-style head: boxes (4 rows) and sigmoid class scores (3 rows) concatenated to [1, 7, 64],
    optionally transposed to [1, 64, 7]."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "wb"], ["box"], name="box_conv"),
             helper.make_node("Conv", ["x", "wc"], ["logits"], name="cls_conv"),
             helper.make_node("Sigmoid", ["logits"], ["scores"], name="sigmoid"),
             helper.make_node("Concat", ["box", "scores"], ["cat"], name="cat", axis=1),
             helper.make_node("Reshape", ["cat", "shape"], ["flat" if transpose else "y"], name="flatten")]
    if transpose:
        nodes.append(helper.make_node("Transpose", ["flat"], ["y"], name="to_rows", perm=[0, 2, 1]))
    return _model(nodes, {"x": [1, 8, 8, 8]}, {"y": [1, 64, 7] if transpose else [1, 7, 64]},
                  {"wb": rng.standard_normal((4, 8, 1, 1)).astype(np.float32),
                   "wc": rng.standard_normal((3, 8, 1, 1)).astype(np.float32),
                   "shape": np.array([1, 7, 64], np.int64)})


def test_a_concat_of_boxes_and_sigmoid_scores_is_judged_in_two_parts():
    got = views(_detector_head(transpose=False))
    assert got == {"y": [View("y", VALUES, 1, 0, 4), View("y", SCORES, 1, 4, 7, "sigmoid", class_axis=1)]}
    assert [v.name for v in got["y"]] == ["y[:, 0:4]", "y[:, 4:7]"]
    # the same head with its rows transposed: the parts follow the axis
    moved = views(_detector_head(transpose=True))["y"]
    assert [(v.kind, v.axis, v.start, v.stop, v.class_axis) for v in moved] == [(VALUES, 2, 0, 4, None),
                                                                              (SCORES, 2, 4, 7, 2)]
    assert moved[1].name == "y[:, :, 4:7]"


def test_a_softmax_output_is_scores_with_top1_and_logits_are_values():
    w = np.ones((5, 4), np.float32)
    model = _model([helper.make_node("MatMul", ["x", "w"], ["logits"], name="fc"),
                    helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=-1)],
                   {"x": [1, 3, 5]}, {"probs": [1, 3, 4], "logits": [1, 3, 4]}, {"w": w})
    got = views(model)
    assert got["probs"] == [View("probs", SCORES, activation="softmax", class_axis=2)]
    assert got["logits"] == [View("logits", VALUES)]


def test_a_concat_along_another_axis_than_the_scores_split_is_judged_as_values():
    """Scores and boxes mixed along an axis the parts cannot follow: one part, values (never scores
    hidden in a part judged as something else)."""
    model = _model([helper.make_node("Sigmoid", ["a"], ["s"], name="sig"),
                    helper.make_node("Concat", ["b", "s"], ["cat"], name="cat", axis=1),
                    helper.make_node("Reshape", ["cat", "shape"], ["y"], name="mix")],
                   {"a": [1, 2, 4], "b": [1, 2, 4]}, {"y": [1, 16]}, {"shape": np.array([1, 16], np.int64)})
    assert views(model) == {"y": [View("y", VALUES)]}


def test_measure_gives_each_part_its_figures_relative_to_its_own_range():
    """Boxes in pixels (0..300) and scores in [0, 1] in one output: a score collapsed from 0.95 to 0.05 is
    95% of the scores' range (0.95), while the whole output's cosine stays above 0.9999."""
    boxes = np.array([[10.0, 20.0, 300.0, 150.0]] * 2).T[None]  # [1, 4, 2]
    scores = np.array([[0.95, 0.0], [0.0, 0.1]])[None]  # [1, 2, 2]: anchor 0 class 0, anchor 1 class 1 (0.1)
    fp32 = {"y": np.concatenate([boxes, scores], axis=1)}
    q = fp32["y"].copy()
    q[0, 0, 0] += 3.0  # a box coordinate 3 px off: 1% of the boxes' 290 px range
    q[0, 4, 0] = 0.05  # the confident score collapsed
    parts = {"y": [View("y", VALUES, 1, 0, 4), View("y", SCORES, 1, 4, 6, "sigmoid", class_axis=1)]}
    got = measure([fp32], [{"y": q}], parts)
    whole = float(fp32["y"].ravel() @ q.ravel() / np.linalg.norm(fp32["y"]) / np.linalg.norm(q))
    assert whole > 0.9999
    b, s = got["y[:, 0:4]"], got["y[:, 4:6]"]
    assert b["kind"] == VALUES and b["max_error"] == pytest.approx(3.0 / 290.0, rel=1e-4)
    assert b["mean_error"] == pytest.approx(3.0 / 8 / 290.0, rel=1e-4) and b["top1"] is None
    assert s["kind"] == SCORES and s["activation"] == "sigmoid" and s["samples"] == 1
    assert s["max_error"] == pytest.approx(0.9 / 0.95, rel=1e-4)
    assert s["mean_error"] == pytest.approx(0.9 / 4 / 0.95, rel=1e-4)
    assert s["cosine"] == pytest.approx((0.95 * 0.05 + 0.01) / np.hypot(0.95, 0.1) / np.hypot(0.05, 0.1), rel=1e-5)
    # top-1 where fp32 decides (its best score >= 0.9: anchor 0 only); its class is still the best one
    assert s["top1"] == 1.0
    q[0, 5, 0] = 0.3  # now class 1 wins at anchor 0
    assert measure([fp32], [{"y": q}], parts)["y[:, 4:6]"]["top1"] == 0.0
    with pytest.raises(ValueError, match=r"y\[:, 0:4\]: fp32 has shape"):
        measure([fp32], [{"y": q[:, :, :1]}], parts)


def test_judge_names_each_part_and_the_measures_it_misses():
    m = {"y[:, 0:4]": {"kind": VALUES, "cosine": 0.9999, "mean_error": 0.004, "max_error": 0.3, "top1": None},
         "y[:, 4:6]": {"kind": SCORES, "cosine": 0.87, "mean_error": 0.02, "max_error": 0.9, "top1": 0.5},
         "probs": {"kind": SCORES, "cosine": 0.97, "mean_error": 0.001, "max_error": 1.0, "top1": None}}
    failures = judge(m, GATE)
    assert [f.part for f in failures] == ["y[:, 4:6]"]  # max error is not judged by default; top-1 None is not taken
    assert failures[0].missed == {"cosine": (0.87, 0.9), "top1": (0.5, 0.9)}
    assert failures[0].describe() == "y[:, 4:6] (scores): cosine 0.8700 < 0.9, top-1 agreement 50.0% < 90%"
    # a NaN misses every threshold; a target that asks for max error gets it judged
    nan = {"p": {"kind": VALUES, "cosine": float("nan"), "mean_error": float("nan"), "max_error": 0.0, "top1": None}}
    assert set(judge(nan, GATE)[0].missed) == {"cosine", "mean_error"}
    strict = Gate(scores={"max_error": 0.5}, values={})
    assert judge(m, strict)[0].describe() == "y[:, 4:6] (scores): max error 90.0% of its range > 50.0%"


def test_the_gate_comes_from_the_targets_accuracy_section(tmp_path):
    target, _ = load_target("arm_2tpu")
    assert Gate.of(target.accuracy) == GATE
    text = builtin_targets()["x86"].read_text()
    path = tmp_path / "t.yaml"
    path.write_text(text + "accuracy:\n  scores: {cosine: 0.99, max_error: 0.25}\n  values: {mean_error: null}\n")
    mine, _ = load_target(path)
    assert Gate.of(mine.accuracy) == Gate(scores={"cosine": 0.99, "mean_error": 0.1, "top1": 0.9, "max_error": 0.25},
                                 values={"cosine": 0.98})


def test_a_bad_accuracy_section_is_refused_at_its_line(tmp_path):
    """As every target key: an unknown measure or a cosine above 1 is a usage error (exit 2) naming the line."""
    text = builtin_targets()["x86"].read_text() + "accuracy:\n  scores:\n    cosin: 0.99\n  values:\n    cosine: 1.5\n"
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(UsageError) as e:
        load_target(path)
    assert e.value.exit_code == EXIT_USAGE
    lines = text.splitlines()
    assert f"{path}:{lines.index('    cosin: 0.99') + 1}: unknown key 'accuracy.scores.cosin'" in e.value.notes
    assert any(n.startswith(f"{path}:{lines.index('    cosine: 1.5') + 1}: field 'accuracy.values.cosine'")
               for n in e.value.notes), e.value.notes


def test_an_output_declared_as_logits_is_judged_as_the_scores_the_users_code_reads():
    """BlazeFace's classificators and a face flag are logits; MediaPipe's graph applies the sigmoid. Judged as
    values, a background anchor's move from -300 to -250 fails the gate and a face lost (3 to -3) passes it.
    Declared, the part is scores after the sigmoid: the lost face fails, the background's move does not
    count."""
    from types import SimpleNamespace

    from edgesdk.compression.accuracy import declared

    model = _model([helper.make_node("Conv", ["x", "w"], ["logits"])], {"x": [1, 8, 4, 4]}, {"logits": [1, 1, 4, 4]},
                   {"w": np.ones((1, 8, 1, 1), np.float32)})
    assert views(model)["logits"][0].kind == VALUES
    (v,) = views(model, {"logits": "sigmoid"})["logits"]
    assert v.kind == SCORES and v.applies and v.activation == "sigmoid"
    fp32 = np.full((1, 1, 4, 4), -300.0, np.float32)
    fp32[0, 0, 0, :2] = 3.0  # two faces
    lost, background = fp32.copy(), fp32.copy()
    lost[0, 0, 0, 1] = -3.0  # one face's score 0.95 -> 0.05
    background[0, 0, 1:] = -250.0  # the background moves where no sigmoid sees it
    for got, fails_as_values in ((lost, False), (background, True)):
        as_values = measure([{"logits": fp32}], [{"logits": got}], views(model))["logits"]
        assert bool(judge({"logits": as_values}, GATE)) is fails_as_values, as_values
    parts = {"logits": [v]}
    got = measure([{"logits": fp32}], [{"logits": lost}], parts)["logits"]
    assert got["declared"] and got["kind"] == SCORES
    assert got["max_error"] == pytest.approx(1 / (1 + np.exp(-3.0)) - 1 / (1 + np.exp(3.0)), rel=1e-4)  # of [0, 1]
    assert [f.part for f in judge({"logits": got}, GATE)] == ["logits"]
    moved = measure([{"logits": fp32}], [{"logits": background}], parts)["logits"]
    assert moved["cosine"] == pytest.approx(1.0) and moved["max_error"] < 1e-9 and not judge({"logits": moved}, GATE)
    # a softmax along the last axis
    (s,) = views(model, {"logits": "softmax"})["logits"]
    assert s.class_axis == 3 and np.allclose(s.of(fp32, batched=False).sum(axis=-1), 1.0)
    # what a build declares: --output-activation, and an SSD decoder's scores output with its activation
    options = SimpleNamespace(output_activations={"flag": "sigmoid"}, task="detection", decoder="ssd",
                              task_options="boxes=regressors,scores=classificators,activation=sigmoid")
    assert declared(options) == {"classificators": "sigmoid", "flag": "sigmoid"}
    assert declared(SimpleNamespace(output_activations={}, task="detection", decoder="ssd",
                                    task_options="scores=classificators,activation=none")) == {}


def test_scores_that_decide_nothing_are_not_judged_by_their_cosine():
    """A person mask of photographs without a person: fp32's scores are all near 0, and int8's noise about
    them has a cosine of nothing (0.36 on the selfie segmenter whose masks agreed at IoU 1.0). Where no fp32
    score reaches DECIDES the cosine is recorded, not judged; the mean error still is, as a share of at least
    DECIDES (not of the 0.02 the background spreads over)."""
    from edgesdk.compression.accuracy import DECIDES

    rng = np.random.default_rng(0)
    part = {"m": [View("m", SCORES, activation="sigmoid")]}
    fp32 = {"m": (rng.random((1, 64)) * 0.02).astype(np.float32)}
    noise = {"m": (rng.random((1, 64)) * 0.02).astype(np.float32)}
    got = measure([fp32], [noise], part)["m"]
    assert got["cosine"] < 0.9 and got["decides"] is False and not judge({"m": got}, GATE)
    wrong = {"m": np.full((1, 64), 0.3, np.float32)}  # far from nothing: the mean error says so
    assert [f.missed.keys() for f in judge(measure([fp32], [wrong], part), GATE)] == [{"mean_error"}]
    lit = {"m": fp32["m"].copy()}
    lit["m"][0, 0] = DECIDES + 0.1  # one decision: the cosine is judged again
    assert "decides" not in measure([lit], [noise], part)["m"]
    assert [set(f.missed) for f in judge(measure([lit], [noise], part), GATE)] == [{"cosine"}]


def test_a_classifier_unsure_of_every_sample_is_said_to_be_unjudged_not_passed():
    """A 1000-way softmax whose fp32 best score is ~0.006 on every sample (a random-weight classifier, or
    held-out inputs of none of its classes): int8 answering another class everywhere stays within a fraction
    of a percent of fp32 by every measure the gate holds, so the gate must say it judged nothing."""
    from edgesdk.compression.accuracy import unjudged

    rng = np.random.default_rng(1)
    part = {"p": [View("p", SCORES, activation="softmax", class_axis=1)]}

    def softmax(x):
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)

    logits = rng.standard_normal((8, 1, 1000)) * 0.5
    fp32 = [{"p": softmax(x)} for x in logits]
    other = [{"p": softmax(x[:, ::-1].copy())} for x in logits]  # another class everywhere
    got = measure(fp32, other, part)
    assert got["p"]["decides"] is False and got["p"]["top1"] is None and not judge(got, GATE)
    assert set(unjudged(got)) == {"p"} and "best score 0.00" in unjudged(got)["p"]
    sure = [{"p": softmax(x * 12)} for x in logits]  # the same classifier, confident: judged, and it fails
    got = measure(sure, [{"p": softmax(x[:, ::-1].copy() * 12)} for x in logits], part)
    assert not unjudged(got) and got["p"]["top1"] == 0.0 and judge(got, GATE)


def test_a_quantized_softmax_output_is_judged_as_the_probabilities_it_codes():
    """A full-int8 classifier's output is QuantizeLinear(Softmax) at scale 1/256, zero point -128: nearly every
    code is -128, so the cosine of two outputs whose best classes differ was 0.9993 (a MobileNetV2's, built
    for the Edge TPU). Dequantized, it is scores with classes: its top-1 is judged."""
    nodes = [helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=-1),
             helper.make_node("QuantizeLinear", ["probs", "s", "z"], ["codes"], name="quantize")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 1000])],
                              [helper.make_tensor_value_info("codes", TensorProto.INT8, [1, 1000])],
                              [numpy_helper.from_array(np.array(1 / 256, np.float32), "s"),
                               numpy_helper.from_array(np.array(-128, np.int8), "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    (v,) = views(model)["codes"]
    assert (v.kind, v.activation, v.class_axis, v.dequantize) == (SCORES, "softmax", 1, (1 / 256, -128.0))
    fp32 = [{"codes": np.full((1, 1000), -128, np.int8)} for _ in range(8)]
    bundle = [{"codes": np.full((1, 1000), -128, np.int8)} for _ in range(8)]
    for k in range(8):
        fp32[k]["codes"][0, k] = 127  # sure of class k
        bundle[k]["codes"][0, k + 10] = 127  # sure of another
    got = measure(fp32, bundle, {"codes": [v]})["codes"]
    assert got["top1"] == 0.0 and got["cosine"] == 0.0 and judge({"codes": got}, GATE)
    raw = measure(fp32, bundle, {"codes": [View("codes", VALUES)]})["codes"]
    assert raw["cosine"] > 0.995  # what judging the codes said


def test_the_tensors_that_only_move_into_a_declared_output_are_judged_as_it():
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Reshape", ["c", "s"], ["r"]),
             helper.make_node("Concat", ["r", "r"], ["logits"], axis=1)]
    model = _model(nodes, {"x": [1, 8, 4, 4]}, {"logits": [1, 32, 1]},
                   {"w": np.ones((1, 8, 1, 1), np.float32), "s": np.array([1, 16, 1], np.int64)})
    from edgesdk.compression.accuracy import declared_chain

    chain = declared_chain(model, {"logits": "sigmoid"})
    assert set(chain) == {"r", "c"} and all(v[0].applies and v[0].activation == "sigmoid" for v in chain.values())
    assert declared_chain(model, {}) == {}
