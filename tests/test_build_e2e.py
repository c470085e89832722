"""End to end: real models through the six stages to a bundle that verifies itself.

MobileNetV2 (tf.keras.applications, weights=None, exported with tf2onnx) and PP-OCR's pretrained
text-direction classifier (from the rapidocr-onnxruntime wheel), for each of the three targets.
Builds are shared through session fixtures (conftest.py)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edgesdk.backends import qemu
from edgesdk.errors import UserError
from edgesdk.ir.numeric import compare
from edgesdk.runtime import BundleModel, Manifest
from edgesdk.verify import verify
from tests.model_zoo import PPOCR_CLS_SHAPE, ROOT, ppocr_cls
from tests.numeric import assert_close
from tests.test_interrupted_build import tiny_model

pytestmark = pytest.mark.slow  # real models built for every target, and their self-tests under qemu


def ort_run(model_path: Path, feeds: dict[str, np.ndarray], shapes: dict | None = None) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def edgesdk(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT / "sdk"), **(env or {})}
    return subprocess.run([sys.executable, "-m", "edgesdk.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=1200)


# --- x86 -----------------------------------------------------------------------------------------


def test_x86_mobilenet_matches_onnxruntime(x86_mobilenet, mobilenet_v2):
    bundle = x86_mobilenet.bundle
    manifest = Manifest.load(bundle)
    assert [s.backend for s in manifest.segments] == ["tvm"]
    assert (bundle / manifest.segments[0].artifact).suffix == ".so"
    model = BundleModel(bundle, log=lambda s: None)
    rng = np.random.default_rng(1)
    for _ in range(2):
        x = rng.uniform(-1, 1, (1, 224, 224, 3)).astype(np.float32)
        got = model.run({"input": x})
        ref = ort_run(mobilenet_v2, {"input": x})
        for name, r in ref.items():
            err = np.max(np.abs(got[name] - r)) / np.max(np.abs(r))
            assert err <= 1e-4, (name, err)  # 1e-4 relative to the output's largest magnitude


def test_x86_bundle_verifies_natively(x86_mobilenet):
    report = verify(x86_mobilenet.bundle)
    assert report.hashes_ok and report.selftest == "passed", report
    assert report.detail.startswith("natively")


def test_unchanged_rebuild_is_all_cache_hits(x86_ppocr):
    from edgesdk.pipeline import BuildOptions, build

    out = x86_ppocr.out
    before = (out / "bundle.tar.gz").read_bytes()
    again = build(BuildOptions(model=ppocr_cls(), target="x86", out=out, input_shapes={"x": (1, 3, 48, 192)},
                               tuning_db=Path(json.loads((out / ".build/4-tune/tune.json").read_text())["database"]),
                               calib_samples=16, cpu_backends=("planned",)))
    assert [s.cached for s in again.stages] == [True] * 6
    assert (out / "bundle.tar.gz").read_bytes() == before


def test_until_and_from(tmp_path, tuning_db):
    # which stages run and which are reused is what is tested, not the model: two nodes build in seconds,
    # on the schedule's CPU backend (timing every candidate took 12 s of tune for two nodes)
    model = tiny_model(tmp_path / "m.onnx", 0)
    out = tmp_path / "o"
    build = ["build", str(model), "--target", "x86", "-o", str(out), "--tuning-db", str(tuning_db),
             "--cpu-backends", "planned"]
    proc = edgesdk(*build, "--until", "schedule", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert [s["name"] for s in summary["stages"]] == ["import", "legalize", "schedule"]
    assert summary["bundle"] is None and not (out / "bundle").exists()
    assert json.loads((out / ".build/3-schedule/plan.json").read_text())["segments"]
    proc = edgesdk(*build, "--json")
    assert proc.returncode == 0, proc.stderr
    cached = [s["cached"] for s in json.loads(proc.stdout)["stages"]]
    assert cached == [True, True, True, False, False, False]
    proc = edgesdk(*build, "--from", "compress", "--json")
    cached = [s["cached"] for s in json.loads(proc.stdout)["stages"]]
    assert cached == [True, True, True, True, False, False]
    # progress goes to stderr, one line per stage, data to stdout
    proc = edgesdk(*build)
    assert proc.stdout == ""
    assert "[1/6] import cached" in proc.stderr and "[6/6] package cached" in proc.stderr
    nodes = json.loads((out / ".build/3-schedule/plan.json").read_text())["placement"]["cpu"]
    assert f"placement: cpu: {nodes} nodes" in proc.stderr
    assert "rules fired: " in proc.stderr  # the import summary, from the cached record
    assert edgesdk(*build, "--quiet").stderr == ""


def test_run_command_writes_outputs(x86_ppocr, tmp_path):
    x = np.random.default_rng(3).uniform(-1, 1, (1, 3, 48, 192)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    proc = edgesdk("run", str(x86_ppocr.bundle), "--input", str(tmp_path / "x.npy"), "-o", str(tmp_path / "y.npy"))
    assert proc.returncode == 0, proc.stderr
    y = np.load(tmp_path / "y.npy")
    ref = ort_run(_fixed(ppocr_cls(), tmp_path), {"x": x})
    assert_close(y, next(iter(ref.values())))
    proc = edgesdk("run", str(x86_ppocr.bundle), "--input", f"y={tmp_path / 'x.npy'}")
    assert proc.returncode == 2 and "has no input 'y'" in proc.stderr
    np.save(tmp_path / "bad.npy", x[:, :, :24])
    proc = edgesdk("run", str(x86_ppocr.bundle), "--input", str(tmp_path / "bad.npy"))
    assert proc.returncode == 2 and "input 'x' has shape (1, 3, 24, 192)" in proc.stderr
    # a file that is not there is a wrong invocation; one whose content numpy cannot read, the data's fault
    proc = edgesdk("run", str(x86_ppocr.bundle), "--input", str(tmp_path / "none.npy"))
    assert proc.returncode == 2 and "none.npy does not exist or is not a file" in proc.stderr, proc.stderr
    (tmp_path / "junk.npy").write_bytes(b"\x93NUMPY junk")
    proc = edgesdk("run", str(x86_ppocr.bundle), "--input", str(tmp_path / "junk.npy"))
    assert proc.returncode == 1 and "junk.npy is not a numpy file (" in proc.stderr, proc.stderr


def _fixed(model: Path, tmp: Path) -> Path:
    m = onnx.load(str(model))
    for d, v in zip(m.graph.input[0].type.tensor_type.shape.dim, (1, 3, 48, 192)):
        d.Clear()
        d.dim_value = v
    path = tmp / "fixed.onnx"
    onnx.save(m, str(path))
    return path


def test_inspect_says_what_runs_where(x86_ppocr, arm_ppocr):
    proc = edgesdk("inspect", str(x86_ppocr.bundle))
    assert proc.returncode == 0, proc.stderr
    assert "s0       cpu" in proc.stdout and "tvm" in proc.stdout and "predicted" in proc.stdout
    proc = edgesdk("inspect", str(arm_ppocr.bundle))
    assert "edgetpu:0" in proc.stdout and "usb:0" in proc.stdout
    assert "NOT compiled" in proc.stdout and "edgetpu_compiler -s" in proc.stdout
    assert "calibration from" in proc.stdout


def test_tampered_bundle_is_refused_by_name(x86_ppocr, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(x86_ppocr.bundle, copy)
    seg = next(copy.glob("segments/*.so"))
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0xFF
    seg.write_bytes(bytes(data))
    with pytest.raises(UserError) as e:
        verify(copy)
    assert any(n.startswith(f"segments/{seg.name}: sha256") for n in e.value.notes)
    proc = edgesdk("verify", str(copy))
    assert proc.returncode == 1 and f"segments/{seg.name}" in proc.stderr and "Traceback" not in proc.stderr


def test_tarball_is_reproducible_and_safe(x86_ppocr, tmp_path):
    tar_path = x86_ppocr.out / "bundle.tar.gz"
    with tarfile.open(tar_path) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names, key=lambda n: n) or names[0] == "bundle"
    assert all(m.mtime == int(os.environ.get("SOURCE_DATE_EPOCH", "0")) and m.uid == 0 for m in members)
    report = verify(tar_path)  # verify unpacks the archive and checks it like a directory
    assert report.selftest == "passed"
    # an archive with a '..' member is refused
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 0
        tar.addfile(info)
    with pytest.raises(UserError, match="refuses member"):
        verify(evil)


def test_failed_build_leaves_no_bundle(x86_ppocr, tmp_path):
    out = tmp_path / "o"
    shutil.copytree(x86_ppocr.out, out)
    (tmp_path / "calib").mkdir()
    (tmp_path / "calib" / "x.npy").write_bytes(b"garbage")
    proc = edgesdk("build", str(ppocr_cls()), "--input-shape", PPOCR_CLS_SHAPE, "--target", "arm_2tpu",
                   "-o", str(out), "--calib", str(tmp_path / "calib"))
    assert proc.returncode == 1, proc.stderr
    assert "x.npy: not a numpy file (no numpy header: not a .npy or .npz file" in proc.stderr, proc.stderr
    assert not (out / "bundle").exists() and not (out / "bundle.tar.gz").exists()


# --- arm_2tpu ----------------------------------------------------------------------------------


def test_arm_bundle_has_int8_tpu_segments(arm_mobilenet):
    manifest = Manifest.load(arm_mobilenet.bundle)
    tpu = [s for s in manifest.segments if s.device.startswith("edgetpu")]
    assert tpu and all(s.backend == "tflite" and s.artifact.endswith(".tflite") for s in tpu)
    assert manifest.arch == "aarch64"
    assert manifest.edgetpu["edgetpu_compiled"] is False
    assert "edgetpu_compiler -s -o segments" in manifest.edgetpu["finish_command"]
    assert manifest.calibration["synthetic"] is True
    assert any("synthetic" in w for w in manifest.warnings)
    for s in tpu:
        assert all(t.quant is not None for t in s.inputs + s.outputs)  # full int8 at the boundary
    req = (arm_mobilenet.bundle / "requirements.txt").read_text()
    assert "ai-edge-litert==" in req and "numpy==" in req


def test_arm_mobilenet_stream_is_replicated_on_both_tpus(arm_mobilenet):
    """MobileNetV2 fits one Edge TPU's cache: built for a stream, the plan is the model on edgetpu:0 and a
    replica on edgetpu:1 taking every other frame, predicted about twice one TPU's frames/s and no slower
    than Coral's own replication (a baseline is a candidate, costed alike); the replica ships its own copy of the
    int8 model, both co-compiled per TPU by the finish command."""
    m = Manifest.load(arm_mobilenet.bundle)
    plan = json.loads((arm_mobilenet.bundle / "plan.json").read_text())
    assert plan["replicas"] == [{"edgetpu:0": "edgetpu:1", "edgetpu:1": "edgetpu:0"}], plan["search"]
    (replica,) = m.replicas
    own = [s for s in m.segments if not s.replica]
    mine = [s for s in m.segments if s.replica == 1]
    assert [s.id for s in mine] == [i for i in replica if i not in {s.id for s in own}]
    assert {s.device for s in own if s.device != "cpu"} == {"edgetpu:0"}
    assert {s.device for s in mine} == {"edgetpu:1"}
    assert all(s.fallback_artifact.endswith(".edgetpu1.tflite") for s in mine)
    assert m.edgetpu["co_compiled"]["edgetpu:1"] == [s.id for s in mine]
    alone = plan["baselines"]["coral default (first unsupported op onwards on the cpu)"]["throughput_fps"]
    coral = plan["baselines"]["coral replication (the model on every edge tpu, frames dealt in turn)"]
    assert plan["predicted"]["throughput_fps"] >= 1.8 * alone
    assert plan["predicted"]["throughput_fps"] >= coral["throughput_fps"]


def test_arm_pretrained_int8_accuracy_bound(arm_ppocr):
    """int8 vs fp32 on the pretrained PP-OCR classifier calibrated with 16 PNG text-line images (PP-OCR's
    preprocessing stated to the build) by the percentile method: the build's accuracy gate passed
    honestly (its softmax judged as scores, on the 4 held-out images), with a cosine similarity >= 0.95
    and top-1 agreement >= 7/8; and on new text lines run here the logits (the input of the final
    softmax) keep the same bound."""
    m = Manifest.load(arm_ppocr.bundle)
    acc = m.accuracy
    assert acc["gate"]["passed"] is True and "accepted_loss" not in acc and acc["gate"]["calibration"] == "real"
    (part, scores), = acc["parts"].items()
    assert scores["kind"] == "scores" and scores["activation"] == "softmax" and acc["samples"] == 4
    assert scores["cosine"] >= 0.95 and scores["top1"] >= 7 / 8, scores
    cal = m.calibration
    assert cal["synthetic"] is False and cal["images"] is True and cal["samples"] == 16
    assert cal["preprocess"] == "color=RGB,scale=0.00392157,mean=0.5,std=0.5,layout=NCHW"
    assert cal["method"] == "percentile" and cal["percentile"] == 99.99
    compress = json.loads((arm_ppocr.out / ".build/5-compress/compress.json").read_text())
    for seg in compress["segments"].values():  # per segment: int8 against the float segment
        assert seg["ranges"]["method"] == "percentile" and seg["ranges"]["narrowed"] > 0
        assert all(a["cosine"] >= 0.95 for a in seg["accuracy_vs_float"].values()), seg["accuracy_vs_float"]
    (logits_name,) = json.loads((arm_ppocr.bundle / "plan.json").read_text())["probes"].values()
    # held out: new text lines, the bundle's logits against onnxruntime's fp32 logits
    from edgesdk.backends import onnxruntime as ort_backend
    from tests.model_zoo import text_lines

    model = BundleModel(arm_ppocr.bundle, log=lambda s: None)
    ref_model = onnx.load(str(arm_ppocr.out / ".build/1-import/model.onnx"))
    xs = np.concatenate([text_lines(6, seed=20), text_lines(6, seed=21, flipped=True)])
    got = np.stack([model.run({"x": x}, extra_outputs=[logits_name])[logits_name] for x in xs])
    ref = np.stack([ort_backend.run(ref_model, {"x": x}, [logits_name])[logits_name] for x in xs])
    held_out = compare(got, ref)
    assert held_out["cosine"] >= 0.95, held_out
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 10 / 12


def test_arm_rec_bundle_uses_both_tpus_and_runs_its_cpu_spans_on_litert(arm_rec):
    """The recognizer's convolutions on the two Edge TPUs; its layer norms and attention (Pow, Sqrt, Div
    by a tensor, MatMul of two activations: LiteRT's CPU lowerings) on the CPU as fp32 .tflite."""
    m = Manifest.load(arm_rec.bundle)
    devices = [s.device for s in m.segments]
    assert "cpu" in devices and "edgetpu:0" in devices and "edgetpu:1" in devices, devices
    cpu = [s for s in m.segments if s.device == "cpu"]
    assert all(s.backend == "tflite" and s.artifact.endswith(".tflite") for s in cpu), cpu
    assert not any(p.name.startswith("twin") for p in arm_rec.bundle.rglob("*"))


def test_arm_cpu_spans_are_chosen_by_policy(arm_rec, arm_captioner):
    """This x86-64 host cannot time aarch64 code: each CPU span's backend is chosen by policy. Every
    CPU span of the recognizer goes to LiteRT, which lowers all of it; the captioner's span with a
    Tile keeps the schedule's TVM cut (Tile has no TFLite lowering of ours). The qemu self-test below
    runs both on aarch64."""
    if platform.machine() != "x86_64":
        pytest.skip("the policy applies where the host cannot run the target's code")
    m = Manifest.load(arm_rec.bundle)
    sel = m.tuning["cpu_selection"]
    assert sel["measured_on"] is None and sel["note"].startswith("not measured (the target's CPU is aarch64")
    assert {span["chosen"] for span in sel["spans"]} == {"litert"}, sel["spans"]
    assert all(span["why"].startswith("policy: LiteRT lowers every node; not measured: ") for span in sel["spans"])
    assert "ai-edge-litert==" in (arm_rec.bundle / "requirements.txt").read_text()
    spans = Manifest.load(arm_captioner.bundle).tuning["cpu_selection"]["spans"]
    planned = [span for span in spans if span["chosen"] == "planned"]
    assert planned and planned[0]["candidates"]["litert"]["skipped"].startswith("cannot lower "), spans


@pytest.mark.qemu
@pytest.mark.parametrize("which", ["arm_rec", "arm_mobilenet", "arm_captioner"])
def test_arm_bundle_selftest_under_qemu(which, request):
    """The bundle's own self-test, run by the aarch64 Python of the arm64 root file system under
    qemu-user: its golden outputs come from an x86-64 build of the same plan run on this host (the
    TVM segments compiled again for x86-64, the TFLite segments, int8 and the fp32 LiteRT CPU ones, as
    they ship), and every segment and model output must match them within the tolerance the build
    recorded for it (docs/bundle.md: these three are bit-exact or within 1 step per segment).
    Then a short pipelined stream (one worker per device) must equal run() frame by frame."""
    if qemu.find_rootfs() is None:
        pytest.fail("the arm64 root file system is missing: `make rootfs` prepares it (make test does)")
    result = request.getfixturevalue(which)
    report = verify(result.bundle)
    assert report.selftest == "passed", (report.detail, report.notes, report.segments)
    # every segment was also checked on its own golden inputs
    assert [s["segment"] for s in report.segments] == [s.id for s in Manifest.load(result.bundle).segments]
    assert all(s["passed"] for s in report.segments)
    assert report.detail.startswith("under qemu-user") and "aarch64" in report.detail
    assert report.stream["passed"] and report.stream["frames"] == 4 and not report.stream["mismatched_frames"]


def test_arm_captioner_spans_the_cpu_and_both_tpus(arm_captioner):
    """The captioner's DenseNet frames and unrolled LSTM cells go to the two Edge TPUs as int8
    TFLite; what stays on the CPU runs on LiteRT where it lowers every node of a span (the policy of
    a host that cannot time aarch64 code), else as aarch64 TVM code."""
    m = Manifest.load(arm_captioner.bundle)
    devices = {s.device for s in m.segments}
    assert {"cpu", "edgetpu:0", "edgetpu:1"} <= devices, devices
    tpu_nodes = sum(s.nodes for s in m.segments if s.device.startswith("edgetpu"))
    assert tpu_nodes > 0.9 * sum(s.nodes for s in m.segments)
    tvm = [s for s in m.segments if s.backend == "tvm"]
    assert tvm, m.segments  # the span with a Tile, which LiteRT does not lower
    for s in tvm:
        elf = (arm_captioner.bundle / s.artifact).read_bytes()[:20]
        assert elf[:4] == b"\x7fELF" and int.from_bytes(elf[18:20], "little") == 183  # EM_AARCH64
    # full int8 on the Edge TPUs: no op left float (TensorFlow's quantizer leaves the LSTM cell's split float
    # now and then; the conversion asks again)
    from edgesdk.backends.tflite.flatbuffer import op_counts

    for s in m.segments:
        if s.device.startswith("edgetpu"):
            assert "DEQUANTIZE" not in op_counts((arm_captioner.bundle / s.artifact).read_bytes()), s
    # the x86-64 twin of each aarch64 library made the golden output, and never ships
    assert arm_captioner.stages[-1].record["twins"]
    assert not any(p.name.startswith("twin") for p in arm_captioner.bundle.rglob("*"))
    # int8 through 2 DenseNets and 6 unrolled LSTM steps, random weights, synthetic calibration:
    # measured cosine 0.988 against the fp32 model; the bound leaves room for other kernels' rounding
    (name, acc), = m.accuracy["tensors"].items()
    assert acc["cosine"] >= 0.95, acc


def test_aarch64_verify_without_rootfs_says_it_did_not_run(arm_ppocr, tmp_path):
    proc = edgesdk("verify", str(arm_ppocr.bundle), env={"EDGESDK_ARM64_ROOTFS": str(tmp_path / "none")})
    assert proc.returncode == 0, proc.stderr
    assert "self-test: self-test did NOT run" in proc.stdout and "passed" not in proc.stdout


def test_edgetpu_compiler_test_double(tmp_path, tuning_db):
    """A stand-in `edgetpu_compiler` (a TEST DOUBLE: the real one cannot be installed here) shows the
    build runs it, parses its log, and ships both models; the double's log leaves the SOFTMAX unmapped,
    so the build says so and corrects the plan's prediction. The runtime, finding no libedgetpu, falls
    back to the uncompiled int8 model and says so."""
    from edgesdk.backends.tflite import operators
    from edgesdk.report.text import inspect_bundle

    otherwise = "Operation is otherwise supported, but not mapped due to some unspecified limitation"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "edgetpu_compiler"
    fake.write_text("""#!/bin/sh
# TEST DOUBLE for Coral's edgetpu_compiler: copies the model and prints a log in the layout version 16
# prints with -s (its table lists only the unmapped rows), the PP-OCR classifier's SOFTMAX left unmapped
out=.; while [ $# -gt 1 ]; do case "$1" in -o) out=$2; shift 2;; -s) shift;; *) shift;; esac; done
in=$1; base=$(basename "$in" .tflite)
cp "$in" "$out/${base}_edgetpu.tflite"
cat <<LOG
Edge TPU Compiler version 16.0.384591198 (test double)
Started a compilation timeout timer of 180 seconds.

Model compiled successfully in 412 ms.

Input model: $in
Input size: 1.03MiB
Output model: $out/${base}_edgetpu.tflite
Output size: 1.21MiB
On-chip memory used for caching model parameters: 1.50MiB
On-chip memory remaining for caching model parameters: 6.22MiB
Off-chip memory used for streaming uncached model parameters: 0.00B
Number of Edge TPU subgraphs: 1
Total number of operations: 149
Operation log: $out/${base}_edgetpu.log

Model successfully compiled but not all operations are supported by the Edge TPU. A percentage of the model \
will instead run on the CPU, which is slower. If possible, consider updating your model to use only operations \
supported by the Edge TPU. For details, visit g.co/coral/model-reqs.
Number of operations that will run on Edge TPU: 148
Number of operations that will run on CPU: 1

Operator                       Count      Status

SOFTMAX                        1          OTHERWISE
... All other operators were mapped successfully. See ${base}_edgetpu.log.
Compilation child process completed within timeout period.
Compilation succeeded!
LOG
""".replace("OTHERWISE", otherwise))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "o"
    proc = edgesdk("build", str(ppocr_cls()), "--input-shape", PPOCR_CLS_SHAPE, "--target", "arm_2tpu", "-o", str(out),
                   "--tuning-db", str(tuning_db), env={"PATH": f"{bindir}:{os.environ['PATH']}"})
    assert proc.returncode == 0, proc.stderr
    m = Manifest.load(out / "bundle")
    assert m.edgetpu["edgetpu_compiled"] is True
    seg = next(s for s in m.segments if s.backend == "tflite")
    log = m.edgetpu["compiler"][seg.id]
    assert (log["ops_on_tpu"], log["ops_on_cpu"], log["on_chip_bytes"]) == (148, 1, int(1.5 * 2**20))
    assert log["ops"] == [{"operator": "SOFTMAX", "count": 1, "status": otherwise}]
    assert log["partly_mapped"] and log["others_mapped"]
    assert seg.artifact.endswith("_edgetpu.tflite") and seg.fallback_artifact.endswith(".tflite")

    # the cut: the uncompiled model's last op is its only SOFTMAX; the segment's nodes split in proportion
    ops = operators((out / "bundle" / seg.fallback_artifact).read_bytes())[0]
    assert ops.count("SOFTMAX") == 1 and ops[-1] == "SOFTMAX"
    scheduled = json.loads((out / ".build/3-schedule/plan.json").read_text())
    planned = next(s for s in scheduled["segments"] if s["id"] == seg.id)
    k = int(len(planned["nodes"]) * (len(ops) - 1) / len(ops) + 0.5)
    (c,) = m.edgetpu["corrections"]
    assert (c["segment"], c["ops"], c["ops_on_tpu"], c["ops_on_cpu"]) == (seg.id, len(ops), len(ops) - 1, 1)
    assert (c["first_unmapped"], c["status"]) == ("SOFTMAX", otherwise)
    assert (c["nodes_on_tpu"], c["first_cpu_node"]) == (k, planned["nodes"][k])
    assert c["predicted_ms_before"] == planned["predicted_ms"] != c["predicted_ms_after"]

    # the corrected figures: the manifest's segment, plan.json's segment, and the plan's latency
    delta = c["predicted_ms_after"] - c["predicted_ms_before"]
    plan = json.loads((out / "bundle" / "plan.json").read_text())
    assert seg.predicted_ms == c["predicted_ms_after"]
    assert next(s for s in plan["segments"] if s["id"] == seg.id)["predicted_ms"] == c["predicted_ms_after"]
    for key in ("latency_ms", "sequential_ms"):
        assert plan["predicted"][key] == pytest.approx(scheduled["predicted"][key] + delta, abs=1e-4)
        assert plan["predicted"][key] != scheduled["predicted"][key]
    assert m.predicted == plan["predicted"]

    warning = (f"{seg.id}: edgetpu_compiler mapped {len(ops) - 1} of {len(ops)} ops to the Edge TPU; the first it "
               f"cannot map is op {len(ops)} (SOFTMAX: {otherwise}), so it runs on the host CPU (costed as the last "
               f"{len(planned['nodes']) - k} of its {len(planned['nodes'])} nodes, from {planned['nodes'][k]}); "
               f"predicted {c['predicted_ms_before']:.3f} -> {c['predicted_ms_after']:.3f} ms")
    assert warning in proc.stderr and warning in m.warnings
    shown = inspect_bundle(m, out / "bundle")
    assert f"{seg.id}: {len(ops) - 1} of {len(ops)} ops mapped to the Edge TPU (parameters 1.50 MiB on chip" in shown
    assert f"first unmapped: op {len(ops)}, SOFTMAX ({otherwise})" in shown

    model = BundleModel(out / "bundle", log=lambda s: None)
    assert any("runs its int8 model on the CPU" in n for n in model.notes), model.notes


# --- rtx3090 -----------------------------------------------------------------------------------


def test_gpu_bundle_has_cuda_library(gpu_ppocr):
    m = Manifest.load(gpu_ppocr.bundle)
    gpu = [s for s in m.segments if s.device == "gpu:0"]
    assert gpu and all(s.backend == "tvm" for s in gpu)
    lib = (gpu_ppocr.bundle / gpu[0].artifact).read_bytes()
    assert b"__global__" in lib or b".target sm_86" in lib or b"sm_86" in lib  # CUDA source or PTX inside
    assert m.device_map["gpu:0"] == "cuda:0"


def test_gpu_bundle_says_the_device_needs_a_cuda_compiler(gpu_ppocr, x86_ppocr):
    """The TVM backend's CUDA libraries compile their kernels when loaded: requirements.txt says so,
    once, as comments after the pinned packages; the same model's CPU bundle says nothing of CUDA."""
    lines = (gpu_ppocr.bundle / "requirements.txt").read_text().splitlines()
    assert lines[-2:] == ["# CUDA segments carry CUDA source that TVM compiles when the library is loaded: the device",
                          "# needs the CUDA toolkit's nvcc (TVM_CUDA_COMPILE_MODE=nvcc) or NVRTC, and an NVIDIA driver"]
    assert "apache-tvm==" in lines[2] or "apache-tvm==" in "\n".join(lines[1:-2])
    assert "CUDA" not in (x86_ppocr.bundle / "requirements.txt").read_text()


@pytest.mark.gpu
def test_gpu_bundle_selftest_on_a_gpu(gpu_ppocr):
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no NVIDIA GPU on this host (never counted as passed)")
    report = verify(gpu_ppocr.bundle)
    assert report.selftest == "passed", report


def test_same_inputs_same_bytes(arm_captioner, tmp_path):
    """Two builds of the same model and target in different directories: byte-identical tarballs
    (an aarch64 TVM library, int8 TFLite models for the Edge TPUs, fp32 ones for LiteRT on the CPU, golden
    data and manifest included). The captioner's LSTM is where TensorFlow's quantizer once answered
    otherwise now and then (docs/platform-notes.md)."""
    import dataclasses

    from edgesdk.pipeline import build

    first = arm_captioner
    kinds = {(s.device == "cpu", s.backend) for s in Manifest.load(first.bundle).segments}
    assert kinds == {(True, "tvm"), (True, "tflite"), (False, "tflite")}, kinds
    # its options, and the database it was built with (another pytest process's, where that one built it)
    database = Path(json.loads((first.out / ".build/4-tune/tune.json").read_text())["database"])
    again = build(dataclasses.replace(first.options, out=tmp_path / "again", tuning_db=database))
    assert (again.out / "bundle.tar.gz").read_bytes() == (first.out / "bundle.tar.gz").read_bytes()
