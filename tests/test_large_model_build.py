"""Builds of models of any size (issue 22): weights kept beside the model as external data through the
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
