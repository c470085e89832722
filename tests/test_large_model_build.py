"""Builds of models of any size: weights kept beside the model as external data through the
stages and into the bundle, `--low-memory`, and the memory estimate that stops a build the machine
cannot hold right after import. The threshold past which weights go beside the model is lowered here
(`irm.EXTERNAL_FROM`) so that a small model takes the path a > 2 GB one takes (`tests/ir/test_large_models.py`
runs a real one through the same functions; benchmarks/bench_memory.py builds one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk import backends, pipeline
from edgesdk.errors import UsageError, UserError
from edgesdk.ir import model as irm
from edgesdk.ir.memory import shown
from edgesdk.pipeline import BuildOptions, build, stage_dir
from edgesdk.runtime import BundleModel, Manifest
from edgesdk.stages import memory
from tests.model_zoo import ROOT


def _mlp(path, n: int = 512, layers: int = 3) -> None:
    """Relu(x @ w + b) x layers, saved with its weights as external data (as large models are)."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        inits += [numpy_helper.from_array((rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array((rng.standard_normal(n) * 0.1).astype(np.float32), f"b{i}")]
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]), helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
                  helper.make_node("Relu", [f"a{i}"], [f"r{i}"])]
        x = f"r{i}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, n])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = irm.IR_VERSION
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=path.name + ".data")


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    path = tmp_path_factory.mktemp("mlp") / "mlp.onnx"
    _mlp(path)
    return path


def test_weights_stay_beside_the_model_through_the_stages_and_the_bundle(mlp, tmp_path, monkeypatch):
    monkeypatch.setattr(irm, "EXTERNAL_FROM", 1 << 16)  # every model of this build is "large"
    monkeypatch.setattr(pipeline, "LARGE_OUTPUT", 1 << 20)  # and says what each stage wrote
    out = tmp_path / "out"
    lines: list[str] = []
    result = build(BuildOptions(model=mlp, target="x86", out=out, low_memory=True, tuning_db=tmp_path / "db"),
                   log=lines.append)
    assert any(line.startswith("import: wrote ") and "the build holds" in line for line in lines), lines
    assert any(line.startswith("build: memory: about ") for line in lines), lines
    for stage in ("import", "legalize", "schedule", "tune"):
        assert (stage_dir(out, stage) / "model.onnx.data").is_file(), stage
    # no stage after import changed a weight: they all link import's one file, the bundle's segment too
    files = [stage_dir(out, s) / "model.onnx.data" for s in ("import", "legalize", "schedule", "tune")]
    files += [stage_dir(out, "schedule") / "segments" / "s0.onnx.data", stage_dir(out, "package") / "bundle" / "segments" / "s0.onnx.data"]
    assert len({f.stat().st_ino for f in files}) == 1, [(f, f.stat().st_ino) for f in files]
    assert (mlp.parent / "mlp.onnx.data").stat().st_ino != files[0].stat().st_ino  # the user's: copied, not linked
    tune = [r for r in result.stages if r.name == "tune"][0].record
    (span,) = tune["cpu_selection"]["spans"]
    assert span["chosen"] == "onnxruntime" and "--low-memory" in span["why"]
    assert all("--low-memory" in c["skipped"] for c in span["candidates"].values())
    manifest = Manifest.load(result.bundle)
    (seg,) = manifest.segments
    assert seg.backend == "onnxruntime"
    listed = json.loads((result.bundle / "manifest.json").read_text())["files"]
    assert seg.artifact + ".data" in listed  # signed and checked on the device like every other file
    assert (result.bundle / (seg.artifact + ".data")).stat().st_size >= 3 * 512 * 512 * 4  # the three weights
    x = np.random.default_rng(1).standard_normal((1, 512)).astype(np.float32)
    want = ort.InferenceSession(str(mlp), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = BundleModel(result.bundle, log=lambda s: None).run({"x": x})["r2"]
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
    # the bundle's own self-test, in a process of its own as on the device
    check = subprocess.run([sys.executable, "-B", "-m", "runtime", "selftest"], cwd=result.bundle,
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr


def _bert_like(path, *, vocab: int = 286_720, dim: int = 64, seq: int = 128, layers: int = 2) -> None:
    """A sentence encoder's shape at a toy width: a 70 MiB word-embedding table read by a Gather (past
    `irm.EXTERNAL_FROM`, so every stage maps it from a `.data` file), position embeddings, the attention
    mask applied, a LayerNormalization, then `layers` residual blocks of MatMul + Add, Relu, MatMul + Add
    (MatMuls the Edge TPU takes only as convolutions: legalize rewrites them). Saved with external data."""
    rng = np.random.default_rng(0)

    def dense(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

    inits = [numpy_helper.from_array((rng.standard_normal((vocab, dim)) * 0.5).astype(np.float32), "word_embeddings.weight"),
             numpy_helper.from_array(dense(seq, dim), "position_embeddings"),
             numpy_helper.from_array(np.array([2], np.int64), "last_axis"),
             numpy_helper.from_array(np.ones(dim, np.float32), "ln_scale"),
             numpy_helper.from_array(np.zeros(dim, np.float32), "ln_bias")]
    nodes = [helper.make_node("Gather", ["word_embeddings.weight", "input_ids"], ["embedded"]),
             helper.make_node("Add", ["embedded", "position_embeddings"], ["positioned"]),
             helper.make_node("Cast", ["attention_mask"], ["mask"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["mask", "last_axis"], ["mask3"]),
             helper.make_node("Mul", ["positioned", "mask3"], ["masked"]),
             helper.make_node("LayerNormalization", ["masked", "ln_scale", "ln_bias"], ["h0"], axis=-1)]
    h = "h0"
    for i in range(layers):
        inits += [numpy_helper.from_array(dense(dim, dim), f"w{i}a"), numpy_helper.from_array(dense(dim) * 0.1, f"b{i}a"),
                  numpy_helper.from_array(dense(dim, dim), f"w{i}b"), numpy_helper.from_array(dense(dim) * 0.1, f"b{i}b")]
        nodes += [helper.make_node("MatMul", [h, f"w{i}a"], [f"m{i}a"]), helper.make_node("Add", [f"m{i}a", f"b{i}a"], [f"a{i}a"]),
                  helper.make_node("Relu", [f"a{i}a"], [f"r{i}"]),
                  helper.make_node("MatMul", [f"r{i}", f"w{i}b"], [f"m{i}b"]), helper.make_node("Add", [f"m{i}b", f"b{i}b"], [f"a{i}b"]),
                  helper.make_node("Add", [h, f"a{i}b"], [f"h{i + 1}"])]
        h = f"h{i + 1}"
    graph = helper.make_graph(nodes, "bert_like",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, seq]),
                               helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, seq])],
                              [helper.make_tensor_value_info(h, TensorProto.FLOAT, [1, seq, dim])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = irm.IR_VERSION
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=path.name + ".data")


def _sentences(n: int, seed: int, *, vocab: int = 286_720, seq: int = 128) -> list[dict[str, np.ndarray]]:
    """Token ids as a tokenizer gives them: a sentence of 8 to 60 ids, then padding (id 0, mask 0)."""
    rng = np.random.default_rng(seed)
    feeds = []
    for _ in range(n):
        length = int(rng.integers(8, 61))
        ids, mask = np.zeros((1, seq), np.int64), np.zeros((1, seq), np.int64)
        ids[0, :length], mask[0, :length] = rng.integers(1, vocab, length), 1
        feeds.append({"input_ids": ids, "attention_mask": mask})
    return feeds


@pytest.mark.slow
def test_an_arm_2tpu_build_past_64_mib_rewrites_its_matmuls_for_the_edge_tpu(tmp_path, weights_never_handed_over):
    """Legalize rewrites the MatMuls of a model whose weights stay in a `.data` file (checking the rewritten
    graph without its weights), the Edge TPU runs them int8, the CPU the 70 MiB embedding, and the bundle
    computes what onnxruntime computes on the original model. No call to onnx's checker or shape inference
    or to onnxruntime is handed a weight on the way."""
    path = tmp_path / "encoder.onnx"
    _bert_like(path)
    calib = tmp_path / "calib"
    calib.mkdir()
    for k, feed in enumerate(_sentences(8, seed=1)):
        np.savez(calib / f"s{k}.npz", **feed)
    out = tmp_path / "out"
    options = BuildOptions(model=path, target="arm_2tpu", out=out, calib=calib, calib_method="minmax",
                           tuning_db=tmp_path / "db")
    # `edgesdk check` asks legalize what it would do on the same imported model
    assert pipeline.check(options)["rewrites"]["matmul-rows-to-conv"]["count"] == 4
    result = build(options, log=lambda s: None)
    legalize = [r for r in result.stages if r.name == "legalize"][0].record
    assert legalize["rewrites"]["matmul-rows-to-conv"]["count"] == 4, legalize["rewrites"]
    # legalize's weights are import's less the MatMuls' (now the Convs', under 64 KiB, in the graph): copied
    # file to file once; the stages after it change none and link legalize's file
    files = [stage_dir(out, s) / "model.onnx.data" for s in ("legalize", "schedule", "tune")]
    assert len({f.stat().st_ino for f in files}) == 1, [(f, f.stat().st_ino) for f in files]
    assert (stage_dir(out, "import") / "model.onnx.data").is_file()
    manifest = Manifest.load(result.bundle)
    devices = {s.device.split(":")[0] for s in manifest.segments}
    assert devices == {"cpu", "edgetpu"}, [(s.id, s.device) for s in manifest.segments]
    (cpu,) = [s for s in manifest.segments if s.device == "cpu"]
    # the embedding in a file of the CPU segment's own (TVM's `.weights`, onnxruntime's `.data`), signed with the rest
    listed = json.loads((result.bundle / "manifest.json").read_text())["files"]
    assert any(name.startswith(f"segments/{cpu.id}.") and (result.bundle / name).stat().st_size >= 286_720 * 64 * 4
               for name in listed), listed
    assert not weights_never_handed_over, weights_never_handed_over
    # what the bundle computes: its golden output, made on this host by the bundle's plan (the CPU segment's
    # x86-64 twin, the Edge TPU's int8 model as it ships), which its self-test holds the device to; the
    # input is the first calibration sentence
    inputs, outputs = (np.load(result.bundle / "golden" / f"{name}.npz") for name in ("inputs", "outputs"))
    feed = {name: inputs[name] for name in ("input_ids", "attention_mask")}
    assert int(feed["attention_mask"].sum()) > 0
    (expected,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)
    (got,) = outputs.values()
    # the Edge TPU's segment computes in int8 (a step is 1/255 of a tensor's calibrated range) through two
    # residual blocks: measured 1.7% of the output's scale, cosine 0.9993; bound 5%, and cosine 0.998
    assert np.max(np.abs(got - expected)) <= 0.05 * np.max(np.abs(expected))
    # the bundle's plan against onnxruntime on the 2 sentences held out of calibration's 8, within the gate
    (accuracy,) = manifest.accuracy["tensors"].values()
    assert manifest.accuracy["samples"] == 2 and manifest.accuracy["held_out"] is True, manifest.accuracy
    assert manifest.accuracy["gate"]["passed"] is True and accuracy["cosine"] >= 0.998, manifest.accuracy


def test_changed_external_weights_are_a_new_model(mlp, tmp_path):
    """The import stage's cache key covers the `.data` file, not only the .onnx beside it."""
    local = tmp_path / "mlp.onnx"
    _mlp(local, n=64, layers=1)
    out = tmp_path / "out"
    build(BuildOptions(model=local, target="x86", out=out, until="import"))
    data = tmp_path / "mlp.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[:4] = np.float32(3.0).tobytes()
    data.write_bytes(bytes(raw))
    again = build(BuildOptions(model=local, target="x86", out=out, until="import"))
    assert not again.stages[0].cached
    w0 = irm.array(irm.read(stage_dir(out, "import") / "model.onnx").graph.initializer[0])
    assert w0.flat[0] == 3.0


def test_a_build_the_machine_cannot_hold_stops_after_import_with_its_estimate(mlp, tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda: 512 << 20)
    out = tmp_path / "out"
    with pytest.raises(UserError) as e:
        build(BuildOptions(model=mlp, target="x86", out=out))
    assert e.value.code == "build.out-of-memory"
    assert "512 MiB available" in e.value.message and "at its peak" in e.value.message
    assert "--low-memory" in e.value.hint and memory.CHECK_ENV in e.value.hint
    # --low-memory would not fit in 512 MiB either: the hint says so rather than offer it first
    assert e.value.hint.startswith("build on a machine with more memory (--low-memory, onnxruntime alone on the CPU, "
                                   "would still need about ")
    assert stage_dir(out, "import").is_dir() and not stage_dir(out, "legalize").exists()
    # where --low-memory fits, the hint offers it first, with its estimate
    from edgesdk.config import load_target

    weights = irm.weight_bytes(irm.read(stage_dir(out, "import") / "model.onnx"))
    low = memory.estimate(weights, load_target("x86")[0], BuildOptions(model=mlp, target="x86", out=out, low_memory=True))
    monkeypatch.setattr(memory, "available_bytes", lambda: low.peak + (1 << 20))
    with pytest.raises(UserError) as fits:
        build(BuildOptions(model=mlp, target="x86", out=out))
    assert fits.value.hint.startswith(f"--low-memory compiles the CPU segments with onnxruntime alone (about {shown(low.peak)})")
    # what the stages hold fits: the build went on to the plan, and stopped before its compilers
    assert stage_dir(out, "schedule").is_dir() and not stage_dir(out, "tune").exists()
    monkeypatch.setattr(memory, "available_bytes", lambda: 512 << 20)
    # already --low-memory: the hint is a bigger machine
    with pytest.raises(UserError) as again:
        build(BuildOptions(model=mlp, target="x86", out=out, low_memory=True))
    assert again.value.hint.startswith("build on a machine with more memory; ")
    # told to build anyway, it goes on (here to legalize); a value that is neither on nor off is a bad invocation
    monkeypatch.setenv(memory.CHECK_ENV, "off")
    build(BuildOptions(model=mlp, target="x86", out=out, until="legalize"))
    assert stage_dir(out, "legalize").is_dir()
    monkeypatch.setenv(memory.CHECK_ENV, "maybe")
    with pytest.raises(UsageError, match="expected on or off"):
        build(BuildOptions(model=mlp, target="x86", out=out, until="legalize", start="legalize"))


def test_the_estimate_follows_the_compilers_a_build_runs():
    from edgesdk.config import load_target

    x86, arm = load_target("x86")[0], load_target("arm_2tpu")[0]
    w = 500 << 20
    full = memory.estimate(w, x86, BuildOptions(model="m", target="x86", out="o"))
    low = memory.estimate(w, x86, BuildOptions(model="m", target="x86", out="o", low_memory=True))
    # at 500 MiB LiteRT's conversion (0.6 GiB + 4 bytes per byte: backends/tflite/limits.py) outweighs TVM's
    # compile (2 per byte); --low-memory runs neither
    assert full.compiler == "litert" and low.compiler == "onnxruntime" and low.peak < full.peak
    # TFLite cannot hold 2 GiB of weights, so its converter is never run on them: TVM's compile is the largest
    big = memory.estimate(3 << 30, x86, BuildOptions(model="m", target="x86", out="o"))
    assert big.compiler == "tvm"
    # the Edge TPU converts through TFLite whatever --low-memory says, each segment under the FlatBuffer's 2 GiB
    assert memory.estimate(w, arm, BuildOptions(model="m", target="arm_2tpu", out="o", low_memory=True)).compiler == "tflite"
    huge = memory.estimate(3 << 30, arm, BuildOptions(model="m", target="arm_2tpu", out="o", low_memory=True))
    assert huge.compiler == "tflite" and huge.peak == (memory.BASE_BYTES + memory.MAPPED_HELD_COPIES * (3 << 30)
                                                       + (600 << 20) + 7 * (2 << 30))  # int8: 7 per byte
    assert memory.BASE_BYTES + memory.MAPPED_HELD_COPIES * w < low.peak
    # past the size whose weights the stages map from their files, the build holds fewer copies of them
    small = 32 << 20
    assert small <= irm.EXTERNAL_FROM < w
    assert (memory.estimate(small, x86, BuildOptions(model="m", target="x86", out="o", low_memory=True)).peak
            == memory.BASE_BYTES + memory.HELD_COPIES * small + 2 * small)  # onnxruntime: 2 bytes per byte


def test_the_estimate_after_schedule_prices_the_devices_the_plan_uses():
    """Before the plan, an arm_2tpu build prices TFLite's int8 converter (the Edge TPU's) on the whole model;
    once the plan puts it all on the CPU, it prices the CPU's compilers alone, and where it puts a segment on
    a TPU, the converter on that segment's weights."""
    import types

    from edgesdk.config import load_target
    from edgesdk.scheduling.plan import PlanSegment

    def segment(sid, device, param_bytes):
        return PlanSegment(sid, device, "tvm", f"segments/{sid}.onnx", ("n",), ("x",), ("y",), 1.0, param_bytes, 1.0)

    arm = load_target("arm_2tpu")[0]
    options = BuildOptions(model="m", target="arm_2tpu", out="o")
    w = 1 << 30
    before = memory.estimate(w, arm, options)
    cpu_only = memory.estimate(w, arm, options, types.SimpleNamespace(segments=(segment("s0", "cpu", w),)))
    # the CPU's compilers on its segments: LiteRT's converter is the hungriest of them at 1 GiB
    litert = backends.backend("litert")
    assert before.compiler == "tflite" and cpu_only.compiler == "litert" and cpu_only.peak < before.peak
    assert cpu_only.peak == (memory.held_bytes(w) + litert.compile_base_bytes
                             + int(litert.compile_bytes_per_weight_byte * w))
    on_tpu = memory.estimate(w, arm, options, types.SimpleNamespace(
        segments=(segment("s0", "edgetpu:0", 64 << 20), segment("s1", "cpu", w - (64 << 20)))))
    tpu_share = memory.estimate(w, arm, options, types.SimpleNamespace(segments=(segment("s0", "edgetpu:0", 64 << 20),)))
    assert tpu_share.compiler == "tflite" and tpu_share.peak < on_tpu.peak <= cpu_only.peak < before.peak


def test_low_memory_is_in_build_help():
    out = subprocess.run([sys.executable, "-m", "edgesdk.cli", "build", "--help"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "sdk"), "COLUMNS": "200"}, timeout=120)
    assert "--low-memory" in out.stdout
