"""A default x86 build measures each CPU span's backends, end to end, on a real pretrained
model (PP-OCR's text direction classifier). What is asserted holds whatever the timings were: a
choice among the candidates that built, the fastest of them by the plan's own record, a bundle that
agrees with onnxruntime and passes its self-test, and a rebuild that replays the measurements."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import onnxruntime as ort
import pytest

from edgesdk.pipeline import BuildOptions, build
from edgesdk.runtime import BundleModel
from edgesdk.runtime.manifest import Manifest
from edgesdk.verify import verify
from tests import model_zoo
from tests.numeric import assert_close

pytestmark = pytest.mark.slow  # a real model built and its CPU backends measured

SHAPE = {"x": (1, 3, 48, 192)}


@pytest.fixture(scope="module")
def selected(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cpu-select")
    options = BuildOptions(model=model_zoo.ppocr_cls(), target="x86", out=tmp / "a", input_shapes=SHAPE,
                           tuning_db=tmp / "db", calib_samples=4)
    return tmp, options, build(options)


def test_every_candidate_is_measured_and_the_fastest_is_shipped(selected):
    _, _, result = selected
    plan = json.loads((result.bundle / "plan.json").read_text())
    sel = plan["cpu_selection"]
    assert sel["measured_on"] and sel["candidates"] == ["tvm", "onnxruntime", "litert", "openvino"]
    (span,) = sel["spans"]  # one CPU span: the whole classifier
    times = {name: c["ms"] for name, c in span["candidates"].items() if "ms" in c}
    assert "planned" in times and "onnxruntime" in times and len(times) >= 2, span
    assert times[span["chosen"]] == min(times.values())
    (seg,) = plan["segments"]
    assert seg["predicted_ms"] == times[span["chosen"]]
    chosen_backend = "tvm" if span["chosen"] == "planned" else span["chosen"]
    assert seg["backend"] == chosen_backend
    manifest = Manifest.load(result.bundle)
    assert manifest.tuning["cpu_selection"] == sel
    assert manifest.segments[0].backend == {"litert": "tflite"}.get(chosen_backend, chosen_backend)


def test_the_bundle_agrees_with_onnxruntime_and_passes_its_self_test(selected):
    _, _, result = selected
    x = np.random.default_rng(3).uniform(-1, 1, SHAPE["x"]).astype(np.float32)
    got = BundleModel(result.bundle, log=lambda s: None).run({"x": x})
    sess = ort.InferenceSession(str(model_zoo.ppocr_cls()), providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x})))
    for name, w in want.items():
        assert_close(got[name], w, name)
    assert verify(result.bundle).selftest == "passed"


def test_a_rebuild_replays_the_measurements_byte_for_byte(selected):
    tmp, options, result = selected
    before = (options.out / "bundle.tar.gz").read_bytes()
    again = build(options)
    assert [s.cached for s in again.stages] == [True] * 6  # its own measurements do not make a miss
    # elsewhere, from a copy of the database: only the winner is timed again (once), and the same bytes ship
    # unless that timing found it behind the runner-up beyond the margin (then every candidate was timed again,
    # and the record says why)
    shutil.copytree(tmp / "db", tmp / "db-copy")
    other = build(BuildOptions(model=options.model, target="x86", out=tmp / "b", input_shapes=SHAPE,
                               tuning_db=tmp / "db-copy", calib_samples=4))
    (span,) = other.stages[3].record["cpu_selection"]["spans"]
    if "replay_refuted" in span:
        refuted = span["replay_refuted"]
        assert refuted["now_ms"] is None or refuted["now_ms"] > refuted["runner_up_ms"] * (1 + refuted["margin"])
    else:
        assert other.stages[3].record["cpu_selection"] == result.stages[3].record["cpu_selection"]
        assert (tmp / "b" / "bundle.tar.gz").read_bytes() == before


def test_inspect_shows_the_measurements(selected):
    from edgesdk.report.text import inspect_bundle

    _, _, result = selected
    text = inspect_bundle(Manifest.load(result.bundle), result.bundle)
    # a lead within the rounds' noise says so beside the choice
    assert "cpu backends measured on" in text and re.search(r" chosen( \(within the measured noise: [^)]+\))?; ", text)
