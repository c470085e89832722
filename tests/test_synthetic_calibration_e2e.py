"""A build without --calib data: its synthetic samples follow the input's range (--input-range, the
range --calib-preprocess gives pixels, the model's metadata), and it says loudly that int8 accuracy on
real inputs is unknown. Measured on real photographs (matplotlib's sample photographs, cut into crops)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk.ir.calibration import load_calibration
from edgesdk.pipeline import BuildOptions, build
from edgesdk.report.text import calibration_summary
from edgesdk.runtime import BundleModel, Manifest

pytestmark = pytest.mark.slow  # whole builds calibrated and judged on real photographs

SIZE = 32


def photo_crops(n: int, seed: int) -> list[np.ndarray]:
    """n RGB crops (NCHW, values in [0, 1]) of the real photographs matplotlib ships (Grace Hopper's
    portrait, a photographed package)."""
    import matplotlib
    from PIL import Image

    data = Path(matplotlib.get_data_path()) / "sample_data"
    photos = [np.asarray(Image.open(data / name).convert("RGB"), np.float32) / 255.0
              for name in ("grace_hopper.jpg", "Minduka_Present_Blue_Pack.png")]
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        p = photos[k % len(photos)]
        y, x = int(rng.integers(0, p.shape[0] - SIZE)), int(rng.integers(0, p.shape[1] - SIZE))
        out.append(np.ascontiguousarray(p[y:y + SIZE, x:x + SIZE].transpose(2, 0, 1)[None]))
    return out


def image_model(path: Path) -> Path:
    """A small convolutional net for RGB images in [0, 1], two branches added. One finds bright regions:
    its filters average the colours (all weights positive) less a threshold (a negative bias), then a
    ReLU, so they answer only where the image is brighter than about 0.35. Samples drawn from [-1, 1]
    average near 0 and light them up only a little, so that branch's calibrated range is narrow and
    every bright region of a photograph saturates it. The other branch's filters are signed (edge-like)."""
    rng = np.random.default_rng(0)
    bright = np.abs(rng.normal(0.05, 0.01, (4, 3, 3, 3))).astype(np.float32)
    edges = rng.normal(0, 0.2, (4, 3, 3, 3)).astype(np.float32)
    inits = {"wb": bright, "bb": (-0.35 * bright.sum(axis=(1, 2, 3))).astype(np.float32), "we": edges,
             "be": np.zeros(4, np.float32), "w2b": rng.normal(0, 0.5, (8, 4, 1, 1)).astype(np.float32),
             "w2e": rng.normal(0, 0.5, (8, 4, 1, 1)).astype(np.float32)}
    N = helper.make_node
    graph = helper.make_graph(
        [N("Conv", ["x", "wb", "bb"], ["cb"], pads=[1, 1, 1, 1]), N("Relu", ["cb"], ["rb"]), N("Conv", ["rb", "w2b"], ["yb"]),
         N("Conv", ["x", "we", "be"], ["ce"], pads=[1, 1, 1, 1]), N("Relu", ["ce"], ["re"]), N("Conv", ["re", "w2e"], ["ye"]),
         N("Add", ["yb", "ye"], ["y"])],
        "image_net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, SIZE, SIZE])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, SIZE, SIZE])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def _error_on_photos(bundle: Path, model: Path, photos: list[np.ndarray]) -> tuple[float, float]:
    """The bundle's largest and root-mean-square error on the photographs, as shares of the fp32 output's
    range."""
    from edgesdk.backends import onnxruntime as ort_backend

    runner = BundleModel(bundle, log=lambda s: None)
    reference = onnx.load(str(model))
    got = np.stack([runner.run({"x": p})["y"] for p in photos])
    want = np.stack([ort_backend.run(reference, {"x": p}, ["y"])["y"] for p in photos])
    span = want.max() - want.min()
    return float(np.abs(got - want).max() / span), float(np.sqrt(np.mean((got - want) ** 2)) / span)


def test_input_range_shapes_the_synthetic_samples_and_int8_is_better_on_photographs(tmp_path):
    """Built for the Edge TPU with no --calib twice: as before, samples uniform in [-1, 1], and with
    --input-range x=0,1. The second build's samples lie in [0, 1] (compress.json and the manifest say
    so, with the range's source), and its int8 bundle is nearer fp32 on 24 real photograph crops: the
    [-1, 1] build clipped the colour averages at the values noise reaches. Both builds say that int8
    accuracy on real inputs is unknown, the first also that nothing states its input's range."""
    model = image_model(tmp_path / "image_net.onnx")
    photos = photo_crops(24, seed=1)
    errors, manifests = {}, {}
    for label, ranges in (("default", {}), ("input-range", {"x": (0.0, 1.0)})):
        options = BuildOptions(model=model, target="arm_2tpu", out=tmp_path / "out", calib_samples=16,
                               input_ranges=ranges)
        result = build(options)
        compress = json.loads((result.out / ".build/5-compress/compress.json").read_text())
        manifests[label] = (Manifest.load(result.bundle), compress["calibration"])
        errors[label] = _error_on_photos(result.bundle, model, photos)
        if ranges:
            samples, _ = load_calibration(options, json.loads((result.out / ".build/1-import/import.json").read_text())["inputs"])
            assert len(samples) == 16 and all(0 <= s["x"].min() and s["x"].max() <= 1 for s in samples)
            assert min(s["x"].min() for s in samples) < 0.01 and max(s["x"].max() for s in samples) > 0.99
    m, calibration = manifests["input-range"]
    assert calibration["inputs"]["x"] == {"low": [0.0], "high": [1.0], "source": "--input-range"}
    assert calibration["distribution"] == "x: uniform(0, 1) in blocks from the whole image to one pixel" and m.calibration["accuracy_on_real_data"] == "unknown"
    assert any("int8 accuracy on real inputs is unknown" in w and "--calib DIR" in w for w in m.warnings), m.warnings
    assert not any("nothing states its range" in w for w in m.warnings), m.warnings
    shown = calibration_summary(m.calibration)  # what `edgesdk inspect` prints
    assert shown[0] == "calibration SYNTHETIC, 16 samples (x: [0, 1] from --input-range)", shown
    assert shown[1].strip().startswith("int8 accuracy on real inputs is UNKNOWN: ") and "--calib DIR" in shown[1], shown
    m, calibration = manifests["default"]
    assert calibration["distribution"] == "uniform(-1, 1)" and calibration["method"] == "minmax"
    assert any("input 'x': nothing states its range" in w and "--input-range x=LOW,HIGH" in w for w in m.warnings)
    # the bound, measured 0.62 and 0.109 (max, rms) against 0.10 and 0.004: the [0, 1] build's worst error on
    # the photographs at most half the [-1, 1] build's, and its rms error a fifth
    (worst, rms), (worst_default, rms_default) = errors["input-range"], errors["default"]
    assert worst < 0.5 * worst_default and rms < 0.2 * rms_default, errors


def test_with_real_data_auto_is_the_default_and_every_choice_is_recorded(tmp_path):
    """Built for the Edge TPU with 16 real photograph crops as --calib data and no --calib-method: the
    method is `auto`. compress.json records, per calibrated tensor, its method, range and error by every
    method; per segment and for the whole model, each candidate's output error and the candidate kept
    (the one of least error); the manifest the method, the counts per method (adding up to the tensors
    calibrated) and the whole-model choice; `inspect` prints them. Only the kept models are left in
    segments/ (the candidates weighed are removed), and the bundle is near fp32 on 24 held-out crops."""
    from edgesdk.backends.tflite.convert import PER_TENSOR
    from edgesdk.ir.calibrators import METHODS
    from edgesdk.stages.compress.auto import PER_SEGMENT

    model = image_model(tmp_path / "image_net.onnx")
    calib = tmp_path / "calib"
    calib.mkdir()
    for k, crop in enumerate(photo_crops(16, seed=2)):
        np.save(calib / f"crop{k:02d}.npy", crop)
    result = build(BuildOptions(model=model, target="arm_2tpu", out=tmp_path / "out", calib=calib, calib_samples=16))
    stage = result.out / ".build/5-compress"
    compress = json.loads((stage / "compress.json").read_text())
    calibration = compress["calibration"]
    assert calibration["method"] == "auto" and not calibration["synthetic"]
    whole = calibration["auto"]
    assert set(whole["output_error"]) == {PER_SEGMENT, PER_TENSOR, *METHODS}, whole
    # weighed on the 12 samples calibrated on, never the 4 held out for the accuracy gate
    assert whole["output_error"][whole["chosen"]] == min(whole["output_error"].values()) and whole["samples"] == 12
    tensors = 0
    for seg_id, entry in compress["segments"].items():
        r = entry["ranges"]
        assert "alternatives" not in entry and r["auto"]["whole_model"] == whole["chosen"], (seg_id, r["auto"])
        assert r["auto"]["output_error"][r["auto"]["chosen"]] == min(r["auto"]["output_error"].values())
        kept = r["auto"]["chosen"] if whole["chosen"] == PER_SEGMENT else whole["chosen"]
        for t in r["per_tensor"]:
            assert set(t["error"]) == set(METHODS) and t["range"] == t["ranges"][t["method"]], t
            assert t["method"] == (t["least"] if kept == PER_TENSOR else kept), (kept, t)
        assert sum(r["methods"].values()) == r["tensors"] == len(r["per_tensor"]) > 0
        tensors += r["tensors"]
    assert sorted(p.name for p in (stage / "segments").iterdir()) == sorted(
        Path(e["artifact"]).name for e in compress["segments"].values())
    m = Manifest.load(result.bundle)
    assert m.calibration["method"] == "auto" and m.calibration["auto"]["chosen"] == whole["chosen"]
    assert sum(m.calibration["methods"].values()) == tensors, m.calibration
    shown = "\n".join(calibration_summary(m.calibration))
    assert f"calibration from {calib}, 16 samples" in shown and "method auto: tensors by method" in shown, shown
    worst, rms = _error_on_photos(result.bundle, model, photo_crops(24, seed=1))
    assert worst < 0.2 and rms < 0.02, (worst, rms)
