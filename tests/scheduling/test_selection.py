"""The tune stage's choice of each CPU span's backend by measurement (scheduling/selection.py).

The mechanism is tested with FAKE TIMERS (timings never go into tests): the timer returns a made-up
time per candidate, so the test knows which one must win. The candidates themselves are real: they
are compiled by their backends and run by the runtime's runners, and a candidate that disagrees with
onnxruntime or fails to build is skipped with its reason, however fast the fake timer says it is.
"""

from __future__ import annotations

import contextlib
import json
import platform
import signal
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk import backends
from edgesdk.backends import Backend, Compiled
from edgesdk.config import load_target
from edgesdk.errors import UserError
from edgesdk.ir import model as irm
from edgesdk.runtime.manifest import TensorSpec
from edgesdk.scheduling import selection
from edgesdk.scheduling.plan import Plan, PlanSegment
from edgesdk.timing import TimingCache
from edgesdk.timing import cache as timing_cache
from tests.numeric import assert_close


def _model(act: str = "Relu") -> onnx.ModelProto:
    """x -> MatMul -> Relu (or `act`) -> MatMul -> y: three nodes on the CPU."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((32, 8)).astype(np.float32), "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"), helper.make_node(act, ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2")]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], [w1, w2])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return irm.infer_shapes(m)


def _plan(model: onnx.ModelProto, cut: list[tuple[str, list[str], tuple[str, ...], tuple[str, ...]]]) -> Plan:
    """A latency plan of CPU segments as the schedule would cut them: (backend, nodes, inputs, outputs)."""
    segs = tuple(PlanSegment(f"s{i}", "cpu", b, f"segments/s{i}.onnx", tuple(n), ins, outs, 0.0, 0, 1.0)
                 for i, (b, n, ins, outs) in enumerate(cut))
    return Plan("x86", "latency", ("x",), ("y",), {}, segs, tuple((s.id,) for s in segs), (), {},
                {"latency_ms": float(len(segs)), "sequential_ms": float(len(segs)), "throughput_fps": 1.0}, {},
                "", "", {}, {"cpu": 3}, ())


def _segment_models(model):
    index = {n.name: i for i, n in enumerate(model.graph.node)}
    return lambda s: irm.extract_segment(model, [index[n] for n in s.nodes], list(s.inputs), list(s.outputs))


def _timer(ms: dict[str, float]):
    """A FAKE TIMER: says candidate took `ms[candidate]` instead of measuring it (the candidates were
    built, run and checked already); it records what it was asked to time."""
    asked: list[str] = []

    def timer(label: str, measure) -> float:
        asked.append(label)
        return ms[label]
    timer.asked = asked
    return timer


def _confirming(ms: float):
    """A FAKE TIMER for a build that replays the timing cache: the winner, timed once more, takes `ms`."""
    asked: list[str] = []

    def timer(label: str, measure) -> float:
        asked.append(label)
        return ms
    timer.asked = asked
    return timer


def _select(model, plan, tmp_path, timer, allowed=("tvm", "onnxruntime"), measurable=None, cache=None, target="x86",
            log=lambda s: None):
    target, _ = load_target(target)
    x = np.random.default_rng(1).standard_normal((1, 16)).astype(np.float32)
    return selection.select(plan, model, _segment_models(model), target, [{"x": x}, {"x": x * 2}], allowed=allowed,
                            tuning_db=tmp_path / "db" / "cpu",
                            cache=cache or TimingCache(tmp_path / "db" / "timing.json"),
                            measurable=measurable, host="test host", log=log, timer=timer)


SPLIT = [("tvm", ["mm1"], ("x",), ("h",)), ("onnxruntime", ["relu", "mm2"], ("h",), ("y",))]


def test_the_fastest_candidate_takes_the_whole_span(tmp_path):
    model = _model()
    timer = _timer({"planned": 0.9, "tvm": 0.5, "onnxruntime": 0.2})
    got = _select(model, _plan(model, SPLIT), tmp_path, timer)
    # one span of two segments: the plan's cut, and the whole span on TVM and on onnxruntime
    (span,) = got.record["spans"]
    assert span["segments"] == ["s0", "s1"] and span["nodes"] == 3
    assert {n: c["ms"] for n, c in span["candidates"].items()} == {"planned": 0.9, "tvm": 0.5, "onnxruntime": 0.2}
    assert span["chosen"] == "onnxruntime" and span["why"].startswith("fastest measured: 0.200 ms")
    (seg,) = got.plan.segments
    assert (seg.id, seg.backend, seg.nodes, seg.inputs, seg.outputs, seg.predicted_ms) == \
        ("s0", "onnxruntime", ("mm1", "relu", "mm2"), ("x",), ("y",), 0.2)
    assert got.plan.pipeline_stages == (("s0",),)  # s1 is gone from the stages too
    assert got.plan.predicted["latency_ms"] == pytest.approx(0.2)  # moved by the measured difference (2.0 -> 0.2)
    assert got.plan.cpu_selection == got.record and json.loads(got.plan.to_json())["cpu_selection"] == got.record
    # interleaved: every round measures each candidate once, in turn
    assert timer.asked == ["planned", "tvm", "onnxruntime"] * selection.ROUNDS
    # the new segment's model is the three nodes, and it computes what the whole model does
    import onnxruntime as ort
    x = np.random.default_rng(2).standard_normal((1, 16)).astype(np.float32)
    part = got.models["s0"]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got_y = ort.InferenceSession(part.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert_close(got_y, want)


def test_the_plans_own_cut_is_kept_when_it_is_fastest(tmp_path):
    model = _model()
    plan = _plan(model, SPLIT)
    got = _select(model, plan, tmp_path, _timer({"planned": 0.1, "tvm": 0.5, "onnxruntime": 0.3}))
    assert got.record["spans"][0]["chosen"] == "planned" and got.models == {}
    assert got.plan.segments == plan.segments  # measured as a whole: each segment keeps its prediction
    assert got.plan.predicted["latency_ms"] == pytest.approx(0.1)


def test_a_wrong_candidate_is_never_chosen_however_fast(tmp_path):
    """A TEST DOUBLE backend whose artifact computes -y: the fake timer calls it fastest, the check refuses it."""
    model = _model()
    wrong = Backend("wrongsign", runner="onnxruntime", rank=9, runtime_dists=("onnxruntime",),
                    compiler=f"{__name__}:compile_negated", lowering="edgesdk.backends.onnxruntime:lowering_reason")
    with backends.registered(wrong):
        got = _select(model, _plan(model, SPLIT), tmp_path, _timer({"planned": 0.9, "onnxruntime": 0.5, "wrongsign": 0.01}),
                      allowed=("onnxruntime", "wrongsign"))
    span = got.record["spans"][0]
    assert span["chosen"] == "onnxruntime"
    assert span["candidates"]["wrongsign"]["skipped"].startswith("its y differs from onnxruntime by")


def _candidate_libraries() -> set[str]:
    """The files of candidates' bundles this process has mapped (a library it loaded stays mapped)."""
    return {line.split(None, 5)[-1] for line in Path("/proc/self/maps").read_text().splitlines()
            if "edgesdk-select-" in line}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
def test_a_large_candidate_is_checked_in_a_process_of_its_own(tmp_path, monkeypatch):
    """Past CHECKED_APART_BYTES (lowered here to 0) a candidate is built here and run only in a child
    process: TVM never unloads a library it loaded, so its weights would stay held through the timing of
    every other candidate. The check is the same: a TEST DOUBLE computing -y is refused."""
    monkeypatch.setattr(selection, "CHECKED_APART_BYTES", 0)
    model = _model()
    wrong = Backend("wrongsign", runner="onnxruntime", rank=9, runtime_dists=("onnxruntime",),
                    compiler=f"{__name__}:compile_negated", lowering="edgesdk.backends.onnxruntime:lowering_reason")
    before = _candidate_libraries()
    with backends.registered(wrong):
        got = _select(model, _plan(model, SPLIT), tmp_path,
                      _timer({"planned": 0.9, "tvm": 0.5, "onnxruntime": 0.7, "wrongsign": 0.01}),
                      allowed=("tvm", "onnxruntime", "wrongsign"))
    span = got.record["spans"][0]
    assert span["candidates"]["wrongsign"]["skipped"].startswith("its y differs from onnxruntime by")
    assert span["chosen"] == "tvm" and span["candidates"]["planned"]["ms"] == 0.9  # checked in a child, and agreed
    assert _candidate_libraries() == before  # no candidate's library was loaded by this process


def test_a_candidate_that_fails_to_build_is_skipped_with_its_reason(tmp_path):
    model = _model()
    broken = Backend("broken", runner="onnxruntime", rank=9, runtime_dists=("onnxruntime",),
                     compiler=f"{__name__}:compile_broken", lowering="edgesdk.backends.onnxruntime:lowering_reason")
    with backends.registered(broken):
        got = _select(model, _plan(model, SPLIT), tmp_path, _timer({"planned": 0.9, "onnxruntime": 0.5}),
                      allowed=("onnxruntime", "broken"))
    span = got.record["spans"][0]
    assert span["candidates"]["broken"] == {"skipped": "the TEST DOUBLE compiler failed on s0"}
    assert span["chosen"] == "onnxruntime"


def test_a_backend_that_cannot_lower_a_node_is_not_a_candidate(tmp_path):
    model = _model()
    picky = Backend("picky", runner="onnxruntime", rank=9, runtime_dists=("onnxruntime",),
                    compiler="edgesdk.backends.onnxruntime:compile_segment", lowering=f"{__name__}:no_relu")
    with backends.registered(picky):
        got = _select(model, _plan(model, SPLIT), tmp_path, _timer({"planned": 0.9, "onnxruntime": 0.5}),
                      allowed=("onnxruntime", "picky"))
    assert got.record["spans"][0]["candidates"]["picky"] == {"skipped": "cannot lower relu: the TEST DOUBLE has no Relu"}


def test_a_rebuild_replays_the_timing_cache_and_gives_the_same_plan(tmp_path):
    model = _model()
    plan = _plan(model, SPLIT)
    first = _select(model, plan, tmp_path, _timer({"planned": 0.9, "tvm": 0.5, "onnxruntime": 0.2}))
    replay = _confirming(0.21)  # within CONFIRM_MARGIN of the cached 0.2
    logged: list[str] = []
    again = _select(model, plan, tmp_path, replay, log=logged.append)
    assert replay.asked == ["onnxruntime"]  # only the winner, once: the replay confirmed
    assert again.plan.to_json() == first.plan.to_json()
    assert any("onnxruntime's replayed lead confirmed: 0.210 ms now (0.200 ms in the timing cache), tvm 0.500 ms"
               in line for line in logged), logged
    # another host's measurements are not this host's
    target, _ = load_target("x86")
    other = selection.select(plan, model, _segment_models(model), target,
                             [{"x": np.ones((1, 16), np.float32)}], allowed=("onnxruntime",),
                             tuning_db=tmp_path / "db" / "cpu", cache=TimingCache(tmp_path / "db" / "timing.json"),
                             measurable=None, host="another host", log=lambda s: None,
                             timer=_timer({"planned": 0.1, "onnxruntime": 0.5}))
    assert other.record["spans"][0]["chosen"] == "planned"


def test_times_measured_while_other_processes_took_the_cpu_decide_the_build_but_are_not_cached(tmp_path,
                                                                                               monkeypatch):
    """Other work on the cores slows the candidates unevenly (onnxruntime's spinning threads most): a choice
    the load made is this build's, but a rebuild measures again instead of replaying it."""
    import contextlib

    from edgesdk.timing.load import Load

    @contextlib.contextmanager
    def busy():
        yield Load(others=0.47)

    @contextlib.contextmanager
    def quiet():
        yield Load(others=0.01)

    model = _model()
    plan = _plan(model, SPLIT)
    logged = []
    monkeypatch.setenv("EDGESDK_LOAD_CHECK", "on")
    monkeypatch.setattr(selection, "others_share", busy)
    first = _select(model, plan, tmp_path, _timer({"planned": 0.9, "tvm": 0.5, "onnxruntime": 0.7}), log=logged.append)
    span = first.record["spans"][0]
    assert span["chosen"] == "tvm" and span["host_busy"] == 0.47
    assert any("took 47% of the CPU" in line and "not cached" in line for line in logged), logged
    monkeypatch.setattr(selection, "others_share", quiet)
    timer = _timer({"planned": 0.9, "tvm": 0.5, "onnxruntime": 0.2})  # quiet: onnxruntime is the faster
    again = _select(model, plan, tmp_path, timer)
    assert {"tvm", "onnxruntime"} <= set(timer.asked)  # measured again, not replayed
    assert again.record["spans"][0]["chosen"] == "onnxruntime"


def _scripted(rounds: dict[str, list[float]]):
    """A FAKE TIMER with injected noise: each candidate's rounds take the times given, in order."""
    left = {name: list(times) for name, times in rounds.items()}
    asked: list[str] = []

    def timer(label: str, measure) -> float:
        asked.append(label)
        return left[label].pop(0)
    timer.asked = asked
    return timer


def test_a_lead_within_the_rounds_noise_is_marked_and_one_beyond_it_is_not(tmp_path):
    """onnxruntime leads TVM by 3 % while its own rounds spread by 8 %: the choice stands (the faster median)
    but is marked as within the noise; by 20 % it is a plain choice. The spread goes into the cache with the time."""
    model = _model()
    plan = _plan(model, SPLIT)
    noisy = {"planned": [0.90, 0.91, 0.92], "tvm": [1.03, 1.02, 1.04], "onnxruntime": [1.00, 1.06, 0.98]}
    logged: list[str] = []
    got = _select(model, plan, tmp_path / "a", _scripted(noisy), log=logged.append)
    (span,) = got.record["spans"]
    assert span["chosen"] == "planned"  # 0.91, ahead of onnxruntime's 1.00 by 10 %, beyond both spreads (2 %, 8 %)
    assert "within_noise" not in span
    noisy["planned"] = [1.20, 1.21, 1.22]
    noisy["tvm"] += [1.03, 1.02, 1.03]  # within the noise: the two timed SETTLE_ROUNDS more, and still close
    noisy["onnxruntime"] += [0.99, 1.01, 1.00]
    got = _select(model, plan, tmp_path / "b", _scripted(noisy), log=logged.append)
    (span,) = got.record["spans"]
    assert span["settled"] == {"candidates": ["onnxruntime", "tvm"], "rounds": selection.ROUNDS + selection.SETTLE_ROUNDS}
    assert span["chosen"] == "onnxruntime" and span["candidates"]["onnxruntime"]["spread"] == pytest.approx(0.08)
    assert span["within_noise"] == {"runner_up": "tvm", "margin": 0.03, "noise": 0.08}
    assert "within the measured noise: 3.0% ahead of tvm" in span["why"]
    cached = json.loads((tmp_path / "b" / "db" / "timing.json").read_text())
    assert sorted(e["spread"] for e in cached.values()) == pytest.approx([0.0165, 0.0194, 0.08], abs=1e-4)


def test_a_close_lead_is_settled_by_more_rounds_of_the_two(tmp_path):
    """onnxruntime's three rounds (1.00, 1.20, 0.90) put its median 2 % ahead of TVM's (1.02), well within its
    own 30 % spread: the two are timed SETTLE_ROUNDS more, in turn, and over all six rounds TVM is the faster
    (1.02 against 1.135) and ships; the planned cut, 20 % behind, is not timed again."""
    model = _model()
    timer = _scripted({"planned": [1.22, 1.23, 1.22], "tvm": [1.02, 1.03, 1.01, 1.02, 1.02, 1.03],
                       "onnxruntime": [1.00, 1.20, 0.90, 1.15, 1.12, 1.18]})
    logged: list[str] = []
    (span,) = _select(model, _plan(model, SPLIT), tmp_path, timer, log=logged.append).record["spans"]
    assert timer.asked == ["planned", "tvm", "onnxruntime"] * selection.ROUNDS + ["onnxruntime", "tvm"] * 3
    assert span["chosen"] == "tvm" and span["candidates"]["onnxruntime"]["ms"] == pytest.approx(1.135)
    assert span["settled"] == {"candidates": ["tvm", "onnxruntime"], "rounds": 6}
    assert any("onnxruntime led tvm by 2.0%, within their rounds' spread (30.0%): both timed 3 rounds more" in line
               for line in logged), logged
    cached = json.loads((tmp_path / "db" / "timing.json").read_text())
    assert sorted((e["ms"], e.get("rounds")) for e in cached.values()) == [(1.02, 6), (1.135, 6), (1.22, None)]
    # a rebuild replays it, the record (settled included) as the build that measured it wrote it
    again = _select(model, _plan(model, SPLIT), tmp_path, _confirming(1.03)).record["spans"]
    assert again == [span]


@pytest.mark.parametrize("seed", range(20))
def test_under_bounded_noise_the_truly_faster_candidate_wins(tmp_path, seed):
    """Each round's time is the true one moved by up to 10 % either way (uniform, seeded); where the true
    gap exceeds what that noise can close ((1 + 0.1) / (1 - 0.1)), the truly faster candidate wins."""
    rng = np.random.default_rng(seed)
    true = {"planned": 1.0, "tvm": float(rng.uniform(1.0, 2.0)), "onnxruntime": float(rng.uniform(1.0, 2.0))}
    fastest = min(true, key=true.get)
    gap = sorted(true.values())[1] / true[fastest]
    rounds = selection.ROUNDS + selection.SETTLE_ROUNDS  # a close pair is timed more
    noisy = {n: [t * (1 + rng.uniform(-0.1, 0.1)) for _ in range(rounds)] for n, t in true.items()}
    (span,) = _select(_model(), _plan(_model(), SPLIT), tmp_path, _scripted(noisy)).record["spans"]
    if gap > 1.1 / 0.9:
        assert span["chosen"] == fastest, (true, noisy, span)
    else:  # inside the noise either may win; the medians of the rounds each was timed decide
        used = {n: noisy[n][:selection.ROUNDS if n not in span.get("settled", {}).get("candidates", ()) else rounds]
                for n in noisy}
        medians = {n: float(np.median(v)) for n, v in used.items()}
        assert span["chosen"] == min(medians, key=medians.get)


def test_a_timing_under_load_is_measured_again_and_cached_only_when_quiet(tmp_path, monkeypatch):
    """The first timing shares the cores with another process (47 % of their time): every candidate is timed
    again at once; the second is quiet, decides and is cached. Still busy both times: the quieter decides and
    nothing is cached."""
    import contextlib

    from edgesdk.timing.load import Load

    loads = iter([0.47, 0.01])

    @contextlib.contextmanager
    def share():
        yield Load(others=next(loads, 0.0))

    model = _model()
    plan = _plan(model, SPLIT)
    monkeypatch.setenv("EDGESDK_LOAD_CHECK", "on")
    monkeypatch.setattr(selection, "others_share", share)
    busy_then_quiet = {"planned": [0.9] * 3 + [0.9] * 3, "tvm": [0.4] * 3 + [0.5] * 3,
                       "onnxruntime": [0.7] * 3 + [0.2] * 3}  # under load onnxruntime lost most
    timer = _scripted(busy_then_quiet)
    logged: list[str] = []
    (span,) = _select(model, plan, tmp_path, timer, log=logged.append).record["spans"]
    assert timer.asked == ["planned", "tvm", "onnxruntime"] * (2 * selection.ROUNDS)
    assert span["timed_twice"] == {"first": 0.47, "second": 0.01} and "host_busy" not in span
    assert span["chosen"] == "onnxruntime" and span["candidates"]["onnxruntime"]["ms"] == 0.2
    assert any("took 47% of the CPU" in line and "timing them again" in line for line in logged), logged
    replay = _confirming(0.2)
    monkeypatch.setattr(selection, "others_share", share)
    assert _select(model, plan, tmp_path, replay).record["spans"][0]["chosen"] == "onnxruntime"
    assert replay.asked == ["onnxruntime"]

    loads = iter([0.6, 0.47])
    timer = _scripted({"planned": [0.9] * 6, "tvm": [0.5] * 6, "onnxruntime": [0.7] * 3 + [0.6] * 3})
    (span,) = _select(model, plan, tmp_path / "busy", timer).record["spans"]
    assert span["host_busy"] == 0.47 and span["candidates"]["onnxruntime"]["ms"] == 0.6  # the quieter timing
    assert not (tmp_path / "busy" / "db" / "timing.json").exists() or all(
        "ms" not in e for e in json.loads((tmp_path / "busy" / "db" / "timing.json").read_text()).values())


def test_a_replayed_winner_that_lost_its_lead_on_a_quiet_host_has_every_candidate_timed_again(tmp_path, monkeypatch):
    """The cache says onnxruntime 0.2 ms, TVM 0.5; timed once more on a quiet host onnxruntime takes 0.7 (the host
    changed: its clock, its memory, what else it runs): slower than TVM's cached time beyond CONFIRM_MARGIN, so
    every candidate is timed again and the fastest now (TVM) ships; the cache holds the new times, and the next
    build replays them. Slower than its own cached time but still ahead (0.4) it keeps its place; on a busy host
    the same 0.7 is not judged: the replay stands."""
    import contextlib

    from edgesdk.timing.load import Load

    loads = {"now": 0.01}

    @contextlib.contextmanager
    def share():
        yield Load(others=loads["now"])

    monkeypatch.setenv("EDGESDK_LOAD_CHECK", "on")
    monkeypatch.setattr(selection, "others_share", share)
    model = _model()
    plan = _plan(model, SPLIT)
    _select(model, plan, tmp_path, _timer({"planned": 0.9, "tvm": 0.5, "onnxruntime": 0.2}))

    logged: list[str] = []
    slower = _confirming(0.4)
    kept = _select(model, plan, tmp_path, slower, log=logged.append)
    assert slower.asked == ["onnxruntime"] and kept.record["spans"][0]["chosen"] == "onnxruntime"
    assert any("onnxruntime's replayed lead confirmed: 0.400 ms now (0.200 ms in the timing cache), tvm 0.500 ms"
               in line for line in logged), logged

    loads["now"] = 0.6  # busy: not judged, the replay stands
    busy = _select(model, plan, tmp_path, _confirming(0.7), log=logged.append)
    assert busy.record["spans"][0]["chosen"] == "onnxruntime" and "replay_refuted" not in busy.record["spans"][0]
    assert any("onnxruntime's replayed lead not confirmed: other processes took 60%" in line for line in logged), logged

    loads["now"] = 0.01
    timer = _scripted({"onnxruntime": [0.7] * (1 + selection.ROUNDS), "planned": [0.9] * selection.ROUNDS,
                       "tvm": [0.3] * selection.ROUNDS})
    logged.clear()
    got = _select(model, plan, tmp_path, timer, log=logged.append)
    assert timer.asked == ["onnxruntime"] + ["planned", "tvm", "onnxruntime"] * selection.ROUNDS
    (span,) = got.record["spans"]
    assert span["chosen"] == "tvm" and span["candidates"]["onnxruntime"]["ms"] == 0.7
    assert span["replay_refuted"] == {"candidate": "onnxruntime", "cached_ms": 0.2, "now_ms": 0.7, "runner_up": "tvm",
                                      "runner_up_ms": 0.5, "margin": 0.25}
    assert any("onnxruntime measured 0.700 ms now (0.200 ms in the timing cache), slower than tvm's 0.500 ms beyond "
               "25%" in line and "timed again" in line for line in logged), logged
    assert ("(timed again: onnxruntime, 0.200 ms in the timing cache, measured 0.700 ms on this build, behind tvm's "
            "0.500 ms)") in "\n".join(selection_summary(got.record))
    from edgesdk.runtime import manifest as mf
    mf._CPU_SELECTION(json.loads(json.dumps(got.record)), "tuning.cpu_selection")  # raises where it does not validate
    replay = _confirming(0.31)  # the new times cached: replayed, the new winner confirmed
    assert _select(model, plan, tmp_path, replay).record["spans"][0]["chosen"] == "tvm" and replay.asked == ["tvm"]


def test_a_backend_whose_compiler_changed_is_measured_anew_with_the_others(tmp_path, monkeypatch):
    """The timing cache keys on each backend's `revision`: a candidate compiled the old way (the
    onnxruntime backend before its affine maps became BatchNormalization) is timed again, not replayed; and
    the span's other candidates with it, since a time replayed from another build, under another load, does
    not compare with one measured now (a quiet build's TVM once beat a busy build's replayed onnxruntime)."""
    model = _model()
    plan = _plan(model, SPLIT)
    _select(model, plan, tmp_path, _timer({"planned": 0.9, "tvm": 0.5, "onnxruntime": 0.2}))
    ort = backends.backend("onnxruntime")
    monkeypatch.setattr(backends.registry, "_BACKENDS", {**backends.registry._BACKENDS,
                                                         "onnxruntime": replace(ort, revision=ort.revision + 1)})
    timer = _timer({"planned": 0.9, "tvm": 0.5, "onnxruntime": 0.2})
    logged: list[str] = []
    _select(model, plan, tmp_path, timer, log=logged.append)
    assert timer.asked == ["planned", "tvm", "onnxruntime"] * selection.ROUNDS  # all timed together, in turn
    # the plan's cut holds an onnxruntime segment too
    assert any("planned, onnxruntime not in the timing cache: tvm timed again with them" in line for line in logged), logged
    again = _confirming(0.2)
    _select(model, plan, tmp_path, again)
    assert again.asked == ["onnxruntime"]  # every one cached now: replayed, the winner confirmed


# --- a timing cache replays times, never correctness ---------------------------------------------

def _plant(cache: Path, skipped_because: str, entry: dict) -> str:
    """The timing cache's entry of the candidate skipped for `skipped_because` replaced by `entry` (what a
    planted or stale cache claims of it): its key."""
    entries = json.loads(cache.read_text())
    (key,) = [k for k, e in entries.items() if skipped_because in e.get("skipped", "")]
    entries[key] = entry
    cache.write_text(json.dumps(entries))
    return key


def test_a_wrong_candidate_whose_time_is_planted_in_the_cache_is_checked_and_dropped(tmp_path):
    """A fast time planted for a candidate that computes -y: the next build checks the fastest even though
    its time is replayed, drops it (its entry marked skipped) and checks the next fastest, which it ships."""
    model = _model()
    wrong = Backend("wrongsign", runner="onnxruntime", rank=9, runtime_dists=("onnxruntime",),
                    compiler=f"{__name__}:compile_negated", lowering="edgesdk.backends.onnxruntime:lowering_reason")
    cache = tmp_path / "db" / "timing.json"
    with backends.registered(wrong):
        _select(model, _plan(model, SPLIT), tmp_path, _timer({"planned": 0.9, "onnxruntime": 0.5, "wrongsign": 0.01}),
                allowed=("onnxruntime", "wrongsign"))
        key = _plant(cache, "differs from onnxruntime", {"ms": 0.0001})
        lines: list[str] = []
        got = selection.select(_plan(model, SPLIT), model, _segment_models(model), load_target("x86")[0],
                               [{"x": np.ones((1, 16), np.float32)}, {"x": np.full((1, 16), 2, np.float32)}],
                               allowed=("onnxruntime", "wrongsign"), tuning_db=tmp_path / "db" / "cpu",
                               cache=TimingCache(cache), measurable=None, host="test host", log=lines.append,
                               timer=(replay := _confirming(0.5)))
    (span,) = got.record["spans"]
    assert span["chosen"] == "onnxruntime" and got.plan.segments[0].backend == "onnxruntime"
    assert replay.asked == ["onnxruntime"]  # the planted one never timed: its check failed first
    assert span["candidates"]["wrongsign"]["skipped"].startswith("its y differs from onnxruntime by")
    assert json.loads(cache.read_text())[key]["skipped"].startswith("its y differs from onnxruntime by")
    assert any("wrongsign skipped" in line and "replayed from the timing cache" in line for line in lines), lines


def compile_zeroed_int8(job) -> Compiled:
    """An `onnxruntime-int8` segment whose outputs are all zeros: the quantized model, each output times 0."""
    from edgesdk.backends.onnxruntime import compile_int8_segment

    compiled = compile_int8_segment(job)
    path = job.segments_dir.parent / compiled.artifact
    m = onnx.load(str(path))
    m.graph.initializer.append(numpy_helper.from_array(np.array(0, np.float32), "zero__"))
    for out in m.graph.output:
        for node in m.graph.node:
            node.output[:] = [f"{o}__pre" if o == out.name else o for o in node.output]
        m.graph.node.append(helper.make_node("Mul", [f"{out.name}__pre", "zero__"], [out.name]))
    onnx.save(m, str(path))
    return compiled


def zeroed_int8(monkeypatch) -> None:
    """onnxruntime's int8 backend replaced by one whose outputs are zeros (its timing cache key unchanged)."""
    zeroed = replace(backends.backend("onnxruntime-int8"), compiler=f"{__name__}:compile_zeroed_int8")
    monkeypatch.setattr(backends.registry, "_BACKENDS", {**backends.registry._BACKENDS, "onnxruntime-int8": zeroed})


PLANTED_GATE = {"ms": 0.0001, "gate": {"cosine": 0.9999, "top1": 1.0, "samples": 2}}


def test_an_int8_candidate_whose_gate_is_planted_in_the_cache_is_gated_again_and_dropped(tmp_path, monkeypatch):
    """`{"ms": 0.0001, "gate": {"cosine": 0.9999, ...}}` planted for an int8 candidate whose outputs are zeros:
    the gate is computed again, never read from the cache; the candidate is dropped, nothing is quantized for
    the package stage, and the fastest float candidate is checked and chosen."""
    zeroed_int8(monkeypatch)
    model = _model()
    timer = _timer({"planned": 0.9, "onnxruntime": 0.5, "onnxruntime-int8": 0.1})
    first = _select_int8(model, _plan(model, SPLIT), tmp_path, timer, allowed=("onnxruntime",))
    assert first.record["spans"][0]["chosen"] == "onnxruntime"  # refused by the gate when measured
    key = _plant(tmp_path / "db" / "timing.json", "accuracy gate", PLANTED_GATE)
    got = _select_int8(model, _plan(model, SPLIT), tmp_path, _confirming(0.5), allowed=("onnxruntime",),
                       int8_dir="again")
    (span,) = got.record["spans"]
    why = span["candidates"]["onnxruntime-int8"]["skipped"]
    assert why.startswith("accuracy gate: y's cosine similarity to fp32 is 0.0000 < 0.99"), why
    assert span["chosen"] == "onnxruntime" and got.quantized == {} and not (tmp_path / "again").exists()
    assert "skipped" in json.loads((tmp_path / "db" / "timing.json").read_text())[key]


@contextlib.contextmanager
def no_hang(seconds: int = 60):
    """A call that would block for ever (opening a FIFO no one writes) fails the test instead."""
    def expired(signum, frame):
        raise AssertionError(f"still blocked after {seconds} s")
    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("text, needle", [
    ("{", "is not valid JSON (line 1 column 2: "),
    ("[]", "holds a JSON array, not an object of entries"),
    ('{"k": {"ms": "fast"}}', "line 1: entry 'k': 'ms' is \"fast\", not a finite positive number of milliseconds"),
    ('{\n "k": {"ms": NaN}}', "line 2: entry 'k': 'ms' is NaN, not a finite positive number of milliseconds"),
    ('{"k": {"ms": -1}}', "'ms' is -1, not a finite positive number"),
    ('{"k": 3}', "entry 'k': is a JSON number, not an object"),
    ('{"k": {"ms": 1, "gate": {"cosine": 7, "top1": null, "samples": 4}}}', "'gate.cosine' is 7, not a number in [-1, 1]"),
    ('{"k": {"ms": 1, "mixed": {"float_ops": [1], "ops": 2}}}', "'mixed' is not an object of float_ops"),
    ('{"k": {"ms": 1, "fast": true}}', "unknown key 'fast'"),
    (b"\xff", "is not UTF-8 text"),
])
def test_a_damaged_timing_cache_is_refused_naming_the_file(tmp_path, text, needle):
    path = tmp_path / "timing.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(UserError) as err:
        TimingCache(path)
    assert err.value.code == "tune.timing-cache" and err.value.exit_code == 1
    assert err.value.message.startswith(f"the timing cache {path}: ") and needle in err.value.message, err.value.message
    assert "remove the file, or point --tuning-db at another directory" in err.value.hint


def test_a_timing_cache_that_is_a_fifo_or_too_large_is_refused_without_reading_it(tmp_path, monkeypatch):
    """A FIFO would block a plain open for ever (no writer comes): it is refused at once, as is a file past the bound."""
    import os

    fifo = tmp_path / "timing.json"
    os.mkfifo(fifo)
    with no_hang(), pytest.raises(UserError, match="not a regular file \\(a FIFO\\)"):
        TimingCache(fifo)
    big = tmp_path / "big.json"
    big.write_text("{}" + " " * 100)
    monkeypatch.setattr(timing_cache, "CACHE_MAX_BYTES", 64)
    with pytest.raises(UserError, match="102 bytes, more than the 64 such a file may hold"):
        TimingCache(big)
    assert TimingCache(tmp_path / "absent.json").entries == {}


def test_the_caches_in_a_tuning_database_never_write_through_a_planted_link(tmp_path):
    """The database may be a shared directory (~/.cache/edgesdk/tuning/): a link planted where a writer
    once put its fixed temporary (`NAME.tmp`) must not redirect the write. Each cache the database holds
    is written, and the link's target is unchanged."""
    from edgesdk.backends.tvm import database
    from edgesdk.compression.plan import write_plan

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    db = tmp_path / "db"
    db.mkdir()
    writers = {
        "timing.json": lambda: TimingCache(db / "timing.json").put("k", {"ms": 1.0}),
        "layers.json": lambda: database._merge(db, "layers.json", {"a": 1}, max),
        "plan.json": lambda: write_plan(db / "plan.json", {"conv": "2:4"}),
    }
    for name, write in writers.items():
        for planted in (f"{name}.tmp", f".{name}.tmp", name.replace(".json", ".tmp")):
            if not (db / planted).exists():
                (db / planted).symlink_to(victim)
        write()
        assert json.loads((db / name).read_text()), name
        assert victim.read_text() == "precious\n", name
        assert (db / name).is_file() and not (db / name).is_symlink()


# --- where this host cannot time the target's CPU (an aarch64 target here): chosen by policy ------

FOREIGN = "the target's CPU is aarch64, this host x86_64"


def _never_timed(label, measure):
    raise AssertionError(f"{label} was timed on a host that cannot run the target's code")


def test_a_foreign_targets_span_that_litert_lowers_goes_to_litert_by_policy(tmp_path):
    """No timing: the whole span on LiteRT (built and checked against onnxruntime here), the cost
    model's predictions kept, and a record that says why and that nothing was measured."""
    model = _model()
    plan = _plan(model, SPLIT)
    got = _select(model, plan, tmp_path, _never_timed, allowed=backends.cpu_candidates(), measurable=FOREIGN,
                  target="arm_2tpu")
    rec = got.record
    assert rec["measured_on"] is None and rec["note"] == f"not measured ({FOREIGN}): chosen by policy"
    assert rec["spans"] == [{
        "segments": ["s0", "s1"], "nodes": 3, "chosen": "litert",
        "why": f"policy: LiteRT lowers every node; not measured: {FOREIGN}",
        "candidates": {"planned": {"policy": "untuned: the tuning database has no records"},
                       "litert": {"policy": "lowers every node; agrees with onnxruntime"}}}]
    (seg,) = got.plan.segments
    assert (seg.id, seg.backend, seg.nodes, seg.inputs, seg.outputs, seg.predicted_ms) == \
        ("s0", "litert", ("mm1", "relu", "mm2"), ("x",), ("y",), 2.0)  # the cost model's, not measured
    assert got.plan.predicted == plan.predicted and set(got.models) == {"s0"}
    assert got.plan.cpu_selection == rec
    arm, _ = load_target("arm_2tpu")
    if platform.machine() == "x86_64":
        assert selection.unmeasurable(arm) == FOREIGN


def test_a_span_with_an_op_litert_cannot_lower_keeps_the_plan_with_the_reason(tmp_path):
    model = _model("Erf")
    plan = _plan(model, SPLIT)
    got = _select(model, plan, tmp_path, _never_timed, allowed=backends.cpu_candidates(), measurable=FOREIGN,
                  target="arm_2tpu")
    (span,) = got.record["spans"]
    assert span["chosen"] == "planned"
    assert span["candidates"]["litert"] == {"skipped": "cannot lower relu: Erf has no tflite lowering"}
    assert span["why"] == f"policy: the schedule's cut (litert: cannot lower relu: Erf has no tflite lowering); " \
                          f"not measured: {FOREIGN}"
    assert got.plan.segments == plan.segments and got.models == {}


def test_cpu_backends_planned_keeps_the_plan_and_reads_nothing(tmp_path):
    """`--cpu-backends planned`: no LiteRT; the tune stage reads neither the model nor samples."""
    model = _model()
    plan = _plan(model, SPLIT)
    target, _ = load_target("arm_2tpu")
    got = selection.select(plan, None, _segment_models(model), target, [], allowed=(), tuning_db=tmp_path / "db",
                           cache=TimingCache(tmp_path / "timing.json"), measurable=FOREIGN, host="test host",
                           log=lambda s: None, timer=_never_timed)
    assert got.plan.segments == plan.segments and got.models == {}
    assert got.record["spans"] == [{"segments": ["s0", "s1"], "nodes": 3, "chosen": "planned",
                                    "candidates": {"planned": {"policy": "the schedule's cut"}},
                                    "why": f"policy: the schedule's cut; not measured: {FOREIGN}"}]
    # without litert among them, the others change nothing either
    only_tvm = _select(model, plan, tmp_path, _never_timed, allowed=("tvm", "onnxruntime"), measurable=FOREIGN,
                       target="arm_2tpu")
    assert only_tvm.plan.segments == plan.segments and only_tvm.record["spans"][0]["chosen"] == "planned"


def test_a_litert_span_that_disagrees_with_onnxruntime_keeps_the_plan(tmp_path, monkeypatch):
    """The policy's candidate is checked as a measured one is: a TEST DOUBLE in its place computes -y."""
    model = _model()
    wrong = Backend("wrongsign", runner="onnxruntime", rank=9, runtime_dists=("onnxruntime",),
                    compiler=f"{__name__}:compile_negated", lowering="edgesdk.backends.onnxruntime:lowering_reason")
    monkeypatch.setattr(backends, "policy_fallback", lambda: "wrongsign")
    with backends.registered(wrong):
        got = _select(model, _plan(model, SPLIT), tmp_path, _never_timed, allowed=("wrongsign",), measurable=FOREIGN,
                      target="arm_2tpu")
    (span,) = got.record["spans"]
    assert span["chosen"] == "planned" and got.models == {}
    assert span["candidates"]["wrongsign"]["skipped"].startswith("its y differs from onnxruntime by")
    assert span["why"].startswith("policy: the schedule's cut (wrongsign: its y differs from onnxruntime by")


@pytest.mark.parametrize("floor, kept", [(0.0, False), (0.01, True)])
def test_a_policy_candidate_is_checked_within_the_spans_rounding_floor(tmp_path, monkeypatch, floor, kept):
    """The policy's check is the measured choice's: a TEST DOUBLE LiteRT whose outputs are 2 % off is refused at
    TOLERANCE, and admitted where rounding alone moves the span by 1 % (a FAKE floor), the record saying so."""
    model = _model()
    monkeypatch.setitem(FACTOR, "value", 1.02)
    monkeypatch.setattr(selection, "_rounding_floor", lambda m, values: floor)  # A FAKE rounding floor
    monkeypatch.setattr(backends, "policy_fallback", lambda: "scaled")
    scaled = Backend("scaled", runner="onnxruntime", rank=9, runtime_dists=("onnxruntime",),
                     compiler=f"{__name__}:compile_scaled", lowering="edgesdk.backends.onnxruntime:lowering_reason")
    logged: list[str] = []
    with backends.registered(scaled):
        got = _select(model, _plan(model, SPLIT), tmp_path, _never_timed, allowed=("scaled",), measurable=FOREIGN,
                      target="arm_2tpu", log=logged.append)
    (span,) = got.record["spans"]
    assert (span["chosen"] == "scaled") is kept, span
    if kept:
        assert span["check_tolerance"] == {"rounding_floor": 0.01, "tolerance": 0.03}
        assert span["candidates"]["scaled"] == {"policy": "lowers every node; agrees with onnxruntime"}
        assert any("checked within 3.00%" in line for line in logged), logged
    else:
        assert "check_tolerance" not in span
        assert span["candidates"]["scaled"]["skipped"].startswith("its y differs from onnxruntime by")


def test_a_tuned_schedules_cut_is_kept_over_litert(tmp_path):
    """Where the database holds tuned records for every function of the plan's TVM segments (only a
    search on the boards writes them for a foreign CPU), the plan's cut stays; LiteRT is not built."""
    model = _model()
    tuned = Backend("tunedtvm", runner="tvm", rank=9, runtime_dists=(), compiler=f"{__name__}:compile_broken",
                    tuner=f"{__name__}:compile_broken", coverage=f"{__name__}:all_tuned",
                    lowering="edgesdk.backends.tvm.segment:lowering_reason")
    plan = _plan(model, [("tunedtvm", ["mm1", "relu", "mm2"], ("x",), ("y",))])
    with backends.registered(tuned):
        got = _select(model, plan, tmp_path, _never_timed, allowed=backends.cpu_candidates(), measurable=FOREIGN,
                      target="arm_2tpu")
    (span,) = got.record["spans"]
    assert span["chosen"] == "planned" and got.plan.segments == plan.segments
    assert span["candidates"] == {"planned": {"policy": "TVM's kernels tuned"},
                                  "litert": {"policy": "not built: the schedule's cut is tuned"}}
    assert span["why"] == f"policy: TVM's kernels of the schedule's cut are tuned; not measured: {FOREIGN}"


def test_a_policy_record_validates_in_the_manifest_and_inspect_shows_it(tmp_path):
    from edgesdk.report.text import cpu_selection_summary
    from edgesdk.runtime import manifest as mf

    model = _model("Erf")
    erf = _select(model, _plan(model, SPLIT), tmp_path, _never_timed, allowed=backends.cpu_candidates(),
                  measurable=FOREIGN, target="arm_2tpu").record
    mf._CPU_SELECTION(json.loads(json.dumps(erf)), "tuning.cpu_selection")  # raises where it does not validate
    with pytest.raises(mf.ManifestError):
        mf._CPU_SELECTION({**erf, "spans": [{**erf["spans"][0], "candidates": {"litert": {"policy": 1}}}]}, "t")
    assert cpu_selection_summary(erf) == [
        f"cpu backends: not measured ({FOREIGN}): chosen by policy",
        ("  s0..s1 (3 nodes): planned chosen; policy: the schedule's cut (litert: cannot lower relu: Erf has no "
         "tflite lowering)")]


def test_spans_stop_at_accelerators_and_pipeline_stages():
    seg = lambda i, dev="cpu": PlanSegment(f"s{i}", dev, "tvm", "", (f"n{i}",), (), (), 0.0, 0, 1.0)  # noqa: E731
    segs = (seg(0), seg(1), seg(2, "edgetpu:0"), seg(3), seg(4), seg(5), seg(6))
    base = Plan("t", "latency", (), (), {}, segs, tuple((s.id,) for s in segs), (("s4", "s5"),), {}, {}, {}, "", "",
                {}, {}, ())
    assert selection.spans(base) == [(0, 2), (3, 7)]  # a parallel step's groups are inside their span
    # a throughput plan's stages are the pipelining DP's: a span does not cross one
    streamed = replace(base, mode="throughput", pipeline_stages=(("s0",), ("s1", "s2"), ("s3", "s4", "s5", "s6")))
    assert selection.spans(streamed) == [(0, 1), (1, 2), (3, 7)]


def test_the_real_cpu_backends_build_and_agree_on_a_model(tmp_path):
    """No double: TVM, onnxruntime, LiteRT (fp32, XNNPACK) and OpenVINO each compile the span and pass the
    check against onnxruntime; the fake timer only decides which wins."""
    model = _model()
    got = _select(model, _plan(model, [("tvm", ["mm1", "relu", "mm2"], ("x",), ("y",))]), tmp_path,
                  _timer({"planned": 0.3, "onnxruntime": 0.2, "openvino": 0.15, "litert": 0.1}),
                  allowed=backends.cpu_candidates())
    span = got.record["spans"][0]
    # the plan's cut is TVM's whole span
    assert set(span["candidates"]) == {"planned", "onnxruntime", "litert", "openvino"}
    assert all("ms" in c for c in span["candidates"].values()), span
    assert span["chosen"] == "litert" and got.plan.segments[0].backend == "litert"


# --- TEST DOUBLE backends (the fake compilers the tests above register) ---------------------------


def compile_negated(job) -> Compiled:
    """An onnxruntime segment that negates its outputs: fast and wrong."""
    m = onnx.ModelProto()
    m.CopyFrom(job.model)
    for out in m.graph.output:
        for node in m.graph.node:
            for k, name in enumerate(node.output):
                if name == out.name:
                    node.output[k] = f"{name}__pre"
        m.graph.node.append(helper.make_node("Neg", [f"{out.name}__pre"], [out.name]))
    artifact = f"segments/{job.segment.id}.onnx"
    irm.save(m, job.segments_dir.parent / artifact)
    shapes, types = irm.static_shapes(job.model), irm.elem_types(job.model)
    spec = lambda n: TensorSpec(n, shapes[n], irm.dtype_name(types[n]))  # noqa: E731
    return Compiled(artifact, tuple(map(spec, job.segment.inputs)), tuple(map(spec, job.segment.outputs)))


def compile_scaled(job, factor: float | None = None) -> Compiled:
    """An onnxruntime segment whose outputs are `factor` (FACTOR by default) times what they should be."""
    m = onnx.ModelProto()
    m.CopyFrom(job.model)
    m.graph.initializer.append(numpy_helper.from_array(np.array(factor or FACTOR["value"], np.float32), "factor__"))
    for out in m.graph.output:
        for node in m.graph.node:
            node.output[:] = [f"{o}__pre" if o == out.name else o for o in node.output]
        m.graph.node.append(helper.make_node("Mul", [f"{out.name}__pre", "factor__"], [out.name]))
    artifact = f"segments/{job.segment.id}.onnx"
    irm.save(m, job.segments_dir.parent / artifact)
    shapes, types = irm.static_shapes(job.model), irm.elem_types(job.model)
    spec = lambda n: TensorSpec(n, shapes[n], irm.dtype_name(types[n]))  # noqa: E731
    return Compiled(artifact, tuple(map(spec, job.segment.inputs)), tuple(map(spec, job.segment.outputs)))


FACTOR = {"value": 1.02}


@pytest.mark.parametrize("factor, floor, kept", [(1.02, 0.0, False), (1.02, 0.01, True), (1.5, 0.01, False)])
def test_a_span_that_rounding_alone_moves_is_checked_within_that_floor(tmp_path, monkeypatch, factor, floor, kept):
    """A TEST DOUBLE backend whose outputs are 2 % off: refused at TOLERANCE where rounding moves the span by nothing;
    admitted where it moves it by 1 % (a FAKE floor: LeViT-128S measured 2.3 %), checked within 3 % then, and
    the record and the log say so; 50 % off is refused whatever the floor (and the floor is not measured)."""
    model = _model()
    monkeypatch.setitem(FACTOR, "value", factor)
    monkeypatch.setattr(selection, "_rounding_floor", lambda m, values: floor)  # A FAKE rounding floor
    scaled = Backend("scaled", runner="onnxruntime", rank=9, runtime_dists=("onnxruntime",),
                     compiler=f"{__name__}:compile_scaled", lowering="edgesdk.backends.onnxruntime:lowering_reason")
    logged: list[str] = []
    with backends.registered(scaled):
        got = _select(model, _plan(model, SPLIT), tmp_path, _timer({"planned": 0.9, "onnxruntime": 0.5, "scaled": 0.1}),
                      allowed=("onnxruntime", "scaled"), log=logged.append)
    (span,) = got.record["spans"]
    assert (span["chosen"] == "scaled") is kept, span
    if floor and factor - 1 < selection.FLOOR_PROBE:  # off by more, the floor is not even measured
        assert span["check_tolerance"] == {"rounding_floor": 0.01, "tolerance": 0.03}
        assert any("one float32 rounding step in its inputs moves its outputs by 1.00% of their scale" in line
                   and "checked within 3.00%" in line for line in logged), logged
    if not kept:
        assert span["candidates"]["scaled"]["skipped"].startswith("its y differs from onnxruntime by")


def test_the_rounding_floor_of_a_plain_span_is_far_under_the_tolerance():
    """The real measurement (onnxruntime on inputs moved by one rounding step): on the MLP, ~1e-7."""
    model = _model()
    x = np.random.default_rng(3).standard_normal((1, 16)).astype(np.float32)
    import onnxruntime as ort
    (y,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], {"x": x})
    assert 0 < selection._rounding_floor(model, [{"x": x, "y": y}]) < selection.TOLERANCE / 100
    # and where it measures the values against something else, it says how far: y doubled is 50 % of its scale off
    assert selection._rounding_floor(model, [{"x": x, "y": 2 * y}]) == pytest.approx(0.5, rel=1e-4)


def compile_broken(job) -> Compiled:
    raise RuntimeError(f"the TEST DOUBLE compiler failed on {job.segment.id}")


def no_relu(node, shapes, consts) -> str | None:
    return "the TEST DOUBLE has no Relu" if node.op_type == "Relu" else None


def all_tuned(models, device, tuning_db) -> str | None:
    """A TEST DOUBLE coverage check: every function of the segments has tuned records."""
    return None


def test_a_span_with_one_candidate_is_neither_built_nor_timed(tmp_path):
    model = _model()
    plan = _plan(model, [("tvm", ["mm1", "relu", "mm2"], ("x",), ("y",))])

    def no_timing(label, measure):
        raise AssertionError(f"{label} was timed")
    got = _select(model, plan, tmp_path, no_timing, allowed=("tvm",))
    assert got.plan.segments == plan.segments
    assert got.record["spans"] == [{"segments": ["s0"], "nodes": 3, "candidates": {}, "chosen": "planned",
                                    "why": "the only candidate"}]


def test_a_span_with_a_parallel_step_is_timed_as_the_device_runs_it_and_can_be_replaced(tmp_path):
    """The plan's cut runs its parallel step on the executor's workers; the whole span on onnxruntime
    replaces the step's segments, and the step leaves the plan."""
    rng = np.random.default_rng(0)
    ws = [numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), f"w{i}") for i in range(2)]
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["a"], name="mma"), helper.make_node("MatMul", ["x", "w1"], ["b"], name="mmb"),
             helper.make_node("Add", ["a", "b"], ["y"], name="add")]
    g = helper.make_graph(nodes, "fork", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], ws)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    model = irm.infer_shapes(model)
    plan = _plan(model, [("tvm", ["mma"], ("x",), ("a",)), ("tvm", ["mmb"], ("x",), ("b",)),
                         ("onnxruntime", ["add"], ("a", "b"), ("y",))])
    plan = replace(plan, segments=tuple(replace(s, threads=1) if s.id != "s2" else s for s in plan.segments),
                   parallel_steps=(("s0", "s1"),))
    got = _select(model, plan, tmp_path, _timer({"planned": 0.4, "tvm": 0.3, "onnxruntime": 0.1}))
    span = got.record["spans"][0]
    assert span["segments"] == ["s0", "s1", "s2"] and set(span["candidates"]) == {"planned", "tvm", "onnxruntime"}
    assert all("ms" in c for c in span["candidates"].values()), span  # the parallel cut built, ran and agreed
    assert [(s.id, s.backend) for s in got.plan.segments] == [("s0", "onnxruntime")]
    assert got.plan.parallel_steps == () and got.plan.pipeline_stages == (("s0",),)
    # a plan of CPU spans alone, measured: one inference is the measurement
    assert got.plan.predicted["latency_ms"] == pytest.approx(0.1)


def test_beside_an_accelerator_the_prediction_moves_by_the_measured_difference():
    """The simulated latency of a plan with an Edge TPU segment moves by (measured - predicted) of the
    CPU span: 1.0 (s0 and s1 at once) + 1.0 (s2) predicted, 0.25 measured."""
    seg = lambda i, dev="cpu", ms=1.0: PlanSegment(f"s{i}", dev, "tvm", "", (f"n{i}",), (), (), 0.0, 0, ms)  # noqa: E731
    plan = Plan("t", "latency", (), (), {}, (seg(0), seg(1), seg(2), seg(3, "edgetpu:0", 2.0)),
                (("s0",), ("s1",), ("s2",), ("s3",)), (("s0", "s1"),), {},
                {"latency_ms": 4.0, "sequential_ms": 5.0, "throughput_fps": 1.0}, {}, "", "", {}, {}, ())
    whole = replace(seg(0), backend="onnxruntime", nodes=("n0", "n1", "n2"))
    new = selection._replan(plan, {(0, 3): (selection.Candidate("onnxruntime", (whole,)), 0.25)})
    assert [(s.id, s.backend, s.predicted_ms) for s in new.segments] == [("s0", "onnxruntime", 0.25),
                                                                         ("s3", "tvm", 2.0)]
    assert new.parallel_steps == () and new.pipeline_stages == (("s0",), ("s3",))
    assert (new.predicted["latency_ms"], new.predicted["sequential_ms"]) == (2.25, 3.25)


def test_a_measurement_runs_the_candidate_alone_in_a_process_of_its_own(tmp_path):
    """No fake here: the real measurement of one candidate, in a child process, gives RUNS positive times."""
    model = _model()
    plan = _plan(model, [("onnxruntime", ["mm1", "relu", "mm2"], ("x",), ("y",))])
    got = _select(model, plan, tmp_path, selection.measured, allowed=("tvm",))
    span = got.record["spans"][0]
    assert set(span["candidates"]) == {"planned", "tvm"}
    assert all(c["ms"] > 0 for c in span["candidates"].values()), span
    assert got.plan.segments[0].predicted_ms == span["candidates"][span["chosen"]]["ms"]


def test_a_candidate_whose_timing_run_fails_is_skipped_with_its_reason(tmp_path):
    model = _model()
    fast = _timer({"planned": 0.9, "tvm": 0.5})

    def timer(label, measure):
        if label == "onnxruntime":
            raise RuntimeError("the timing run failed: Killed")
        return fast(label, measure)
    got = _select(model, _plan(model, SPLIT), tmp_path, timer)
    span = got.record["spans"][0]
    assert span["candidates"]["onnxruntime"] == {"skipped": "the timing run failed: Killed"}
    assert span["chosen"] == "tvm"


# --- int8 candidates (`--cpu-precision int8`) behind the accuracy gate ---------------------------------

def _select_int8(model, plan, tmp_path, timer, allowed=("onnxruntime", "litert"), n=8, target="x86", measurable=None,
                 shape=(1, 16), log=lambda s: None, int8_dir="int8"):
    """`select` with int8 candidates, on `n` samples (a quarter held out for the gate)."""
    target, _ = load_target(target)
    rng = np.random.default_rng(1)
    samples = [{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(n)]
    return selection.select(plan, model, _segment_models(model), target, samples, allowed=allowed,
                            tuning_db=tmp_path / "db" / "cpu", cache=TimingCache(tmp_path / "db" / "timing.json"),
                            measurable=measurable, host="test host", log=log, timer=timer, precision="int8",
                            int8_dir=tmp_path / int8_dir)


def test_int8_candidates_are_quantized_gated_and_chosen_when_fastest(tmp_path):
    model = _model()
    timer = _timer({"planned": 0.9, "onnxruntime": 0.8, "litert": 0.7, "litert-int8": 0.2, "onnxruntime-int8": 0.3})
    got = _select_int8(model, _plan(model, SPLIT), tmp_path, timer)
    rec = got.record
    assert rec["precision"] == "int8"
    assert rec["candidates"] == ["onnxruntime", "litert", "onnxruntime-int8", "litert-int8"]
    assert rec["gate"] == {"cosine": selection.GATE_COSINE, "top1": selection.GATE_TOP1,
                           "calibration_samples": 6, "held_out_samples": 2}
    (span,) = rec["spans"]
    for name in ("litert-int8", "onnxruntime-int8"):  # an MLP quantizes well: both pass the gate
        gate = span["candidates"][name]["gate"]
        assert gate["cosine"] >= selection.GATE_COSINE and gate["samples"] == 2, gate
        assert gate["top1"] is not None and gate["top1"] >= selection.GATE_TOP1  # y is (1, 8) class scores
    assert span["chosen"] == "litert-int8"
    (seg,) = got.plan.segments
    assert seg.backend == "litert-int8" and seg.predicted_ms == 0.2


def test_a_span_holding_a_node_kept_on_the_cpu_for_accuracy_has_no_int8_candidate(tmp_path):
    """A node the plan keeps in float on the CPU (`Plan.keep_on_cpu`: the accuracy remedy's culprits,
    `--keep-on-cpu`) stays float: its span's int8 candidates are skipped with why, however fast they are."""
    model = _model()
    timer = _timer({"planned": 0.9, "onnxruntime": 0.8, "litert": 0.7, "litert-int8": 0.1, "onnxruntime-int8": 0.1})
    plan = replace(_plan(model, SPLIT), keep_on_cpu={"nodes": ["relu"], "segments": {"relu": "s0"}})
    got = _select_int8(model, plan, tmp_path, timer)
    (span,) = got.record["spans"]
    for name in ("litert-int8", "onnxruntime-int8"):
        assert span["candidates"][name]["skipped"] == "relu kept in float on the cpu for accuracy (plan.json keep_on_cpu)"
    assert span["chosen"] == "litert" and not {"litert-int8", "onnxruntime-int8"} & set(timer.asked)


def test_an_int8_candidate_under_the_gate_is_never_chosen_however_fast(tmp_path, monkeypatch):
    """The gate made impossible to pass: every int8 candidate is skipped with why, and the span stays
    fp32 though the fake timer calls int8 fastest. onnxruntime's int8 is refused by the gate on the
    held-out samples; LiteRT's already by its mixed-precision search on the calibration samples, which
    no share of float ops lets reach a cosine of 1.01."""
    monkeypatch.setattr(selection, "GATE_COSINE", 1.01)
    model = _model()
    timer = _timer({"planned": 0.9, "onnxruntime": 0.8, "litert": 0.7, "litert-int8": 0.1, "onnxruntime-int8": 0.1})
    got = _select_int8(model, _plan(model, SPLIT), tmp_path, timer)
    (span,) = got.record["spans"]
    why = span["candidates"]["onnxruntime-int8"]["skipped"]
    assert why.startswith("accuracy gate: y's cosine similarity to fp32 is ") and "on 2 held-out samples" in why
    why = span["candidates"]["litert-int8"]["skipped"]
    assert why.startswith("mixed precision misses the accuracy target even with 1 of 2 ops float (y's cosine"), why
    assert span["chosen"] == "litert" and "litert-int8" not in timer.asked and "onnxruntime-int8" not in timer.asked


def test_full_int8_under_the_gate_is_searched_for_mixed_precision_gated_chosen_and_replayed(tmp_path):
    """The cancelling model (tests/backends/test_tflite_mixed.py), where full int8 loses the signal: LiteRT's
    int8 candidate keeps the few ops that cost it float, passes the gate on the held-out samples, wins by
    the fake timer, and is quantized again for the package stage with the same ops float, to the same
    bytes. A rebuild replays the timing cache: no search, the same ops, the same bytes."""
    from tests.backends.test_tflite_mixed import cancelling_model

    model = irm.infer_shapes(cancelling_model())
    nodes = [n.name for n in model.graph.node]
    plan = replace(_plan(model, [("onnxruntime", nodes, ("x",), ("z",))]), outputs=("z",))
    timer = _timer({"planned": 0.9, "litert": 0.7, "litert-int8": 0.2, "onnxruntime-int8": 0.3})
    lines: list[str] = []
    got = _select_int8(model, plan, tmp_path, timer, n=16, shape=(1, 4, 8, 8), log=lines.append)
    (span,) = got.record["spans"]
    cand = span["candidates"]["litert-int8"]
    assert span["chosen"] == "litert-int8" and cand["gate"]["cosine"] >= selection.GATE_COSINE
    assert {"Add", "Sub"} <= {name.rsplit("/", 1)[-1] for name in cand["mixed"]["names"]} and cand["mixed"]["float_ops"] == len(cand["mixed"]["names"])
    assert cand["mixed"]["ops"] == 7
    assert "mixed" not in span["candidates"]["onnxruntime-int8"]  # onnxruntime quantizes every node
    assert any("ranking 7 ops by the error each adds alone" in line for line in lines)
    quantized = got.quantized["s0"]
    assert quantized["mixed"]["float_ops"] == cand["mixed"]["names"]
    first = (tmp_path / "int8" / quantized["artifact"]).read_bytes()
    summary = "\n".join(selection_summary(got.record))
    assert f"litert-int8 0.200 ms (cosine {cand['gate']['cosine']:.4f}" in summary
    assert f"mixed precision, {cand['mixed']['float_ops']} of 7 ops float" in summary

    lines.clear()
    again = _select_int8(model, plan, tmp_path, _confirming(0.2), n=16, shape=(1, 4, 8, 8), log=lines.append,
                         int8_dir="int8-again")
    assert again.record["spans"] == got.record["spans"]
    assert not any("ranking" in line for line in lines)
    assert (tmp_path / "int8-again" / again.quantized["s0"]["artifact"]).read_bytes() == first


def selection_summary(record):
    from edgesdk.report.text import cpu_selection_summary

    return cpu_selection_summary(record)


def test_top1_agreement_is_gated_on_class_scores():
    """`gate` on a bundle double whose arg max differs from the reference's on one held-out sample in four."""
    class Flipping:  # A TEST DOUBLE of an opened bundle: returns the reference, its arg max moved on sample 0
        inputs = (TensorSpec("x", (1, 4), "float32"),)
        outputs = (TensorSpec("y", (1, 5), "float32"),)

        def run(self, feeds):
            y = held[int(feeds["x"][0, 0])]["y"].copy()
            if feeds["x"][0, 0] == 0:
                y[0, [0, 1]] = y[0, [1, 0]]  # swaps the top two, which are close: cosine stays high
            return {"y": y}

    held = [{"x": np.full((1, 4), k, np.float32), "y": np.array([[10.0, 9.99, 1, 1, 1]], np.float32)} for k in range(4)]
    with pytest.raises(ValueError, match=r"accuracy gate: y's top-1 agrees with fp32 on 75% < 90% of 4 held-out"):
        selection.gate(Flipping(), held, ["y"])
    # not a model output (an intermediate tensor): no top-1 is taken, the cosine passes
    assert selection.gate(Flipping(), held, []) == {"cosine": pytest.approx(1.0, abs=1e-6), "top1": None, "samples": 4}


def test_held_out_split():
    s = [{"k": i} for i in range(32)]
    calib, held = selection.held_out_split(s)
    assert len(calib) == 24 and held == s[24:]
    one = [{"k": 0}]
    assert selection.held_out_split(one) == (one, one)


def test_a_foreign_target_takes_litert_int8_by_policy_where_it_passes_the_gate(tmp_path):
    """An aarch64 target with --cpu-precision int8: nothing is timed; LiteRT's int8 is built, gated on
    the held-out samples here, chosen, and quantized again for the package stage."""
    model = _model()
    got = _select_int8(model, _plan(model, SPLIT), tmp_path, _never_timed, target="arm_2tpu", measurable=FOREIGN)
    (span,) = got.record["spans"]
    assert got.record["precision"] == "int8" and got.record["measured_on"] is None
    assert span["chosen"] == "litert-int8" and span["candidates"]["litert-int8"]["gate"]["cosine"] >= selection.GATE_COSINE
    assert span["why"] == f"policy: LiteRT int8 lowers every node and passes the accuracy gate; not measured: {FOREIGN}"
    assert "litert" not in span["candidates"]  # not built: int8 was admitted first
    (seg,) = got.plan.segments
    assert seg.backend == "litert-int8" and set(got.quantized) == {"s0"}
    assert (tmp_path / "int8" / got.quantized["s0"]["artifact"]).is_file()


def test_a_foreign_target_under_the_gate_falls_back_to_litert_fp32_with_why(tmp_path, monkeypatch):
    monkeypatch.setattr(selection, "GATE_COSINE", 1.01)
    model = _model()
    got = _select_int8(model, _plan(model, SPLIT), tmp_path, _never_timed, target="arm_2tpu", measurable=FOREIGN)
    (span,) = got.record["spans"]
    # refused by its mixed-precision search already: no share of float ops reaches a cosine of 1.01
    why = "mixed precision misses the accuracy target even with 1 of 2 ops float (y's cosine"
    assert span["chosen"] == "litert" and span["candidates"]["litert-int8"]["skipped"].startswith(why)
    assert span["why"].startswith(f"policy: LiteRT lowers every node (litert-int8: {why}")
    assert got.quantized == {}


def test_low_memory_takes_the_one_candidate_left_unbuilt_and_untimed(tmp_path):
    """`only` (--low-memory): candidates another backend compiles are left out, with why; the one left
    (onnxruntime's whole span, the plan's cut holding a TVM segment) is taken without a build or a timing."""
    model = _model()
    target, _ = load_target("x86")
    x = np.random.default_rng(1).standard_normal((1, 16)).astype(np.float32)
    got = selection.select(_plan(model, SPLIT), model, _segment_models(model), target, [{"x": x}], allowed=("onnxruntime",),
                           tuning_db=tmp_path / "db" / "cpu", cache=TimingCache(tmp_path / "db" / "timing.json"),
                           measurable=None, host="test host", log=lambda s: None, timer=_never_timed, only=("onnxruntime",))
    (span,) = got.record["spans"]
    assert span["chosen"] == "onnxruntime" and span["why"] == "the only candidate (--low-memory)"
    assert span["candidates"] == {"planned": {"skipped": "--low-memory: compiled by onnxruntime, tvm"}}
    (seg,) = got.plan.segments
    assert (seg.backend, seg.nodes) == ("onnxruntime", ("mm1", "relu", "mm2")) and set(got.models) == {"s0"}
    assert not (tmp_path / "db" / "timing.json").exists()  # nothing measured


def test_an_output_a_quantizelinear_makes_may_differ_by_one_step():
    """Two int8 kernels round a requantization differently: a QuantizeLinear's output one integer step off the
    reference passes (scale 120: TOLERANCE alone allows 0.12), two steps do not; an integer output nothing
    quantizes (an arg max) gets no step."""
    class Handle:  # A TEST DOUBLE for an opened candidate: its outputs given
        inputs = (TensorSpec("x", (1, 4), "float32"),)
        outputs = (TensorSpec("q", (1, 4), "int8"),)

        def __init__(self, q):
            self.q = q

        def run(self, feeds):
            return {"q": self.q}

    want = np.array([[120, -3, 7, 0]], np.int8)
    sample = {"x": np.zeros((1, 4), np.float32), "q": want}
    selection.check(Handle(want + np.int8(1)), [sample], quantized=frozenset({"q"}))
    with pytest.raises(selection.Disagrees, match="its q differs from onnxruntime by 2"):
        selection.check(Handle(want + np.int8(2)), [sample], quantized=frozenset({"q"}))
    with pytest.raises(selection.Disagrees, match="its q differs from onnxruntime by 1"):
        selection.check(Handle(want + np.int8(1)), [sample])
