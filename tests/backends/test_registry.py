"""The build side's backend registry: the stages ask it what a backend does instead of comparing names."""

from __future__ import annotations

import pytest

from edgesdk import backends
from edgesdk.backends import Backend


def test_the_shipped_backends_and_what_they_do():
    # requirements.txt order; litert and openvino are fp32 CPU candidates the tune stage measures, the int8
    # bf16 and fp16 ones its candidates with --cpu-precision int8, bf16, fp16 or auto; litert-own, a quantized
    # TFLite model's own file, the candidate of a span that is the whole model
    assert [b.name for b in backends.backends()] == ["tvm", "tflite", "onnxruntime", "litert", "litert-own",
                                                     "litert-int8", "onnxruntime-int8", "openvino", "openvino-bf16",
                                                     "openvino-fp16"]
    assert "litert-own" not in backends.cpu_candidates()
    assert all(b.lowering for b in backends.backends())  # legalize and the CPU backend choice ask each
    assert [b.name for b in backends.backends() if b.tunes] == ["tvm"]
    assert [b.name for b in backends.backends() if b.quantizes] == ["tflite", "litert-int8", "onnxruntime-int8"]
    assert backends.backend("tvm").runtime_dists == ("apache-tvm", "apache-tvm-ffi")
    assert backends.backend("openvino").runtime_dists == ("openvino", "openvino-telemetry")  # the wheel needs both


def test_the_cpu_candidates_their_int8_twins_and_the_policy_fallback_are_registry_data():
    # the order ties between equal measurements are broken in, as the tune stage measured them before
    assert backends.cpu_candidates() == ["tvm", "onnxruntime", "litert", "openvino"]
    assert backends.cpu_candidates("int8") == ["onnxruntime-int8", "litert-int8"]
    assert backends.cpu_candidates("bf16") == ["openvino-bf16"]
    assert backends.cpu_candidates("fp16") == ["openvino-fp16"]
    assert {b: backends.variant(b, "int8") for b in backends.cpu_candidates()} == {
        "tvm": None, "onnxruntime": "onnxruntime-int8", "litert": "litert-int8", "openvino": None}
    assert {b: backends.variant(b, "bf16") for b in backends.cpu_candidates()} == {
        "tvm": None, "onnxruntime": None, "litert": None, "openvino": "openvino-bf16"}
    assert backends.policy_fallback() == "litert"  # what ARM users run, where the target's CPU cannot be timed here
    fast = Backend("fastcpu", runner="onnxruntime", rank=9, runtime_dists=(), cpu_order=9)
    with backends.registered(fast):
        assert backends.cpu_candidates() == ["tvm", "onnxruntime", "litert", "openvino", "fastcpu"]
    assert backends.cpu_candidates() == ["tvm", "onnxruntime", "litert", "openvino"]


def test_a_backend_registered_for_a_test_is_forgotten_after_it():
    fake = Backend("fake", runner="onnxruntime", rank=9, runtime_dists=("onnxruntime",))  # after the others
    with backends.registered(fake):
        assert backends.backend("fake") is fake and backends.backends()[-1] is fake
        with pytest.raises(ValueError, match="already registered"):
            backends.register(fake)
    with pytest.raises(ValueError, match="no backend named 'fake'; known: litert, litert-int8, litert-own, onnxruntime, onnxruntime-int8, openvino, openvino-bf16, openvino-fp16, tflite, tvm"):
        backends.backend("fake")


def test_only_the_edge_tpu_has_a_finisher_and_it_says_how_to_finish():
    f = backends.finisher("edgetpu")
    assert f is not None and f.name == "edgetpu_compiler"
    assert backends.finisher("cpu") is None and backends.finisher("gpu") is None
    assert f.finish_command(["segments/s0.tflite"]) == "edgetpu_compiler -s -o segments segments/s0.tflite"
    warning = f.unfinished_warning(["segments/s0.tflite", "segments/s2.tflite"])
    assert warning.startswith("edgetpu_compiler is not installed: 2 Edge TPU model(s) ship uncompiled")
    assert warning.endswith("cd bundle && edgetpu_compiler -s -o segments segments/s0.tflite segments/s2.tflite")
    with pytest.raises(ValueError, match="already has a finisher"):
        backends.register_finisher(f)


@pytest.mark.parametrize("target", ["x86", "rtx3090"])
def test_tvm_tuning_over_rpc_bounds_builders_by_a_cpu_entry_only(monkeypatch, tmp_path, target):
    """The TVM tuner hands MetaSchedule the cores of the boards' CPU entry; a GPU entry has no cores
    (tuning for the RTX 3090 over RPC once failed reading them)."""
    from edgesdk.backends.tvm import segment
    from edgesdk.config import load_target

    seen = {}
    monkeypatch.setattr(segment, "tune_onnx", lambda models, codegen, db, **kw: seen.update(kw, codegen=codegen) or {})
    t, _ = load_target(target)
    kind = "gpu" if target == "rtx3090" else "cpu"
    device = t.device(kind)
    job = backends.TuneJob(kind=kind, models=(), device=device, tuning_db=tmp_path, trials=8, time_budget_s=None,
                           seed=0, boards=backends.Boards.parse("127.0.0.1:9190", "k"), log_dir=tmp_path,
                           progress=None, log=lambda s: None)
    backends.backend("tvm").tune(job)
    assert seen["codegen"] == device.codegen
    assert seen["num_cores"] == (t.host.cores if kind == "cpu" else None)
    assert seen["boards"] == backends.Boards("127.0.0.1", 9190, "k")
