"""End to end on arm_2tpu: a per-frame CNN (model_zoo.frame_cnn: four frames through one set of weights,
a CPU-only Slice between them) becomes four Edge TPU segments that compute the same thing; they ship as
one artifact per Edge TPU, each TPU's models co-compiled in one `edgetpu_compiler` call (a TEST DOUBLE:
the real compiler cannot be installed here) in the plan's cache priority, run through one interpreter per
TPU, and equal onnxruntime on the float model within the int8 tolerance; under qemu the bundle's
self-test (golden, per segment, and a pipelined stream) passes on the aarch64 runtime."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edgesdk.backends import qemu
from edgesdk.runtime import BundleModel, Manifest
from edgesdk.verify import verify
from tests import model_zoo
from tests.edgetpu_double import install_co_compiling_double

pytestmark = pytest.mark.slow  # a per-frame CNN built for arm_2tpu and run under qemu


@pytest.fixture(scope="module")
def frames_bundle(tmp_path_factory, tuning_db):
    from tests.conftest import _build

    root = tmp_path_factory.mktemp("frames")
    with pytest.MonkeyPatch.context() as mp:
        install_co_compiling_double(root / "bin", mp)
        result = _build(root / "out", model_zoo.frame_cnn(), "arm_2tpu", tuning_db=tuning_db)
    return result, (root / "bin" / "calls.txt").read_text().split("\n")


def test_the_frames_are_one_artifact_per_tpu_co_compiled_in_cache_priority(frames_bundle):
    result, calls = frames_bundle
    plan = json.loads((result.bundle / "plan.json").read_text())
    tpu = [s for s in plan["segments"] if s["device"].startswith("edgetpu")]
    frames = [s for s in tpu if len(s["nodes"]) > 2]                 # the per-frame CNNs
    assert len(frames) == 4 and {s["device"] for s in frames} == {"edgetpu:0", "edgetpu:1"}, tpu
    first = frames[0]["id"]
    assert [s.get("same_as", "") for s in frames] == ["", first, first, first]

    m = Manifest.load(result.bundle)
    by_id = {s.id: s for s in m.segments}
    for device in ("edgetpu:0", "edgetpu:1"):
        mine = [by_id[s["id"]] for s in frames if s["device"] == device]
        assert len({s.artifact for s in mine}) == 1 and mine[0].artifact.endswith("_edgetpu.tflite"), mine
    arts = {by_id[s["id"]].artifact for s in frames}
    assert len(arts) == 2                                            # one per TPU, not one per frame
    # each frame segment keeps its own tensor names over the shared model's signature keys
    assert len({s.inputs[0].name for s in (by_id[f["id"]] for f in frames)}) == 4

    # one compiler call per TPU, each model once, in the plan's cache priority order
    # (paths as the package stage gave them, in its temporary directory: relative to the bundle here)
    made = [[path.split("/bundle/", 1)[1] for path in c.split()] for c in calls if c.strip()]
    assert len(made) == 2 and sorted(len(c) for c in made) == sorted(
        len({by_id[i].artifact for i in ids}) for ids in m.edgetpu["co_compiled"].values())
    for device, ids in m.edgetpu["co_compiled"].items():
        order = plan["caches"]["instances"][device]["compile_order"]
        assert ids == order
        models = list(dict.fromkeys(by_id[i].fallback_artifact for i in ids))
        assert models in made, (made, models)
    assert m.edgetpu["edgetpu_compiled"] is True
    # the double caches 1 MiB of each call's first model and streams all of every later one: the capacity it
    # had is recorded per TPU, and a later model's segments are priced again as streaming every weight
    for device, cache in m.edgetpu["caches"].items():
        assert cache["capacity_bytes"] == 2**20 + 2 * 2**10 and cache["cached_bytes"] == 2**20
    later = {i for ids in m.edgetpu["co_compiled"].values() for i in ids
             if by_id[i].fallback_artifact != by_id[ids[0]].fallback_artifact}
    corrected = {c["segment"]: c for c in m.edgetpu.get("cache_corrections", [])}
    assert later and set(corrected) <= later
    for sid, c in corrected.items():
        assert c["streamed_share"] == 1.0 and c["predicted_ms_after"] > c["predicted_ms_before"]
        assert by_id[sid].predicted_ms == c["predicted_ms_after"]


def test_the_shared_interpreter_gives_onnxruntimes_answer(frames_bundle):
    result, _ = frames_bundle
    model = BundleModel(result.bundle, log=lambda s: None)
    runners = {seg.id: r for seg, r in model.runners}
    m = model.manifest
    tpu = [s for s in m.segments if s.device == "edgetpu:0" and s.nodes > 2]
    assert len(tpu) == 2 and runners[tpu[0].id]._shared is runners[tpu[1].id]._shared
    # a frame segment run on the other's input under its own names gives the other's answer
    x = np.random.default_rng(0).uniform(-1, 1, (1, 3, 32, 32)).astype(np.float32)
    a, b = (runners[t.id].run({t.inputs[0].name: x})[t.outputs[0].name] for t in tpu)
    np.testing.assert_array_equal(a, b)
    # onnxruntime on the float model, with each frame's features as extra outputs
    graph = onnx.load(str(model_zoo.frame_cnn()))
    features = [f"f{k}/features" for k in range(4)]
    graph.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in features)
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    got, want = [], []
    for _ in range(4):
        clip = rng.uniform(-1, 1, (1, 4, 3, 32, 32)).astype(np.float32)
        got.append(model.run({"clip": clip}, extra_outputs=features))
        want.append(dict(zip(["logits", *features], session.run(None, {"clip": clip}))))
    # every frame through its TPU's shared int8 model (calibrated on all four frames' synthetic inputs):
    # measured 0.3-4.1 % of the features' scale, the worst a value beyond the calibrated range
    for name in features:
        g, w = np.stack([x[name] for x in got]), np.stack([x[name] for x in want])
        assert np.abs(g - w).max() <= 0.06 * np.abs(w).max(), name
    # the int8 classifier over 128 features of random weights: measured 1.7-7.7 % of a sample's largest
    # logit, 5 % of the largest over the samples
    g, w = np.stack([x["logits"] for x in got]), np.stack([x["logits"] for x in want])
    assert np.abs(g - w).max() <= 0.1 * np.abs(w).max()


@pytest.mark.qemu
def test_the_shared_segments_bundle_passes_its_self_test_under_qemu(frames_bundle):
    if qemu.find_rootfs() is None:
        pytest.fail("the arm64 root file system is missing: `make rootfs` prepares it (make test does)")
    result, _ = frames_bundle
    report = verify(result.bundle)
    assert report.selftest == "passed", (report.detail, report.notes, report.segments)
    assert all(s["passed"] for s in report.segments) and len(report.segments) == len(Manifest.load(result.bundle).segments)
    assert report.stream["passed"] and not report.stream["mismatched_frames"]
