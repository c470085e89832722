"""Accuracy of int8 arm_2tpu bundles on real held-out inputs, against the fp32 model.

    .venv/bin/python benchmarks/bench_accuracy.py [--models ppocr-rec,yolov8n,...] [--configs synthetic,minmax,best]
        [--best-method percentile] [--no-verify] [--accept] [--work DIR] [--out benchmarks/results/accuracy-arm2tpu.json]
    .venv/bin/python benchmarks/bench_accuracy.py --table benchmarks/results/accuracy-arm2tpu.json

Each model is built for `targets/arm_2tpu.yaml` three times, each build in a fresh process of its own
(`edgesdk build --json`): (a) `synthetic`, no `--calib`; (b) `minmax`, 32 real calibration images with
`--calib-preprocess` and `--calib-method minmax`; (c) `best`, the same images with the best method the build
offers (`--best-method`: `auto` is the build's default with `--calib`). With `--accept`, every build takes
`--accept-accuracy-loss`, so that a bundle below its gate is published and measured too (the accuracy remedy
then does not run). Face-landmark builds declare the face flag a logit read through a sigmoid
(`--output-activation conv2d_31=sigmoid`); BlazeFace's SSD decoder declares its scores so. Then, in another fresh process,
the int8 bundle runs on real held-out inputs that no calibration saw (on this x86 host: `BundleModel` with the
x86-64 twins of its aarch64 segments and the Edge TPU segments on LiteRT's CPU interpreter, the build's own
golden path), beside the fp32 model (onnxruntime on the original ONNX file; LiteRT's float interpreter on
the original TFLite file; for the selfie segmenter, whose custom op the interpreter cannot run, onnxruntime on
the build's import of it). Last, unless `--no-verify`, `edgesdk verify` runs the bundle's own self-test on
aarch64 under qemu-user.

Measures, per model, on what its outputs mean: `compression.tasks.measure_task`, the measure `--eval DIR --task T`
applies in the build (the options of each model in `model_specs`), with its verdict against the issue's goals;
the bench adds only what no task covers:
- PP-OCRv4 recognizer (`ocr`): characters read (greedy CTC decoding, the dictionary in the model's metadata), fp32's
  and int8's against the rendered strings, and int8's against fp32's reading;
- PP-OCRv4 detector (`segmentation`, threshold 0.3 as PP-OCR's DB post-processing): text-mask IoU, pooled and per page;
- YOLOv8n, nudenet's 320n.onnx (`detection`, decoder `yolov8`, score >= 0.25, NMS 0.5): fp32's detections kept,
  lost, and int8's false ones at IoU 0.5;
- BlazeFace, MediaPipe short range (`detection`, decoder `ssd` with MediaPipe's anchors, score >= 0.5, NMS 0.3):
  the same, and the best face score per image;
- PP-OCR direction classifier (`classification`): top-1 against the true orientation (upright or 180 degrees);
- selfie segmentation (`segmentation`, threshold 0.5): person-mask IoU, pooled and per image;
- face landmarks (MediaPipe, PReLU) and iris landmarks (no task covers them, measured here): mean landmark error in
  pixels of the crop (192 and 64) and as a share of it; the face flag after its sigmoid;
- every output (`generic`), per part where an output mixes kinds (YOLOv8's boxes and class scores; sigmoids
  applied to BlazeFace's scores and the face flag: the split is here until the gate's per-output views are on
  main): cosine, max and mean error as shares of the fp32 part's range, top-1 agreement over a class axis.
Also recorded: what the build said (exit code, its warnings, the manifest's accuracy section with its own task
figure from `--eval` on the same held-out inputs, written as .npy files with labels.txt, seconds).

Real inputs (tests/model_zoo.py; `make models` fetches them): text lines and pages rendered in DejaVu Sans;
scikit-image's photographs and scanned pages; face crops (scikit-image's astronaut, matplotlib's Grace
Hopper, lfw_subset). Calibration and held-out sets never share an image (see `inputs`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import _results

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk")]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
EDGESDK = [sys.executable, "-m", "edgesdk.cli"]
CALIB_SAMPLES = 32


def model_specs() -> dict[str, dict]:
    """name -> the model's file, fixed input shape, preprocessing (as --calib-preprocess states it), how its
    fp32 reference runs, and the task its outputs are measured by (--task, --decoder, --task-options)."""
    from tests import model_zoo as z

    return {
        "ppocr-rec": dict(path=z.ppocr_rec(), shape="x=1x3x48x320", pre="scale=1/255,mean=0.5,std=0.5",
                          ref="onnx", task=("ocr", None, ""),
                          what="PP-OCRv4 recognizer (the demo model), 48x320 text lines"),
        "ppocr-det": dict(path=z.PPOCR_DET, shape="x=1x3x640x640",
                          pre="scale=1/255,mean=0.485:0.456:0.406,std=0.229:0.224:0.225", ref="onnx",
                          task=("segmentation", None, "threshold=0.3"),  # PP-OCR's DB post-processing threshold
                          what="PP-OCRv4 text detector, 640x640 pages"),
        "yolov8n": dict(path=z.yolov8n(), shape="images=1x3x320x320", pre="scale=1/255", ref="onnx",
                        task=("detection", "yolov8", "score=0.25,iou=0.5"),  # Ultralytics' deployed defaults
                        what="YOLOv8n (nudenet 320n.onnx), 320x320 photographs"),
        "blazeface": dict(path=z.BLAZEFACE, shape=None, pre="scale=1/127.5,mean=1,layout=NHWC", ref="litert",
                          # MediaPipe's face_detection_short_range graph: its anchors, min score 0.5, NMS 0.3
                          task=("detection", "ssd", "boxes=regressors,scores=classificators,anchors=8:16:16:16,"
                                "size=128,activation=sigmoid,score=0.5,iou=0.3"),
                          what="BlazeFace short range (MediaPipe), 128x128 photographs"),
        "face-landmark": dict(path=z.FACE_LANDMARK, shape=None, pre="scale=1/255,layout=NHWC", ref="litert",
                              task=None, what="MediaPipe face landmarks (PReLU), 192x192 face crops",
                              # the face flag is a logit MediaPipe's graph reads through a sigmoid
                              activations=("conv2d_31=sigmoid",)),
        "ppocr-cls": dict(path=z.ppocr_cls(), shape="x=1x3x48x192", pre="scale=1/255,mean=0.5,std=0.5",
                          ref="onnx", task=("classification", None, ""),
                          what="PP-OCR text direction classifier, 48x192 text lines"),
        "selfie": dict(path=z.SELFIE_SEGMENTATION, shape=None, pre="scale=1/255,layout=NHWC", ref="imported",
                       task=("segmentation", None, "threshold=0.5"),
                       what="MediaPipe selfie segmentation, 256x256 photographs"),
        "iris": dict(path=z.IRIS_LANDMARK, shape=None, pre="scale=1/255,layout=NHWC", ref="litert",
                     task=None, what="MediaPipe iris landmarks, 64x64 eye crops"),
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
        if name in ("blazeface", "yolov8n", "selfie"):  # a model is calibrated on what it finds too (BlazeFace:
            # faces; nudenet's YOLOv8n: people's faces and bodies; the selfie segmenter: people): half photo crops,
            # half lfw faces (none held out)
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
# Measures: compression.tasks' (what `--eval DIR --task T` measures in the build) wherever a task has one; here
# only what it lacks: the split of an output into the parts it is judged by (the gate's views, until the
# gate's compression/accuracy.py is on main), landmark error, and per-image figures beside the pooled ones.

def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-np.clip(np.asarray(x, np.float64), -100, 100)))


def parts(name: str, output: str, y: np.ndarray) -> dict[str, tuple[np.ndarray, str]]:
    """One sample's output split into the parts it is judged by, each as (values, kind): "scores" after
    their sigmoid/softmax, "values" otherwise."""
    if name == "yolov8n":  # [1, 4 + classes, anchors]: boxes, then class scores (sigmoid in the graph)
        return {f"{output}[boxes]": (y[:, :4], "values"), f"{output}[scores]": (y[:, 4:], "scores")}
    if name == "blazeface" and output == "classificators":
        return {f"{output}[sigmoid]": (sigmoid(y), "scores")}
    if name == "face-landmark" and output == "conv2d_31":
        return {f"{output}[face flag, sigmoid]": (sigmoid(y), "scores")}
    kind = "scores" if name in ("ppocr-rec", "ppocr-cls", "ppocr-det", "selfie") else "values"
    return {output: (y, kind)}


def generic(name: str, fp32: list[dict], int8: list[dict]) -> dict[str, dict]:
    """tasks' generic measure (cosine, max and mean error as shares of fp32's range) per part of each
    output, and tasks' top-1 agreement for the class scores of the two OCR models (class axis last)."""
    from edgesdk.compression import tasks

    def split(run: dict) -> dict[str, np.ndarray]:
        return {part: v for output, y in run.items() for part, (v, _) in parts(name, output, y).items()}

    kinds = {part: kind for output, y in fp32[0].items() for part, (_, kind) in parts(name, output, y).items()}
    a, b = [split(f) for f in fp32], [split(g) for g in int8]
    out = tasks.measure_task("generic", a, b)["outputs"]
    for part, row in out.items():
        row["kind"] = kinds[part]
        if kinds[part] == "scores" and name in ("ppocr-rec", "ppocr-cls"):
            row["top1"] = tasks.measure_task("classification", a, b, output=part)["top1_agreement"]
    return out


def landmark_error(fp32: list[np.ndarray], int8: list[np.ndarray], crop: int) -> dict:
    """Mean distance (x, y) between fp32's and int8's landmarks per image, in pixels of the crop: the mean
    and the worst image, and both as a share of the crop's side."""
    per_image = [float(np.linalg.norm(g.reshape(-1, 3)[:, :2] - w.reshape(-1, 3)[:, :2], axis=1).mean())
                 for g, w in zip(int8, fp32)]
    return {"mean_px": round(float(np.mean(per_image)), 2), "worst_px": round(max(per_image), 2),
            "mean_share": round(float(np.mean(per_image)) / crop, 4), "crop_px": crop}


def task_options(name: str) -> tuple[str, str | None, str] | None:
    """(--task, --decoder, --task-options) of a model whose task compression.tasks measures."""
    return model_specs()[name]["task"]


def task_spec(name: str) -> dict:
    """The measure's options, as the build parses --task/--decoder/--task-options (and, for the recognizer,
    its dictionary, from the model's own metadata as the build reads it)."""
    import onnx

    from edgesdk.compression import tasks

    t, decoder, options = task_options(name)
    spec = tasks.parse_options(t, decoder, options)
    if t == "ocr":
        model = onnx.load(str(model_specs()[name]["path"]), load_external_data=False)
        spec["characters"] = tasks.dictionary(metadata={p.key: p.value for p in model.metadata_props})
    return spec


def labels(name: str, truth):
    from edgesdk.compression import tasks

    if truth is None:
        return None
    t = task_options(name)[0]
    if t == "ocr":
        return tasks.Labels("rendered strings", texts=tuple(truth))
    return tasks.Labels("true orientations", classes=np.asarray(truth, np.int64))


def task(name: str, fp32: list[dict], int8: list[dict], truth) -> dict:
    """The task's figures: compression.tasks.measure_task's (with its verdict against the issue's goals),
    plus per-image figures; landmark error for the two landmark models, which no task covers."""
    from edgesdk.compression import tasks

    if task_options(name):
        spec = task_spec(name)
        out = tasks.measure_task(task_options(name)[0], fp32, int8, labels(name, truth), **spec)
        out["summary"] = tasks.summary(out)
        if out["task"] == "segmentation":  # per image too: the worst page matters as much as the pool
            ious = [tasks.measure_task("segmentation", [f], [g], **spec)["iou"] for f, g in zip(fp32, int8)]
            out.update(iou_per_image_mean=round(float(np.mean(ious)), 4), iou_per_image_min=round(min(ious), 4),
                       iou_last_images=[round(v, 4) for v in ious[-8:]])
        if name == "blazeface":  # the best face score per image, after its sigmoid (capped when int8 clips)
            best = lambda runs: [float(sigmoid(r["classificators"]).max()) for r in runs]  # noqa: E731
            out.update(best_score_fp32_max=round(max(best(fp32)), 4), best_score_int8_max=round(max(best(int8)), 4))
        return out
    if name == "face-landmark":
        flag32 = sigmoid(np.array([float(f["conv2d_31"].ravel()[0]) for f in fp32]))
        flag8 = sigmoid(np.array([float(g["conv2d_31"].ravel()[0]) for g in int8]))
        return {"task": "landmarks", "measure": "landmark error (468 points, x/y) in pixels of the 192 crop; face flag "
                "after its sigmoid", "crops": len(fp32),
                **landmark_error([f["conv2d_21"] for f in fp32], [g["conv2d_21"] for g in int8], 192),
                "face_flag_fp32_mean": round(float(flag32.mean()), 4), "face_flag_int8_mean": round(float(flag8.mean()), 4),
                "face_flag_max_change": round(float(np.abs(flag8 - flag32).max()), 4)}
    if name == "iris":
        eyes = landmark_error([f["output_eyes_contours_and_brows"] for f in fp32],
                              [g["output_eyes_contours_and_brows"] for g in int8], 64)
        iris = landmark_error([f["output_iris"] for f in fp32], [g["output_iris"] for g in int8], 64)
        return {"task": "landmarks", "measure": "landmark error in pixels of the 64 eye crop", "eyes": len(fp32),
                "contours": eyes, "iris": iris}
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


def eval_dir(work: Path, name: str) -> Path:
    """The held-out inputs as the build's `--eval DIR` reads them: one .npy per sample, made by the same formula
    as the bench's own run (so that no build option decides how they are read), and labels.txt where the
    truth is known (the rendered strings; the orientations)."""
    d = work / "eval" / name
    if not d.exists():
        tmp = d.with_name(d.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        _, held, truth = inputs(name)
        pre = model_specs()[name]["pre"]
        h, w = held[0].shape[:2]
        for k, x in enumerate(preprocess(held, pre, (1, h, w, 3) if "layout=NHWC" in pre else (1, 3, h, w))):
            np.save(tmp / f"{k:03d}.npy", x)
        if truth is not None:
            (tmp / "labels.txt").write_text("".join(f"{t}\n" for t in truth), encoding="utf-8")
        tmp.rename(d)
    return d


def portable(text: str, work: Path) -> str:
    """`text` with this machine's paths as the results file states them: WORK for --work, the model cache as
    .cache/models (EDGESDK_MODEL_CACHE may move it), the checkout relative."""
    from tests import model_zoo as z

    return text.replace(str(work), "WORK").replace(str(z.CACHE), ".cache/models").replace(str(ROOT) + "/", "")


def build(work: Path, name: str, config: str, best_method: str, accept: bool = False) -> dict:
    spec = model_specs()[name]
    out = work / "builds" / f"{name}-{config}"
    cmd = [*EDGESDK, "build", str(spec["path"]), "-t", str(ROOT / "targets" / "arm_2tpu.yaml"), "-o", str(out),
           "--tuning-db", str(work / "tuning-db"), "--json"]
    if spec["shape"]:
        cmd += ["--input-shape", spec["shape"]]
    for declared in spec.get("activations", ()):
        cmd += ["--output-activation", declared]
    if config != "synthetic":
        method = "minmax" if config == "minmax" else best_method
        cmd += ["--calib", str(calib_dir(work, name)), "--calib-samples", str(CALIB_SAMPLES),
                "--calib-preprocess", spec["pre"], "--calib-method", method]
    if spec["task"]:  # the build's own task measure on the held-out inputs (the manifest's accuracy.task)
        t, decoder, options = spec["task"]
        cmd += ["--eval", str(eval_dir(work, name)), "--task", t, *(["--decoder", decoder] if decoder else []),
                *(["--task-options", options] if options else [])]
    if accept:  # publish below the gate, so that what a refused bundle would have read is measured too
        cmd += ["--accept-accuracy-loss"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "sdk")})
    row = {"command": portable(" ".join(["edgesdk", *cmd[3:]]), work),
           "exit_code": proc.returncode, "seconds": round(time.perf_counter() - t0, 1),
           "warnings": [portable(line.strip(), work) for line in proc.stderr.splitlines() if "warning" in line.lower()]}
    try:
        summary = json.loads(proc.stdout)
    except json.JSONDecodeError:
        summary = {"error": {"message": (proc.stderr.strip().splitlines() or ["no output"])[-1]}}
    if "error" in summary:
        row["error"] = {k: summary["error"].get(k) for k in ("code", "message", "hint", "notes")}
        return row
    from edgesdk.runtime import Manifest

    m = Manifest.load(out / "bundle")
    row["manifest_accuracy"] = compact(json.loads(portable(json.dumps(m.accuracy), work)))
    row["calibration"] = {k: m.calibration.get(k) for k in ("synthetic", "samples", "method", "percentile", "images")}
    row["segments"] = [f"{s.id}:{s.device}" for s in m.segments]
    return row


def compact(accuracy: dict) -> dict:
    """The manifest's accuracy record with its remedy said by node name: which nodes each round kept on the
    CPU, the probe's sentence, the predicted latency (the manifest has each node's figures)."""
    r = accuracy.get("remedy")
    if not r:
        return accuracy
    rounds = [{k: x[k] for k in ("round", "nodes", "latency_ms_before", "failures_before", "probe") if k in x}
              for x in r.get("rounds", [])]
    return {**accuracy, "remedy": {"kept_on_cpu": [k["node"] for k in r.get("kept_on_cpu", [])],
                                   "rounds": rounds, "predicted": r.get("predicted"), "after": r.get("after")}}


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
        keys = list(dict.fromkeys(k.split("/", 1)[1] for k in arrays.files))  # the model's output order
        fp32 = [{k: arrays[f"{i}/{k}"] for k in keys} for i in range(len(xs))]
    else:
        fp32 = reference(spec, xs, out)
        cached.parent.mkdir(parents=True, exist_ok=True)
        np.savez(cached, **{f"{i}/{k}": v for i, f in enumerate(fp32) for k, v in f.items()})
    int8 = [model.run({inp.name: x}) for x in xs]
    int8 = [{k: g[k].reshape(f[k].shape) for k in f} for f, g in zip(fp32, int8)]
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
    met = "" if "verdict" not in t else " ✓" if t["verdict"]["met"] else " ✗"
    if name == "ppocr-rec":
        return f"{t['characters_int8']:.1%} characters ({t['characters']:.1%} of fp32's reading){met}"
    if name in ("ppocr-det", "selfie"):
        per_image = f" (per image: mean {t['iou_per_image_mean']:.3f}, min {t['iou_per_image_min']:.3f})" \
            if "iou_per_image_mean" in t else ""
        return f"IoU {t['iou']:.3f}{per_image}{met}"
    if name in ("yolov8n", "blazeface"):
        best = f"; best score {t['best_score_int8_max']:.3f}" if "best_score_int8_max" in t else ""
        return f"{t['kept']} of {t['detections_fp32']} kept, {t['false']} false{best}{met}"
    if name == "face-landmark":
        return f"{t['mean_px']:.1f} px ({t['mean_share']:.1%}); flag {t['face_flag_int8_mean']:.3f}"
    if name == "iris":
        return f"{t['contours']['mean_px']:.2f} px ({t['contours']['mean_share']:.1%}); iris {t['iris']['mean_px']:.2f} px"
    if name == "ppocr-cls":
        return f"top-1 {t['top1_int8']:.1%} (agrees {t['top1_agreement']:.1%}){met}"
    raise KeyError(name)


def fp32_headline(name: str, t: dict) -> str:
    return {"ppocr-rec": lambda: f"{t['characters_fp32']:.1%} characters",
            "ppocr-cls": lambda: f"top-1 {t['top1_fp32']:.1%}",
            "yolov8n": lambda: f"{t['detections_fp32']} detections",
            "blazeface": lambda: f"{t['detections_fp32']} faces; best score {t['best_score_fp32_max']:.3f}",
            "face-landmark": lambda: f"flag {t['face_flag_fp32_mean']:.3f}"}.get(name, lambda: "reference")()


def measure_of(t: dict) -> str:
    """What a task figure is, in words: tasks' goal where it has one."""
    return t.get("measure") or f"{t['task']}: goal {t['verdict']['goal']}"


def goal_table(results: dict) -> str:
    """The first of `table`'s tables: each model's task figure against its goal, per configuration (RESULTS.md's)."""
    return table(results).split("\n\n")[0]


def table(results: dict) -> str:
    """The markdown tables of a results file: task figures, every output's figures, what each build said."""
    configs = ("synthetic", "minmax", "best")
    lines = ["| model | held out | measure | fp32 | synthetic | real, min-max | real, " + results["best_method"] + " |",
             "|---|---|---|---|---|---|---|"]
    built = ["| model | configuration | exit | build s | warnings | the accuracy remedy | manifest cosine (its own samples) | "
             "the build's `--eval` on the held-out inputs | aarch64 self-test (qemu) |",
             "|---|---|---|---|---|---|---|---|---|"]
    generic_rows = ["| model | output part | synthetic: cosine / max err | min-max | " + results["best_method"] + " |",
                    "|---|---|---|---|---|"]
    for name, entry in results["models"].items():
        rows = entry["configs"]
        ok = [c for c in configs if "task" in rows.get(c, {})]
        first = rows[ok[0]] if ok else {}
        cells = [headline(name, rows[c]["task"]) + (" (published below its gate: --accept)" if rows[c]["build"].get(
                     "manifest_accuracy", {}).get("accepted_loss") else "") if c in ok else
                 refused(rows[c]["build"]) if c in rows else "—" for c in configs]
        lines.append(f"| {entry['what']} | {first.get('held_out', '—')} | {measure_of(first['task']) if ok else '—'} | "
                     f"{fp32_headline(name, first['task']) if ok else '—'} | " + " | ".join(cells) + " |")
        for c in configs:
            if c not in rows:
                continue
            b, st = rows[c]["build"], rows[c].get("selftest_aarch64_qemu", {})
            cos = ", ".join(f"{v['cosine']:.3f}" for v in (b.get("manifest_accuracy") or {}).get("tensors", {}).values())
            # every build here says edgetpu_compiler is missing (the text says so once)
            # the missed task goal is the next column's
            warns = "; ".join(w.removeprefix("warning: ") for w in b["warnings"]
                              if "edgetpu_compiler is not installed" not in w and "misses its" not in w) or "none"
            own = (b.get("manifest_accuracy") or {}).get("task")
            built.append(f"| {name} | {c} | {b['exit_code']} | {b['seconds']} | {warns} | {remedy_of(b)} | {cos or '—'} | "
                         f"{headline(name, own) if own else '—'} | {(st or {}).get('selftest', 'not run')} |")
        for part in first.get("generic", {}):
            cells = [f"{rows[c]['generic'][part]['cosine']:.4f} / {rows[c]['generic'][part]['max_error']:.1%}"
                     + (f", top-1 {rows[c]['generic'][part]['top1']:.1%}" if "top1" in rows[c]["generic"][part] else "")
                     if c in ok else "—" for c in configs]
            generic_rows.append(f"| {name} | {part} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [""] + generic_rows + [""] + built) + "\n"


def refused(b: dict) -> str:
    """A refused build's cell: its error code and the figure its message names."""
    e = b.get("error") or {}
    said = (e.get("message") or "").split(": ", 1)[-1].split(" (goal:")[0]
    return f"**refused** `{e.get('code')}`: {said}"


def remedy_of(b: dict) -> str:
    """What the accuracy remedy did: the rounds and the predicted latency without and with it (published), or
    its notes' rounds (refused)."""
    r = (b.get("manifest_accuracy") or {}).get("remedy")
    if r:
        p = r["predicted"]
        return (f"{len(r['rounds'])} round(s), {len(r['kept_on_cpu'])} node(s) on the CPU: predicted "
                f"{p['latency_ms_without']:.1f} → {p['latency_ms']:.1f} ms")
    rounds = [n for n in ((b.get("error") or {}).get("notes") or []) if n.startswith("accuracy remedy: round")]
    return f"{len(rounds)} round(s), still refused" if rounds else "none"


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
    ap.add_argument("--accept", action="store_true",
                    help="build with --accept-accuracy-loss: a bundle under its gate is published and measured")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "bench-accuracy",
                    help="builds, calibration images and fp32 references")
    ap.add_argument("--out", type=Path, default=_results.path("accuracy-arm2tpu"))
    ap.add_argument("--table", type=Path, help="print the markdown tables of a results file, and nothing else")
    ap.add_argument("--evaluate", nargs=2, metavar=("MODEL", "CONFIG"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.table:
        given = json.loads(args.table.read_text())
        print(table(given.get("data", given)), end="")
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
            row = {"build": build(args.work, name, config, args.best_method, args.accept)}
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
            _results.write("accuracy-arm2tpu", results, goal_table(results), out=args.out)  # a partial run keeps what it has
    print(f"wrote {args.out} in {results['seconds']} s", file=sys.stderr)


if __name__ == "__main__":
    main()
