"""The accuracy probe (bundling/probe.py) on a real build's compress stage: the YOLOv8-style head of
tests/yolo_head.py for arm_2tpu, calibrated min-max on photographs, whose class scores miss the gate in int8
(its last Concat gives them the boxes' step); with its Edge TPU segment in float they meet it. And the
shortfall measures the probe ranks by."""

from __future__ import annotations

import json

import numpy as np

from edgesdk.bundling import probe
from edgesdk.compression import tasks
from edgesdk.compression.accuracy import Gate, views
from edgesdk.config import load_target
from edgesdk.ir import model as irm
from edgesdk.ir.calibration import load_calibration
from edgesdk.pipeline import BuildOptions, build, stage_dir
from edgesdk.scheduling.plan import Plan
from tests import yolo_head


def test_the_probe_finds_the_segment_whose_float_version_meets_the_gate(tmp_path):
    path, calib = yolo_head.written_with_photos(tmp_path)
    options = BuildOptions(model=path, target="arm_2tpu", out=tmp_path / "out", calib=calib, calib_samples=12,
                           calib_method="minmax", calib_preprocess=yolo_head.PHOTOS_PREPROCESS, until="compress")
    build(options)
    scheduled, compressed = stage_dir(options.out, "schedule"), stage_dir(options.out, "compress")
    plan = Plan.load(scheduled)
    entries = json.loads((compressed / "compress.json").read_text())["segments"]
    io = json.loads((stage_dir(options.out, "import") / "import.json").read_text())
    samples, _ = load_calibration(options, io["inputs"])
    parts = views(irm.read(stage_dir(options.out, "import") / "model.onnx"))
    judge = probe.parts_judge(parts, Gate.of(load_target("arm_2tpu")[0].accuracy))
    said = []
    got = probe.probe(plan, scheduled, compressed, entries, samples, judge, "the gate", said.append)
    on_tpu = [s.id for s in plan.segments if s.device.startswith("edgetpu") and s.id in entries]
    assert got["samples"] == probe.PROBE_SAMPLES and got["measure"] == "the gate"
    assert not got["int8"]["met"] and got["int8"]["shortfall"] > 0.5, got["int8"]  # mean error 95% > 10%
    assert "output0[:, 4:6] (scores): mean error" in got["int8"]["said"]
    # each alone, the first k and the last k
    n = len(on_tpu)
    assert sorted(tuple(r["segments"]) for r in got["float"]) == sorted(
        {(s,) for s in on_tpu} | {tuple(on_tpu[:k]) for k in range(2, n + 1)} | {tuple(on_tpu[-k:]) for k in range(2, n)})
    best = got["float"][0]
    assert best["met"] and best["shortfall"] == 0 and best["said"] == "within the gate"
    assert best["nodes"] == [x for s in plan.segments if s.id in best["segments"] for x in s.nodes]
    met = [r for r in got["float"] if r["met"]]
    assert len(best["nodes"]) == min(len(r["nodes"]) for r in met)  # of those that meet it, the fewest nodes
    assert said == [f"package: accuracy probe: {len(got['float'])} set(s) of the {n} int8 segment(s) on accelerators "
                    f"in float in turn, on {probe.PROBE_SAMPLES} sample(s)"]


def test_a_tasks_shortfall_is_how_far_it_falls_below_its_goal():
    fp32 = [{"y": np.array([[0.1, 0.9], [0.8, 0.2]])}]
    same = tasks.measure_task("classification", fp32, fp32)
    assert same["verdict"]["met"] and tasks.shortfall(same) == 0.0
    flipped = tasks.measure_task("classification", fp32, [{"y": np.array([[0.9, 0.1], [0.8, 0.2]])}])
    assert not flipped["verdict"]["met"]
    assert tasks.shortfall(flipped) == tasks.GOALS["classification"] - flipped["top1_agreement"] > 0
    detections = {"task": "detection", "against": "fp32", "kept": 18, "detections_fp32": 20, "false": 1}
    assert tasks.shortfall(detections, 0.95) == (0.95 - 0.9) + 1 / 20
    assert tasks.shortfall({**detections, "kept": 20, "false": 0}, 0.95) == 0.0
