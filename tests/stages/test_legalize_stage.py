"""The legalize stage end to end on arm_2tpu: exact rewrites where the Edge TPU refuses an op, ReLU-sum
approximations of the functions it lacks within the bound, the import stage's optimizations after them,
coverage and transitions before and after; the bound's failure as a clear error or a CPU fallback; and
`edgesdk check`, which rewrites nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.model_zoo import ROOT

EPS = 0.01


def _model(path: Path) -> Path:
    """Conv -> Softplus -> Conv -> LeakyRelu -> Conv -> GELU (tf2onnx's erf form): the Edge TPU lacks
    Softplus, LeakyRelu and Erf."""
    rng = np.random.default_rng(0)

    def w(name, shape):
        return numpy_helper.from_array((rng.normal(size=shape) * 0.3).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Softplus", ["c1"], ["s1"], name="softplus"),
        helper.make_node("Conv", ["s1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("LeakyRelu", ["c2"], ["l2"], name="leaky", alpha=0.1),
        helper.make_node("Conv", ["l2", "w3"], ["c3"], name="conv3", pads=[1, 1, 1, 1]),
        helper.make_node("Div", ["c3", "sqrt2"], ["d"], name="gelu_div"),
        helper.make_node("Erf", ["d"], ["e"], name="gelu_erf"),
        helper.make_node("Add", ["e", "one"], ["a"], name="gelu_add"),
        helper.make_node("Mul", ["c3", "a"], ["m"], name="gelu_mul"),
        helper.make_node("Mul", ["m", "half"], ["y"], name="gelu_half"),
    ]
    inits = [w("w1", (8, 3, 3, 3)), w("w2", (8, 8, 3, 3)), w("w3", (8, 8, 3, 3)),
             numpy_helper.from_array(np.float32(np.sqrt(2)), "sqrt2"), numpy_helper.from_array(np.float32(1), "one"),
             numpy_helper.from_array(np.float32(0.5), "half")]
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    onnx.save(m, path)
    return path


def _build(model: Path, out: Path, **options):
    from edgesdk.pipeline import BuildOptions, build

    result = build(BuildOptions(model=model, target="arm_2tpu", out=out, until="legalize", **options))
    return result.stages[1].record, out / ".build" / "2-legalize"


def _run(model: onnx.ModelProto | Path, x: np.ndarray) -> np.ndarray:
    m = onnx.load(str(model)) if isinstance(model, Path) else model
    m.ir_version = min(m.ir_version, 10)
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_rewrites_and_approximations_move_everything_onto_the_edge_tpu(tmp_path):
    src = _model(tmp_path / "m.onnx")
    record, stage = _build(src, tmp_path / "o")
    assert record["rewrites"] == {"leaky-relu-to-prelu": {"count": 1, "exactness": "exact"}}
    approx = {tuple(a["nodes"]): a for a in record["approximations"]}
    assert set(approx) == {("softplus",), ("gelu_erf",)}
    assert approx[("gelu_erf",)]["ops"] == ["Div", "Erf", "Add", "Mul", "Mul"]  # the whole GELU, once
    for a in approx.values():
        assert a["grid_error"] <= EPS and a["knots"] and a["int8_error"] > 0
    # before: Softplus, LeakyRelu and Erf on the CPU; after: every node on the Edge TPU, no transitions
    assert record["before"]["coverage"]["edgetpu"]["ops_fraction"] < 1 and record["before"]["transitions"] > 0
    assert record["after"]["coverage"]["edgetpu"]["ops_fraction"] == 1.0 and record["after"]["transitions"] == 0
    model = onnx.load(str(stage / "model.onnx"))
    assert not {"Softplus", "LeakyRelu", "Erf"} & {n.op_type for n in model.graph.node}
    # each approximation as two convolutions (relu_sum.to_onnx_conv), whatever its knot count
    shifts = [n for n in model.graph.node if n.op_type == "Conv" and n.name.startswith("relu_sum")]
    assert len(shifts) == 4, [n.name for n in model.graph.node]
    capable = [{p.key: p.value for p in n.metadata_props}["edgesdk.capable"] for n in model.graph.node]
    assert all(c.startswith("edgetpu") for c in capable), capable
    # the legalized function against the original, beyond the calibration samples the build used
    x = np.random.default_rng(7).uniform(-1, 1, (1, 3, 16, 16)).astype(np.float32)
    ref, got = _run(src, x), _run(stage / "model.onnx", x)
    e2e = record["end_to_end"]
    assert 0 < np.abs(got - ref).max() < 0.1, np.abs(got - ref).max()
    assert e2e["max_abs_error"] > 0 and e2e["samples"] > 0
    report = json.loads((stage / "legalize.json").read_text())
    assert report["approximations"] and report["refusals"] == []


def test_a_bound_that_cannot_be_met_falls_back_to_the_cpu_or_fails_naming_the_node(tmp_path):
    from edgesdk.errors import UserError

    src = _model(tmp_path / "m.onnx")
    with pytest.raises(UserError) as err:
        _build(src, tmp_path / "o", max_abs_error=1e-7, allow_cpu_fallback=False)  # --no-cpu-fallback
    assert err.value.code == "legalize.approximation-bound"
    assert "softplus" in "\n".join(err.value.notes) and "gelu_erf" in "\n".join(err.value.notes)
    assert "--no-cpu-fallback" in err.value.hint
    assert not (tmp_path / "o" / ".build" / "2-legalize").exists()

    record, stage = _build(src, tmp_path / "f", max_abs_error=1e-7)  # the default: exact, on the CPU
    assert {tuple(f["nodes"]) for f in record["fallbacks"]} == {("softplus",), ("gelu_erf",)}
    assert record["approximations"] == []
    ops = {n.op_type for n in onnx.load(str(stage / "model.onnx")).graph.node}
    assert {"Softplus", "Erf"} <= ops and "LeakyRelu" not in ops  # the exact rewrite still applies


def test_the_bound_in_int8_steps_of_each_output(tmp_path):
    """--max-error-lsb K bounds each approximation by K int8 steps of its own output (the range it takes on
    the calibrated input range / 255): half a step needs more knots than two, each meets its bound, and
    with --max-abs-error too the tighter bound holds."""
    src = _model(tmp_path / "m.onnx")
    fine, _ = _build(src, tmp_path / "half", max_error_lsb=0.5)
    coarse, _ = _build(src, tmp_path / "two", max_error_lsb=2.0)
    for record, k in ((fine, 0.5), (coarse, 2.0)):
        for a in record["approximations"]:
            assert a["bound_from"].startswith(f"{k:g} int8 steps of the output, ")
            step = float(a["bound_from"].rsplit(", ", 1)[1].split()[0])
            assert a["bound"] == pytest.approx(k * step, rel=5e-3)   # the step as printed, 3 digits
            assert a["grid_error"] <= a["bound"]
    knots = lambda r: {tuple(a["nodes"]): len(a["knots"]) for a in r["approximations"]}  # noqa: E731
    assert all(knots(fine)[n] > knots(coarse)[n] for n in knots(fine)), (knots(fine), knots(coarse))
    both, _ = _build(src, tmp_path / "both", max_error_lsb=2.0, max_abs_error=1e-3)
    for a in both["approximations"]:
        assert a["bound"] <= 1e-3 and a["grid_error"] <= 1e-3


def test_no_rewrites_and_cpu_targets_leave_the_graph_alone(tmp_path):
    from edgesdk.pipeline import BuildOptions, build

    src = _model(tmp_path / "m.onnx")
    record, stage = _build(src, tmp_path / "o", legalize_rewrites=False)
    assert record["rewrites"] == {} and record["approximations"] == []
    assert {"Softplus", "LeakyRelu", "Erf"} <= {n.op_type for n in onnx.load(str(stage / "model.onnx")).graph.node}
    result = build(BuildOptions(model=src, target="x86", out=tmp_path / "x", until="legalize"))
    assert result.stages[1].record["rewrites"] == {} and result.stages[1].record["approximations"] == []


def test_check_reports_without_rewriting(tmp_path):
    src = _model(tmp_path / "m.onnx")
    before = src.read_bytes()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "sdk")}
    cmd = [sys.executable, "-m", "edgesdk.cli", "check", str(src), "--target", "arm_2tpu"]
    text = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert text.returncode == 0, text.stderr
    assert "Softplus" in text.stdout and "edgetpu.unsupported-op" in text.stdout
    assert "as imported: edgetpu" in text.stdout and "after legalize: edgetpu" in text.stdout
    assert "rewrite leaky-relu-to-prelu x1 (exact)" in text.stdout and "approximate softplus" in text.stdout
    js = subprocess.run(cmd + ["--json"], capture_output=True, text=True, env=env, timeout=300)
    assert js.returncode == 0, js.stderr
    report = json.loads(js.stdout)
    nodes = {n["node"]: n for n in report["nodes"]}
    assert nodes["softplus"]["devices"] == ["cpu/tvm"]
    assert nodes["softplus"]["refusals"][0]["code"] == "edgetpu.unsupported-op"
    assert nodes["conv1"]["devices"][0] == "edgetpu" and nodes["conv1"]["flops"] > 0
    assert report["before"]["transitions"] > report["after"]["transitions"] == 0
    assert src.read_bytes() == before
    bad = subprocess.run(cmd[:4] + ["--target", "nope"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_build_prints_what_legalize_did(tmp_path):
    src = _model(tmp_path / "m.onnx")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "sdk")}
    r = subprocess.run([sys.executable, "-m", "edgesdk.cli", "build", str(src), "--target", "arm_2tpu", "-o",
                        str(tmp_path / "o"), "--until", "legalize"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "legalize: edgetpu runs 70.0% -> 100.0% of ops" in r.stderr, r.stderr
    assert "rewrites: leaky-relu-to-prelu x1" in r.stderr
    assert "2 function(s) approximated by sums of ReLUs (bound 0.01)" in r.stderr
    assert "outputs move by at most" in r.stderr


def test_a_recurrent_cell_stays_on_the_cpu_and_says_why():
    """silero-vad (pretrained, from its wheel) carries an exported ONNX LSTM: for arm_2tpu it is
    refused by the Edge TPU as recurrent (full int8 cannot quantize it) and runs on the CPU."""
    from edgesdk.pipeline import BuildOptions, check
    from tests.model_zoo import SILERO_VAD

    report = check(BuildOptions(model=SILERO_VAD, target="arm_2tpu", out=Path("."), allow_cpu_fallback=True,
                                input_shapes={"input": (1, 512), "state": (2, 1, 128)}, input_values={"sr": (16000.0,)}))
    lstm = [n for n in report["nodes"] if n["op"] == "LSTM"]
    assert len(lstm) == 1 and lstm[0]["devices"] == ["cpu/onnxruntime"], lstm
    refusal = next(r for r in lstm[0]["refusals"] if r["device"] == "edgetpu")
    assert refusal["code"] == "edgetpu.recurrent" and "cannot quantize a recurrent cell" in refusal["reason"]


# --- how far an approximation moves the outputs: silent, warned, refused ----------------------------


def _sine_model(path: Path, *, deep: bool = True) -> Path:
    """Conv -> Sin (no Edge TPU op: approximated by a ReLU sum on [-7.4, 8.9]) -> two Convs: the Edge TPU
    on both sides of the sine makes its approximation worth placing there. Without the two Convs the
    plan keeps the model as imported, the sine on the CPU."""
    rng = np.random.default_rng(0)

    def w(name, shape, scale):
        return numpy_helper.from_array((rng.normal(size=shape) * scale).astype(np.float32), name)

    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Sin", ["c"], ["s" if deep else "y"], name="sine")]
    inits = [w("w1", (32, 3, 3, 3), 0.5)]
    if deep:
        nodes += [helper.make_node("Conv", ["s", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
                  helper.make_node("Conv", ["c2", "w3"], ["y"], name="conv3", pads=[1, 1, 1, 1])]
        inits += [w("w2", (32, 32, 3, 3), 0.1), w("w3", (8, 32, 3, 3), 0.1)]
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8 if deep else 32, 32, 32])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    onnx.save(m, path)
    return path


def test_an_approximation_that_moves_an_output_less_than_1_percent_is_silent_and_more_warns(tmp_path):
    """The sine within 0.01 moves y by 0.5 % of y's range on the calibration samples: nothing said. Within
    0.05, by 3.1 %: a warning in the record that names the node, the output and the figure."""
    src = _sine_model(tmp_path / "m.onnx")
    close, _ = _build(src, tmp_path / "close", max_abs_error=0.01)
    (a,) = close["approximations"]
    assert a["verdict"] == "ok" and a["end_to_end"]["max_error_of_range"] < 0.01 and close["warnings"] == []
    loose, stage = _build(src, tmp_path / "loose", max_abs_error=0.05)
    (a,) = loose["approximations"]
    share = a["end_to_end"]["max_error_of_range"]
    assert a["verdict"] == "warning" and 0.01 < share < 0.1 and a["end_to_end"]["output"] == "y"
    (warning,) = loose["warnings"]
    assert warning.startswith("the approximation of sine (Sin) moves output 'y' by ") and f"{share:.1%} of its range" in warning
    assert "--max-abs-error" in warning
    report = json.loads((stage / "legalize.json").read_text())
    assert report["output_shares"] == {"warning": 0.01, "refused": 0.10}
    # edgesdk check says the same, and its summary gives the figure beside the approximation
    from edgesdk.pipeline import BuildOptions, check
    from edgesdk.report.text import check_summary

    checked = check(BuildOptions(model=src, target="arm_2tpu", out=Path("."), max_abs_error=0.05))
    assert checked["warnings"] == [warning]
    assert f"moves output 'y' by {a['end_to_end']['max_abs_error']:.3g} ({share:.2%} of its range)" in check_summary(checked)


def test_approximations_that_move_an_output_more_together_than_alone_warn_together(tmp_path):
    """Two sines on two convolutions of x, summed: each approximation within 0.03 moves y by 0.75 % of its
    range, silent; together by 1.5 %: one warning with the figure, and `check` flags its end-to-end line."""
    from edgesdk.pipeline import BuildOptions, check
    from edgesdk.report.text import check_summary

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Sin", ["c"], ["s"], name="sine"),
             helper.make_node("Conv", ["x", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Sin", ["c2"], ["s2"], name="sine2"),
             helper.make_node("Add", ["s", "s2"], ["y"], name="sum")]
    inits = [numpy_helper.from_array((rng.normal(size=(8, 3, 3, 3)) * 0.5).astype(np.float32), n) for n in ("w1", "w2")]
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    onnx.save(m, tmp_path / "m.onnx")
    checked = check(BuildOptions(model=tmp_path / "m.onnx", target="arm_2tpu", out=Path("."), max_abs_error=0.03))
    alone = [a["end_to_end"]["max_error_of_range"] for a in checked["approximations"]]
    together = checked["end_to_end"]["max_error_of_range"]
    assert len(alone) == 2 and max(alone) < 0.01 < together
    (warning,) = checked["warnings"]
    assert warning.startswith("the 2 approximations together move output 'y' by ") and f"{together:.1%} of its range" in warning
    assert f"({together:.2%} of their range, output 'y'; more than the 1% legalize warns above)" in check_summary(checked)


def test_an_approximation_that_moves_an_output_more_than_10_percent_stops_the_build_where_the_plan_uses_it(tmp_path, capsys):
    """Within 0.5 the sine moves y by 29 % of its range: the build stops at schedule, exit 1, naming the
    node and the figure, with the ways out. A plan that keeps the sine exact on the CPU, or the model as
    imported, is not refused."""
    from edgesdk.cli import main

    src = _sine_model(tmp_path / "m.onnx")
    capsys.readouterr()
    code = main(["build", str(src), "--target", "arm_2tpu", "--until", "schedule", "--max-abs-error", "0.5",
                 "-o", str(tmp_path / "o")])
    stderr = capsys.readouterr().err
    assert code == 1, stderr
    lines = stderr.strip().splitlines()
    error = next(line for line in lines if line.startswith("error: "))
    assert error.startswith("error: the approximation of sine (Sin) moves output 'y' by ")
    assert "of its range on 8 calibration sample(s), more than the 10% legalize allows" in error
    assert lines[-1].startswith("hint: build with --no-rewrites") and "--max-error-lsb" in lines[-1]
    assert any("warning: the approximation of sine (Sin)" in line for line in lines[:lines.index(error)])
    assert "Traceback" not in stderr
    assert not (tmp_path / "o" / ".build" / "3-schedule").exists()

    # what the schedule stage asks: the plan's model holds the refused approximation's nodes (its prefix)
    from edgesdk.errors import UserError
    from edgesdk.legalization.legalize import refuse_moved_outputs

    (a,) = json.loads((tmp_path / "o" / ".build" / "2-legalize" / "legalize.json").read_text())["approximations"]
    assert a["verdict"] == "refuse"
    with pytest.raises(UserError) as e:
        refuse_moved_outputs([a], onnx.load(str(tmp_path / "o" / ".build" / "2-legalize" / "model.onnx")))
    assert e.value.code == "legalize.approximation-moves-output"
    # a plan that left the sine exact, or placed the model as imported, uses nothing to refuse
    refuse_moved_outputs([a], onnx.load(str(src)))
