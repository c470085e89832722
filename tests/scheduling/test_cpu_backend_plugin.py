"""One file suffices to add a CPU backend to the tune stage's choice of each CPU span's backend: this
test file alone registers a fake CPU backend (its compiler, its lowering check, and `cpu_order`, which
makes it a candidate: `backends.cpu_candidates`) and a fake runner, and shows the selection builds,
checks and measures it, chooses it when it is fastest and not when it is not, and forgets it once
unregistered. Nothing of edgesdk is edited.

TEST DOUBLES: "fastcpu" stands for a CPU backend we do not have; it writes the segment's ONNX graph,
which its bundle runs with the onnxruntime runner. The runners say how long each candidate took
(timings never go into tests); the candidates' outputs are real, and checked.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgesdk import backends
from edgesdk.backends import Backend, Compiled
from edgesdk.config import load_target
from edgesdk.ir import model as irm
from edgesdk.runtime.manifest import TensorSpec
from edgesdk.scheduling import selection
from edgesdk.timing import RUNS, WARMUP, FakeRunner, InProcess, TimingCache
from tests.scheduling.test_selection import SPLIT, _model, _plan, _segment_models


def compile_fast(job) -> Compiled:
    """The fake backend's compiler: the segment's graph as it is."""
    artifact = f"segments/{job.segment.id}.fastcpu.onnx"
    irm.save(job.model, job.segments_dir.parent / artifact)
    shapes, types = irm.static_shapes(job.model), irm.elem_types(job.model)
    spec = lambda n: TensorSpec(n, shapes[n], irm.dtype_name(types[n]))  # noqa: E731
    return Compiled(artifact, tuple(map(spec, job.segment.inputs)), tuple(map(spec, job.segment.outputs)))


FAST = Backend("fastcpu", runner="onnxruntime", rank=9, runtime_dists=("onnxruntime",), cpu_order=9,
               compiler=f"{__name__}:compile_fast", lowering="edgesdk.backends.onnxruntime:lowering_reason")


class Stopwatch:
    """A FAKE RUNNER (`timing.Runner`): bundles run in this process; a measurement takes what `ms` says of
    the candidate (its bundle's directory is named after it)."""

    local = True

    def __init__(self, ms: dict[str, float]) -> None:
        self.ms, self.asked = ms, []

    def open(self, bundle: Path):
        return InProcess().open(bundle)

    def measure(self, bundle: Path, feeds: Path, *, warmup: int = WARMUP, runs: int = RUNS) -> list[float]:
        self.asked.append(bundle.name)
        return [self.ms[bundle.name]] * runs


def _select(tmp_path, runner, allowed):
    model = _model()
    target, _ = load_target("x86")
    x = np.random.default_rng(1).standard_normal((1, 16)).astype(np.float32)
    return selection.select(_plan(model, SPLIT), model, _segment_models(model), target, [{"x": x}, {"x": x * 2}],
                            allowed=allowed, tuning_db=tmp_path / "db" / "cpu",
                            cache=TimingCache(tmp_path / "db" / "timing.json"), measurable=None, host="test host",
                            log=lambda s: None, runner=runner)


def _allowed(cpu_backends: tuple[str, ...]) -> list[str]:
    """What the tune stage measures under `--cpu-backends` (TVM and LiteRT left out here: they compile slowly)."""
    return [b for b in backends.cpu_candidates() if b in cpu_backends]


def test_a_cpu_backend_registered_in_this_file_is_measured_and_chosen_when_fastest(tmp_path):
    before = backends.cpu_candidates()
    runner = Stopwatch({"planned": 0.9, "onnxruntime": 0.3, "fastcpu": 0.1})
    with backends.registered(FAST):
        assert backends.cpu_candidates() == [*before, "fastcpu"]  # after the built-in ones: ties go to them
        got = _select(tmp_path, runner, _allowed(("onnxruntime", "fastcpu")))
    (span,) = got.record["spans"]
    assert got.record["candidates"] == ["onnxruntime", "fastcpu"]
    assert {n: c["ms"] for n, c in span["candidates"].items()} == {"planned": 0.9, "onnxruntime": 0.3, "fastcpu": 0.1}
    assert span["chosen"] == "fastcpu" and span["why"].startswith("fastest measured: 0.100 ms")
    (seg,) = got.plan.segments
    assert (seg.backend, seg.nodes, seg.predicted_ms) == ("fastcpu", ("mm1", "relu", "mm2"), 0.1)
    assert runner.asked == ["planned", "onnxruntime", "fastcpu"] * selection.ROUNDS  # each in turn, every round
    # unregistered: no longer a candidate, and nothing else changed
    assert backends.cpu_candidates() == before
    assert "fastcpu" not in {b.name for b in backends.backends()}


def test_a_registered_cpu_backend_that_is_slower_is_measured_but_not_chosen(tmp_path):
    runner = FakeRunner({"planned": 0.9, "onnxruntime": 0.3, "fastcpu": 0.5})
    with backends.registered(FAST):
        got = _select(tmp_path, runner, _allowed(("onnxruntime", "fastcpu")))
    (span,) = got.record["spans"]
    # the same time every round: no spread
    assert span["candidates"]["fastcpu"] == {"ms": 0.5, "spread": 0.0} and span["chosen"] == "onnxruntime"
    assert runner.asked == ["planned", "onnxruntime", "fastcpu"] * selection.ROUNDS
