"""The accuracy remedy end to end: a bundle below the accuracy gate is planned again with its culprit layers
kept in float on the CPU, and the plan, the manifest, the build summary and `inspect` say which nodes moved,
why, what the gate measured before and after, and what that costs in predicted latency (docs/accuracy.md).

The model is the YOLOv8-style head of `tests/yolo_head.py` for arm_2tpu, calibrated on real photographs
(scikit-image's samples): its last Concat runs in int8 on the Edge TPU, where the class scores ([0, 1]) take
the boxes' step (pixels), so the scores miss the gate whatever the calibration."""

from __future__ import annotations

import json

import pytest

from tests import yolo_head
from tests.test_cli import assert_user_facing, edgesdk

pytestmark = pytest.mark.slow  # whole builds planned again by the accuracy remedy

SCORES = "output0[:, 4:6]"


def test_below_the_gate_the_culprits_are_kept_on_the_cpu_and_the_plan_says_what_it_cost(tmp_path):
    path, calib = yolo_head.written_with_photos(tmp_path)
    out = tmp_path / "out"
    args = ["build", str(path), "--target", "arm_2tpu", "-o", str(out), "--calib", str(calib), "--calib-samples", "12",
            "--calib-method", "minmax", "--calib-preprocess", yolo_head.PHOTOS_PREPROCESS]

    # without the remedy: the build fails, its hint names the culprits to keep on the CPU
    proc = edgesdk(*args, "--no-accuracy-remedy")
    assert_user_facing(proc, 1, f"error: the bundle misses the target's accuracy gate against fp32 on 3 held-out "
                                f"sample(s): {SCORES} (scores)")
    hint = next(line for line in proc.stderr.splitlines() if line.startswith("hint: "))
    assert "keep the culprit layers in float on the CPU: --keep-on-cpu /scores," in hint, hint
    assert not (out / "bundle").exists() and "accuracy remedy" not in proc.stderr

    # with it (the default): one round keeps the culprits on the CPU, and the bundle passes the gate
    proc = edgesdk(*args)
    assert proc.returncode == 0, proc.stderr
    assert "accuracy remedy: round 1: the bundle misses the accuracy gate; keeping /scores (shared-quantization)" \
        in proc.stderr
    plan = json.loads((out / "bundle" / "plan.json").read_text())
    kept = plan["keep_on_cpu"]
    assert "/scores" in kept["nodes"] and set(kept["segments"]) == set(kept["nodes"])
    devices = {s["id"]: s["device"] for s in plan["segments"]}
    assert all(devices[sid] == "cpu" for sid in kept["segments"].values()), plan["segments"]
    assert all(n not in s["nodes"] for s in plan["segments"] if s["device"] != "cpu" for n in kept["nodes"])
    assert any(d.startswith("edgetpu") for d in devices.values())
    # the latency the remedy costs, beside the plan without it
    p = kept["predicted"]
    assert p["latency_ms"] == plan["predicted"]["latency_ms"] and p["latency_ms_without"] < p["latency_ms"]
    [step] = kept["remedy"]
    assert step["round"] == 1 and step["latency_ms"] == p["latency_ms_without"]
    assert [f["part"] for f in step["failures"]] == [SCORES]
    moved = {m["node"]: m for m in step["moved"]}
    assert set(moved) == set(kept["nodes"]) and moved["/scores"]["cause"] == "shared-quantization"
    assert moved["/scores"]["device"].startswith("edgetpu") and moved["/scores"]["added_error"] > 0.1
    # the manifest: the gate passed, with its figures before the remedy and after
    accuracy = json.loads((out / "bundle" / "manifest.json").read_text())["accuracy"]
    assert accuracy["gate"]["passed"] is True and "accepted_loss" not in accuracy
    remedy = accuracy["remedy"]
    assert remedy["after"]["passed"] is True and remedy["predicted"] == p
    before, after = remedy["rounds"][0]["parts_before"][SCORES], remedy["after"]["parts"][SCORES]
    threshold = accuracy["gate"]["thresholds"]["scores"]["mean_error"]
    assert before["mean_error"] > threshold >= after["mean_error"], (before, after)
    # the build summary and inspect say so
    for text in (proc.stderr, edgesdk("inspect", str(out / "bundle")).stdout):
        assert "kept in float on the cpu: /scores (round 1: shared-quantization, " in text, text
        assert f"predicted latency {p['latency_ms_without']:.3f} ms without that, {p['latency_ms']:.3f} ms with it" \
            in text, text
        assert f"{SCORES}: before the remedy cosine " in text, text
    assert "kept in float on the cpu (the accuracy remedy, 1 round(s)): " in proc.stderr
    assert "Kept in float on the CPU" in (out / ".build" / "6-package" / "accuracy.html").read_text()

    # a name the model does not have is refused before anything is placed
    proc = edgesdk(*args, "--keep-on-cpu", "/scores,/no/such/node", "--until", "schedule")
    assert_user_facing(proc, 2, "error: --keep-on-cpu names 1 node(s) the model does not have: /no/such/node")


def _failure(culprits: list[dict], probe: dict | None = None):
    from edgesdk.bundling.gate import GateFailure

    return GateFailure("below", "hint", ["figures"], {"parts": {SCORES: {"cosine": 0.9}}, "culprits": culprits,
                                                       "failures": [{"part": SCORES, "kind": "scores", "missed": {}}],
                                                       **({"probe": probe} if probe else {})})


def _culprit(node: str, segment: str, added: float, cause: str = "shared-quantization") -> dict:
    return {"node": node, "segment": segment, "op": "Conv", "cause": cause, "added_error": added, "error": added,
            "added_snr_db": 10.0, "why": "..."}


def test_a_round_moves_the_culprits_that_matter_on_an_accelerator_at_most_three_times(tmp_path):
    """Which culprits a round keeps on the CPU: those on an accelerator (not one already on the CPU) losing at
    least a tenth of the worst one's loss, an approximation's replaced nodes each, none already kept; from the
    second round, the segment the probe found best in float instead; no round where the user accepts the loss
    or turns the remedy off; after 3 rounds, or with nothing left to move, the error's notes say what was
    tried."""
    import dataclasses

    from edgesdk.pipeline import REMEDY_ROUNDS, BuildOptions, _probed, _remedy, stage_dir
    from edgesdk.scheduling.plan import Plan

    segment = {"artifact": "segments/s.onnx", "inputs": [], "outputs": [], "flops": 0.0, "param_bytes": 0,
               "predicted_ms": 1.0, "backend": "tflite"}
    plan = {"target": "arm_2tpu", "mode": "latency", "inputs": ["x"], "outputs": ["y"], "probes": {},
            "segments": [{**segment, "id": "s0", "device": "edgetpu:0", "nodes": ["a", "b", "c", "d", "f", "g"]},
                         {**segment, "id": "s1", "device": "cpu", "backend": "litert", "nodes": ["e"]}],
            "pipeline_stages": [["s0"], ["s1"]], "predicted": {"latency_ms": 1.5, "throughput_fps": 600.0}}
    tune = stage_dir(tmp_path, "tune")
    tune.mkdir(parents=True)
    (tune / "plan.json").write_text(json.dumps(plan))
    options = BuildOptions(model=tmp_path / "m.onnx", target="arm_2tpu", out=tmp_path, start="compress")
    culprits = [_culprit("a", "s0", 0.5), _culprit("e", "s1", 0.9), _culprit("b, c", "s0", 0.06, "approximation"),
                _culprit("d", "s0", 0.04, "calibration-clipping")]
    said = []
    first = _remedy(options, _failure(culprits), said.append)
    assert first.keep_on_cpu == ("a", "b", "c") and first.start is None  # d: under a tenth of a's 0.5; e: on the cpu
    [step] = first.remedy
    assert step["round"] == 1 and step["latency_ms"] == 1.5 and [m["node"] for m in step["moved"]] == ["a", "b", "c"]
    assert step["moved"][0]["device"] == "edgetpu:0" and step["failures"][0]["part"] == SCORES
    assert said == ["accuracy remedy: round 1: the bundle misses the accuracy gate; keeping a (shared-quantization), "
                    "b (approximation), c (approximation) in float on the cpu and planning again from the schedule stage"]
    # a later round: where the package stage's probe found an accelerator segment whose float version does
    # better end to end, its nodes (those not kept already); the probe is not used in the first round
    probe = {"measure": "the accuracy gate on the held-out samples", "samples": 3,
             "int8": {"met": False, "shortfall": 0.5, "said": "below"},
             "float": [{"segments": ["s0"], "devices": ["edgetpu:0"], "nodes": ["c", "d", "f"], "met": True,
                        "shortfall": 0.0, "said": "within the gate"}]}
    assert _remedy(options, _failure(culprits, probe), said.append).keep_on_cpu == ("a", "b", "c")
    second = _remedy(first, _failure([_culprit("a", "s0", 0.5), _culprit("g", "s0", 0.3)], probe), said.append)
    assert second.keep_on_cpu == ("a", "b", "c", "d", "f") and len(second.remedy) == 2
    assert [(m["node"], m["cause"]) for m in second.remedy[1]["moved"]] == [("d", "end-to-end"), ("f", "end-to-end")]
    assert second.remedy[1]["probe"].startswith("with s0 (3 nodes) in float")  # once, not node by node
    assert said[-1].startswith("accuracy remedy: round 2: the bundle misses the accuracy gate; keeping 2 node(s) "
                               "(d, f): with s0 (3 nodes) in float and every other segment int8, the accuracy gate on "
                               "the held-out samples: within the gate (all int8: below)")
    # a probe whose best segment does no better than all int8 moves nothing: the culprits do
    blind = {**probe, "int8": {"met": True, "shortfall": 0.0, "said": "met on the probe's samples too"}}
    assert _probed(blind, Plan.load(stage_dir(tmp_path, "tune")), first.keep_on_cpu) == ([], None)
    useless = {**probe, "float": [{**probe["float"][0], "met": False, "shortfall": 0.5}]}
    third = _remedy(second, _failure([_culprit("a", "s0", 0.5), _culprit("g", "s0", 0.3)], useless), said.append)
    assert third.keep_on_cpu == ("a", "b", "c", "d", "f", "g") and len(third.remedy) == REMEDY_ROUNDS == 3
    # then no more: the error says what was tried
    last = _failure([_culprit("h", "s0", 0.3), _culprit("b", "s0", 0.1)])
    assert _remedy(third, last, said.append) is None
    assert last.notes == ["figures", "accuracy remedy: round 1 kept a, b, c on the cpu in float (1.500 ms predicted "
                          "before it)", "accuracy remedy: round 2 kept d, f on the cpu in float (1.500 ms predicted "
                          "before it)", "accuracy remedy: round 3 kept g on the cpu in float (1.500 ms predicted before "
                          "it)", "accuracy remedy: stopped after 3 round(s), still below the gate"]
    nothing = _failure([_culprit("a", "s0", 0.5), _culprit("e", "s1", 0.9)])
    assert _remedy(first, nothing, said.append) is None
    assert nothing.notes[-1] == "accuracy remedy: no culprit is left on an accelerator"
    # nothing tried, nothing said: the user accepts the loss, turns the remedy off, or no culprit is on an accelerator
    for opts, found in ((dataclasses.replace(options, accept_accuracy_loss=True), culprits),
                        (dataclasses.replace(options, accuracy_remedy=False), culprits),
                        (options, [_culprit("e", "s1", 0.9)])):
        failure = _failure(found)
        assert _remedy(opts, failure, said.append) is None and failure.notes == ["figures"]
    assert len(said) == 4


def test_a_probe_round_is_said_once_not_node_by_node():
    """A probe's round moves a set of segments, which can be most of a model (YOLOv8n: 175 nodes): the
    summary and `inspect` say the round once, with its sentence, and the culprits' nodes one by one."""
    from edgesdk.bundling.gate import remedy
    from edgesdk.report.text import remedy_lines

    culprit = {"node": "a", "segment": "s0", "device": "edgetpu:0", "cause": "saturation", "added_error": 0.2}
    probed = [{"node": n, "segment": "s2", "device": "edgetpu:1", "cause": "end-to-end", "added_error": 0.5,
               "why": "in float with s2: the round's probe"} for n in ("b", "c", "d", "e", "f")]
    rounds = [{"round": 1, "moved": [culprit], "latency_ms": 1.0, "failures": [], "parts": {}},
              {"round": 2, "moved": probed, "latency_ms": 1.5, "failures": [], "parts": {},
               "probe": "with s2 (5 nodes) in float and every other segment int8, the gate: within the gate"}]
    kept = {"nodes": ["a", "b", "c", "d", "e", "f"], "segments": {}, "remedy": rounds,
            "predicted": {"latency_ms": 3.0, "latency_ms_without": 1.0, "cost_ms": 2.0}}
    record = remedy(kept, {"gate": {"passed": True}, "parts": {}})
    assert record["rounds"][1]["probe"].startswith("with s2 (5 nodes)") and "probe" not in record["rounds"][0]
    first = remedy_lines(record, {})[0]
    assert first == ("kept in float on the cpu: a (round 1: saturation, 20.0% of its range lost there on edgetpu:0); "
                     "5 node(s) (b, c, d, e, ...; round 2, end to end: with s2 (5 nodes) in float and every other "
                     "segment int8, the gate: within the gate)")


def test_a_remedy_that_left_nothing_on_an_accelerator_says_so(tmp_path):
    """Kept in float everywhere by the remedy, a bundle passes the gate as the CPU's model: the build warns, naming
    the rounds and what to do; a plan that still uses an accelerator says nothing."""
    from edgesdk.pipeline import _warn_all_on_cpu

    said = []
    for devices in (["cpu", "cpu"], ["cpu", "edgetpu:0"]):
        (tmp_path / "plan.json").write_text(json.dumps({"segments": [{"device": d} for d in devices]}))
        _warn_all_on_cpu(tmp_path, 3, said.append)
    assert len(said) == 1 and said[0].startswith("warning: the accuracy remedy kept every node in float on the CPU "
                                                 "(3 round(s)): no accelerator runs any of this model")
    assert "--accept-accuracy-loss" in said[0] and "--calib" in said[0]
