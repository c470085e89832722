"""Per-layer pruning plans end to end: `--prune-plan auto --latency-budget MS` measures each layer's
kernels on this host and chooses by dynamic programming, the compress stage prunes what the tune stage
planned, a plan file replays it on any host, and `--eval DIR` reports accuracy on labelled data.

Budgets are set from what the first build measured (kept in the tuning database's kernel times), never from
fixed numbers: timings differ between hosts and runs, the plan's arithmetic does not.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from edgesdk.errors import UserError
from edgesdk.pipeline import BuildOptions, build, stage_dir
from edgesdk.runtime.manifest import Manifest
from tests.test_cli import assert_user_facing, edgesdk
from tests.test_prune_e2e import small_cnn

pytestmark = pytest.mark.slow  # pruning plans measured on whole builds


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    # batch 16 at 28x28, 32 to 64 channels: large enough that the sparse kernels' savings outweigh the layout
    # changes around them (at 4x16x16 with 16 channels the fastest plan ran slower than the dense model whole)
    return small_cnn(tmp_path_factory.mktemp("plan-model") / "cnn.onnx", (16, 16, 28, 28), 32)


def plan_of(out) -> dict:
    return json.loads((stage_dir(out, "tune") / "prune_plan.json").read_text())


@pytest.fixture(scope="module")
def measured(tmp_path_factory, cnn):
    """A build whose budget the dense model meets: the plan measures every option and prunes nothing."""
    root = tmp_path_factory.mktemp("plan")
    options = BuildOptions(model=cnn, target="x86", out=root / "dense", prune_plan="auto", latency_budget=1e6,
                           cpu_backends=("planned",), calib_samples=8, tuning_db=root / "db")
    logs: list[str] = []
    result = build(options, log=logs.append)
    return root, options, result, logs


def test_a_budget_the_dense_model_meets_prunes_nothing(measured):
    root, _, result, logs = measured
    plan = plan_of(root / "dense")
    assert plan["source"] == "auto" and set(plan["layers"]) == {"conv2", "conv3", "conv4"}
    assert set(plan["layers"].values()) == {"dense"} and plan["predicted_ms"] == plan["dense_ms"]
    # every option measured: dense, 2:4 and 1:4 (the default candidates) for each convolution
    for options in plan["options"].values():
        assert [o["method"] for o in options] == ["dense", "2:4", "1:4"]
        assert all(o["ms"] > 0 for o in options) and options[0]["loss"] == 0.0
        assert all(o["loss"] > 0 for o in options[1:])  # random weights: every mask moves the output
    assert plan["fastest_ms"] <= plan["dense_ms"]
    assert any("nothing is pruned" in line for line in logs)
    assert Manifest.load(result.bundle).pruning["layers"] == 0


def test_a_tighter_budget_prunes_the_least_sensitive_layers_that_meet_it(measured, cnn):
    root, options, _, _ = measured
    first = plan_of(root / "dense")
    if first["fastest_ms"] >= first["dense_ms"] - 1e-9:
        # this host measured the fastest plan no faster whole than the dense model: no budget below the dense
        # time can be met, and the build says so (the other branch is what the plan is for)
        with pytest.raises(UserError, match="cannot be met"):
            build(BuildOptions(**{**options.__dict__, "out": root / "mid", "latency_budget": first["dense_ms"] * 0.99}))
        return
    budget = (first["dense_ms"] + first["fastest_ms"]) / 2
    logs: list[str] = []
    result = build(BuildOptions(**{**options.__dict__, "out": root / "mid", "latency_budget": budget}), log=logs.append)
    plan = plan_of(root / "mid")
    assert plan["options"] == first["options"]  # the kernel times replayed from the database, the same samples
    assert plan["predicted_ms"] <= budget < plan["dense_ms"]
    # the plan's prediction is its arithmetic: the dense time less each chosen option's saving, the kernels'
    # savings scaled to what the fastest plan saved whole
    scale = plan["scale"]

    def saves(name, o):
        return max(0.0, plan["options"][name][0]["ms"] - o["ms"]) * scale

    saving = sum(saves(name, next(o for o in opts if o["method"] == plan["layers"][name]))
                 for name, opts in plan["options"].items())
    assert plan["predicted_ms"] == pytest.approx(plan["dense_ms"] - saving, abs=1e-3)
    # nothing cheaper in summed loss meets the budget (three layers, three options: all 27 plans)
    import itertools

    names = list(plan["options"])
    feasible = [sum(o["loss"] for o in combo) for combo in itertools.product(*(plan["options"][n] for n in names))
                if plan["dense_ms"] - sum(saves(n, o) for n, o in zip(names, combo)) <= budget]
    assert plan["loss"] == pytest.approx(min(feasible), abs=1e-5)
    # the compress stage pruned exactly what the tune stage planned
    record = json.loads((stage_dir(root / "mid", "compress") / "compress.json").read_text())["pruning"]
    pruned = {k: v for k, v in plan["layers"].items() if v != "dense"}
    assert pruned and {r["layer"]: r["method"] for r in record["layers"]} == pruned
    assert record["plan"]["source"] == "auto" and record["plan"]["budget_ms"] == budget
    manifest = Manifest.load(result.bundle)
    assert manifest.pruning["plan"]["predicted_ms"] == plan["predicted_ms"]
    assert any(line.startswith("tune: prune plan: dense ") and "predicted" in line for line in logs)
    proc = edgesdk("inspect", str(result.bundle))
    assert proc.returncode == 0 and f"per-layer plan chosen under a {budget:g} ms budget" in proc.stdout, proc.stdout


def test_no_layer_is_pruned_where_the_dense_model_meets_the_budget_on_another_backend(measured, cnn, tmp_path):
    """The budget is the model's time as the build runs it: onnxruntime on the dense model counts."""
    root, options, _, _ = measured
    logs: list[str] = []
    build(BuildOptions(**{**options.__dict__, "out": tmp_path / "b", "cpu_backends": ("tvm", "onnxruntime")}),
          log=logs.append)
    plan = plan_of(tmp_path / "b")
    assert set(plan["layers"].values()) == {"dense"} and plan["dense_best"]["ms"] > 0
    assert any("tune: prune plan: the dense model runs in" in line and "nothing is pruned" in line for line in logs)
    assert not any("timing each layer" in line for line in logs)


def test_a_plan_file_replays_the_same_weights_without_measuring(measured, cnn, tmp_path):
    root, options, _, _ = measured
    first = plan_of(root / "dense")
    plan = {"layers": {"conv2": "1:4", "conv3": "dense", "conv4": "2:4"}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    logs: list[str] = []
    build(BuildOptions(model=cnn, target="x86", out=tmp_path / "b", prune_plan=str(path), cpu_backends=("planned",),
                       calib_samples=8, tuning_db=tmp_path / "db"), log=logs.append)
    assert not any("timing each layer" in line for line in logs)
    pruned = onnx.load(str(stage_dir(tmp_path / "b", "compress") / "pruned.onnx"))
    w = {t.name: numpy_helper.to_array(t) for t in pruned.graph.initializer}
    dense = {t.name: numpy_helper.to_array(t) for t in onnx.load(cnn).graph.initializer}
    assert np.mean(w["w2"] == 0) == pytest.approx(0.75) and np.mean(w["w4"] == 0) == pytest.approx(0.5)
    assert np.array_equal(w["w3"], dense["w3"]) and np.array_equal(w["w1"], dense["w1"])
    assert plan_of(tmp_path / "b")["layers"] == plan["layers"] and first["format"] == plan_of(tmp_path / "b")["format"]


def test_an_unreachable_budget_is_refused_with_the_fastest_prediction(measured, cnn, tmp_path):
    root, _, _, _ = measured
    first = plan_of(root / "dense")
    proc = edgesdk("build", cnn, "-t", "x86", "-o", str(tmp_path / "o"), "--cpu-backends", "planned",
                   "--prune-plan", "auto", "--latency-budget", f"{first['fastest_ms'] / 4:.6f}",
                   "--tuning-db", str(root / "db"), "--calib-samples", "8")
    assert_user_facing(proc, 1, "cannot be met: the fastest plan", "raise the budget to at least")
    assert not (tmp_path / "o" / "bundle").exists()


def test_auto_plans_need_a_host_that_runs_the_target(cnn, tmp_path):
    proc = edgesdk("build", cnn, "-t", "arm_2tpu", "-o", str(tmp_path / "o"), "--prune-plan", "auto",
                   "--latency-budget", "5", "--tuning-db", str(tmp_path / "db"), "--until", "tune")
    assert_user_facing(proc, 2, "--prune-plan auto times each layer's kernels on this host", "--prune-plan FILE")


@pytest.mark.parametrize("args, needles", [
    (["--latency-budget", "5"], ["--latency-budget needs --prune-plan auto"]),
    (["--prune-plan", "auto"], ["--prune-plan auto needs --latency-budget MS"]),
    (["--prune", "2:4,1:4"], ["a list of methods needs --prune-plan auto"]),
    (["--prune-plan", "auto", "--latency-budget", "5", "--prune", "2:4,9:4"], ["'9:4'"]),
    (["--prune-plan", "missing.json"], ["--prune-plan missing.json: no such file"]),
    (["--prune", "2:4", "--eval", "no-such-dir"], ["--eval no-such-dir: not a directory"]),
])
def test_plan_options_that_do_not_go_together_are_refused(cnn, tmp_path, args, needles):
    proc = edgesdk("build", cnn, "-t", "x86", "-o", str(tmp_path / "o"), *args, cwd=tmp_path)
    assert_user_facing(proc, 2, *needles)


def test_a_plan_file_naming_a_layer_the_model_lacks_names_its_line(cnn, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"layers": {\n  "conv2": "2:4",\n  "conv7": "1:4"\n}}\n')
    proc = edgesdk("build", cnn, "-t", "x86", "-o", str(tmp_path / "o"), "--prune-plan", str(path),
                   "--tuning-db", str(tmp_path / "db"))
    assert_user_facing(proc, 2, f"{path}:3: the model has no prunable layer 'conv7'", "conv2")


# -- --eval: accuracy on labelled data ------------------------------------------------------------------

def trained_mlp(path, rng) -> tuple[str, np.ndarray, np.ndarray, dict]:
    """A 16 -> 64 -> 64 -> 4 ReLU network trained here (plain gradient descent, softmax cross-entropy) on four
    Gaussian classes; the held-out samples and labels, and its weights."""
    centers = rng.standard_normal((4, 16)) * 1.2

    def draw(n):
        y = rng.integers(0, 4, n)
        return (centers[y] + rng.standard_normal((n, 16))).astype(np.float32), y

    x, y = draw(2000)
    w = {"w1": rng.standard_normal((16, 64)) * 0.25, "b1": np.zeros(64), "w2": rng.standard_normal((64, 64)) * 0.18,
         "b2": np.zeros(64), "w3": rng.standard_normal((64, 4)) * 0.18, "b3": np.zeros(4)}
    for _ in range(300):
        h1 = np.maximum(x @ w["w1"] + w["b1"], 0)
        h2 = np.maximum(h1 @ w["w2"] + w["b2"], 0)
        z = h2 @ w["w3"] + w["b3"]
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        g = (p - np.eye(4)[y]) / len(x)
        grads = {"w3": h2.T @ g, "b3": g.sum(0)}
        g2 = (g @ w["w3"].T) * (h2 > 0)
        grads.update({"w2": h1.T @ g2, "b2": g2.sum(0)})
        g1 = (g2 @ w["w2"].T) * (h1 > 0)
        grads.update({"w1": x.T @ g1, "b1": g1.sum(0)})
        for k in w:
            w[k] -= 0.5 * grads[k]
    w = {k: v.astype(np.float32) for k, v in w.items()}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"], name="fc1"), helper.make_node("Add", ["m1", "b1"], ["a1"]),
             helper.make_node("Relu", ["a1"], ["h1"]),
             helper.make_node("MatMul", ["h1", "w2"], ["m2"], name="fc2"), helper.make_node("Add", ["m2", "b2"], ["a2"]),
             helper.make_node("Relu", ["a2"], ["h2"]),
             helper.make_node("MatMul", ["h2", "w3"], ["m3"], name="fc3"), helper.make_node("Add", ["m3", "b3"], ["z"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, (1, 16))],
                              [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, (1, 4))],
                              [numpy_helper.from_array(v, k) for k, v in w.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))
    xt, yt = draw(200)
    return str(path), xt, yt, w


def forward(w: dict, x: np.ndarray) -> np.ndarray:
    h1 = np.maximum(x @ w["w1"] + w["b1"], 0)
    return np.maximum(h1 @ w["w2"] + w["b2"], 0) @ w["w3"] + w["b3"]


def test_eval_reports_the_accuracy_of_the_dense_and_the_pruned_model_on_labelled_data(tmp_path):
    model, x, y, w = trained_mlp(tmp_path / "mlp.onnx", np.random.default_rng(0))
    data = tmp_path / "eval"
    data.mkdir()
    np.save(data / "a.npy", x[:120])  # two files of stacked samples, read in name order
    np.save(data / "b.npy", x[120:])
    (data / "labels.txt").write_text("# class per sample\n" + "\n".join(str(v) for v in y) + "\n")
    logs: list[str] = []
    # import fuses each MatMul+Add into a Gemm that keeps the MatMul's name
    result = build(BuildOptions(model=model, target="x86", out=tmp_path / "b", prune="1:8", prune_layers="fc2",
                                eval_data=data, cpu_backends=("planned",), calib_samples=16,
                                tuning_db=tmp_path / "db"), log=logs.append)
    acc = json.loads((stage_dir(tmp_path / "b", "compress") / "compress.json").read_text())["pruning"]["accuracy"]
    pruned = {t.name: numpy_helper.to_array(t) for t in
              onnx.load(str(stage_dir(tmp_path / "b", "compress") / "pruned.onnx")).graph.initializer}
    want_dense = float(np.mean(np.argmax(forward(w, x), 1) == y))
    want_pruned = float(np.mean(np.argmax(forward({**w, **pruned}, x), 1) == y))
    assert acc["labels"] == 200 and acc["samples"] == 200 and acc["output"] == "z"
    assert acc["top1"]["dense"] == pytest.approx(want_dense, abs=1e-6) and want_dense > 0.9  # a trained model
    assert acc["top1"]["pruned"] == pytest.approx(want_pruned, abs=1e-6)
    assert np.mean(pruned["w2"] == 0) == pytest.approx(7 / 8)
    assert any("top-1 accuracy on 200 labelled sample(s) of --eval" in line for line in logs)
    assert Manifest.load(result.bundle).pruning["accuracy"]["top1"] == acc["top1"]
    proc = edgesdk("inspect", str(result.bundle))
    assert f"top-1 accuracy on 200 labelled sample(s) (--eval): dense {want_dense:.2%}" in proc.stdout, proc.stdout

    (data / "labels.txt").write_text("\n".join(str(v) for v in y[:-1]) + "\n")
    proc = edgesdk("build", model, "-t", "x86", "-o", str(tmp_path / "o"), "--prune", "2:4", "--eval", str(data), "--cpu-backends", "planned", "--tuning-db", str(tmp_path / "db"))
    assert_user_facing(proc, 1, "199 labels for 200 rows of output 'z'")
    (data / "labels.txt").write_text("1\ncat\n")
    proc = edgesdk("build", model, "-t", "x86", "-o", str(tmp_path / "o"), "--prune", "2:4", "--eval", str(data), "--cpu-backends", "planned", "--tuning-db", str(tmp_path / "db"))
    assert_user_facing(proc, 1, f"{data / 'labels.txt'}:2: 'cat' is not an integer class")
    (data / "labels.txt").unlink()
    proc = edgesdk("build", model, "-t", "x86", "-o", str(tmp_path / "o"), "--prune", "2:4", "--eval", str(data), "--cpu-backends", "planned", "--tuning-db", str(tmp_path / "db"))
    assert_user_facing(proc, 1, "no labels.txt")
    assert not (tmp_path / "o" / "bundle").exists()
