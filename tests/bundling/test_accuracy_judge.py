"""The package stage's end-to-end judgement of a bundle against the fp32 model (`bundle._judge`): a bundle
with int8 segments anywhere (the Edge TPU's included) whose output parts miss the target's accuracy gate
is refused (`accuracy.gate`, nothing is published) naming each failing part, its figures and the culprit
layers, unless the user accepts the loss; a float bundle that disagrees with the model beyond the float
tolerance is refused. The accuracy records are made here, as `golden.accuracy` writes them."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from edgesdk.bundling.bundle import _judge
from edgesdk.compression.culprits import Culprit
from edgesdk.config import load_target
from edgesdk.errors import UserError
from edgesdk.scheduling import selection
from edgesdk.scheduling.plan import PlanSegment

TARGET, _ = load_target("arm_2tpu")
REAL = {"synthetic": False, "samples": 32, "source": "calib/"}
SYNTHETIC = {"synthetic": True, "samples": 32, "distribution": "uniform(-1, 1)", "seed": 0}
CULPRIT = Culprit("/model.22/cv3.0/conv/Conv", "s0", "/model.22/cv3.0/conv/Conv_output_0", "Conv", "CONV_2D",
                  0.41, 9.3, 0.38, 11.2, "calibration-clipping", "its values leave [-2.8, 3.4], the range int8 "
                  "represents there, by up to 6.9 (2.60% of them) (fp32 reaches [-9.2, 7.1])")


def _plan(*segments: tuple[str, str]):
    """What `_judge` reads of a plan: its segments (device, backend)."""
    segs = tuple(PlanSegment(f"s{i}", device, backend, f"segments/s{i}.onnx", ("n",), ("x",), ("y",), 0.0, 0, 1.0)
                 for i, (device, backend) in enumerate(segments))
    return SimpleNamespace(segments=segs, cpu_selection={})


def _tensors(cosine: float, err: float, scale: float = 2.0) -> dict:
    return {"y": {"cosine": cosine, "max_abs_error": err, "max_rel_error": err / scale}}


def _detector(score_cosine: float, score_mean: float = 0.0003, top1: float | None = 1.0) -> dict:
    """A detector's accuracy record: boxes fine, the scores as given."""
    return {"reference": "onnxruntime on the imported fp32 model", "samples": 8, "held_out": True,
            "tensors": _tensors(0.9999, 3.0, 316.0),
            "parts": {"y[:, 0:4]": {"output": "y", "kind": "values", "cosine": 0.9995, "max_error": 0.28,
                                    "mean_error": 0.009, "top1": None, "range": [0.0, 316.4], "samples": 8},
                      "y[:, 4:22]": {"output": "y", "kind": "scores", "activation": "sigmoid", "cosine": score_cosine,
                                     "max_error": 0.77, "mean_error": score_mean, "top1": top1, "range": [0.0, 0.76],
                                     "samples": 8}}}


def _judged(accuracy: dict, plan, *, accept: bool = False, calibration: dict = REAL, method: str = "minmax",
            found: tuple = (CULPRIT,)) -> tuple[dict, list[str], list[str], list]:
    lines, warnings, searched = [], [], []

    def search(failures):
        searched.append([f.part for f in failures])
        return list(found)

    out = _judge(accuracy, plan, lines.append, target=TARGET, calibration=calibration, warn=warnings.append,
                 options=SimpleNamespace(accept_accuracy_loss=accept, calib_method=method, calib_percentile=99.99),
                 search=search)
    return out, lines, warnings, searched


def test_edge_tpu_int8_scores_that_collapsed_are_refused_naming_the_part_and_the_culprits():
    """The YOLOv8 case: the whole output's cosine is 0.9999, its scores' 0.87: the scores part fails, the
    boxes part does not, and the error names the figures and the culprit layer."""
    with pytest.raises(UserError) as err:
        _judged(_detector(0.87), _plan(("edgetpu:0", "tflite"), ("cpu", "tvm")))
    e = err.value
    assert e.code == "accuracy.gate" and e.exit_code == 1
    assert e.message == ("the bundle misses the target's accuracy gate against fp32 on 8 held-out sample(s): "
                         "y[:, 4:22] (scores): cosine 0.8700 < 0.9")
    assert "y[:, 0:4]" not in e.message and not any(n.startswith("y[:, 0:4]") for n in e.notes)
    assert e.notes[0].startswith("y[:, 4:22] (scores): cosine 0.8700 < 0.9; cosine 0.8700, mean error 0.03% and "
                                 "max error 77.0% of its range, top-1 100.0%")
    assert e.notes[1] == f"culprit: {CULPRIT.describe()}"
    assert "/model.22/cv3.0/conv/Conv in s0 (Conv -> CONV_2D): 38.0% of its range lost here" in e.notes[1]
    for remedy in ("--calib", "--calib-method percentile", "on the CPU", "--accept-accuracy-loss"):
        assert remedy in e.hint, remedy
    assert "--cpu-precision fp32" not in e.hint  # no int8 CPU segment to make float


def test_accepted_loss_is_published_and_recorded_loudly():
    out, lines, warnings, searched = _judged(_detector(0.87), _plan(("edgetpu:0", "tflite")), accept=True)
    assert searched == [["y[:, 4:22]"]]
    assert out["accepted_loss"] is True and out["gate"]["passed"] is False
    assert out["failures"] == [{"part": "y[:, 4:22]", "kind": "scores",
                                "missed": {"cosine": {"value": 0.87, "threshold": 0.9}}}]
    assert out["culprits"] == [CULPRIT.to_json()]
    assert warnings == ["--accept-accuracy-loss: the bundle is published BELOW its accuracy gate: y[:, 4:22] (scores): "
                        "cosine 0.8700 < 0.9; culprit: /model.22/cv3.0/conv/Conv (calibration-clipping)"]
    assert any(line.startswith("package: accuracy of y[:, 4:22] (scores, after its sigmoid) vs fp32 on 8 held-out "
                               "sample(s): cosine 0.8700") and line.endswith("BELOW THE GATE (cosine 0.8700 < 0.9)")
               for line in lines), lines


def test_a_bundle_within_the_gate_passes_and_synthetic_calibration_is_said_to_be_unknown():
    out, lines, warnings, searched = _judged(_detector(0.99), _plan(("edgetpu:0", "tflite")))
    assert out["gate"] == {"thresholds": {"scores": {"cosine": 0.9, "mean_error": 0.1, "top1": 0.9},
                                          "values": {"cosine": 0.98, "mean_error": 0.02}},
                           "passed": True, "calibration": "real"}
    assert "accepted_loss" not in out and "failures" not in out and searched == [] and warnings == []
    _, _, warnings, _ = _judged(_detector(0.99), _plan(("edgetpu:0", "tflite")), calibration=SYNTHETIC)
    assert len(warnings) == 1 and "its accuracy on real data is unknown" in warnings[0]
    with pytest.raises(UserError) as err:
        _judged(_detector(0.5), _plan(("edgetpu:0", "tflite")), calibration=SYNTHETIC, method="percentile")
    assert err.value.notes[-1].startswith("calibration: its int8 ranges come from synthetic samples (no --calib)")
    assert "--calib DIR" in err.value.hint and "--calib-method minmax" in err.value.hint


def test_a_classifier_the_gate_cannot_judge_is_said_so_not_passed_silently():
    """fp32 unsure of every held-out sample (best score 0.006 of a 1000-way softmax): the bundle is
    published (fp32 decided nothing to keep), but the log says NOT JUDGED, the verdict records why and the
    user is warned that its decisions went unchecked."""
    accuracy = {"reference": "onnxruntime on the imported fp32 model", "samples": 8, "held_out": True,
                "tensors": _tensors(0.41, 0.005, 0.006),
                "parts": {"predictions": {"output": "predictions", "kind": "scores", "activation": "softmax",
                                          "cosine": 0.41, "decides": False, "max_error": 0.011,
                                          "mean_error": 0.0039, "top1": None, "range": [0.0, 0.0062],
                                          "samples": 8}}}
    out, lines, warnings, searched = _judged(accuracy, _plan(("edgetpu:0", "tflite")))
    assert out["gate"]["passed"] is True and searched == []
    assert "best score 0.0062 < 0.5" in out["gate"]["unjudged"]["predictions"]
    assert lines[-1].endswith(": NOT JUDGED") and "passes" not in lines[-1]
    assert len(warnings) == 1 and warnings[0].startswith("the accuracy gate cannot judge predictions: fp32 decides "
                                                         "nothing") and "--calib" in warnings[0]
    decided = {**accuracy, "parts": {"predictions": {**accuracy["parts"]["predictions"], "top1": 1.0}}}
    out, lines, warnings, _ = _judged(decided, _plan(("edgetpu:0", "tflite")))
    assert "unjudged" not in out["gate"] and lines[-1].endswith(": passes") and warnings == []


def test_percentile_calibration_that_clips_the_culprits_is_told_to_keep_more_of_each_tail():
    """The demo's recognizer at --calib-percentile 99.99: the culprits are clipped by their calibrated
    ranges, and the hint names the percentile that keeps ten times less of each tail out."""
    with pytest.raises(UserError) as err:
        _judged(_detector(0.87), _plan(("edgetpu:0", "tflite")), method="percentile")
    assert "keep more of each tail: --calib-percentile 99.999, or --calib-method minmax" in err.value.hint
    other = dataclasses.replace(CULPRIT, cause="shared-quantization")
    with pytest.raises(UserError) as err:
        _judged(_detector(0.87), _plan(("edgetpu:0", "tflite")), method="percentile", found=(other,))
    assert "--calib-percentile" not in err.value.hint and "try --calib-method minmax" in err.value.hint


def test_int8_cpu_segments_under_the_gate_are_refused_too():
    """A softmax's top-1 where fp32 decides: half of them flipped, under the 90% the gate wants."""
    probs = {"reference": "onnxruntime on the imported fp32 model", "samples": 8, "held_out": True,
             "tensors": _tensors(0.97, 0.4, 1.0),
             "parts": {"y": {"output": "y", "kind": "scores", "activation": "softmax", "cosine": 0.97, "max_error": 1.0,
                             "mean_error": 0.01, "top1": 0.5, "range": [0.0, 1.0], "samples": 8}}}
    with pytest.raises(UserError) as err:
        _judged(probs, _plan(("cpu", "litert-int8")), found=())
    assert err.value.code == "accuracy.gate"
    assert err.value.message.endswith("y (scores): top-1 agreement 50.0% < 90%")
    assert "--cpu-precision fp32" in err.value.hint
    assert err.value.notes[1] == "culprits: none found (no int8 segment could be compared layer by layer)"


def test_a_float_bundle_that_disagrees_with_the_model_is_refused():
    with pytest.raises(UserError) as err:
        _judge({"samples": 8, "tensors": _tensors(0.9999, 0.5), "parts": {}}, _plan(("cpu", "tvm"), ("cpu", "onnxruntime")),
               lambda s: None)
    assert err.value.code == "package.float-mismatch"
    assert err.value.message.startswith("the bundle's y differs from the fp32 model by 0.5 (0.25 of its largest "
                                        "magnitude, more than the float tolerance 0.001) on 8 samples")
    assert "--tuning-db pointing at an empty directory" in err.value.hint
    with pytest.raises(UserError, match="differs from the fp32 model by nan"):
        _judge({"samples": 8, "tensors": _tensors(float("nan"), float("nan")), "parts": {}}, _plan(("cpu", "tvm")),
               lambda s: None)
    # within the tolerance the tune stage's check of float candidates allows: accepted, and not gated
    out = _judge({"samples": 8, "tensors": _tensors(1.0, 0.9 * selection.TOLERANCE * 2.0), "parts": {}},
                 _plan(("cpu", "tvm")), lambda s: None)
    assert "gate" not in out


def test_the_summary_inspect_and_the_report_say_an_accepted_loss_loudly():
    from edgesdk.report.html import accuracy_page
    from edgesdk.report.text import accuracy_summary

    out, _, _, _ = _judged(_detector(0.87), _plan(("edgetpu:0", "tflite")), accept=True, calibration=SYNTHETIC)
    lines = accuracy_summary(out).splitlines()
    assert lines[0] == ("accuracy: each output against fp32 on 8 held-out samples: BELOW THE ACCURACY GATE: published "
                        "only because of --accept-accuracy-loss (1 part(s) under the target's thresholds)")
    assert lines[1].startswith("  y[:, 0:4] (values): cosine 0.9995") and "BELOW" not in lines[1]
    assert lines[2].endswith(": BELOW (cosine 0.87, the gate wants >= 0.9)")
    assert lines[3] == ("  culprit /model.22/cv3.0/conv/Conv in s0 (Conv -> CONV_2D): 38.0% of its range lost there, "
                        "SNR 11.2 dB; calibration-clipping")
    assert lines[4] == "  calibration SYNTHETIC (no --calib): the accuracy on real data is UNKNOWN"
    page = accuracy_page(out)
    assert "BELOW THE ACCURACY GATE" in page and "/model.22/cv3.0/conv/Conv" in page and "calibration-clipping" in page
    # a bundle from before the gate judged parts: nothing of this, inspect shows its old lines
    assert accuracy_summary({"samples": 8, "tensors": {"y": {"cosine": 1.0, "max_abs_error": 0.0}}}) == ""


def _ocr_task(met: bool) -> dict:
    """`--eval DIR --task ocr`'s record (compression/tasks.py) where int8 reads 68.9% of the characters."""
    return {"task": "ocr", "source": "heldout/", "summary": "characters fp32 100.0%, int8 68.9%; ...",
            "verdict": {"met": met, "goal": "int8 reads >= 98% of the characters fp32 reads",
                        "missed": [] if met else ["characters 68.94% < 98.00%"]}}


def test_a_missed_task_goal_is_not_published_and_names_the_culprits_unless_accepted():
    """The gate's output parts pass on synthetic held-out samples, while the user's own held-out lines show
    what int8 loses: the task's verdict decides."""
    from edgesdk.bundling.gate import GateFailure, judge_task

    plan = _plan(("edgetpu:0", "tflite"), ("cpu", "onnxruntime"))
    options = SimpleNamespace(accept_accuracy_loss=False, calib_method="minmax", calib_percentile=99.99)
    accuracy = {**_detector(0.95), "task": _ocr_task(met=False)}
    warnings: list[str] = []
    with pytest.raises(GateFailure) as e:
        judge_task(accuracy, plan, options, SYNTHETIC, search=lambda failures: [CULPRIT], warn=warnings.append)
    err = e.value
    assert err.code == "accuracy.task" and err.exit_code == 1
    assert err.message == ("the bundle misses its ocr goal on --eval heldout/: characters 68.94% < 98.00% "
                           "(goal: int8 reads >= 98% of the characters fp32 reads)")
    assert "calibrate on real inputs" in err.hint and "--keep-on-cpu /model.22/cv3.0/conv/Conv" in err.hint
    assert "--task-options goal=SHARE" in err.hint and "--accept-accuracy-loss" in err.hint
    assert any(n.startswith("culprit: /model.22/cv3.0/conv/Conv in s0") for n in err.notes), err.notes
    assert err.accuracy["culprits"][0]["node"] == "/model.22/cv3.0/conv/Conv"  # what the remedy moves

    accepting = SimpleNamespace(**{**vars(options), "accept_accuracy_loss": True})
    accepted = judge_task(accuracy, plan, accepting, SYNTHETIC, search=lambda failures: [CULPRIT], warn=warnings.append)
    assert accepted["accepted_loss"] is True and warnings == [
        "--accept-accuracy-loss: the bundle is published below its task goal: the bundle misses its ocr goal on "
        "--eval heldout/: characters 68.94% < 98.00% (goal: int8 reads >= 98% of the characters fp32 reads)"]
    # pruned: the figures are against the dense model, and pruning's loss is the user's choice: said
    pruned = SimpleNamespace(**{**vars(options), "prune": "2:4"})
    assert judge_task(accuracy, plan, pruned, SYNTHETIC, search=lambda failures: pytest.fail("searched"),
                      warn=warnings.append) is accuracy
    assert warnings[-1].endswith("; the bundle is pruned (--prune), which the figures against the dense model include")
    # a goal met: nothing searched, nothing said
    met = {**accuracy, "task": _ocr_task(met=True)}
    assert judge_task(met, plan, options, SYNTHETIC, search=lambda failures: pytest.fail("searched"),
                      warn=warnings.append) is met


def test_a_model_quantized_itself_is_held_to_the_gate_wherever_it_runs():
    """A full-int8 TFLite model on a GPU or CPU plan runs its own Q/DQ graph: TVM's QuantizeLinear rounds a tie
    otherwise than onnxruntime's, and an int8 step moved early moves a deep network's answer far past the float
    tolerance (a MobileNetV2 by 0.97 of its largest magnitude, its top-1 the same): judged by the gate, not
    refused as a wrong kernel."""
    plan = _plan(("gpu:0", "tvm"))
    with pytest.raises(UserError) as err:
        _judged(_detector(0.99), plan)  # the float plan of a float model: a wrong kernel
    assert err.value.code == "package.float-mismatch"
    lines, warnings = [], []
    out = _judge(_detector(0.99), plan, lines.append, target=TARGET, calibration=REAL, warn=warnings.append,
                 options=SimpleNamespace(accept_accuracy_loss=False, calib_method="minmax", calib_percentile=99.99),
                 search=lambda failures: [], int8_model=True)
    assert out["gate"]["passed"] is True
    with pytest.raises(UserError) as err:
        _judge(_detector(0.5), plan, lines.append, target=TARGET, calibration=REAL, warn=warnings.append,
               options=SimpleNamespace(accept_accuracy_loss=False, calib_method="minmax", calib_percentile=99.99),
               search=lambda failures: [], int8_model=True)
    assert err.value.code == "accuracy.gate"
