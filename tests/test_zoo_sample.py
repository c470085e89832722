"""A sample of the zoo (benchmarks/zoo_models.py) in the suite: zoo models built for arm_2tpu and x86 exactly as
`make zoo` builds them (bench_zoo.cell: the command line a user runs, `edgesdk build MODEL --target T --calib
DIR`, then `edgesdk verify`, under qemu for aarch64) and held to what the zoo's fixes made true, for the classes
of failure no smaller test covers (the others are named at SAMPLE). The full matrix is `make zoo`, run before
a stage change lands (benchmarks/RESULTS.md, question `zoo`).

The models are made as the zoo makes them (random weights, real inputs: photo crops, English token ids) and
cached under .cache/zoo; their samples and bundles go to a temporary directory."""

from __future__ import annotations

import sys

import pytest

from tests.model_zoo import ROOT

sys.path[:0] = [str(ROOT / "benchmarks")]
import bench_zoo  # noqa: E402  (after the path above)

pytestmark = pytest.mark.slow

# (model, target) -> the failure class it stands for, and (arm_2tpu) the least share of its FLOPs on the Edge
# TPU. The suite's time keeps it to the cheapest build of each class; the zoo's other classes are tested on
# smaller models where they were fixed: external-data weights with rewrites (tests/test_large_model_build.py,
# tests/ir/test_large_models.py), a detection head on the Edge TPU (tests/test_detector_e2e.py: YOLOv8n for
# arm_2tpu), fp16-weight TFLite (tests/frontends/test_tensorflow.py), a softmax fp32 decides nothing on
# (tests/compression/test_accuracy.py, tests/bundling/test_accuracy_judge.py), a full-int8 TFLite
# (tests/legalization/test_quantized.py, tests/frontends/test_tensorflow.py; its quantized softmax judged as
# probabilities, tests/compression/test_accuracy.py; onnxruntime under qemu, tests/backends/test_qemu.py),
# EfficientNet's pool (tests/backends/test_tflite.py), a loss spread over many layers and a ViT's segment
# inputs (tests/bundling/test_culprit_search.py).
SAMPLE = {
    # the embeddings' Gather and the attention mask's arithmetic stay on the CPU: 2 % of the FLOPs
    ("hf-bert-mini", "arm_2tpu"): ("attention, token ids and a mask; dynamic input shapes fixed at build", 0.97),
    ("hf-bert-mini", "x86"): ("attention on the CPU backends; dynamic input shapes fixed at build", None),
    ("keras-mobilenet-v3-small", "arm_2tpu"): ("a Keras file; HardSwish, lowered for the Edge TPU", 0.99),
    ("face-landmark", "arm_2tpu"): ("a wheel's pretrained model; PReLU", 0.99),
    ("yolov8n", "x86"): ("a detection head with constant anchors; SiLU", None),
}

# the x86 bundle against the fp32 model it was built from: the build's own tolerance for float segments
X86_RELATIVE_ERROR = 1e-3


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:  # the samples and bundles go here, not to .cache/zoo-runs
        patch.setattr(bench_zoo, "WORK", tmp_path_factory.mktemp("zoo-runs"))
        patch.setattr(bench_zoo, "TIME_ROUNDS", 0)  # timings never go into tests
        yield bench_zoo.WORK


@pytest.mark.parametrize("name, target", list(SAMPLE), ids=[f"{n}-{t}" for n, t in SAMPLE])
def test_a_zoo_model_builds_verifies_and_keeps_fp32s_answers(work, name, target):
    if not (work / name / "calib").exists():
        bench_zoo.prepare(name)
    row = bench_zoo.cell(name, target)
    assert row["outcome"] == "ok", row
    agreement = row["agreement"]
    assert agreement["outputs"] and not agreement.get("unjudged"), agreement  # the gate judged every part
    if target == "x86":
        assert "timing" not in row
        for output, measured in agreement["outputs"].items():
            assert measured["max_rel_error"] <= X86_RELATIVE_ERROR, (output, agreement)
        return
    assert row["tpu_flops_after"] >= SAMPLE[name, target][1], row
    assert row["latency_ms"] <= row["coral_default_ms"] * 1.001, row  # never worse than Coral's own plan


def test_a_model_the_target_cannot_take_is_refused_with_a_typed_error(work):
    """Silero VAD on arm_2tpu with --no-cpu-fallback: the square root of its STFT's magnitude, which no sum
    of ReLUs approximates within the bound on its range, is a typed refusal (exit 1,
    `legalize.approximation-bound`), not an internal error (without the flag it runs on the CPU)."""
    name = "silero-vad"
    if not (work / name / "calib").exists():
        bench_zoo.prepare(name)
    row = bench_zoo.cell(name, "arm_2tpu", ("--no-cpu-fallback",))
    assert row["outcome"] == "refused" and row["exit"] == 1, row
    assert row["code"] == "legalize.approximation-bound" and "cannot be approximated" in row["message"], row
