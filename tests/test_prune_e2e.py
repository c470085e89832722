"""`edgesdk build --prune` end to end: the compress stage prunes the CPU's layers and reports
the pruned model's fidelity to the dense one; the package compiles the pruned CPU segments, TVM with
sparse kernels; the bundle computes the pruned model (onnxruntime on `pruned.onnx`) and passes its
self-test, on x86 here and on aarch64 under qemu; an Edge TPU's layers stay dense."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from onnx import helper, numpy_helper

from edgesdk.compression import prunable
from edgesdk.pipeline import BuildOptions, build, stage_dir
from edgesdk.runtime import BundleModel
from edgesdk.runtime.manifest import Manifest
from edgesdk.verify import verify
from tests.model_zoo import ROOT
from tests.numeric import assert_close
from tests.test_cli import assert_user_facing, edgesdk

pytestmark = pytest.mark.slow  # pruned models built, self-tested under qemu too

SHAPE = (4, 8, 16, 16)


def small_cnn(path, shape=SHAPE, width: int = 16) -> str:
    """conv 8->W, conv W->2W stride 2, conv 2W->2W + residual, conv 1x1, global pool, Gemm: five prunable
    layers, the middle three pruned by default; channels multiples of 4, so 2:4 prunes exactly half."""
    rng = np.random.default_rng(0)

    def w(*shape):
        return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32))

    c1, c2 = width, 2 * width
    weights = {"w1": w(c1, shape[1], 3, 3), "w2": w(c2, c1, 3, 3), "w3": w(c2, c2, 3, 3), "w4": w(c2, c2, 1, 1),
               "fc": w(10, c2), "b1": w(c1), "b2": w(c2), "b3": w(c2), "b4": w(c2), "fb": w(10)}
    for name, t in weights.items():
        t.name = name
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1] * 4, name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1] * 4, strides=[2, 2], name="conv2"),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"], pads=[1] * 4, name="conv3"),
             helper.make_node("Add", ["c3", "r2"], ["s3"], name="add3"),
             helper.make_node("Relu", ["s3"], ["r3"], name="relu3"),
             helper.make_node("Conv", ["r3", "w4", "b4"], ["c4"], name="conv4"),
             helper.make_node("Relu", ["c4"], ["r4"], name="relu4"),
             helper.make_node("GlobalAveragePool", ["r4"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "fc", "fb"], ["logits"], transB=1, name="fc")]
    graph = helper.make_graph(nodes, "small_cnn", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, (shape[0], 10))],
                              list(weights.values()))
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))
    return str(path)


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    return small_cnn(tmp_path_factory.mktemp("prune-model") / "cnn.onnx")


@pytest.fixture(scope="module")
def x86_pruned(tmp_path_factory, cnn):
    out = tmp_path_factory.mktemp("prune-x86")
    # --cpu-backends planned: the schedule's TVM cut, nothing timed (the measured choice is tested in test_cpu_selection_e2e.py)
    options = BuildOptions(model=cnn, target="x86", out=out / "b", prune="2:4", cpu_backends=("planned",),
                           sparse_kernels="sparse", calib_samples=8, tuning_db=out / "db")
    return options, build(options)


def pruned_model(out) -> onnx.ModelProto:
    return onnx.load(str(stage_dir(out, "compress") / "pruned.onnx"))


def test_the_middle_layers_are_pruned_two_of_four_and_the_edges_stay_dense(x86_pruned, cnn):
    options, result = x86_pruned
    dense = {t.name: numpy_helper.to_array(t) for t in onnx.load(cnn).graph.initializer}
    pruned = {t.name: numpy_helper.to_array(t) for t in pruned_model(options.out).graph.initializer}
    for name in ("w1", "fc", "b1", "b2", "fb"):  # the first and last layers, and every bias, untouched
        assert np.array_equal(pruned[name], dense[name]), name
    for name in ("w2", "w3", "w4"):
        w = pruned[name]
        groups = (w != 0).reshape(w.shape[0], w.shape[1] // 4, 4, *w.shape[2:]).sum(axis=2)
        assert (groups == 2).all(), name  # exactly 2 of every 4 input channels at each kernel position
        assert np.array_equal(w[w != 0], dense[name][w != 0])  # the kept weights as they were
    record = json.loads((stage_dir(options.out, "compress") / "compress.json").read_text())["pruning"]
    assert [r["layer"] for r in record["layers"]] == ["conv2", "conv3", "conv4"]
    assert record["sparsity"] == 0.5 and record["retrained"] is False


def test_the_manifest_reports_fidelity_and_the_sparse_kernels(x86_pruned):
    _, result = x86_pruned
    m = Manifest.load(result.bundle)
    p = m.pruning
    assert p["method"] == "2:4" and p["layers"] == 3 and p["sparsity"] == 0.5 and not p["corrected"]
    assert p["sparse_kernels"] == 3  # conv2, conv3 and conv4: half their weights zero, forced onto sparse kernels
    (choices,) = [t["sparse_choices"] for t in m.tuning["segments"].values() if "sparse_choices" in t]
    assert [c["why"] for c in choices] == ["forced: --sparse-kernels sparse"] * 3
    fid = p["fidelity"]
    assert "dense model" in fid["against"] and fid["samples"] == 8
    logits = fid["end_to_end"]["logits"]
    assert 0.0 < logits["cosine"] < 1.0 and logits["max_abs_error"] > 0  # pruning changed the answer...
    assert 0.0 <= logits["top1_agreement"] <= 1.0
    assert m.accuracy["reference"] == "onnxruntime on the pruned fp32 model (--prune)"
    assert m.accuracy["tensors"]["logits"]["cosine"] > 0.9999  # ...and the bundle computes the pruned model
    from edgesdk.report.text import inspect_bundle

    text = inspect_bundle(m, result.bundle)
    assert "pruning     2:4: 3 layer(s), 50.0% of their weights zero, no retraining; 3 convolution(s) on sparse" in text
    assert "fidelity of logits to the dense model: cosine" in text and "against the pruned fp32 model" in text


def test_the_bundle_computes_the_pruned_model_and_passes_its_self_test(x86_pruned):
    options, result = x86_pruned
    x = np.random.default_rng(5).standard_normal(SHAPE).astype(np.float32)
    got = BundleModel(result.bundle, log=lambda s: None).run({"x": x})["logits"]
    session = ort.InferenceSession(pruned_model(options.out).SerializeToString(), providers=["CPUExecutionProvider"])
    assert_close(got, session.run(None, {"x": x})[0], "logits")
    assert verify(result.bundle).selftest == "passed"


def test_the_correction_refits_the_kept_weights_and_says_what_it_gained(tmp_path, cnn):
    result = build(BuildOptions(model=cnn, target="x86", out=tmp_path / "b", prune="1:4", prune_correct=True,
                                cpu_backends=("planned",), calib_samples=16, tuning_db=tmp_path / "db"))
    record = json.loads((stage_dir(tmp_path / "b", "compress") / "compress.json").read_text())["pruning"]
    corr = record["correction"]
    assert corr["samples"] == 12 and corr["held_out"] == 4  # fitted on three quarters, judged on the rest
    assert "held-out" in record["fidelity"]["against"]
    before, after = corr["end_to_end_before"]["logits"], record["fidelity"]["end_to_end"]["logits"]
    assert after["cosine"] > before["cosine"]
    for layer in corr["layers"].values():
        assert layer["residual_after"] <= layer["residual_before"]
    # zeros stay zero: the corrected weights keep 1 of every 4
    w = {t.name: numpy_helper.to_array(t) for t in pruned_model(tmp_path / "b").graph.initializer}["w3"]
    assert ((w != 0).reshape(32, 8, 4, 3, 3).sum(axis=2) == 1).all()
    assert Manifest.load(result.bundle).pruning["corrected"] is True


def test_a_build_without_prune_changes_no_weight(tmp_path, cnn):
    result = build(BuildOptions(model=cnn, target="x86", out=tmp_path / "b", cpu_backends=("planned",),
                                calib_samples=4, tuning_db=tmp_path / "db"))
    assert not (stage_dir(tmp_path / "b", "compress") / "pruned.onnx").exists()
    assert Manifest.load(result.bundle).pruning == {}
    assert "sparse_kernels" not in json.dumps(Manifest.load(result.bundle).tuning)


@pytest.mark.parametrize("args, code, needles", [
    (["--prune", "3:2"], 2, ["'3:2'", "2:4, 1:4"]),
    (["--prune", "magnitude:1.5"], 2, ["magnitude:1.5"]),
    (["--prune-layers", "conv2"], 2, ["--prune-layers, --prune-correct and --sparse-kernels need --prune"]),
    (["--prune", "2:4", "--sparse-kernels", "fast"], 2, ["--sparse-kernels fast: expected measured, sparse or dense"]),
    (["--prune", "2:4", "--prune-layers", "conv9,conv2"], 2, ["no prunable layer matches 'conv9'", "conv1, conv2"]),
])
def test_bad_prune_options_are_refused(tmp_path, cnn, args, code, needles):
    proc = edgesdk("build", cnn, "-t", "x86", "-o", str(tmp_path / "o"), "--cpu-backends", "planned", *args)
    assert_user_facing(proc, code, *needles)
    assert not (tmp_path / "o" / "bundle").exists()


def cpu_only_arm_target(path) -> str:
    """arm_2tpu without its Edge TPUs: the board's Cortex-A53 alone."""
    spec = yaml.safe_load((ROOT / "targets" / "arm_2tpu.yaml").read_text())
    spec["name"], spec["description"] = "arm_cpu", "arm_2tpu's Cortex-A53 without its Edge TPUs (a test target)"
    spec["devices"] = [d for d in spec["devices"] if d["kind"] == "cpu"]
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


@pytest.fixture(scope="module")
def arm_pruned(tmp_path_factory, cnn):
    out = tmp_path_factory.mktemp("prune-arm")
    options = BuildOptions(model=cnn, target=cpu_only_arm_target(out / "arm_cpu.yaml"), out=out / "b", prune="1:4",
                           cpu_backends=("planned",), calib_samples=4, tuning_db=out / "db")
    return build(options)


@pytest.mark.qemu
def test_a_pruned_aarch64_bundle_passes_its_self_test_under_qemu(arm_pruned):
    from edgesdk.backends import qemu

    if qemu.find_rootfs() is None:
        pytest.fail("the arm64 root file system is missing: `make rootfs` prepares it (make test does)")
    m = Manifest.load(arm_pruned.bundle)
    assert m.arch == "aarch64" and m.pruning["sparse_kernels"] == 3
    report = verify(arm_pruned.bundle)
    assert report.selftest == "passed", (report.detail, report.notes, report.segments)
    assert report.detail.startswith("under qemu-user")


def test_on_arm_2tpu_the_edge_tpu_layers_stay_dense(tmp_path, cnn):
    """The Edge TPU computes every weight, zero or not: of the layers --prune chose, those the plan puts on an
    Edge TPU stay dense (and the build says why), those on the CPU are pruned."""
    logs: list[str] = []
    options = BuildOptions(model=cnn, target="arm_2tpu", out=tmp_path / "b", prune="2:4", prune_layers="all",
                           calib_samples=4, tuning_db=tmp_path / "db", until="compress")
    build(options, log=logs.append)
    plan = json.loads((stage_dir(tmp_path / "b", "schedule") / "plan.json").read_text())
    on_tpu = {n for s in plan["segments"] if s["device"].startswith("edgetpu") for n in s["nodes"]}
    record = json.loads((stage_dir(tmp_path / "b", "compress") / "compress.json").read_text())["pruning"]
    # every prunable layer of the model as scheduled (legalize turned the Gemm into a 1x1 convolution)
    chosen = [x.name for x in prunable(onnx.load(str(stage_dir(tmp_path / "b", "schedule") / "model.onnx")))]
    assert chosen[:4] == ["conv1", "conv2", "conv3", "conv4"] and len(chosen) == 5
    assert record["accelerator_layers_dense"] == [n for n in chosen if n in on_tpu]
    assert [r["layer"] for r in record["layers"]] == [n for n in chosen if n not in on_tpu]
    assert record["accelerator_layers_dense"], plan["segments"]  # this plan puts some of them on an Edge TPU
    assert "the Edge TPU gains nothing from sparsity" in "\n".join(logs)


def test_the_candidates_are_timed_pruned_and_whichever_wins_runs_the_pruned_model(tmp_path, cnn):
    logs: list[str] = []
    options = BuildOptions(model=cnn, target="x86", out=tmp_path / "b", prune="1:4", calib_samples=4,
                           cpu_backends=("tvm", "onnxruntime"), tuning_db=tmp_path / "db")
    result = build(options, log=logs.append)
    assert "tune: CPU candidates are timed with 3 layer(s) pruned (1:4)" in logs
    # the tune stage's own segments stay dense: the compress stage prunes
    dense = {t.name: numpy_helper.to_array(t) for t in onnx.load(cnn).graph.initializer}
    for path in (stage_dir(tmp_path / "b", "tune") / "segments").glob("*.onnx"):
        for t in onnx.load(str(path)).graph.initializer:
            if t.name in dense:
                assert np.array_equal(numpy_helper.to_array(t), dense[t.name]), (path.name, t.name)
    # the TVM candidate timed each pruned convolution's two kernels once, kept with the database: the package
    # stage chose from those times (the same choice as the candidate measured)
    times = json.loads((stage_dir(tmp_path / "b", "tune") / "tuning_db" / "cpu" / "kernel_times.json").read_text())
    assert len(times) == 3 and all({"sparse_ms", "dense_ms"} <= set(t) for t in times.values())
    for seg in Manifest.load(result.bundle).tuning.get("segments", {}).values():
        for c in seg.get("sparse_choices", []):
            assert {"sparse_ms": c["sparse_ms"], "dense_ms": c["dense_ms"]} in times.values()
            assert c["kernel"] == ("sparse" if c["sparse_ms"] < c["dense_ms"] else "dense")
    x = np.random.default_rng(6).standard_normal(SHAPE).astype(np.float32)
    got = BundleModel(result.bundle, log=lambda s: None).run({"x": x})["logits"]
    session = ort.InferenceSession(pruned_model(tmp_path / "b").SerializeToString(), providers=["CPUExecutionProvider"])
    assert_close(got, session.run(None, {"x": x})[0], "logits")
