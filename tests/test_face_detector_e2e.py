"""MediaPipe's BlazeFace (short range) built for arm_2tpu, calibrated on real faces and photographs, its task
measured on held-out ones: its `classificators` output is logits that MediaPipe's graph reads through a
sigmoid. The SSD decoder's `activation=sigmoid` declares it so: the int8 range of the output (and of the
Reshapes and the Concatenation sharing its quantization) is where the sigmoid moves, and the gate judges the
scores after it. Before, that output's int8 step was 1.55 logits (its min-max range reached -394): every
face read 0.5 or 0.825, 7 false faces on 24 held-out images, and the bundle was refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from edgesdk.runtime.manifest import Manifest
from tests import model_zoo
from tests.test_cli import edgesdk

pytestmark = pytest.mark.slow  # a real face detector built and calibrated

SSD = "boxes=regressors,scores=classificators,anchors=8:16:16:16,size=128,activation=sigmoid,score=0.5,iou=0.3"


def _square(rgb: np.ndarray, size: int, box: tuple[float, float, float] = (0.5, 0.5, 1.0)) -> np.ndarray:
    """The square of side box[2] (a share of the shorter side) centred at box[:2] (shares), resized."""
    h, w = rgb.shape[:2]
    side = int(min(h, w) * box[2])
    y, x = int((h - side) * box[1]), int((w - side) * box[0])
    return np.asarray(Image.fromarray(rgb[y:y + side, x:x + side]).resize((size, size), Image.BILINEAR))


def test_blazeface_with_its_sigmoid_declared_keeps_every_face_and_adds_none(tuning_db, tmp_path):
    photos, faces = model_zoo.photos(), model_zoo.faces()
    calib = tmp_path / "calib"
    calib.mkdir()
    # calibration: lfw faces 2-13 and crops of the photographs other than the two with a face
    shots = [_square(f, 128) for f in faces[2:14]] + [_square(p, 128, (0.3 + 0.4 * (k % 2), 0.5, 0.7))
                                                      for k, p in enumerate(photos[1:3] + photos[4:6])]
    for k, img in enumerate(shots):
        Image.fromarray(img).save(calib / f"{k:02d}.png")
    # held out: the astronaut's photograph and Grace Hopper's face, whole and cropped, and other lfw faces
    held = [_square(photos[0], 128), _square(photos[0], 128, (0.55, 0.3, 0.6)), _square(faces[1], 128),
            _square(faces[1], 128, (0.4, 0.6, 0.85))] + [_square(f, 128) for f in faces[40:48]]
    data = tmp_path / "eval"
    data.mkdir()
    for k, img in enumerate(held):
        np.save(data / f"{k:02d}.npy", (img[None].astype(np.float32) / 127.5 - 1.0))
    out = tmp_path / "out"
    proc = edgesdk("build", str(model_zoo.BLAZEFACE), "-t", "arm_2tpu", "-o", str(out), "--tuning-db",
                   str(tuning_db / "arm_2tpu"), "--calib", str(calib), "--calib-samples", str(len(shots)),
                   "--calib-preprocess", "scale=1/127.5,mean=1,layout=NHWC", "--eval", str(data),
                   "--task", "detection", "--decoder", "ssd", "--task-options", SSD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    accuracy = Manifest.load(out / "bundle").accuracy
    task = accuracy["task"]
    assert task["detections_fp32"] >= 8, task  # faces are found at all: the measure can fail
    assert task["verdict"]["met"] and task["lost"] == 0 and task["false"] == 0, task
    part = accuracy["parts"]["classificators"]
    assert part["kind"] == "scores" and part["declared"] and part["activation"] == "sigmoid", part
    assert accuracy["parts"]["regressors"]["kind"] == "values"
    compress = json.loads((out / ".build" / "5-compress" / "compress.json").read_text())
    saturated = [s["ranges"]["saturated"] for s in compress["segments"].values() if "saturated" in s.get("ranges", {})]
    assert saturated and saturated[0]["outputs"] == {"classificators": "sigmoid"} and saturated[0]["range"][1] == 8.0
