"""Reduced precision per CPU span (`--cpu-precision bf16|int8|auto`, scheduling/selection.py): which precisions
a target's CPU is offered, and OpenVINO's bfloat16 candidate built, gated against fp32 on held-out photographs
and chosen only when it passes. FAKE TIMERS decide which candidate is fastest (timings never go into tests);
the candidates, their runs and the gate are real."""

from __future__ import annotations

import json
from contextlib import closing
from dataclasses import replace

import numpy as np
import onnx
import pytest
from PIL import Image

from edgesdk.bundling import golden
from edgesdk.config import load_target
from edgesdk.ir import model as irm
from edgesdk.runtime.executor import BundleModel
from edgesdk.scheduling import selection
from edgesdk.timing import InProcess, TimingCache
from tests import model_zoo
from tests.scheduling.test_selection import _plan, _segment_models, _timer

ROOT = model_zoo.ROOT


def _target(tmp_path, mcpu: str, arch: str = "x86"):
    """targets/x86.yaml built for another CPU model."""
    text = (ROOT / "targets" / f"{arch}.yaml").read_text().replace("mcpu: haswell", f"mcpu: {mcpu}")
    path = tmp_path / f"{arch}-{mcpu}.yaml"
    path.write_text(text)
    return load_target(path)[0]


def test_bf16_is_offered_only_for_a_target_cpu_that_computes_in_it(tmp_path):
    haswell, spr = load_target("x86")[0], _target(tmp_path, "sapphirerapids")
    assert selection.reduced_precisions("fp32", spr) == ((), {})
    assert selection.reduced_precisions("bf16", spr) == (("bf16",), {})
    assert selection.reduced_precisions("fp16", spr) == (("fp16",), {})
    assert selection.reduced_precisions("auto", spr) == (("bf16", "fp16", "int8"), {})
    kept, lacking = selection.reduced_precisions("auto", haswell)  # the shipped x86 target is AVX2
    assert kept == ("int8",) and lacking["bf16"].startswith("the target's CPU (haswell) has neither avx512bf16 nor amx-bf16")
    assert lacking["fp16"].startswith("the target's CPU (haswell) has no avx512fp16")
    zen4 = _target(tmp_path, "znver4")  # bfloat16 in AVX-512, no float16 arithmetic
    assert selection.reduced_precisions("auto", zen4)[0] == ("bf16", "int8")
    kept, lacking = selection.reduced_precisions("bf16", load_target("arm_2tpu")[0])
    assert kept == () and "x86-64" in lacking["bf16"]
    assert selection.reduced_precisions("int8", haswell) == (("int8",), {})  # int8 runs on every CPU


def _mobilenet_photos():
    """MobileNetV2 (0.35, 96x96) and scikit-image's photographs as its inputs, [-1, 1] as it takes them."""
    model = irm.infer_shapes(onnx.load(model_zoo.mobilenet_v2(96, 0.35)))
    name = model.graph.input[0].name
    samples = [{name: (np.asarray(Image.fromarray(p).resize((96, 96), Image.BILINEAR), np.float32)[None] / 127.5 - 1)}
               for p in model_zoo.photos()]
    nodes = [irm.node_name(n, i) for i, n in enumerate(model.graph.node)]
    out = model.graph.output[0].name
    plan = replace(_plan(model, [("onnxruntime", nodes, (name,), (out,))]), inputs=(name,), outputs=(out,))
    return model, plan, samples


def _select(tmp_path, model, plan, samples, timer, precision="bf16", mcpu="sapphirerapids", lines=None):
    return selection.select(plan, model, _segment_models(model), _target(tmp_path, mcpu), samples,
                            allowed=["openvino"], tuning_db=tmp_path / "db" / "cpu",
                            cache=TimingCache(tmp_path / "db" / "timing.json"), measurable=None, host="test host",
                            log=(lines.append if lines is not None else lambda line: None), timer=timer,
                            precision=precision)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_16_bit_float_candidate_is_gated_on_held_out_photographs_and_chosen_when_fastest(tmp_path, precision):
    model, plan, samples = _mobilenet_photos()
    lines: list[str] = []
    variant = f"openvino-{precision}"
    got = _select(tmp_path, model, plan, samples, _timer({"planned": 0.9, "openvino": 0.5, variant: 0.2}),
                  precision=precision, lines=lines)
    assert got.record["precision"] == precision and got.record["candidates"] == ["openvino", variant]
    assert got.record["gate"]["held_out_samples"] == len(samples) // 4
    (span,) = got.record["spans"]
    gate = span["candidates"][variant]["gate"]
    assert gate["cosine"] >= selection.GATE_COSINE and gate["top1"] >= selection.GATE_TOP1, gate
    assert "gate" not in span["candidates"]["openvino"]  # float32: checked within fp32's tolerance instead
    assert span["chosen"] == variant and got.plan.segments[0].backend == variant
    assert any(f"{variant}, fastest measured: 0.200 ms" in line for line in lines), lines


def test_a_bf16_candidate_under_the_gate_is_never_chosen_however_fast(tmp_path, monkeypatch):
    monkeypatch.setattr(selection, "GATE_COSINE", 1.01)  # a cosine no computation reaches
    model, plan, samples = _mobilenet_photos()
    timer = _timer({"planned": 0.9, "openvino": 0.5, "openvino-bf16": 0.01})
    (span,) = _select(tmp_path, model, plan, samples, timer).record["spans"]
    assert span["candidates"]["openvino-bf16"]["skipped"].startswith("accuracy gate: ")
    assert span["chosen"] == "openvino" and "openvino-bf16" not in timer.asked


def test_a_target_cpu_without_bf16_gets_no_bf16_candidate_and_the_record_says_why(tmp_path):
    model, plan, samples = _mobilenet_photos()
    lines: list[str] = []
    got = _select(tmp_path, model, plan, samples, _timer({"planned": 0.9, "openvino": 0.5}), mcpu="haswell",
                  lines=lines)
    assert got.record["candidates"] == ["openvino"] and "openvino-bf16" not in got.record["spans"][0]["candidates"]
    assert "haswell" in got.record["precisions_not_offered"]["bf16"]
    assert any(line.startswith("tune: no bf16 candidate: the target's CPU (haswell)") for line in lines), lines


def test_a_bf16_segments_self_test_allows_a_multiple_of_its_distance_from_float32(tmp_path):
    """Another CPU rounds bfloat16 otherwise: the golden tolerance of a bf16 segment's output is FLOAT16_MARGIN
    times how far it is from the same segment in float32 on the golden inputs, never less than float's."""
    model, plan, samples = _mobilenet_photos()
    (seg,) = plan.segments
    whole = replace(seg, backend="openvino-bf16")
    cand = selection.Candidate("openvino-bf16", (whole,))
    selection.build(cand, {seg.id: model}, _target(tmp_path, "sapphirerapids"), tmp_path / "bundle", tmp_path / "db")
    host = BundleModel(tmp_path / "bundle", log=lambda line: None)
    (_, runner), = host.runners
    assert runner.precision == "bf16"
    name, out = plan.inputs[0], plan.outputs[0]
    feeds = {name: samples[0][name]}
    ran = host.run(feeds)
    float32 = runner.float32_outputs(feeds)[out]
    tolerance = golden.tolerances(host, host.manifest, {**feeds, **ran})["tensors"][out]
    distance = float(np.max(np.abs(ran[out].astype(np.float64) - float32)))
    assert tolerance["abs"] == pytest.approx(max(golden.FLOAT16_MARGIN * distance,
                                                 golden.FLOAT_RTOL * float(np.max(np.abs(ran[out]))))), tolerance
    assert tolerance["rule"] == f"{golden.FLOAT16_MARGIN:g}x its distance from float32" and "bfloat16" in tolerance["reason"]
    # the float32 candidate's own run agrees with float32 within fp32's tolerance: the distance is bfloat16's
    fp32 = selection.Candidate("openvino", (replace(seg, backend="openvino"),))
    selection.build(fp32, {seg.id: model}, _target(tmp_path, "sapphirerapids"), tmp_path / "fp32", tmp_path / "db")
    with closing(InProcess().open(tmp_path / "fp32")) as handle:
        plain = handle.run(feeds)[out]
    assert np.max(np.abs(plain - float32)) <= 1e-4 * np.max(np.abs(float32))


@pytest.mark.slow
@pytest.mark.parametrize("host_cpu", [None, "haswell"], ids=["this-host", "forced-avx2"])
def test_a_build_for_this_hosts_cpu_with_bf16_ships_what_the_gate_admitted(tmp_path, monkeypatch, host_cpu):
    """`edgesdk build --cpu-precision bf16` for a target built for this host (`mcpu: native`; or this host taken
    for an AVX2 Haswell, EDGESDK_HOST_CPU), calibrated on photographs: where the CPU computes in bfloat16,
    OpenVINO's bf16 candidate is measured and gated, and a bf16 bundle that ships is held to the target's
    accuracy gate and passes its self-test; where it does not, the record says why no bf16 candidate was
    offered and the bundle is float32 throughout."""
    from edgesdk.backends.tvm import HOST_CPU_ENV, target_features

    if host_cpu:
        monkeypatch.setenv(HOST_CPU_ENV, host_cpu)
    from edgesdk.pipeline import BuildOptions, build
    from edgesdk.runtime.manifest import Manifest
    from edgesdk.verify import verify

    model, plan, samples = _mobilenet_photos()
    calib = tmp_path / "calib"
    calib.mkdir()
    for k, s in enumerate(samples):
        np.savez(calib / f"{k}.npz", **s)
    target = tmp_path / "x86-native.yaml"
    target.write_text((ROOT / "targets" / "x86.yaml").read_text().replace("mcpu: haswell", "mcpu: native"))
    result = build(BuildOptions(model=model_zoo.mobilenet_v2(96, 0.35), target=str(target), out=tmp_path / "out",
                                calib=calib, cpu_precision="bf16", cpu_backends=("openvino",),
                                tuning_db=tmp_path / "db"))
    manifest = Manifest.load(result.bundle)
    sel = manifest.tuning["cpu_selection"]
    assert sel["precision"] == "bf16"
    assert sel["target_cpu"]["mcpu"] == (host_cpu or sel["target_cpu"]["mcpu"])  # a build for this host says so
    assert ("avx512bf16" in sel["target_cpu"]["features"]) == ("avx512bf16" in target_features({"kind": "llvm", "mcpu": "native"}))
    if {"avx512bf16", "amx-bf16"} & target_features({"kind": "llvm", "mcpu": "native"}):
        (span,) = sel["spans"]
        bf16 = span["candidates"]["openvino-bf16"]
        assert "gate" in bf16 or bf16["skipped"].startswith("accuracy gate"), bf16
        if span["chosen"] == "openvino-bf16":
            assert manifest.accuracy["gate"]["passed"]  # judged by the target's gate, not fp32's tolerance
            assert "bfloat16" in manifest.golden["outputs"][plan.outputs[0]]["reason"]
    else:
        assert "openvino-bf16" not in sel["candidates"] and "bf16" in sel["precisions_not_offered"]
        assert all(s["backend"] != "openvino-bf16" for s in json.loads((result.bundle / "plan.json").read_text())["segments"])
    assert verify(result.bundle).selftest == "passed"
