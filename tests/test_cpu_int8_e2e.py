"""`--cpu-precision int8` end to end on a real pretrained model (PP-OCR's text direction
classifier) calibrated on text-line images: the tune stage quantizes its int8 candidates on the
calibration share, gates them on the held-out quarter, and (with a FAKE TIMER that calls int8
fastest: timings never go into tests) ships the fastest one that passed, quantized again exactly
as measured. What is asserted holds whichever int8 candidate passes the gate."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from edgesdk import backends, timing
from edgesdk.cli import main as cli_main
from edgesdk.ir.numeric import compare
from edgesdk.pipeline import BuildOptions, build
from edgesdk.runtime import BundleModel
from edgesdk.runtime.manifest import Manifest
from edgesdk.scheduling import selection
from edgesdk.verify import verify
from tests import model_zoo

pytestmark = pytest.mark.slow  # a real model built and its int8 candidates measured

INT8 = set(backends.cpu_candidates("int8"))
SHAPE = {"x": (1, 3, 48, 192)}


@pytest.fixture(scope="module")
def int8_build(tmp_path_factory, text_calib):
    tmp = tmp_path_factory.mktemp("cpu-int8")

    def fake_laps(bundle, feeds, **_):  # A FAKE TIMER: int8 candidates 0.1 ms, the others 1 ms
        return [0.1 if Path(bundle).name in INT8 else 1.0] * 3

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(timing.runner, "measure_alone", fake_laps)
        options = BuildOptions(model=model_zoo.ppocr_cls(), target="x86", out=tmp / "a",
                               input_shapes=SHAPE, tuning_db=tmp / "db", calib=text_calib, calib_method="minmax",
                               calib_preprocess=model_zoo.PPOCR_CLS_PREPROCESS, cpu_backends=("onnxruntime", "litert"),
                               cpu_precision="int8")
        return options, build(options)


def test_the_fastest_int8_candidate_that_passed_the_gate_is_shipped(int8_build):
    _, result = int8_build
    sel = json.loads((result.bundle / "plan.json").read_text())["cpu_selection"]
    assert sel["precision"] == "int8" and sel["gate"]["held_out_samples"] == 4  # 16 images: 12 + 4
    (span,) = sel["spans"]
    passed = {n for n, c in span["candidates"].items() if n in INT8 and "gate" in c}
    for name in INT8 - passed:  # one that did not pass says why
        assert span["candidates"][name]["skipped"], span
    assert passed, f"no int8 candidate passed the gate: {span}"
    for name in passed:
        assert span["candidates"][name]["gate"]["cosine"] >= selection.GATE_COSINE
    assert span["chosen"] in passed
    manifest = Manifest.load(result.bundle)
    (seg,) = manifest.segments
    assert seg.backend == {"litert-int8": "tflite", "onnxruntime-int8": "onnxruntime"}[span["chosen"]]
    assert manifest.tuning["cpu_selection"] == sel
    int8 = json.loads((result.bundle.parent / ".build" / "4-tune" / "int8.json").read_text())
    assert list(int8["segments"]) == [seg.id]  # quantized again as measured, on the calibration share
    assert manifest.calibration["samples"] == 16 and manifest.calibration["images"] is True


def test_the_shipped_int8_segment_is_the_one_gated_and_passes_its_self_test(int8_build, text_calib):
    """The tune stage quantized the chosen segment again exactly as the candidate it gated: on the
    held-out images (the last quarter of --calib) the bundle reproduces the gate's cosine; and its
    golden self-test passes. (Agreement on images never seen is a property of the data, measured in
    benchmarks/, not asserted here.)"""
    from edgesdk.ir.calibration import load_image, parse_preprocess

    _, result = int8_build
    span = json.loads((result.bundle / "plan.json").read_text())["cpu_selection"]["spans"][0]
    (seg,) = Manifest.load(result.bundle).segments
    pre = parse_preprocess(model_zoo.PPOCR_CLS_PREPROCESS, SHAPE["x"])
    held = [load_image(p, pre, "float32") for p in sorted(text_calib.iterdir())[-4:]]
    # the segment as shipped, and the float segment the tune stage cut: every output the span hands on
    shipped = dict((s.id, r) for s, r in BundleModel(result.bundle, log=lambda s: None).runners)[seg.id]
    floats = ort.InferenceSession(str(result.bundle.parent / ".build" / "4-tune" / "segments" / f"{seg.id}.onnx"),
                                  providers=["CPUExecutionProvider"])
    got = [shipped.run({"x": x}) for x in held]
    want = [dict(zip([o.name for o in floats.get_outputs()], floats.run(None, {"x": x}))) for x in held]
    worst = min(compare(np.stack([g[t.name] for g in got]), np.stack([w[t.name] for w in want]))["cosine"]
                for t in seg.outputs)
    assert worst == pytest.approx(span["candidates"][span["chosen"]]["gate"]["cosine"], abs=2e-6)
    assert verify(result.bundle).selftest == "passed"


def test_inspect_shows_the_gate(int8_build):
    from edgesdk.report.text import inspect_bundle

    _, result = int8_build
    text = inspect_bundle(Manifest.load(result.bundle), result.bundle)
    assert "int8 candidates quantized on 12 calibration samples" in text and "(cosine 0." in text


# --- a planted timing cache: the tiny MLP, built in this process so that a TEST DOUBLE can stand in for
# onnxruntime's int8 backend (its outputs all zeros; the timing cache's key is the real backend's) ---------

@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A tuning database whose timing cache claims `{"ms": 0.0001, "gate": {"cosine": 0.9999, ...}}` for the
    int8 candidate whose outputs are zeros (refused by the gate when it was measured): the build's arguments."""
    import onnx

    from tests.scheduling.test_selection import PLANTED_GATE, _model, _plant, zeroed_int8

    zeroed_int8(monkeypatch)
    monkeypatch.setattr(timing.runner, "measure_alone", lambda bundle, feeds, **_: [1.0] * 3)  # A FAKE TIMER
    onnx.save(_model(), tmp_path / "mlp.onnx")
    args = ["build", str(tmp_path / "mlp.onnx"), "--target", "x86", "--cpu-precision", "int8",
            "--cpu-backends", "onnxruntime", "--tuning-db", str(tmp_path / "db")]
    assert cli_main([*args, "-o", str(tmp_path / "first"), "--until", "tune"]) == 0
    _plant(tmp_path / "db" / "timing.json", "accuracy gate", PLANTED_GATE)
    return args


def _fp32_and_bundle(model: Path, bundle: Path) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(5).standard_normal((1, 16)).astype(np.float32)
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    return want, BundleModel(bundle, log=lambda s: None).run({"x": x})["y"]


def test_a_planted_timing_cache_never_ships_a_bundle_of_zeros(planted, tmp_path, capsys):
    """The planted entry replays a time, not the gate: the candidate is gated again, dropped, and the
    fastest candidate that passes its check ships; the bundle computes what the model does."""
    capsys.readouterr()
    assert cli_main([*planted, "-o", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "onnxruntime-int8 skipped: accuracy gate: y's cosine similarity to fp32 is 0.0000" in err, err
    span = json.loads((tmp_path / "out" / "bundle" / "plan.json").read_text())["cpu_selection"]["spans"][0]
    assert span["chosen"] != "onnxruntime-int8" and "skipped" in span["candidates"]["onnxruntime-int8"]
    want, got = _fp32_and_bundle(tmp_path / "mlp.onnx", tmp_path / "out" / "bundle")
    assert np.abs(want).max() > 0.1 and np.abs(got - want).max() <= 1e-3 * np.abs(want).max()


def test_a_bundle_under_the_gate_is_never_published(planted, tmp_path, capsys, monkeypatch):
    """Were the selection fooled (its gate made to pass here), the package stage's accuracy gate refuses
    the bundle of zeros: exit 1 naming the output and its figures, and no bundle/ or bundle.tar.gz."""
    monkeypatch.setattr(selection, "gate", lambda *a, **k: {"cosine": 0.9999, "top1": 1.0, "samples": 2})
    capsys.readouterr()
    out = tmp_path / "out"
    assert cli_main([*planted, "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "error: the bundle misses the target's accuracy gate against fp32 on 8 held-out sample(s): y (values): " \
           "cosine 0.0000 < 0.98" in err, err
    assert "hint: calibrate on real inputs" in err and "--cpu-precision fp32" in err and "Traceback" not in err
    assert not (out / "bundle").exists() and not (out / "bundle.tar.gz").exists()


def test_a_fifo_as_the_timing_cache_is_refused_at_once(tmp_path, capsys):
    """A FIFO in place of timing.json hung the build (a plain open waits for a writer): now exit 1, naming it."""
    import os

    import onnx

    from tests.scheduling.test_selection import _model, no_hang

    onnx.save(_model(), tmp_path / "mlp.onnx")
    (tmp_path / "db").mkdir()
    os.mkfifo(tmp_path / "db" / "timing.json")
    with no_hang():
        code = cli_main(["build", str(tmp_path / "mlp.onnx"), "--target", "x86", "--cpu-backends", "planned",
                         "--tuning-db", str(tmp_path / "db"), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"error: the timing cache {tmp_path / 'db' / 'timing.json'}: not a regular file (a FIFO)" in err, err
    assert "hint: the timing cache only saves measuring again: remove the file" in err
    assert not (tmp_path / "out" / "bundle").exists()
