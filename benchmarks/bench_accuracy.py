"""Accuracy of int8 arm_2tpu bundles on real held-out inputs, against the fp32 model (issue 44).

    .venv/bin/python benchmarks/bench_accuracy.py [--models rec,det,...] [--configs synthetic,minmax,best]
        [--best-method percentile] [--no-verify] [--work DIR] [--out benchmarks/accuracy_before.json]
    .venv/bin/python benchmarks/bench_accuracy.py --table benchmarks/accuracy_before.json

Each model is built for `targets/arm_2tpu.yaml` three times, each build in a fresh process of its own
(`edgesdk build --json`): (a) `synthetic`, no `--calib`; (b) `minmax`, 32 real calibration images with
`--calib-preprocess` and `--calib-method minmax`; (c) `best`, the same images with the best method the build
offers (`--best-method`: `percentile` today, `auto` once the build has it). Then, in another fresh process,
the int8 bundle runs on real held-out inputs that no calibration saw (on this x86 host: `BundleModel` with the
x86-64 twins of its aarch64 segments and the Edge TPU segments on LiteRT's CPU interpreter, the build's own
golden path), beside the fp32 model (onnxruntime on the original ONNX file; LiteRT's float interpreter on
the original TFLite file; for the selfie segmenter, whose custom op the interpreter cannot run, onnxruntime on
the build's import of it). Last, unless `--no-verify`, `edgesdk verify` runs the bundle's own self-test on
aarch64 under qemu-user.

Measures, per model, on what its outputs mean (the task measures are implemented here, in small functions, until
`compression/tasks.py` exists on main; then `ctc_greedy`, `character_accuracy`, `mask_iou`, `yolov8_decode`,
`match_detections` ... switch to it):
- PP-OCRv4 recognizer: characters read (greedy CTC decoding with the model's own dictionary), fp32's and
  int8's character accuracy against the rendered strings, and int8's against fp32's reading;
- PP-OCRv4 detector: text-mask IoU, the probability map thresholded at 0.3 as PP-OCR's DB post-processing does;
- YOLOv8n (nudenet's 320n.onnx): detections (class score >= 0.25, per-class NMS at IoU 0.5) kept, lost and
  false at IoU 0.5 against fp32's;
- BlazeFace (MediaPipe short range): boxes decoded with MediaPipe's SSD anchors (score >= 0.5, NMS at 0.3),
  kept/lost/false at IoU 0.5, and the face scores of the matched boxes;
- face landmarks (MediaPipe, PReLU): mean landmark error in pixels of the 192-pixel crop and as a share of it,
  and the face flag (after its sigmoid);
- iris landmarks (MediaPipe): the same on the 64-pixel eye crop;
- PP-OCR direction classifier: top-1 against the true orientation (upright or rotated 180 degrees);
- selfie segmentation: mask IoU at 0.5;
- every output (the contract's generic measure), per part where an output mixes kinds (YOLOv8's boxes and
  class scores; BlazeFace's scores after their sigmoid): cosine, max and mean error as shares of the fp32
  part's range, top-1 agreement over a class axis.
Also recorded: what the build said (exit code, its warnings, the manifest's accuracy section, seconds).

Real inputs (tests/model_zoo.py; `make models` fetches them): text lines and pages rendered in DejaVu Sans;
scikit-image's photographs and scanned pages; face crops (scikit-image's astronaut, matplotlib's Grace
Hopper, lfw_subset). Calibration and held-out sets never share an image (see `INPUTS`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk")]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
EDGESDK = [sys.executable, "-m", "edgesdk.cli"]
CALIB_SAMPLES = 32


def model_specs() -> dict[str, dict]:
    """name -> the model's file, fixed input shape, preprocessing (as --calib-preprocess states it) and
    how its fp32 reference runs."""
    from tests import model_zoo as z

    return {
        "ppocr-rec": dict(path=z.ppocr_rec(), shape="x=1x3x48x320", pre="scale=1/255,mean=0.5,std=0.5",
                          ref="onnx", what="PP-OCRv4 recognizer (the demo model), 48x320 text lines"),
        "ppocr-det": dict(path=z.PPOCR_DET, shape="x=1x3x640x640",
                          pre="scale=1/255,mean=0.485:0.456:0.406,std=0.229:0.224:0.225", ref="onnx",
                          what="PP-OCRv4 text detector, 640x640 pages"),
        "yolov8n": dict(path=z.yolov8n(), shape="images=1x3x320x320", pre="scale=1/255", ref="onnx",
                        what="YOLOv8n (nudenet 320n.onnx), 320x320 photographs"),
        "blazeface": dict(path=z.BLAZEFACE, shape=None, pre="scale=1/127.5,mean=1,layout=NHWC", ref="litert",
                          what="BlazeFace short range (MediaPipe), 128x128 photographs"),
        "face-landmark": dict(path=z.FACE_LANDMARK, shape=None, pre="scale=1/255,layout=NHWC", ref="litert",
                              what="MediaPipe face landmarks (PReLU), 192x192 face crops"),
        "ppocr-cls": dict(path=z.ppocr_cls(), shape="x=1x3x48x192", pre="scale=1/255,mean=0.5,std=0.5",
                          ref="onnx", what="PP-OCR text direction classifier, 48x192 text lines"),
        "selfie": dict(path=z.SELFIE_SEGMENTATION, shape=None, pre="scale=1/255,layout=NHWC", ref="imported",
                       what="MediaPipe selfie segmentation, 256x256 photographs"),
        "iris": dict(path=z.IRIS_LANDMARK, shape=None, pre="scale=1/255,layout=NHWC", ref="litert",
                     what="MediaPipe iris landmarks, 64x64 eye crops"),
    }


# ---------------------------------------------------------------------------------------------------------
# Real inputs: (calibration images, held-out images, truth) per model, RGB uint8 at the model's input size.
# Calibration and held-out sets share no source image: text from other seeds; photographs split by picture;
# faces split by person (calibration: the astronaut and lfw_subset's faces 0-31; held out: Grace Hopper and
# lfw_subset's faces 32-99).

CALIB_PHOTOS = ("coffee.png", "chelsea.png", "rocket.jpg", "motorcycle_left.png", "coins.png", "ihc.png",
                "gravel.png", "brick.png")
HELD_OUT_PHOTOS = ("camera.png", "moon.png", "hubble_deep_field.jpg", "grass.png")


def resize(rgb: np.ndarray, h: int, w: int) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.fromarray(rgb).resize((w, h), Image.Resampling.BILINEAR))


def crops(rgb: np.ndarray, n: int, size: int, seed: int, lo: float = 0.5, hi: float = 0.9) -> list[np.ndarray]:
    """n square crops of lo-hi of the picture's shorter side, every other one mirrored, resized to size."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        s = int(min(rgb.shape[:2]) * rng.uniform(lo, hi))
        y, x = int(rng.integers(0, rgb.shape[0] - s + 1)), int(rng.integers(0, rgb.shape[1] - s + 1))
        c = resize(rgb[y:y + s, x:x + s], size, size)
        out.append(c[:, ::-1] if k % 2 else c)
    return out


def square(rgb: np.ndarray, size: int) -> np.ndarray:
    """The whole picture, padded to a square with its mean colour (as a letterbox), resized to size."""
    h, w = rgb.shape[:2]
    s = max(h, w)
    canvas = np.empty((s, s, 3), np.uint8)
    canvas[:] = rgb.reshape(-1, 3).mean(0).astype(np.uint8)
    canvas[(s - h) // 2:(s - h) // 2 + h, (s - w) // 2:(s - w) // 2 + w] = rgb
    return resize(canvas, size, size)


def photo_sets(size: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Calibration: 4 crops of each of 8 photographs. Held out: 4 other photographs and the two with a face
    (the astronaut's is held out here: the photo models never see a face crop of it in calibration), each
    whole and as 3 crops."""
    import matplotlib

    from tests import model_zoo as z

    named = dict(zip(z.PHOTOS, z.photos()))
    calib = [c for i, name in enumerate(CALIB_PHOTOS) for c in crops(named[name], 4, size, seed=i)]
    hopper = z._rgb(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg")
    held = []
    for i, rgb in enumerate([named[n] for n in HELD_OUT_PHOTOS] + [named["astronaut.png"], hopper]):
        held += [square(rgb, size)] + crops(rgb, 3, size, seed=100 + i, lo=0.6, hi=0.95)
    return calib, held


def face_sets(size: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Calibration: lfw_subset's faces 0-23 and 8 crops about the astronaut's face. Held out: lfw_subset's
    faces 32-99 and Grace Hopper's face, as cropped and as 7 crops moved and scaled by up to 10 %."""
    from tests import model_zoo as z

    faces = z.faces()  # astronaut, Grace Hopper, then lfw's 100 faces
    calib = [resize(f, size, size) for f in faces[2:2 + 24]] + jittered(faces[0], 8, size, seed=1)
    held = [resize(f, size, size) for f in faces[2 + 32:]] + [resize(faces[1], size, size)]
    held += jittered(faces[1], 7, size, seed=2)
    return calib, held


def jittered(rgb: np.ndarray, n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    side = rgb.shape[0]
    out = []
    for k in range(n):
        s = int(side * rng.uniform(0.8, 1.0))
        y, x = (int(v) for v in rng.integers(0, side - s + 1, 2))
        c = resize(rgb[y:y + s, x:x + s], size, size)
        out.append(c[:, ::-1] if k % 2 else c)
    return out


def text_line_sets(width: int, seed: int, calib_n: int, held_n: int, flipped: bool):
    """Rendered lines (model_zoo.rendered_text_lines) at 48 x width: calibration from one seed, held out from
    another; with `flipped`, half of each rotated by 180 degrees (the direction classifier's class 1)."""
    from tests import model_zoo as z

    def lines(n, s):
        imgs, strings = z.rendered_text_lines(n, seed=s, width=width)
        if not flipped:
            return list(imgs), strings
        imgs = [im if k % 2 == 0 else im[::-1, ::-1] for k, im in enumerate(imgs)]
        return imgs, [k % 2 for k in range(n)]

    calib, _ = lines(calib_n, seed)
    held, truth = lines(held_n, seed + 1000)
    return calib, held, truth


def page_sets(size: int):
    """Calibration: 32 rendered pages. Held out: 10 other rendered pages and scikit-image's two scanned
    pages (padded square)."""
    from tests import model_zoo as z

    calib = list(z.rendered_text_pages(CALIB_SAMPLES, seed=1, size=size))
    held = list(z.rendered_text_pages(10, seed=2, size=size)) + [square(d, size) for d in z.documents()]
    return calib, held


def eye_crops(faces192: list[np.ndarray], size: int = 64) -> list[np.ndarray]:
    """Each face's two eyes as MediaPipe crops them for its iris model: a square about the eye's corners
    (landmarks 33/133 and 362/263 of the fp32 face landmark model), 2.3 times their distance wide, the left
    eye mirrored."""
    from tests import model_zoo as z

    out = []
    for face, marks in zip(faces192, litert_run(z.FACE_LANDMARK, [f / np.float32(255) for f in faces192])):
        pts = marks["conv2d_21"].reshape(-1, 3)[:, :2]
        for (a, b), mirror in (((33, 133), False), ((362, 263), True)):
            c, d = (pts[a] + pts[b]) / 2, np.linalg.norm(pts[a] - pts[b])
            half = max(2, int(round(1.15 * d)))
            x0, y0 = int(round(c[0])) - half, int(round(c[1])) - half
            padded = np.pad(face, ((2 * half, 2 * half), (2 * half, 2 * half), (0, 0)), mode="edge")
            crop = resize(padded[y0 + 2 * half:y0 + 4 * half, x0 + 2 * half:x0 + 4 * half], size, size)
            out.append(crop[:, ::-1] if mirror else crop)
    return out


def inputs(name: str) -> tuple[list[np.ndarray], list[np.ndarray], object]:
    """(calibration images, held-out images, truth or None) for one model."""
    if name == "ppocr-rec":
        return text_line_sets(320, 10, CALIB_SAMPLES, 40, flipped=False)
    if name == "ppocr-cls":
        return text_line_sets(192, 20, CALIB_SAMPLES, 40, flipped=True)
    if name == "ppocr-det":
        return (*page_sets(640), None)
    if name in ("yolov8n", "selfie", "blazeface"):
        size = {"yolov8n": 320, "selfie": 256, "blazeface": 128}[name]
        calib, held = photo_sets(size)
        if name == "blazeface":  # a face detector is calibrated on faces too: half photo crops, half faces
            calib = calib[::2] + face_sets(size)[0][:16]
        return calib, held, None
    if name == "face-landmark":
        return (*face_sets(192), None)
    if name == "iris":
        calib, held = face_sets(192)
        return eye_crops(calib)[:CALIB_SAMPLES], eye_crops(held), None
    raise KeyError(name)


def preprocess(images: list[np.ndarray], spec: str, shape: tuple[int, ...]) -> list[np.ndarray]:
    """The held-out images as model inputs, by the same formula the build applies to --calib images."""
    from edgesdk.ir.calibration import parse_preprocess

    pre = parse_preprocess(spec, shape)
    out = []
    for img in images:
        px = img.astype(np.float32)
        if pre.color == "BGR":
            px = px[..., ::-1]
        x = (px * pre.scale - np.asarray(pre.mean, np.float32)) / np.asarray(pre.std, np.float32)
        x = np.transpose(x, (2, 0, 1)) if pre.layout == "NCHW" else x
        out.append(np.ascontiguousarray(x[None]).astype(np.float32))
    return out


# ---------------------------------------------------------------------------------------------------------
# fp32 references

def litert_run(path: Path, xs: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
    from ai_edge_litert.interpreter import Interpreter

    it = Interpreter(str(path))
    it.allocate_tensors()
    (inp,) = it.get_input_details()
    out = []
    for x in xs:
        it.set_tensor(inp["index"], x.reshape(inp["shape"]).astype(np.float32))
        it.invoke()
        out.append({d["name"]: it.get_tensor(d["index"]).copy() for d in it.get_output_details()})
    return out


def onnx_run(path: Path, xs: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    names = [o.name for o in sess.get_outputs()]
    return [dict(zip(names, sess.run(None, {name: x}))) for x in xs]


def reference(spec: dict, xs: list[np.ndarray], build_dir: Path) -> list[dict[str, np.ndarray]]:
    if spec["ref"] == "litert":
        return litert_run(spec["path"], xs)
    if spec["ref"] == "imported":  # the interpreter cannot run the file's custom op; the import is exact
        return onnx_run(build_dir / ".build" / "1-import" / "model.onnx", xs)
    return onnx_run(spec["path"], xs)


# ---------------------------------------------------------------------------------------------------------
# Generic per-output measures (the gate's `compression.accuracy.measure`, here until it is on main)

def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-np.clip(x, -80, 80)))


def parts(name: str, output: str, y: np.ndarray) -> dict[str, tuple[np.ndarray, str]]:
    """An output split into the parts it is judged by, each as (values, kind): "scores" after their
    sigmoid/softmax, "values" otherwise. `y` has the samples stacked on axis 0."""
    if name == "yolov8n":  # [n, 1, 4 + classes, anchors]: boxes, then class scores (sigmoid in the graph)
        return {f"{output}[boxes]": (y[:, :, :4], "values"), f"{output}[scores]": (y[:, :, 4:], "scores")}
    if name == "blazeface" and output == "classificators":
        return {f"{output}[sigmoid]": (sigmoid(y), "scores")}
    if name == "face-landmark" and output == "conv2d_31":
        return {f"{output}[face flag, sigmoid]": (sigmoid(y), "scores")}
    kind = "scores" if name in ("ppocr-rec", "ppocr-cls", "ppocr-det", "selfie") else "values"
    return {output: (y, kind)}


def generic(name: str, fp32: list[dict], int8: list[dict]) -> dict[str, dict]:
    out = {}
    for output in fp32[0]:
        want = np.stack([f[output] for f in fp32]).astype(np.float64)
        got = np.stack([g[output].reshape(f[output].shape) for g, f in zip(int8, fp32)]).astype(np.float64)
        judged, measured = parts(name, output, want), parts(name, output, got)
        for part, (w, kind) in judged.items():
            g = measured[part][0]
            span = float(w.max() - w.min()) or 1.0
            err = np.abs(g - w)
            cos = float(np.dot(g.ravel(), w.ravel()) / (np.linalg.norm(g) * np.linalg.norm(w) + 1e-30))
            row = {"kind": kind, "cosine": round(cos, 5), "max_error": round(float(err.max()) / span, 5),
                   "mean_error": round(float(err.mean()) / span, 5), "range": round(span, 5)}
            if kind == "scores" and name in ("ppocr-rec", "ppocr-cls"):  # a class axis: the last
                row["top1"] = round(float(np.mean(g.argmax(-1) == w.argmax(-1))), 4)
            out[part] = row
    return out


# ---------------------------------------------------------------------------------------------------------
# Task measures (compression/tasks.py's, here until it is on main)

def ctc_greedy(probs: np.ndarray, classes: list[str]) -> str:
    """Greedy CTC decoding: the best class per time step, repeats merged, blanks (class 0) dropped; the
    spaces read at either end dropped (a line's margins)."""
    best = probs.reshape(-1, probs.shape[-1]).argmax(-1)
    keep = np.concatenate([[True], best[1:] != best[:-1]]) & (best != 0)
    return "".join(classes[k] for k in best[keep]).strip(" ")


def edit_distance(a: str, b: str) -> int:
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def character_accuracy(read: list[str], truth: list[str]) -> float:
    """1 - (edit distance summed over the lines) / (characters of the truth), at least 0."""
    return max(0.0, 1 - sum(edit_distance(r, t) for r, t in zip(read, truth)) / sum(len(t) for t in truth))


def mask_iou(a: np.ndarray, b: np.ndarray) -> float:
    union = np.logical_or(a, b).sum()
    return float(np.logical_and(a, b).sum() / union) if union else 1.0


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box of a [n, 4] with every box of b [m, 4], corners (x0, y0, x1, y1)."""
    lt, rb = np.maximum(a[:, None, :2], b[None, :, :2]), np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), -1)
    area = lambda r: np.prod(np.clip(r[:, 2:] - r[:, :2], 0, None), -1)  # noqa: E731
    return inter / (area(a)[:, None] + area(b)[None, :] - inter + 1e-12)


def nms(boxes: np.ndarray, scores: np.ndarray, iou: float) -> list[int]:
    order, keep = list(np.argsort(-scores)), []
    while order:
        k = order.pop(0)
        keep.append(k)
        order = [j for j in order if box_iou(boxes[k:k + 1], boxes[j:j + 1])[0, 0] <= iou]
    return keep


def yolov8_decode(y: np.ndarray, score: float = 0.25, iou: float = 0.5) -> list[tuple[int, float, np.ndarray]]:
    """[4 + classes, anchors] -> (class, score, corners) per detection: the best class's score >= `score`,
    non-maximum suppression per class at `iou` (Ultralytics' defaults for a deployed model)."""
    y = y.reshape(y.shape[-2], y.shape[-1])
    cls, conf = y[4:].argmax(0), y[4:].max(0)
    idx = np.nonzero(conf >= score)[0]
    cx, cy, w, h = y[:4, idx]
    boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 1)
    out = []
    for c in np.unique(cls[idx]):
        sel = np.nonzero(cls[idx] == c)[0]
        out += [(int(c), float(conf[idx][sel][k]), boxes[sel][k]) for k in nms(boxes[sel], conf[idx][sel], iou)]
    return out


def ssd_anchors(size: int, strides: list[int]) -> np.ndarray:
    """MediaPipe's SsdAnchorsCalculator with fixed_anchor_size and aspect ratio 1 (the interpolated scale
    adds a second): 2 anchors per cell per layer, layers of one stride sharing a grid; centres (x, y)."""
    out = []
    for stride in dict.fromkeys(strides):
        per_cell, grid = 2 * strides.count(stride), -(-size // stride)
        ys, xs = np.meshgrid((np.arange(grid) + 0.5) / grid, (np.arange(grid) + 0.5) / grid, indexing="ij")
        out.append(np.repeat(np.stack([xs.ravel(), ys.ravel()], 1), per_cell, 0))
    return np.concatenate(out)


BLAZEFACE_ANCHORS = None


def blazeface_decode(regressors: np.ndarray, scores: np.ndarray, threshold: float = 0.5, iou: float = 0.3):
    """MediaPipe's face_detection_short_range decoding: 896 anchors (strides 8, 16, 16, 16 on 128 pixels),
    box centre = raw / 128 + anchor, size = raw / 128, scores through a sigmoid (clipped at +-100),
    min score 0.5, then NMS at 0.3 (MediaPipe blends overlapping boxes; plain NMS here)."""
    global BLAZEFACE_ANCHORS
    if BLAZEFACE_ANCHORS is None:
        BLAZEFACE_ANCHORS = ssd_anchors(128, [8, 16, 16, 16])
    r, s = regressors.reshape(-1, 16), sigmoid(np.clip(scores.reshape(-1), -100, 100))
    idx = np.nonzero(s >= threshold)[0]
    c = r[idx, :2] / 128 + BLAZEFACE_ANCHORS[idx]
    wh = r[idx, 2:4] / 128
    boxes = np.concatenate([c - wh / 2, c + wh / 2], 1)
    return [(0, float(s[idx][k]), boxes[k]) for k in nms(boxes, s[idx], iou)]


def match_detections(fp32: list, int8: list, iou: float = 0.5) -> dict:
    """fp32's detections kept by int8 (same class, IoU >= `iou`, each matched once, greedily by fp32's
    score), lost, and int8's false ones (matching none); the score change of the kept ones."""
    used, kept, deltas = set(), 0, []
    for c, s, box in sorted(fp32, key=lambda d: -d[1]):
        best, best_iou = None, iou
        for j, (c2, s2, box2) in enumerate(int8):
            if j not in used and c2 == c and (v := box_iou(box[None], box2[None])[0, 0]) >= best_iou:
                best, best_iou = j, v
        if best is not None:
            used.add(best)
            kept += 1
            deltas.append(abs(int8[best][1] - s))
    return {"fp32": len(fp32), "kept": kept, "lost": len(fp32) - kept, "false": len(int8) - len(used),
            "max_score_change_kept": round(max(deltas), 4) if deltas else None}


def sum_matches(rows: list[dict]) -> dict:
    out = {k: sum(r[k] for r in rows) for k in ("fp32", "kept", "lost", "false")}
    changes = [r["max_score_change_kept"] for r in rows if r["max_score_change_kept"] is not None]
    out["kept_share"] = round(out["kept"] / out["fp32"], 4) if out["fp32"] else None
    out["max_score_change_kept"] = max(changes) if changes else None
    return out


def landmark_error(fp32: list[np.ndarray], int8: list[np.ndarray], crop: int) -> dict:
    """Mean distance (x, y) between fp32's and int8's landmarks per image, in pixels of the crop: the mean
    and the worst image, and both as a share of the crop's side."""
    per_image = [float(np.linalg.norm(g.reshape(-1, 3)[:, :2] - w.reshape(-1, 3)[:, :2], axis=1).mean())
                 for g, w in zip(int8, fp32)]
    return {"mean_px": round(float(np.mean(per_image)), 2), "worst_px": round(max(per_image), 2),
            "mean_share": round(float(np.mean(per_image)) / crop, 4), "crop_px": crop}


def task(name: str, fp32: list[dict], int8: list[dict], truth) -> dict:
    from tests import model_zoo as z

    if name == "ppocr-rec":
        classes = z.ppocr_dictionary()
        read32 = [ctc_greedy(f["softmax_11.tmp_0"], classes) for f in fp32]
        read8 = [ctc_greedy(g["softmax_11.tmp_0"], classes) for g in int8]
        return {"measure": "characters read (greedy CTC, the model's dictionary)", "lines": len(truth),
                "characters_fp32": round(character_accuracy(read32, truth), 4),
                "characters_int8": round(character_accuracy(read8, truth), 4),
                "characters_int8_vs_fp32": round(character_accuracy(read8, read32), 4),
                "examples": [{"truth": t, "fp32": a, "int8": b} for t, a, b in list(zip(truth, read32, read8))[:3]]}
    if name == "ppocr-det":
        (out,) = fp32[0]
        ious = [mask_iou(f[out] > 0.3, g[out].reshape(f[out].shape) > 0.3) for f, g in zip(fp32, int8)]
        return {"measure": "text-mask IoU at 0.3", "pages": len(ious), "mask_iou_mean": round(float(np.mean(ious)), 4),
                "mask_iou_min": round(min(ious), 4), "mask_iou_scanned_pages": [round(v, 4) for v in ious[-2:]]}
    if name == "yolov8n":
        rows = [match_detections(yolov8_decode(f["output0"]), yolov8_decode(g["output0"].reshape(f["output0"].shape)))
                for f, g in zip(fp32, int8)]
        return {"measure": "detections (score >= 0.25, NMS 0.5) matched at IoU 0.5", "images": len(rows),
                **sum_matches(rows)}
    if name == "blazeface":
        rows = [match_detections(blazeface_decode(f["regressors"], f["classificators"]),
                                 blazeface_decode(g["regressors"], g["classificators"])) for f, g in zip(fp32, int8)]
        best32 = [float(sigmoid(np.clip(f["classificators"], -100, 100)).max()) for f in fp32]
        best8 = [float(sigmoid(np.clip(g["classificators"], -100, 100)).max()) for g in int8]
        return {"measure": "faces (MediaPipe anchors, score >= 0.5, NMS 0.3) matched at IoU 0.5", "images": len(rows),
                **sum_matches(rows), "best_score_fp32_max": round(max(best32), 4),
                "best_score_int8_max": round(max(best8), 4)}
    if name == "face-landmark":
        flag32 = sigmoid(np.array([float(f["conv2d_31"].ravel()[0]) for f in fp32]))
        flag8 = sigmoid(np.array([float(g["conv2d_31"].ravel()[0]) for g in int8]))
        return {"measure": "landmark error (468 points, x/y) in pixels of the 192 crop; face flag after its sigmoid",
                "crops": len(fp32), **landmark_error([f["conv2d_21"] for f in fp32], [g["conv2d_21"] for g in int8], 192),
                "face_flag_fp32_mean": round(float(flag32.mean()), 4), "face_flag_int8_mean": round(float(flag8.mean()), 4),
                "face_flag_max_change": round(float(np.abs(flag8 - flag32).max()), 4)}
    if name == "iris":
        eyes = landmark_error([f["output_eyes_contours_and_brows"] for f in fp32],
                              [g["output_eyes_contours_and_brows"] for g in int8], 64)
        iris = landmark_error([f["output_iris"] for f in fp32], [g["output_iris"] for g in int8], 64)
        return {"measure": "landmark error in pixels of the 64 eye crop", "eyes": len(fp32),
                "contours": eyes, "iris": iris}
    if name == "ppocr-cls":
        (out,) = fp32[0]
        t = np.array(truth)
        p32 = np.array([f[out].ravel().argmax() for f in fp32])
        p8 = np.array([g[out].ravel().argmax() for g in int8])
        return {"measure": "top-1 orientation (upright / 180 degrees) against the truth", "lines": len(t),
                "top1_fp32": round(float(np.mean(p32 == t)), 4), "top1_int8": round(float(np.mean(p8 == t)), 4),
                "agreement": round(float(np.mean(p8 == p32)), 4)}
    if name == "selfie":
        (out,) = fp32[0]
        ious = [mask_iou(f[out] > 0.5, g[out].reshape(f[out].shape) > 0.5) for f, g in zip(fp32, int8)]
        people = [round(v, 4) for v in ious[-8:]]  # the astronaut's and Grace Hopper's pictures, last
        return {"measure": "person-mask IoU at 0.5", "images": len(ious), "mask_iou_mean": round(float(np.mean(ious)), 4),
                "mask_iou_min": round(min(ious), 4), "mask_iou_people": people}
    raise KeyError(name)


# ---------------------------------------------------------------------------------------------------------
# One configuration: the build (its own process), the held-out run (its own process), the self-test.

def calib_dir(work: Path, name: str) -> Path:
    from PIL import Image

    d = work / "calib" / name
    if not d.exists():
        tmp = d.with_name(d.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        calib, _, _ = inputs(name)
        assert len(calib) == CALIB_SAMPLES, (name, len(calib))
        for k, img in enumerate(calib):
            Image.fromarray(img).save(tmp / f"{k:02d}.png")
        tmp.rename(d)
    return d


def build(work: Path, name: str, config: str, best_method: str) -> dict:
    spec = model_specs()[name]
    out = work / "builds" / f"{name}-{config}"
    cmd = [*EDGESDK, "build", str(spec["path"]), "-t", str(ROOT / "targets" / "arm_2tpu.yaml"), "-o", str(out),
           "--tuning-db", str(work / "tuning-db"), "--json"]
    if spec["shape"]:
        cmd += ["--input-shape", spec["shape"]]
    if config != "synthetic":
        method = "minmax" if config == "minmax" else best_method
        cmd += ["--calib", str(calib_dir(work, name)), "--calib-samples", str(CALIB_SAMPLES),
                "--calib-preprocess", spec["pre"], "--calib-method", method]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "sdk")})
    row = {"command": " ".join(["edgesdk", *cmd[3:]]).replace(str(work), "WORK").replace(str(ROOT) + "/", ""),
           "exit_code": proc.returncode, "seconds": round(time.perf_counter() - t0, 1),
           "warnings": [line.strip() for line in proc.stderr.splitlines() if "warning" in line.lower()]}
    try:
        summary = json.loads(proc.stdout)
    except json.JSONDecodeError:
        summary = {"error": {"message": (proc.stderr.strip().splitlines() or ["no output"])[-1]}}
    if "error" in summary:
        row["error"] = {k: summary["error"].get(k) for k in ("code", "message", "hint")}
        return row
    from edgesdk.runtime import Manifest

    m = Manifest.load(out / "bundle")
    row["manifest_accuracy"] = m.accuracy
    row["calibration"] = {k: m.calibration.get(k) for k in ("synthetic", "samples", "method", "percentile", "images")}
    row["segments"] = [f"{s.id}:{s.device}" for s in m.segments]
    return row


def evaluate(work: Path, name: str, config: str) -> dict:
    """The held-out run, in this process: fp32 reference (cached per model) and the int8 bundle."""
    from edgesdk.pipeline import stage_dir
    from edgesdk.runtime import BundleModel

    spec = model_specs()[name]
    out = work / "builds" / f"{name}-{config}"
    _, held, truth = inputs(name)
    model = BundleModel(out / "bundle", artifacts={p.stem: p for p in (stage_dir(out, "package") / "twin").glob("*.so")},
                        log=lambda s: None)
    (inp,) = model.inputs
    xs = preprocess(held, spec["pre"], tuple(inp.shape))
    cached = work / "reference" / f"{name}.npz"
    if cached.exists():
        arrays = np.load(cached)
        keys = sorted({k.split("/", 1)[1] for k in arrays.files})
        fp32 = [{k: arrays[f"{i}/{k}"] for k in keys} for i in range(len(xs))]
    else:
        fp32 = reference(spec, xs, out)
        cached.parent.mkdir(parents=True, exist_ok=True)
        np.savez(cached, **{f"{i}/{k}": v for i, f in enumerate(fp32) for k, v in f.items()})
    int8 = [model.run({inp.name: x}) for x in xs]
    int8 = [{k: g[k] for k in f} for f, g in zip(fp32, int8)]
    return {"held_out": len(xs), "generic": generic(name, fp32, int8), "task": task(name, fp32, int8, truth)}


def selftest(work: Path, name: str, config: str) -> dict:
    out = work / "builds" / f"{name}-{config}"
    t0 = time.perf_counter()
    proc = subprocess.run([*EDGESDK, "verify", str(out / "bundle"), "--json"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "sdk")})
    row = {"exit_code": proc.returncode, "seconds": round(time.perf_counter() - t0, 1)}
    try:
        report = json.loads(proc.stdout)
        row.update(selftest=report.get("selftest"), detail=report.get("detail"))
    except json.JSONDecodeError:
        row["detail"] = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return row


def headline(name: str, t: dict) -> str:
    """One configuration's task figure, as the results table shows it."""
    if name == "ppocr-rec":
        return f"{t['characters_int8']:.1%} characters"
    if name in ("ppocr-det", "selfie"):
        return f"IoU {t['mask_iou_mean']:.3f} (min {t['mask_iou_min']:.3f})"
    if name in ("yolov8n", "blazeface"):
        return f"{t['kept']} of {t['fp32']} kept, {t['false']} false"
    if name == "face-landmark":
        return f"{t['mean_px']:.1f} px ({t['mean_share']:.1%}); flag {t['face_flag_int8_mean']:.3f}"
    if name == "iris":
        return f"{t['contours']['mean_px']:.2f} px ({t['contours']['mean_share']:.1%}); iris {t['iris']['mean_px']:.2f} px"
    if name == "ppocr-cls":
        return f"top-1 {t['top1_int8']:.1%} (agrees {t['agreement']:.1%})"
    raise KeyError(name)


def fp32_headline(name: str, t: dict) -> str:
    return {"ppocr-rec": lambda: f"{t['characters_fp32']:.1%} characters",
            "ppocr-cls": lambda: f"top-1 {t['top1_fp32']:.1%}",
            "yolov8n": lambda: f"{t['fp32']} detections", "blazeface": lambda: f"{t['fp32']} faces",
            "face-landmark": lambda: f"flag {t['face_flag_fp32_mean']:.3f}"}.get(name, lambda: "reference")()


def table(results: dict) -> str:
    """The markdown tables of benchmarks/RESULTS.md from a results file."""
    configs = ("synthetic", "minmax", "best")
    lines = ["| model | held out | measure | fp32 | synthetic | real, min-max | real, " + results["best_method"] + " |",
             "|---|---|---|---|---|---|---|"]
    built = ["| model | configuration | exit | build s | warnings | manifest cosine (its own samples) | "
             "aarch64 self-test (qemu) |", "|---|---|---|---|---|---|---|"]
    generic_rows = ["| model | output part | synthetic: cosine / max err | min-max | " + results["best_method"] + " |",
                    "|---|---|---|---|---|"]
    for name, entry in results["models"].items():
        rows = entry["configs"]
        ok = [c for c in configs if "task" in rows.get(c, {})]
        first = rows[ok[0]] if ok else {}
        cells = [headline(name, rows[c]["task"]) if c in ok else
                 f"build failed: {rows[c]['build'].get('error', {}).get('code')}" if c in rows else "—" for c in configs]
        lines.append(f"| {entry['what']} | {first.get('held_out', '—')} | {first.get('task', {}).get('measure', '—')} | "
                     f"{fp32_headline(name, first['task']) if ok else '—'} | " + " | ".join(cells) + " |")
        for c in configs:
            if c not in rows:
                continue
            b, st = rows[c]["build"], rows[c].get("selftest_aarch64_qemu", {})
            cos = ", ".join(f"{v['cosine']:.3f}" for v in (b.get("manifest_accuracy") or {}).get("tensors", {}).values())
            # every build here says edgetpu_compiler is missing (the text says so once)
            warns = "; ".join(w.removeprefix("warning: ") for w in b["warnings"]
                              if "edgetpu_compiler is not installed" not in w) or "none"
            built.append(f"| {name} | {c} | {b['exit_code']} | {b['seconds']} | {warns} | {cos or '—'} | "
                         f"{st.get('selftest', '—')} |")
        for part in first.get("generic", {}):
            cells = [f"{rows[c]['generic'][part]['cosine']:.4f} / {rows[c]['generic'][part]['max_error']:.1%}"
                     + (f", top-1 {rows[c]['generic'][part]['top1']:.1%}" if "top1" in rows[c]["generic"][part] else "")
                     if c in ok else "—" for c in configs]
            generic_rows.append(f"| {name} | {part} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [""] + generic_rows + [""] + built) + "\n"


def host_cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores ({platform.machine()})"
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(model_specs()))
    ap.add_argument("--configs", default="synthetic,minmax,best")
    ap.add_argument("--best-method", default="percentile", help="the calibration method of the 'best' configuration")
    ap.add_argument("--no-verify", action="store_true", help="skip the aarch64 self-test under qemu")
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench-accuracy",
                    help="builds, calibration images and fp32 references")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "accuracy_before.json")
    ap.add_argument("--table", type=Path, help="print the markdown tables of a results file, and nothing else")
    ap.add_argument("--evaluate", nargs=2, metavar=("MODEL", "CONFIG"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())), end="")
        return
    if args.evaluate:  # the child process of one held-out run: its result as one JSON line
        print(json.dumps(evaluate(args.work, *args.evaluate), default=float))
        return
    specs = model_specs()
    results = {"host": host_cpu(), "target": "targets/arm_2tpu.yaml", "best_method": args.best_method,
               "calibration_samples": CALIB_SAMPLES, "models": {}}
    t_all = time.perf_counter()
    for name in args.models.split(","):
        entry = results["models"][name] = {"what": specs[name]["what"], "file": specs[name]["path"].name,
                                           "configs": {}}
        for config in args.configs.split(","):
            print(f"{name} {config}: building", file=sys.stderr, flush=True)
            row = {"build": build(args.work, name, config, args.best_method)}
            if row["build"]["exit_code"] == 0:
                proc = subprocess.run([sys.executable, __file__, "--work", str(args.work), "--evaluate", name, config],
                                      capture_output=True, text=True)
                try:
                    row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
                except (json.JSONDecodeError, IndexError):
                    row["evaluate_error"] = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                if not args.no_verify:
                    row["selftest_aarch64_qemu"] = selftest(args.work, name, config)
            entry["configs"][config] = row
            print(json.dumps({name: {config: {k: row.get(k) for k in ("task", "selftest_aarch64_qemu")}}}, default=str),
                  file=sys.stderr, flush=True)
            results["seconds"] = round(time.perf_counter() - t_all, 1)
            args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")  # a partial run keeps what it has
    print(f"wrote {args.out} in {results['seconds']} s", file=sys.stderr)


if __name__ == "__main__":
    main()
