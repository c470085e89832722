"""A full-int8 TFLite model built for x86, end to end: the tune stage offers the file as given (`litert-own`), and
where it is chosen the package stage ships the very file, whose bundle answers bit for bit as LiteRT on the file
does, passes the accuracy gate against the model's own int8 and its self-test. The choice is made by a FAKE TIMER
(timings never go into tests); everything else is real. Inputs: scikit-image's photographs on the model's int8
input grid."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from edgesdk.backends.tflite import own
from edgesdk.pipeline import BuildOptions, build
from edgesdk.runtime import BundleModel
from edgesdk.scheduling import selection
from edgesdk.verify import verify
from tests.scheduling.test_selection import _timer
from tests.scheduling.test_selection_own import _photos, quantized  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow  # a model built through every stage


@pytest.fixture(scope="module")
def built(quantized, tmp_path_factory):  # noqa: F811
    source, _ = quantized
    tmp = tmp_path_factory.mktemp("own-e2e")
    calib = tmp / "calib"
    calib.mkdir()
    photos = _photos(source)
    for k, sample in enumerate(photos):
        np.savez(calib / f"{k:03}.npz", **sample)
    timer = _timer({"planned": 3.0, "onnxruntime": 2.0, "litert-own": 1.0})
    with pytest.MonkeyPatch.context() as patch:  # the FAKE TIMER, where the tune stage calls the selection
        patch.setattr(selection, "select", functools.partial(selection.select, timer=timer))
        result = build(BuildOptions(model=source, target="x86", out=tmp / "out", tuning_db=tmp / "db", calib=calib,
                                    cpu_backends=("onnxruntime", "litert")))
    return source, photos, result


def test_the_file_is_shipped_as_given_and_answers_as_it_does(built):
    source, photos, result = built
    plan = json.loads((result.bundle / "plan.json").read_text())
    (span,) = plan["cpu_selection"]["spans"]
    assert span["chosen"] == "litert-own" and plan["cpu_selection"]["reference"].startswith("the imported TFLite"), span
    manifest = json.loads((result.bundle / "manifest.json").read_text())
    (seg,) = manifest["segments"]
    assert seg["backend"] == "tflite" and (result.bundle / seg["artifact"]).read_bytes() == source.read_bytes()
    model = BundleModel(result.bundle, log=lambda s: None)
    want = own.outputs(source, photos, ["output_0"])
    for sample, w in zip(photos, want):
        got = model.run(sample)["output_0"]
        assert got.dtype == np.int8 and np.array_equal(got, w["output_0"])
    gate = manifest["accuracy"]
    assert gate["gate"]["passed"] and gate["reference"].startswith("LiteRT"), gate
    assert verify(result.bundle).selftest == "passed"
