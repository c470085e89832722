"""YOLOv8 detectors for arm_2tpu, the flagship target's most common use.

The head of a YOLOv8 export computes its anchor grid in the graph (ConstantOfShape/Range/Expand/Concat,
none of it depending on the input's values): import folds it, and nothing of it reaches an Edge TPU
segment, whose output it once was (compress refused the build). `edgesdk check` and `edgesdk build`
agree; a failed build with `--json` still prints one JSON object naming the error."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from edgesdk.runtime import BundleModel
from tests import model_zoo, yolo_head
from tests.test_cli import assert_user_facing, constants_only, edgesdk

pytestmark = pytest.mark.slow  # YOLOv8 detectors built for arm_2tpu


def _parts(got: np.ndarray, want: np.ndarray) -> dict[str, dict[str, float]]:
    """Per part of a [4 + classes, anchors] output (the boxes in pixels, the class scores in [0, 1]): the
    largest and the mean absolute error, each as a share of that part's scale (its largest magnitude in
    `want`), and the cosine similarity."""
    out = {}
    for name, part in (("boxes", slice(0, 4)), ("scores", slice(4, None))):
        g, w = got[..., part, :].astype(np.float64), want[..., part, :].astype(np.float64)
        scale = np.abs(w).max()
        err = np.abs(g - w)
        out[name] = {"max": err.max() / scale, "mean": err.mean() / scale,
                     "cosine": float((g * w).sum() / np.linalg.norm(g) / np.linalg.norm(w))}
    return out


def test_a_yolov8_head_builds_for_arm_2tpu_check_agrees_and_the_gate_sees_its_scores(tmp_path):
    """The head at 80x80 (its first scale's stride tensor a ConstantOfShape of 1,600 elements, 2,100
    anchors, as YOLOv8n's at 320x320): check finds nothing that keeps a node off the Edge TPU, and the
    build puts the whole detector there, grid folded. Its last Concat is int8 on the Edge TPU, where the
    class scores ([0, 1]) take the boxes' step (pixels): the whole output's cosine stays 0.9999 while the
    scores collapse. The accuracy gate judges the scores as scores: the build fails (exit 1, no bundle)
    naming that part, not the boxes, and the culprit (the sigmoid's values requantized for the Concat,
    which shares one quantization between its inputs and its output). `--accept-accuracy-loss` publishes
    it, and the manifest, inspect and the build summary say so."""
    path = tmp_path / "yolov8_head.onnx"
    onnx.save(yolo_head.model(), path)
    check = edgesdk("check", str(path), "--target", "arm_2tpu", "--json")
    assert check.returncode == 0, check.stderr
    report = json.loads(check.stdout)
    refused = [(n["node"], r["code"]) for n in report["nodes"] for r in n["refusals"] if not r["device"].startswith("cpu")]
    assert refused == [] and all(n["devices"][0] == "edgetpu" for n in report["nodes"]), refused
    assert not {"ConstantOfShape", "Range", "Expand"} & {n["op"] for n in report["nodes"]}

    out = tmp_path / "out"
    # the verdict as it is, without the remedy that keeps the culprits on the CPU (test_accuracy_remedy_e2e.py)
    proc = edgesdk("build", str(path), "--target", "arm_2tpu", "-o", str(out), "--no-accuracy-remedy")
    assert_user_facing(proc, 1, "error: the bundle misses the target's accuracy gate")
    error = next(line for line in proc.stderr.splitlines() if line.startswith("error: "))
    assert "output0[:, 4:6] (scores)" in error and "output0[:, 0:4]" not in error, error
    culprits = [line.strip() for line in proc.stderr.splitlines() if line.strip().startswith("culprit: ")]
    assert culprits and culprits[0].startswith("culprit: /scores in s0 (Sigmoid -> "), culprits
    assert "shared-quantization: CONCATENATION keeps one quantization for its input and output" in culprits[0]
    assert "its accuracy on real data is unknown" in proc.stderr
    assert not (out / "bundle").exists() and not (out / "bundle.tar.gz").exists()
    assert not (out / ".build" / "6-package").exists()

    proc = edgesdk("build", str(path), "--target", "arm_2tpu", "-o", str(out), "--accept-accuracy-loss", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["bundle"] == str(out / "bundle")
    assert "--accept-accuracy-loss: the bundle is published BELOW its accuracy gate" in proc.stderr
    plan = json.loads((out / "bundle" / "plan.json").read_text())
    assert [s["device"] for s in plan["segments"]] == ["edgetpu:0"], plan["segments"]
    accuracy = json.loads((out / "bundle" / "manifest.json").read_text())["accuracy"]
    assert accuracy["accepted_loss"] is True and [f["part"] for f in accuracy["failures"]] == ["output0[:, 4:6]"]
    assert accuracy["culprits"][0]["node"] == "/scores" and accuracy["culprits"][0]["cause"] == "shared-quantization"
    shown = edgesdk("inspect", str(out / "bundle"))
    assert shown.returncode == 0, shown.stderr
    assert ("accuracy    each output against fp32 on 8 held-out samples: BELOW THE ACCURACY GATE: published only "
            "because of --accept-accuracy-loss") in shown.stdout
    assert "culprit /scores in s0" in shown.stdout and "calibration SYNTHETIC" in shown.stdout
    assert (out / ".build" / "6-package" / "accuracy.html").is_file()
    # the boxes as onnxruntime computes them on the exported model, on inputs like the synthetic calibration's
    model = BundleModel(out / "bundle", log=lambda s: None)
    reference = onnx.load(str(path))
    import onnxruntime as ort

    session = ort.InferenceSession(reference.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    for _ in range(2):
        x = rng.uniform(-1, 1, (1, 3, 80, 80)).astype(np.float32)
        boxes = _parts(model.run({"images": x})["output0"], session.run(None, {"images": x})[0])["boxes"]
        assert boxes["max"] <= 0.06 and boxes["mean"] <= 0.01, boxes


@pytest.mark.parametrize("command", ["build", "check"])
@pytest.mark.parametrize("case, code, exit_code", [("bad-stage", "build.bad-stage", 2),
                                                    ("constant", "import.nothing-to-compute", 1)])
def test_a_failure_with_json_prints_the_error_as_json(tmp_path, command, case, code, exit_code):
    """One JSON object on stdout, what the error: and hint: lines (still on stderr) say; the same exit code."""
    model = constants_only(tmp_path / "shape_only.onnx")
    args = [command, str(model), "--target", "arm_2tpu", "--json"]
    if command == "build":
        args += ["-o", str(tmp_path / "out")] + (["--until", "bogus"] if case == "bad-stage" else [])
    elif case == "bad-stage":
        args[1] = str(tmp_path / "missing.onnx")
        code, exit_code = "build.model-not-found", 2
    proc = edgesdk(*args)
    assert proc.returncode == exit_code, proc.stderr
    error = json.loads(proc.stdout)["error"]
    assert error["code"] == code and error["exit_code"] == exit_code
    assert f"error: {error['message']}" in proc.stderr and f"hint: {error['hint']}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "bundle").exists()


def _photo(size: int) -> np.ndarray:
    """matplotlib's sample photograph (Grace Hopper's portrait, 512x600), resized to size x size: RGB in
    [0, 1], NCHW, as Ultralytics feeds a YOLOv8 export."""
    import matplotlib
    from PIL import Image

    image = Image.open(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg").convert("RGB")
    return (np.asarray(image.resize((size, size)), np.float32) / 255.0).transpose(2, 0, 1)[None]


def _crops(directory: Path, count: int, size: int) -> Path:
    """`count` calibration images: crops of 50-90% of the photograph, every other one mirrored; the
    whole frame, which the test compares on, is none of them."""
    import matplotlib
    from PIL import Image, ImageOps

    image = Image.open(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg").convert("RGB")
    rng = np.random.default_rng(1)
    directory.mkdir()
    for k in range(count):
        s = rng.uniform(0.5, 0.9)
        w, h = int(image.width * s), int(image.height * s)
        x0, y0 = rng.integers(0, image.width - w + 1), rng.integers(0, image.height - h + 1)
        crop = image.crop((x0, y0, x0 + w, y0 + h)).resize((size, size))
        (ImageOps.mirror(crop) if k % 2 else crop).save(directory / f"crop{k:02d}.png")
    return directory


def test_a_real_yolov8n_builds_for_arm_2tpu_and_finds_what_onnxruntime_finds(tmp_path):
    """nudenet's YOLOv8n (trained weights) at 320x320 for arm_2tpu, calibrated on 16 crops of a photograph
    and run on the whole photograph: the boxes and the class scores, each against onnxruntime on the model
    as exported, relative to its own scale. The strongest detection (a face, 0.52) is the same anchor and
    class, its score within 0.1 and its box within 2% of the image; overall the boxes agree to a cosine of
    0.999 and a mean error of 2% of their scale, the scores to a cosine of 0.9."""
    from edgesdk.pipeline import BuildOptions, build

    source = model_zoo.yolov8n()
    calib = _crops(tmp_path / "calib", 16, 320)
    result = build(BuildOptions(model=source, target="arm_2tpu", out=tmp_path / "out",
                                input_shapes={"images": (1, 3, 320, 320)}, calib=calib, calib_samples=16, calib_method="minmax",
                                calib_preprocess="color=RGB,scale=0.00392157,layout=NCHW",
                                tuning_db=tmp_path / "tuning"))
    plan = json.loads((result.bundle / "plan.json").read_text())
    assert any(s["device"].startswith("edgetpu") for s in plan["segments"])
    # real calibration: within the accuracy gate on its held-out crops, honestly (nothing accepted)
    accuracy = json.loads((result.bundle / "manifest.json").read_text())["accuracy"]
    assert accuracy["gate"]["passed"] is True and "accepted_loss" not in accuracy, accuracy
    assert accuracy["parts"]["output0[:, 4:22]"]["cosine"] >= 0.95, accuracy["parts"]
    imported = onnx.load(str(tmp_path / "out" / ".build" / "1-import" / "model.onnx"))
    assert not {"ConstantOfShape", "Range", "Expand"} & {n.op_type for n in imported.graph.node}

    import onnxruntime as ort

    x = _photo(320)
    want = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"]).run(None, {"images": x})[0][0]
    got = BundleModel(result.bundle, log=lambda s: None).run({"images": x})["output0"][0]
    assert got.shape == want.shape == (22, 2100)
    parts = _parts(got, want)
    assert parts["boxes"]["cosine"] >= 0.999 and parts["boxes"]["mean"] <= 0.02, parts
    assert parts["scores"]["cosine"] >= 0.9, parts
    best = int(want[4:].max(0).argmax())
    assert want[4:, best].max() > 0.5 and int(want[4:, best].argmax()) == 1  # FACE_FEMALE
    assert int(got[4:].max(0).argmax()) == best and int(got[4:, best].argmax()) == 1
    assert abs(got[4:, best].max() - want[4:, best].max()) <= 0.1
    assert np.abs(got[:4, best] - want[:4, best]).max() <= 0.02 * 320, (got[:4, best], want[:4, best])
