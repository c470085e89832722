"""The compress stage keeps each int8 conversion for the next plan of the same output directory
(stages/compress/reuse.py): the accuracy remedy's next round converts only the segments it changed. A kept
conversion must be exactly the one converting again would write, under the segment's own id; anything
the conversion reads that differs must convert again."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk.backends.registry import QuantizeJob
from edgesdk.backends.tflite.segment import quantize_segment
from edgesdk.ir import model as irm
from edgesdk.scheduling.plan import PlanSegment
from edgesdk.stages.compress import reuse
from tests import model_zoo


def _segment(folder, seg_id: str, device: str, weight_scale: float = 0.2):
    """A Conv + ReLU segment as the schedule writes one: each node naming its device."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((8, 3, 3, 3)) * weight_scale).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["y"], name="relu")], "segment",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])], [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    for node in model.graph.node:
        irm.set_meta(node, irm.DEVICE_KEY, device)
    path = folder / f"{seg_id}.onnx"
    irm.save(model, path)
    seg = PlanSegment(id=seg_id, device=device, backend="tflite", artifact=f"segments/{seg_id}.onnx",
                      nodes=("conv", "relu"), inputs=("x",), outputs=("y",), flops=0.0, param_bytes=w.nbytes,
                      predicted_ms=0.0)
    return seg, path


def _samples(model_file, scale: float = 1.0) -> list[dict]:
    """Crops of a photograph (scikit-image's astronaut), as a segment's inputs, with the float outputs."""
    import onnxruntime as ort

    photo = model_zoo.photos()[model_zoo.PHOTOS.index("astronaut.png")].astype(np.float32) / 127.5 - 1.0
    session = ort.InferenceSession(str(model_file))
    out = []
    for k in range(6):
        x = np.ascontiguousarray(photo[40 * k:40 * k + 16, 100:116].transpose(2, 0, 1)[None]) * scale
        out.append({"x": x, "y": session.run(None, {"x": x})[0]})
    return out


def _job(seg, model_file, samples, out_dir) -> QuantizeJob:
    out_dir.mkdir(parents=True, exist_ok=True)
    return QuantizeJob(segment=seg, model=irm.read(model_file), samples=samples, out_dir=out_dir, method="minmax",
                       percentile=99.99, log=lambda line: None)


def test_a_later_plan_reuses_a_conversion_exactly_and_converts_what_changed(tmp_path):
    plans = tmp_path / "schedule"
    plans.mkdir()
    first, first_file = _segment(plans, "s3", "edgetpu:1")
    # the next plan: the same segment, cut after a new CPU segment (another id), on the other Edge TPU
    again, again_file = _segment(plans, "s1", "edgetpu:0")
    samples = _samples(first_file)
    build_dir, said = tmp_path / ".build", []
    conversions = []

    def converting(job):
        def run():
            conversions.append(job.segment.id)
            return quantize_segment(job)
        return run

    kept = reuse.Kept(build_dir, sdk="code-1")
    round1 = _job(first, first_file, samples, tmp_path / "round1" / "segments")
    entry1 = kept.quantized(first, round1, first_file, converting(round1), said.append)
    kept.forget_unused()
    assert conversions == ["s3"] and entry1["artifact"] == "segments/s3.tflite"

    kept = reuse.Kept(build_dir, sdk="code-1")
    round2 = _job(again, again_file, samples, tmp_path / "round2" / "segments")
    entry2 = kept.quantized(again, round2, again_file, converting(round2), said.append)
    kept.forget_unused()
    assert conversions == ["s3"], "the same graph on the same samples was converted again"
    assert said[-1].startswith("compress: s1: 2 nodes: int8 as an earlier plan of this build converted the same graph")
    assert entry2["artifact"] == "segments/s1.tflite" and sorted(p.name for p in round2.out_dir.iterdir()) == ["s1.tflite"]
    # exactly what converting s1 itself writes and records
    fresh = _job(again, again_file, samples, tmp_path / "fresh" / "segments")
    assert json.loads(json.dumps(quantize_segment(fresh))) == entry2
    assert (fresh.out_dir / "s1.tflite").read_bytes() == (round2.out_dir / "s1.tflite").read_bytes()

    # what a conversion reads, changed: converted again, and the kept conversion nobody used is gone
    other_weights, other_file = _segment(tmp_path / "round2", "s1", "edgetpu:0", weight_scale=0.3)
    cases = [("weights", other_weights, other_file, samples, "code-1"),
             ("samples", again, again_file, _samples(again_file, scale=0.5), "code-1"),
             ("sdk", again, again_file, samples, "code-2")]
    for k, (why, seg, path, feeds, sdk) in enumerate(cases):
        kept = reuse.Kept(build_dir, sdk=sdk)
        job = _job(seg, path, feeds, tmp_path / why / "segments")
        kept.quantized(seg, job, path, converting(job), said.append)
        kept.forget_unused()
        assert len(conversions) == 2 + k, why
        assert len(list((build_dir / reuse.DIR).iterdir())) == 1, why

    # a kept file changed since is converted again, never copied into a bundle
    (kept_file,) = (build_dir / reuse.DIR).glob("*/files/*.tflite")
    kept_file.write_bytes(kept_file.read_bytes()[:-1] + b"x")
    kept = reuse.Kept(build_dir, sdk="code-2")
    job = _job(again, again_file, samples, tmp_path / "changed" / "segments")
    kept.quantized(again, job, again_file, converting(job), said.append)
    kept.forget_unused()
    assert len(conversions) == 5
    assert (job.out_dir / "s1.tflite").read_bytes() == (fresh.out_dir / "s1.tflite").read_bytes()

    # --from asks for the work anew
    kept = reuse.Kept(build_dir, sdk="code-2", enabled=False)
    job = _job(again, again_file, samples, tmp_path / "anew" / "segments")
    kept.quantized(again, job, again_file, converting(job), said.append)
    assert len(conversions) == 6


@pytest.mark.parametrize("field", ["method", "percentile"])
def test_the_options_of_a_conversion_are_part_of_what_is_kept(tmp_path, field):
    plans = tmp_path / "schedule"
    plans.mkdir()
    seg, path = _segment(plans, "s0", "edgetpu:0")
    samples = [{"x": np.zeros((1, 3, 16, 16), np.float32), "y": np.zeros((1, 8, 16, 16), np.float32)}]
    job = _job(seg, path, samples, tmp_path / "a" / "segments")
    changed = _job(seg, path, samples, tmp_path / "b" / "segments")
    changed = dataclasses.replace(changed, **{field: "percentile" if field == "method" else 99.0})
    keys = {reuse.Kept(tmp_path, "code")._digest(seg, j, path) for j in (job, changed)}
    assert len(keys) == 2
