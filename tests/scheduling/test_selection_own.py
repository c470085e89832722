"""A quantized TFLite model whose whole graph is one CPU span (scheduling/selection.py, `OWN`): the file as given is
a candidate, and the span's candidates are checked and gated against LiteRT running it, not against onnxruntime on
the QDQ graph the import made of it (another int8 arithmetic, which rounds near ties otherwise: a full-int8
MobileNetV2's onnxruntime and OpenVINO answers were 255 steps off its own on photographs).

The model is a small full-int8 classifier converted by TensorFlow; its inputs are photographs (scikit-image's) on
its int8 input grid. Choices are made by FAKE TIMERS (timings never go into tests); the candidates are real."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import onnx
import pytest
from PIL import Image

from edgesdk import backends, frontends
from edgesdk.backends import Backend
from edgesdk.config import load_target
from edgesdk.ir import model as irm
from edgesdk.runtime.manifest import TensorSpec
from edgesdk.scheduling import selection
from edgesdk.scheduling.plan import Plan, PlanSegment
from edgesdk.timing import TimingCache
from tests import model_zoo
from tests.frontends import tf_models
from tests.scheduling.test_selection import FOREIGN, _never_timed, _timer


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """The small conv net as a full-int8 TFLite file (int8 input and output), imported as the import stage does."""
    import tensorflow as tf

    out = tmp_path_factory.mktemp("own-tflite")
    converter = tf.lite.TFLiteConverter.from_keras_model(tf_models.conv_net())
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = tf_models.representative(tf_models.IMAGE)
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    converter.inference_input_type = converter.inference_output_type = tf.int8
    source = out / "net_int8.tflite"
    source.write_bytes(converter.convert())
    model, _ = frontends.load(source, out)
    for value in (*model.graph.input, *model.graph.output):  # the batch fixed at 1, as the import stage fixes it
        value.type.tensor_type.shape.dim[0].dim_value = 1
    return source, irm.infer_shapes(model)


def _photos(source, n: int = 12) -> list[dict]:
    """Crops of scikit-image's photographs at the model's 16x16, on its int8 input grid."""
    from ai_edge_litert.interpreter import Interpreter

    scale, zero = Interpreter(model_path=str(source)).get_input_details()[0]["quantization"]
    out = []
    for photo in model_zoo.photos()[:n]:
        small = np.asarray(Image.fromarray(photo).resize(tf_models.IMAGE[:2], Image.BILINEAR), np.float32) / 127.5 - 1
        out.append({"image": np.clip(np.round(small / scale) + zero, -128, 127).astype(np.int8)[None]})
    return out


def _whole_plan(model: onnx.ModelProto, backend: str = "onnxruntime") -> Plan:
    nodes = tuple(n.name for n in model.graph.node)
    seg = PlanSegment("s0", "cpu", backend, "segments/s0.onnx", nodes, ("image",), ("output_0",), 0.0, 0, 1.0)
    return Plan("x86", "latency", ("image",), ("output_0",), {}, (seg,), (("s0",),), (), {},
                {"latency_ms": 1.0, "sequential_ms": 1.0, "throughput_fps": 1.0}, {}, "", "", {}, {"cpu": len(nodes)}, ())


def _select(source, model, tmp_path, timer, allowed=("onnxruntime", "litert"), measurable=None, target="x86",
            log=lambda s: None, own=True):
    target, _ = load_target(target)
    plan = _whole_plan(model)
    index = {n.name: i for i, n in enumerate(model.graph.node)}
    cut = lambda s: irm.extract_segment(model, [index[n] for n in s.nodes], list(s.inputs), list(s.outputs))  # noqa: E731
    return selection.select(plan, model, cut, target, _photos(source), allowed=allowed,
                            tuning_db=tmp_path / "db" / "cpu", cache=TimingCache(tmp_path / "db" / "timing.json"),
                            measurable=measurable, host="test host", log=log, timer=timer,
                            own=source if own else None)


def test_the_whole_model_span_ships_the_file_as_given_where_it_is_fastest(quantized, tmp_path):
    source, model = quantized
    logged: list[str] = []
    got = _select(source, model, tmp_path, _timer({"planned": 3.0, "litert-own": 1.0}),
                  log=logged.append)
    rec = got.record
    assert rec["reference"] == "the imported TFLite file on LiteRT (the model's own int8 arithmetic)"
    (span,) = rec["spans"]
    assert span["chosen"] == "litert-own", span
    own = span["candidates"]["litert-own"]
    assert own["gate"]["cosine"] == pytest.approx(1.0, abs=1e-6) and own["gate"]["top1"] == 1.0, own
    assert own["gate"]["samples"] == 3  # the held-out quarter of 12 photographs
    # LiteRT's fp32 lowering does not take the QDQ graph: a candidate left out with why
    assert span["candidates"]["litert"]["skipped"].startswith("cannot lower"), span
    # every other candidate was held to the file: agreed within a step and gated, or refused saying against what
    c = span["candidates"]["planned"]  # the schedule's onnxruntime segment
    assert "gate" in c or "LiteRT on the model's own file" in c["skipped"] or "own int8" in c["skipped"], c
    (seg,) = got.plan.segments
    assert (seg.backend, seg.nodes, seg.inputs, seg.outputs) == \
        ("litert-own", tuple(n.name for n in model.graph.node), ("image",), ("output_0",))
    # what the package stage compiles: the file itself, its tensors the graph's (int8 in, int8 out)
    manifest = selection.build(selection.Candidate("litert-own", got.plan.segments), got.models,
                               load_target("x86")[0], tmp_path / "bundle", tmp_path / "db" / "cpu", source=source)
    (s,) = manifest.segments
    assert (tmp_path / "bundle" / s.artifact).read_bytes() == source.read_bytes()
    assert s.backend == "tflite" and s.inputs == (TensorSpec("image", (1, 16, 16, 3), "int8", key="image"),)
    assert any("the model's own TFLite file is the reference" in line for line in logged), logged


def test_another_candidate_that_answers_as_the_file_does_ships_where_it_is_faster(quantized, tmp_path):
    """onnxruntime on this small net's QDQ graph rounds as LiteRT does (here, bit for bit; another CPU's int8
    kernels may move a step): held to the file, it passes the gate, and it wins."""
    source, model = quantized
    got = _select(source, model, tmp_path, _timer({"planned": 1.0, "litert-own": 3.0}))
    (span,) = got.record["spans"]
    assert span["chosen"] == "planned", span
    gate = span["candidates"]["planned"]["gate"]
    assert gate["cosine"] >= selection.GATE_COSINE and gate["top1"] >= selection.GATE_TOP1 and gate["samples"] == 3
    assert got.plan.segments[0].backend == "onnxruntime"


def compile_negated_int8(job):
    """A TEST DOUBLE backend: onnxruntime on the segment, its int8 output negated (fast and wrong)."""
    from tests.scheduling.test_selection import compile_negated

    return compile_negated(job)


def test_a_candidate_off_the_files_answer_is_never_chosen_however_fast(quantized, tmp_path):
    source, model = quantized
    negated = Backend("negated", runner="onnxruntime", rank=9, runtime_dists=("onnxruntime",),
                      compiler=f"{__name__}:compile_negated_int8", lowering="edgesdk.backends.onnxruntime:lowering_reason")
    with backends.registered(negated):
        got = _select(source, model, tmp_path, _timer({"planned": 3.0, "negated": 0.1, "litert-own": 5.0}),
                      allowed=("onnxruntime", "litert", "negated"))
    (span,) = got.record["spans"]
    assert span["candidates"]["negated"]["skipped"].startswith(
        "its output_0 differs from LiteRT on the model's own file by"), span
    assert span["chosen"] != "negated"


def test_without_the_file_the_span_is_checked_against_onnxruntime_and_has_no_own_candidate(quantized, tmp_path):
    source, model = quantized
    got = _select(source, model, tmp_path, _timer({"planned": 3.0}), own=False)
    (span,) = got.record["spans"]
    assert "reference" not in got.record and "litert-own" not in span["candidates"], span


def test_a_span_that_is_not_the_whole_model_has_no_own_candidate(quantized):
    source, model = quantized
    plan = _whole_plan(model)
    first = model.graph.node[0]
    part = PlanSegment("s0", "cpu", "onnxruntime", "segments/s0.onnx", (first.name,), ("image",), (first.output[0],),
                       0.0, 0, 1.0)
    cut = dataclasses.replace(plan, segments=(part,), outputs=(first.output[0],))
    cands, skipped = selection.candidates(cut, (0, 1), model, ["litert"], source)
    assert "litert-own" not in {c.name for c in cands}
    assert skipped["litert-own"].startswith(f"the span holds 1 of the model's {len(model.graph.node)} nodes"), skipped


def test_a_foreign_target_ships_the_file_as_given_by_policy(quantized, tmp_path):
    source, model = quantized
    got = _select(source, model, tmp_path, _never_timed, allowed=backends.cpu_candidates(), measurable=FOREIGN,
                  target="arm_2tpu")
    (span,) = got.record["spans"]
    assert span["chosen"] == "litert-own" and span["why"].startswith(
        "policy: the imported TFLite file as given (the model's own int8 arithmetic)"), span
    assert got.plan.segments[0].backend == "litert-own" and set(got.models) == {"s0"}


def test_the_gate_judges_int8_codes_as_the_values_they_stand_for():
    """Codes of an int8 softmax over 1,000 classes (zero point -128): a candidate whose top class differs on every
    sample keeps a cosine over 0.99 on the raw codes (their common offset); decoded, the probabilities share
    nothing."""
    def codes(top: int, value: int) -> np.ndarray:
        out = np.full((1, 1000), -128, np.int8)
        out[0, top] = value
        return out

    class Handle:  # A TEST DOUBLE for an opened candidate: its outputs given
        inputs = (TensorSpec("x", (1, 2), "float32"),)
        outputs = (TensorSpec("p", (1, 1000), "int8"),)

        def run(self, feeds):
            return {"p": codes(5, 90)}

    decode = functools.partial(selection._decoded, grids={"p": (1 / 256, -128)})
    raw = [{"x": np.zeros((1, 2), np.float32), "p": codes(7, 100)} for _ in range(4)]
    with pytest.raises(ValueError, match="top-1 agrees with the file on 0%"):
        selection.gate(Handle(), raw, ["p"], against="the file")  # the cosine passed: only top-1 refuses
    held = [{**r, "p": decode(r)["p"]} for r in raw]
    with pytest.raises(ValueError, match="cosine similarity to the model's own int8 is 0.0000"):
        selection.gate(Handle(), held, ["p"], decode=decode, against="the model's own int8")
