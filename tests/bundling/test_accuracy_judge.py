"""The package stage's end-to-end judgement of a bundle against the fp32 model (`bundle._judge`): a bundle
whose int8 CPU segments miss the accuracy gate they were chosen behind, or a float bundle that disagrees
with the model beyond the float tolerance, is refused (nothing is published); an accelerator's int8
segments are reported only. The accuracy records are made here, as `golden.accuracy` writes them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from edgesdk.bundling.bundle import _judge
from edgesdk.errors import UserError
from edgesdk.scheduling import selection
from edgesdk.scheduling.plan import PlanSegment


def _plan(*segments: tuple[str, str], gate: dict | None = None):
    """What `_judge` reads of a plan: its segments (device, backend) and its `cpu_selection`."""
    segs = tuple(PlanSegment(f"s{i}", device, backend, f"segments/s{i}.onnx", ("n",), ("x",), ("y",), 0.0, 0, 1.0)
                 for i, (device, backend) in enumerate(segments))
    return SimpleNamespace(segments=segs, cpu_selection={"gate": gate} if gate else {})


def _accuracy(cosine: float, err: float, scale: float = 2.0, top1: float | None = None) -> dict:
    out = {"reference": "onnxruntime on the imported fp32 model", "samples": 8,
           "tensors": {"y": {"cosine": cosine, "max_abs_error": err, "max_rel_error": err / scale}}}
    return {**out, "top1_agreement": top1} if top1 is not None else out


INT8 = {"cosine": 0.99, "top1": 0.9, "calibration_samples": 24, "held_out_samples": 8}


def test_int8_cpu_segments_under_the_gate_are_refused():
    lines: list[str] = []
    with pytest.raises(UserError) as err:
        _judge(_accuracy(0.0, 1.5), _plan(("cpu", "onnxruntime-int8"), gate=INT8), lines.append)
    assert err.value.code == "package.accuracy-gate" and err.value.exit_code == 1
    assert err.value.message == ("the bundle's y has a cosine similarity of 0.00000 to the fp32 model on 8 samples, "
                                 "under the accuracy gate (0.99) its int8 CPU segments (s0) were chosen behind")
    assert "--cpu-precision fp32" in err.value.hint
    assert lines == ["package: accuracy of y vs the fp32 model: cosine 0.00000, max abs error 1.5"]
    with pytest.raises(UserError, match=r"top-1 agrees with the fp32 model's on 50% of 8 samples, under the accuracy "
                                        r"gate \(90%\)"):
        _judge(_accuracy(0.995, 0.1, top1=0.5), _plan(("cpu", "litert-int8"), gate=INT8), lambda s: None)
    # the gate the selection used, not the default: a stricter one recorded in the plan is applied
    with pytest.raises(UserError, match=r"under the accuracy gate \(0.999\)"):
        _judge(_accuracy(0.995, 0.1), _plan(("cpu", "litert-int8"), gate={**INT8, "cosine": 0.999}), lambda s: None)
    _judge(_accuracy(0.995, 0.1, top1=0.95), _plan(("cpu", "litert-int8"), gate=INT8), lambda s: None)


def test_a_float_bundle_that_disagrees_with_the_model_is_refused():
    with pytest.raises(UserError) as err:
        _judge(_accuracy(0.9999, 0.5), _plan(("cpu", "tvm"), ("cpu", "onnxruntime")), lambda s: None)
    assert err.value.code == "package.float-mismatch"
    assert err.value.message.startswith("the bundle's y differs from the fp32 model by 0.5 (0.25 of its largest "
                                        "magnitude, more than the float tolerance 0.001) on 8 samples")
    assert "--tuning-db pointing at an empty directory" in err.value.hint
    with pytest.raises(UserError, match="differs from the fp32 model by nan"):
        _judge(_accuracy(float("nan"), float("nan")), _plan(("cpu", "tvm")), lambda s: None)
    # within the tolerance the tune stage's check of float candidates allows: accepted
    _judge(_accuracy(1.0, 0.9 * selection.TOLERANCE * 2.0), _plan(("cpu", "tvm")), lambda s: None)


def test_an_accelerators_int8_segments_are_reported_not_judged():
    """The Edge TPU's int8 (its own gate is another matter): with it in the plan, nothing is refused here."""
    lines: list[str] = []
    _judge(_accuracy(0.3, 4.0), _plan(("edgetpu:0", "tflite"), ("cpu", "litert-int8"), gate=INT8), lines.append)
    assert lines == ["package: accuracy of y vs the fp32 model: cosine 0.30000, max abs error 4"]
