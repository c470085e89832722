"""Task measures: a reduced model (int8, pruned) against the fp32 model, judged by what its outputs mean.

A cosine over a whole output says little about a task: a detector's box coordinates drown its class
scores, a recognizer reads a quarter of the characters at cosine 0.97. So `--eval DIR --task T` decodes
both models' outputs as the task does and compares the results, against DIR's labels where it has them,
else against the fp32 model's own results (then fp32 scores 100 % by definition and the figure is the
reduced model's agreement with it):

- **classification**: top-1 and top-5 over the last axis of the first output, a row per label (labels.txt:
  one integer class per row); top-1 and top-5 agreement with fp32's top-1 always.
- **detection**: a decoder (`yolov8`: [B, 4+C, N], cx cy w h in input pixels then C class scores after
  their sigmoid; `yolov5`: [B, N, 5+C] with an objectness before the class scores; `ssd`: a boxes output
  [B, N, 4+] and a scores output [B, N, C], with anchors where the boxes are offsets from them), each
  detection's score the best class's, those of `score` (0.25) and more kept, then non-maximum suppression
  per class at IoU `iou` (0.5), at most `max` (300) per image. The reduced model's detections are matched
  to the reference's (fp32's, or labels.txt's boxes: `INDEX CLASS X1 Y1 X2 Y2` per line, INDEX the image's
  number from 0 in sample order) greedily by score, each to the unmatched reference box of its class with
  the largest IoU of at least `match` (0.5): kept (matched), lost (a reference box left unmatched), false
  (a detection matched to none).
- **ocr**: CTC greedy decoding of a [B, T, C] output: the arg max per step, repeats collapsed, the blank
  (index 0) dropped, index i the dictionary's character i - 1 and, where C is the dictionary's length
  plus 2, the last index a space (PP-OCR's layout). Leading and trailing spaces are dropped: a line's
  empty margin is no character of it. Character accuracy is 1 - (sum of edit distances) / (sum of the
  reference strings' lengths), over all lines (labels.txt: each line one sample's text, verbatim).
- **segmentation**: a mask per image, the arg max over the class axis or, for a single channel, the
  output over `threshold` (0.5) as the model gives it; mean IoU over the classes present in either mask
  (for a single channel, of the foreground), pixel agreement (labels.npy: the class of each pixel).
- **generic**: per output, cosine similarity, and the max and mean absolute error as shares of the fp32
  output's range (max - min).

The verdict (`verdict`) compares the figures with stated goals, each the share of fp32's result the reduced
model keeps: classification 0.99 (top-1), detection 0.95 of the detections kept and no more false ones,
ocr 0.98 (characters), segmentation 0.95 (IoU), generic cosine 0.99; `goal=` changes the share. The
measures decide nothing: the build records them and their verdict.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import numpy as np

from ..errors import UsageError, UserError
from ..ir.calibration import MAX_LABELS_BYTES, open_regular_file, read_samples, utf8_text
from ..options import Decoder, Task, check_choice
from .activations import ACTIVATIONS, activated

TASKS: tuple[str, ...] = get_args(Task)
DECODERS: tuple[str, ...] = get_args(Decoder)
LABELS_TEXT = "labels.txt"  # classification, detection, ocr
LABELS_MASKS = "labels.npy"  # segmentation
GOALS = {"classification": 0.99, "detection": 0.95, "ocr": 0.98, "segmentation": 0.95, "generic": 0.99}
MAX_DICTIONARY_BYTES = 16 << 20
MAX_ANCHORS_BYTES = 256 << 20
EXAMPLES = 5  # lines recorded where the readings differ (ocr)

_NUMBER = float
# the --task-options keys of each task, with their parsers and defaults (None: none, or found by the measure)
_KEYS: dict[str, dict[str, tuple]] = {
    "classification": {"output": (str, None), "goal": (_NUMBER, GOALS["classification"])},
    "detection": {"output": (str, None), "boxes": (str, None), "scores": (str, None), "score": (_NUMBER, 0.25),
                  "iou": (_NUMBER, 0.5), "match": (_NUMBER, 0.5), "max": (int, 300), "anchors": (str, None),
                  "size": (_NUMBER, None), "activation": (str, "auto"), "background": (int, None),
                  "goal": (_NUMBER, GOALS["detection"])},
    "ocr": {"output": (str, None), "dictionary": (str, None), "goal": (_NUMBER, GOALS["ocr"])},
    "segmentation": {"output": (str, None), "axis": (int, None), "threshold": (_NUMBER, 0.5),
                     "goal": (_NUMBER, GOALS["segmentation"])},
    "generic": {"goal": (_NUMBER, GOALS["generic"])},
}
_SSD_ONLY = ("boxes", "scores", "anchors", "size", "activation", "background")


@dataclass(frozen=True)
class Labels:
    """Ground truth from an --eval directory: one of the fields, by task."""

    source: str  # the file it came from
    classes: np.ndarray | None = None  # classification: one integer class per row of the first output
    boxes: tuple[np.ndarray, ...] | None = None  # detection: per image, rows (class, x1, y1, x2, y2)
    texts: tuple[str, ...] | None = None  # ocr: one string per row
    masks: np.ndarray | None = None  # segmentation: [images, *mask shape], integer classes


# -- options ---------------------------------------------------------------------------------------------

def parse_options(task: str, decoder: str | None, text: str | None) -> dict:
    """`--task-options KEY=VALUE,...` for `task` (and `--decoder`), with every default filled in; UsageError
    (exit 2) naming a key the task does not take or a value that does not parse."""
    check_choice("task", task)
    if (decoder is not None) != (task == "detection"):
        raise UsageError("cli.task-options", "--task detection needs --decoder" if decoder is None else
                         f"--decoder {decoder} goes with --task detection only",
                         f"--task detection --decoder {'|'.join(DECODERS)}")
    check_choice("decoder", decoder)
    keys = {k: v for k, v in _KEYS[task].items() if decoder == "ssd" or k not in _SSD_ONLY}
    spec: dict = {k: default for k, (_, default) in keys.items()}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or key not in keys:
            raise UsageError("cli.bad-task-options", f"--task-options: '{item.strip()}' is not KEY=VALUE with KEY "
                             f"one of {', '.join(keys)}", f"the options of --task {task}"
                             + (f" --decoder {decoder}" if decoder else "") + ", e.g. "
                             + ("score=0.25,iou=0.5" if task == "detection" else f"goal={GOALS[task]}"))
        try:
            spec[key] = keys[key][0](value)
            if keys[key][0] is _NUMBER and not np.isfinite(spec[key]):
                raise ValueError
        except ValueError:
            raise UsageError("cli.bad-task-options", f"--task-options: {key}={value}: not "
                             + ("an integer" if keys[key][0] is int else "a number" if keys[key][0] is _NUMBER
                                else "a value"), "e.g. score=0.25") from None
    for key in ("score", "iou", "match", "goal", "threshold"):
        if key in spec and spec[key] is not None and not 0 <= spec[key] <= 1:
            raise UsageError("cli.bad-task-options", f"--task-options: {key}={spec[key]:g}: outside [0, 1]",
                             "scores, IoUs and goals are shares")
    if spec.get("activation") not in (None, "auto", "sigmoid", "softmax", "none"):
        raise UsageError("cli.bad-task-options", f"--task-options: activation={spec['activation']}: expected "
                         "auto, sigmoid, softmax or none", "the function that makes the scores output scores")
    if spec.get("max", 1) < 1 or spec.get("size") is not None and spec["size"] <= 0:
        raise UsageError("cli.bad-task-options", "--task-options: " + (f"max={spec['max']}: fewer than 1 detection"
                         if spec.get("max", 1) < 1 else f"size={spec['size']:g}: not a side in pixels"),
                         "e.g. max=300, size=128")
    if decoder == "ssd" and 0 in _strides(spec["anchors"] or ""):
        raise UsageError("cli.bad-task-options", f"--task-options: anchors={spec['anchors']}: a stride of 0",
                         "strides in pixels joined by ':', e.g. 8:16:16:16")
    if decoder == "ssd" and spec["anchors"] is not None and spec["size"] is None:
        raise UsageError("cli.bad-task-options", f"--task-options: anchors={spec['anchors']} needs size=",
                         "the model input's side in pixels, e.g. size=128 for BlazeFace")
    for key in ("dictionary", "anchors"):
        if spec.get(key) is not None and (key == "dictionary" or not _strides(spec[key])) \
                and not Path(spec[key]).exists():
            raise UsageError("cli.task-file", f"--task-options: {key}={spec[key]}: no such file",
                             "a dictionary is a UTF-8 file of one character per line; anchors an .npy of [N, 4]"
                             if key == "dictionary" else "anchors are an .npy file of [N, 4] (cx, cy, w, h), or "
                             "strides joined by ':' (e.g. 8:16:16:16)")
    return {**({"decoder": decoder} if decoder else {}), **spec}


def files(spec: Mapping) -> list[Path]:
    """The files the options name (their content is part of what the measure depends on)."""
    return [Path(spec[k]) for k in ("dictionary", "anchors") if spec.get(k) and not _strides(str(spec[k]))]


def _strides(text: str) -> tuple[int, ...]:
    return tuple(int(s) for s in text.split(":")) if re.fullmatch(r"\d+(:\d+)*", text) else ()


# -- labels ----------------------------------------------------------------------------------------------

def load_labels(root: Path, task: str, images: int) -> Labels | None:
    """The labels of an --eval directory for `task`, None where it has none (the reference is then fp32).
    `images`: how many images the samples hold (samples times batch), which detection labels index."""
    if task == "segmentation":
        path = Path(root) / LABELS_MASKS
        if not path.exists():
            return None
        masks = next(iter(read_samples(path, ["labels"]).values()))
        if masks.dtype.kind not in "iub":
            raise UserError("eval.labels", f"{path}: {masks.dtype} values: not integer classes",
                            "save one integer class per pixel: numpy.save(path, masks.astype(int))")
        return Labels(str(path), masks=masks.astype(np.int64))
    path = Path(root) / LABELS_TEXT
    if task == "generic" or not path.exists():
        return None
    hint = {"classification": "one integer class per line", "ocr": "one line of text per sample",
            "detection": "one box per line: INDEX CLASS X1 Y1 X2 Y2 (INDEX: the image's number from 0)"}[task]
    with open_regular_file(path, MAX_LABELS_BYTES, "eval.label", hint) as f:
        text = utf8_text(f.read(), path, "eval.label", f"save {LABELS_TEXT} as UTF-8 text: {hint}")
    if task == "ocr":  # verbatim: '#' and spaces are text
        return Labels(str(path), texts=tuple(text.splitlines()))
    rows = [(n, line.split("#", 1)[0].split()) for n, line in enumerate(text.splitlines(), 1)]
    rows = [(n, fields) for n, fields in rows if fields]
    if task == "classification":
        classes = []
        for n, fields in rows:
            if len(fields) != 1 or not re.fullmatch(r"[+-]?\d{1,18}", fields[0]):
                raise UserError("eval.label", f"{path}:{n}: '{_short(' '.join(fields))}' is not an integer class", hint)
            classes.append(int(fields[0]))
        return Labels(str(path), classes=np.asarray(classes, np.int64))
    boxes: list[list] = [[] for _ in range(images)]
    for n, fields in rows:
        try:
            index, cls = int(fields[0]), int(fields[1])
            corners = [float(v) for v in fields[2:]]
            if len(fields) != 6 or not all(np.isfinite(corners)):
                raise ValueError
        except (ValueError, IndexError):
            raise UserError("eval.label", f"{path}:{n}: '{_short(' '.join(fields))}' is not INDEX CLASS X1 Y1 X2 Y2",
                            hint) from None
        if not 0 <= index < images:
            raise UserError("eval.label", f"{path}:{n}: image {index}, and --eval holds {images} image(s) "
                            f"(0 to {images - 1})", hint)
        boxes[index].append([cls, *corners])
    return Labels(str(path), boxes=tuple(np.asarray(b, np.float64).reshape(-1, 5) for b in boxes))


def _short(s: str) -> str:
    return s if len(s) <= 40 else s[:40] + "..."


def dictionary(path: Path | None = None, metadata: Mapping[str, str] | None = None) -> list[str] | None:
    """A CTC recognizer's characters: a file of one character per line (PP-OCR's ppocr_keys_v1.txt), or the
    model's `character` metadata, which PP-OCR's ONNX exports carry."""
    if path is not None:
        hint = "a UTF-8 file of one character per line"
        with open_regular_file(Path(path), MAX_DICTIONARY_BYTES, "eval.dictionary", hint) as f:
            return utf8_text(f.read(), Path(path), "eval.dictionary", hint).splitlines()
    text = (metadata or {}).get("character")
    return text.splitlines() if text else None


def _anchors(spec: Mapping) -> np.ndarray | None:
    """SSD anchors [N, 4] (cx, cy, w, h) in [0, 1] of the image: an .npy file, or strides (`8:16:16:16`),
    MediaPipe's fixed-size anchors: per layer of stride s two anchors (w = h = 1) at every cell of a
    size/s grid, consecutive layers of one stride sharing the grid (BlazeFace short range, 128 px:
    16x16x2 + 8x8x6 = 896)."""
    text = spec.get("anchors")
    if text is None:
        return None
    strides = _strides(text)
    if not strides:
        a = next(iter(read_samples(Path(text), ["anchors"]).values()))
        if a.ndim != 2 or a.shape[1] < 4 or a.dtype.kind not in "fiu":
            raise UserError("eval.anchors", f"{text}: shape {list(a.shape)} of {a.dtype}: not anchors [N, 4]",
                            "save (cx, cy, w, h) per anchor, in [0, 1] of the image, with numpy.save")
        return a[:, :4].astype(np.float64)
    size, out, k = spec["size"], [], 0
    while k < len(strides):
        same = next((j for j in range(k, len(strides)) if strides[j] != strides[k]), len(strides)) - k
        grid = int(np.ceil(size / strides[k]))
        ys, xs = np.meshgrid((np.arange(grid) + 0.5) / grid, (np.arange(grid) + 0.5) / grid, indexing="ij")
        cells = np.stack([xs.ravel(), ys.ravel()], 1)
        out.append(np.concatenate([np.repeat(cells, 2 * same, axis=0), np.ones((len(cells) * 2 * same, 2))], 1))
        k += same
    return np.concatenate(out)


# -- detection -------------------------------------------------------------------------------------------

def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box of `a` [n, 4] with every box of `b` [m, 4] (x1, y1, x2, y2): [n, m]."""
    a, b = np.asarray(a, np.float64).reshape(-1, 4), np.asarray(b, np.float64).reshape(-1, 4)
    lo, hi = np.maximum(a[:, None, :2], b[None, :, :2]), np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(hi - lo, 0, None), axis=2)
    area = lambda x: np.prod(np.clip(x[:, 2:] - x[:, :2], 0, None), axis=1)  # noqa: E731
    union = area(a)[:, None] + area(b)[None, :] - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


@dataclass(frozen=True)
class Detections:
    """One image's detections: boxes [k, 4] (x1, y1, x2, y2), scores [k], classes [k], best first."""

    boxes: np.ndarray
    scores: np.ndarray
    classes: np.ndarray


def _nms(boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, threshold: float, limit: int) -> Detections:
    """Greedy non-maximum suppression within each class: a box whose IoU with a better one of its class is
    over `threshold` goes; the best `limit` stay."""
    order = np.argsort(-scores, kind="stable")
    keep: list[int] = []
    for c in np.unique(classes):
        todo = order[classes[order] == c]
        while todo.size:
            keep.append(int(todo[0]))
            todo = todo[1:][iou(boxes[todo[0]], boxes[todo[1:]])[0] <= threshold]
    keep = sorted(keep, key=lambda i: (-scores[i], i))[:limit]
    return Detections(boxes[keep], scores[keep], classes[keep])


def _corners(cxcywh: np.ndarray) -> np.ndarray:
    c, half = cxcywh[:, :2], cxcywh[:, 2:4] / 2
    return np.concatenate([c - half, c + half], 1)


def decode(outputs: Mapping[str, np.ndarray], spec: Mapping) -> list[Detections]:
    """Every image's detections in one sample's outputs, by `spec["decoder"]` (module docstring)."""
    decoder, names = spec["decoder"], list(outputs)
    if decoder in ("yolov8", "yolov5"):
        name = spec.get("output") or names[0]
        out = np.asarray(_output(outputs, name), np.float64)
        if out.ndim != 3 or out.shape[1 if decoder == "yolov8" else 2] < (5 if decoder == "yolov8" else 6):
            raise _shape_error(name, out.shape, "[B, 4+C, N]" if decoder == "yolov8" else "[B, N, 5+C]", decoder)
        images = []
        for p in out:
            p = p.T if decoder == "yolov8" else p  # [N, 4+C] or [N, 5+C]
            scores = p[:, 4:] if decoder == "yolov8" else p[:, 5:] * p[:, 4:5]
            images.append(_select(_corners(p[:, :4]), scores, spec))
        return images
    boxes_name = spec.get("boxes") or _ssd_outputs(outputs)[0]
    scores_name = spec.get("scores") or _ssd_outputs(outputs)[1]
    raw, scores = (np.asarray(_output(outputs, n), np.float64) for n in (boxes_name, scores_name))
    if raw.ndim != 3 or raw.shape[2] < 4 or scores.ndim != 3 or scores.shape[:2] != raw.shape[:2]:
        raise UserError("eval.output", f"output '{boxes_name}' {list(raw.shape)} and '{scores_name}' "
                        f"{list(scores.shape)}: not SSD boxes [B, N, 4+] and scores [B, N, C] of one N",
                        "name them with --task-options boxes=NAME,scores=NAME")
    activation = spec.get("activation_resolved") or spec.get("activation") or "none"
    if activation == "auto":
        activation = "sigmoid" if scores.min() < 0 or scores.max() > 1 else "none"
    scores = _activated(scores, activation)
    if spec.get("background") is not None:  # a softmax over every class, then the background never chosen
        if not 0 <= spec["background"] < scores.shape[2]:
            raise UserError("eval.output", f"--task-options background={spec['background']}: output "
                            f"'{scores_name}' has {scores.shape[2]} classes", "the background's column, e.g. 0")
        scores = scores.copy()
        scores[..., spec["background"]] = -np.inf
    anchors = spec["anchors_array"] if "anchors_array" in spec else _anchors(spec)
    if anchors is not None and len(anchors) != raw.shape[1]:
        raise UserError("eval.anchors", f"{len(anchors)} anchors for the {raw.shape[1]} boxes of output '{boxes_name}'",
                        "give the anchors the model was trained with (for strides, check size= and the strides)")
    images = []
    for r, s in zip(raw, scores):
        if anchors is None:
            corners = r[:, :4]
        else:  # MediaPipe's encoding: offsets and sizes in input pixels, scaled by the anchor's size
            d = r[:, :4] / spec["size"]
            centre, extent = d[:, :2] * anchors[:, 2:] + anchors[:, :2], d[:, 2:4] * anchors[:, 2:]
            corners = _corners(np.concatenate([centre, extent], 1))
        images.append(_select(corners, s, spec))
    return images


def _ssd_outputs(outputs: Mapping[str, np.ndarray]) -> tuple[str, str]:
    """The boxes and scores outputs of an SSD head, where the options name none: of the first two
    outputs, the one whose last axis is 4 (or, with keypoints, the longer one) holds the boxes."""
    names = [n for n in outputs if np.ndim(outputs[n]) == 3][:2]
    if len(names) < 2:
        raise UserError("eval.output", f"the model's outputs {list(outputs)}: not an SSD head's boxes and scores",
                        "name them with --task-options boxes=NAME,scores=NAME")
    a, b = (np.shape(outputs[n])[-1] for n in names)
    return (names[0], names[1]) if a == 4 or (b != 4 and a > b) else (names[1], names[0])


def _activated(scores: np.ndarray, activation: str) -> np.ndarray:
    return activated(scores, activation) if activation in ACTIVATIONS else scores


def _select(boxes: np.ndarray, scores: np.ndarray, spec: Mapping) -> Detections:
    best, cls = scores.max(axis=1), scores.argmax(axis=1)
    keep = best >= spec["score"]
    return _nms(boxes[keep], best[keep], cls[keep], spec["iou"], spec["max"])


def match(found: Detections, boxes: np.ndarray, classes: np.ndarray,
          threshold: float) -> tuple[int, int, int, list[float]]:
    """`found` matched to the reference `boxes` [m, 4] of `classes` [m], greedily by score, each to the
    unmatched box of its class with the largest IoU of at least `threshold`: (kept, lost, false, the
    matched pairs' IoUs)."""
    free = np.ones(len(boxes), bool)
    overlaps = iou(found.boxes, boxes)
    ious: list[float] = []
    for k in range(len(found.scores)):
        candidates = np.where(free & (classes == found.classes[k]) & (overlaps[k] >= threshold), overlaps[k], -1)
        j = int(np.argmax(candidates)) if len(candidates) else -1
        if j >= 0 and candidates[j] >= 0:
            free[j] = False
            ious.append(float(overlaps[k, j]))
    kept = len(ious)
    return kept, len(boxes) - kept, len(found.scores) - kept, ious


def _detection(fp32: list[dict], reduced: list[dict], labels: Labels | None, spec: dict) -> dict:
    spec = dict(spec)
    if spec["decoder"] == "ssd":
        spec["anchors_array"] = _anchors(spec)
        if spec["activation"] == "auto":  # decided once, on fp32's scores, for both models
            name = spec.get("scores") or _ssd_outputs(fp32[0])[1]
            values = np.concatenate([np.ravel(o[name]) for o in fp32])
            spec["activation_resolved"] = "sigmoid" if values.min() < 0 or values.max() > 1 else "none"
        else:
            spec["activation_resolved"] = spec["activation"]
    ref = [d for o in fp32 for d in decode(o, spec)]
    got = [d for o in reduced for d in decode(o, spec)]
    pairs = [match(g, r.boxes, r.classes, spec["match"]) for g, r in zip(got, ref)]
    kept, lost, false = (sum(p[i] for p in pairs) for i in range(3))
    ious = [x for p in pairs for x in p[3]]
    out = {"images": len(ref), "detections_fp32": int(sum(len(r.scores) for r in ref)),
           "detections_int8": int(sum(len(g.scores) for g in got)), "kept": kept, "lost": lost, "false": false,
           "mean_iou": round(float(np.mean(ious)), 4) if ious else None,
           "decoder": {k: spec[k] for k in ("decoder", "score", "iou", "match", "max")}}
    if labels is not None:
        if len(labels.boxes) != len(ref):
            raise UserError("eval.labels", f"{labels.source}: boxes for {len(labels.boxes)} images, and the "
                            f"model's output has {len(ref)}", "INDEX counts the images of every sample in order")
        for who, dets in (("fp32", ref), ("int8", got)):
            m = [match(d, b[:, 1:], b[:, 0].astype(np.int64), spec["match"]) for d, b in zip(dets, labels.boxes)]
            out.update({f"{k}_{who}": sum(x[i] for x in m) for i, k in enumerate(("kept", "lost", "false"))})
        out["objects"] = int(sum(len(b) for b in labels.boxes))
    return out


# -- classification, ocr, segmentation, generic ----------------------------------------------------------

def _output(outputs: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    if name not in outputs:
        raise UserError("eval.output", f"the model has no output '{name}' (its outputs: {', '.join(outputs)})",
                        "name one of its outputs with --task-options output=NAME")
    return outputs[name]


def _shape_error(name: str, shape, expected: str, task: str) -> UserError:
    """The output `name` (of one sample: `shape`) is not what `task` decodes."""
    return UserError("eval.output", f"output '{name}' has shape {list(shape)}: not {expected} as {task} decodes it",
                     "name the right output with --task-options output=NAME, or choose the task or decoder that "
                     "fits the model")


def _joined(runs: list[dict], name: str) -> np.ndarray:
    return np.concatenate([np.atleast_1d(np.asarray(_output(r, name))) for r in runs])


def _classification(fp32: list[dict], reduced: list[dict], labels: Labels | None, spec: dict) -> dict:
    name = spec.get("output") or next(iter(fp32[0]))
    ref, got = _joined(fp32, name), _joined(reduced, name)
    if ref.ndim < 2 or ref.shape[-1] < 2:
        raise _shape_error(name, np.shape(fp32[0][name]), "class scores [..., C] (C >= 2)", "classification")
    ref, got = ref.reshape(-1, ref.shape[-1]), got.reshape(-1, ref.shape[-1])
    top5 = ref.shape[1] > 5  # with 5 classes or fewer, top-5 says nothing
    first = lambda s: np.argmax(s, -1)  # noqa: E731
    in5 = lambda s, c: np.any(np.argsort(-s, -1, kind="stable")[:, :5] == c[:, None], 1)  # noqa: E731
    out = {"rows": len(ref), "output": name, "top1_agreement": _share(first(ref) == first(got)),
           "top5_agreement": _share(in5(got, first(ref))) if top5 else None}
    if labels is not None:
        c = labels.classes
        if len(c) != len(ref):
            raise UserError("eval.labels", f"{labels.source}: {len(c)} labels for {len(ref)} rows of output '{name}'",
                            "one integer class per row of the output, in sample order")
        if c.min(initial=0) < 0 or c.max(initial=0) >= ref.shape[1]:
            raise UserError("eval.labels", f"{labels.source}: labels must be classes 0..{ref.shape[1] - 1} of output "
                            f"'{name}'", "one integer class per row of the output, in sample order")
        out.update(top1_fp32=_share(first(ref) == c), top1_int8=_share(first(got) == c),
                   top5_fp32=_share(in5(ref, c)) if top5 else None, top5_int8=_share(in5(got, c)) if top5 else None)
    return out


def ctc_greedy(scores: np.ndarray, characters: Sequence[str]) -> list[str]:
    """Each row of `scores` [B, T, C] read by CTC greedy decoding (module docstring)."""
    table = ["", *characters, *([" "] if scores.shape[-1] == len(characters) + 2 else [])]
    out = []
    for row in np.argmax(scores, -1):
        keep = np.r_[True, row[1:] != row[:-1]] & (row != 0)
        out.append("".join(table[i] for i in row[keep]).strip(" "))
    return out


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: insertions, deletions and substitutions of one character each."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        diagonal, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (ca != cb))
    return row[-1]


def characters(read: Sequence[str], reference: Sequence[str]) -> float:
    """1 - (sum of edit distances) / (sum of the references' lengths), at least 0."""
    total = sum(len(r) for r in reference)
    errors = sum(edit_distance(a, r) for a, r in zip(read, reference))
    return round(max(0.0, 1 - errors / total), 6) if total else (1.0 if errors == 0 else 0.0)


def _ocr(fp32: list[dict], reduced: list[dict], labels: Labels | None, spec: dict) -> dict:
    name = spec.get("output") or next(iter(fp32[0]))
    ref, got = _joined(fp32, name), _joined(reduced, name)
    chars = spec.get("characters")
    if ref.ndim != 3:
        raise _shape_error(name, np.shape(fp32[0][name]), "per-step class scores [B, T, C]", "ocr")
    if not chars:
        raise UserError("eval.dictionary", "the model carries no 'character' metadata: ocr needs the recognizer's "
                        "dictionary", "give it with --task-options dictionary=FILE (one character per line)")
    if ref.shape[-1] not in (len(chars) + 1, len(chars) + 2):
        raise UserError("eval.dictionary", f"output '{name}' has {ref.shape[-1]} classes per step, and the dictionary "
                        f"{len(chars)} characters: expected {len(chars) + 1} (the blank first) or {len(chars) + 2} "
                        "(and a space last)", "give the dictionary the model was trained with")
    a, b = ctc_greedy(ref, chars), ctc_greedy(got, chars)
    out = {"lines": len(a), "output": name, "characters": characters(b, a),
           "lines_same": _share(np.array([x == y for x, y in zip(a, b)]))}
    truth = a
    if labels is not None:
        truth = list(labels.texts)
        if len(truth) != len(a):
            raise UserError("eval.labels", f"{labels.source}: {len(truth)} lines of text for {len(a)} lines read "
                            f"from output '{name}'", "one line of text per sample (per batch row), in sample order")
        out.update(characters_fp32=characters(a, truth), characters_int8=characters(b, truth),
                   lines_fp32=_share(np.array([x == t for x, t in zip(a, truth)])),
                   lines_int8=_share(np.array([y == t for y, t in zip(b, truth)])))
    out["examples"] = [{"label": t, "fp32": x, "int8": y} if labels is not None else {"fp32": x, "int8": y}
                       for x, y, t in zip(a, b, truth) if y != t or x != t][:EXAMPLES]
    return out


def _masks(scores: np.ndarray, axis: int | None, threshold: float) -> tuple[np.ndarray, bool]:
    """Class per pixel [images, ...] and whether the output was a single channel."""
    if axis is None or scores.shape[axis] == 1:
        s = scores if axis is None else np.squeeze(scores, axis)
        return (s > threshold).astype(np.int64), True
    return np.argmax(scores, axis).astype(np.int64), False


def mask_iou(a: np.ndarray, b: np.ndarray, foreground_only: bool) -> float:
    """Mean IoU over the classes present in either mask (only class 1 where `foreground_only`)."""
    present = [1] if foreground_only else np.union1d(np.unique(a), np.unique(b))
    ious = []
    for c in present:
        union = np.sum((a == c) | (b == c))
        ious.append(np.sum((a == c) & (b == c)) / union if union else 1.0)
    return round(float(np.mean(ious)), 6)


def _segmentation(fp32: list[dict], reduced: list[dict], labels: Labels | None, spec: dict) -> dict:
    name = spec.get("output") or next(iter(fp32[0]))
    ref, got = _joined(fp32, name), _joined(reduced, name)
    if ref.ndim not in (3, 4):
        raise _shape_error(name, np.shape(fp32[0][name]), "masks [B, C, H, W], [B, H, W, C] or [B, H, W]",
                           "segmentation")
    axis = spec.get("axis")
    if axis is None and ref.ndim == 4:  # the class axis: the shorter of the two a layout may put it on
        axis = 1 if ref.shape[1] <= ref.shape[3] else 3
    if axis is not None and not 1 <= axis % ref.ndim < ref.ndim:
        raise UserError("eval.output", f"--task-options axis={axis}: output '{name}' has {ref.ndim} axes",
                        "the class axis, e.g. axis=1 for NCHW")
    (a, single), (b, _) = _masks(ref, axis, spec["threshold"]), _masks(got, axis, spec["threshold"])
    out = {"images": len(a), "output": name, "classes": "foreground" if single else int(ref.shape[axis]),
           "iou": mask_iou(a, b, single), "pixels": _share(a == b)}
    if labels is not None:
        truth = labels.masks
        if truth.shape != a.shape:
            raise UserError("eval.labels", f"{labels.source}: masks of shape {list(truth.shape)}, and the model's "
                            f"output '{name}' gives {list(a.shape)}", "one class per pixel of every image, stacked")
        out.update(iou_fp32=mask_iou(a, truth, single), iou_int8=mask_iou(b, truth, single))
    return out


def _generic(fp32: list[dict], reduced: list[dict], labels: Labels | None, spec: dict) -> dict:
    out = {}
    for name in fp32[0]:
        a, b = _joined(fp32, name).astype(np.float64).ravel(), _joined(reduced, name).astype(np.float64).ravel()
        span = float(a.max() - a.min()) if a.size else 0.0
        norms = float(np.linalg.norm(a) * np.linalg.norm(b))
        cosine = 1.0 if np.array_equal(a, b) else float(np.clip(a @ b / norms, -1, 1)) if norms else 0.0
        error = np.abs(a - b)
        scale = span or 1.0
        out[name] = {"cosine": round(cosine, 6), "max_error": round(float(error.max(initial=0)) / scale, 6),
                     "mean_error": round(float(error.mean()) / scale if error.size else 0.0, 6)}
    return {"outputs": out}


def _share(agree: np.ndarray) -> float:
    return round(float(np.mean(agree)), 6) if np.size(agree) else 1.0


MEASURES = {"classification": _classification, "detection": _detection, "ocr": _ocr,
            "segmentation": _segmentation, "generic": _generic}


def measure_task(task: str, fp32_outputs: list[dict], int8_outputs: list[dict], labels: Labels | None = None,
                 **spec) -> dict:
    """The task's figures for the reduced model's outputs (`int8_outputs`, one dict per sample, the model's
    outputs in its order) against fp32's or `labels`, with their `verdict`. `spec`: parse_options' keys;
    for ocr `characters` (the dictionary)."""
    if not fp32_outputs or len(fp32_outputs) != len(int8_outputs):
        raise ValueError(f"{len(fp32_outputs)} fp32 and {len(int8_outputs)} reduced runs: need one of each per sample")
    figures = {"task": task, "against": "labels" if labels is not None else "fp32",
               **MEASURES[task](fp32_outputs, int8_outputs, labels, {**_defaults(task, spec), **spec})}
    return {**figures, "verdict": verdict(figures, spec.get("goal"))}


def _defaults(task: str, spec: Mapping) -> dict:
    keys = {k: v for k, v in _KEYS[task].items() if spec.get("decoder") == "ssd" or k not in _SSD_ONLY}
    return {k: default for k, (_, default) in keys.items()}


def shortfall(figures: Mapping, goal: float | None = None) -> float:
    """How far `figures` (measure_task's) fall short of the task's goal, in the goal's own share (0 where
    met): a detector's missing share of fp32's detections plus its extra false ones per detection, the
    missing share of characters, of mask IoU, of top-1; the cosines missing on a generic model's outputs."""
    task = figures["task"]
    g = GOALS[task] if goal is None else goal
    labelled = figures["against"] == "labels"
    short = lambda value, floor: max(0.0, floor - value) if value is not None else 0.0  # noqa: E731
    if task == "classification":
        return (short(figures["top1_int8"], g * figures["top1_fp32"]) if labelled
                else short(figures["top1_agreement"], g))
    if task == "detection":
        kept, base = ((figures["kept_int8"], figures["kept_fp32"]) if labelled else
                      (figures["kept"], figures["detections_fp32"]))
        extra = figures["false_int8"] - figures["false_fp32"] if labelled else figures["false"]
        return short(kept / max(base, 1), g) + max(0, extra) / max(base, 1)
    if task == "ocr":
        return short(figures["characters_int8"] / figures["characters_fp32"]
                     if labelled and figures["characters_fp32"] else figures["characters"], g)
    if task == "segmentation":
        return short(figures["iou_int8"] / figures["iou_fp32"] if labelled and figures["iou_fp32"] else figures["iou"], g)
    return sum(short(f["cosine"], g) for f in figures["outputs"].values())


def verdict(figures: Mapping, goal: float | None = None) -> dict:
    """Whether `figures` (measure_task's) meet the task's goal: `met`, the `goal` as a sentence, and what
    was `missed`, each with its figure."""
    task = figures["task"]
    g = GOALS[task] if goal is None else goal
    missed: list[str] = []
    labelled = figures["against"] == "labels"

    def at_least(what: str, value: float | None, floor: float) -> None:
        if value is not None and value < floor - 1e-12:
            missed.append(f"{what} {value:.2%} < {floor:.2%}")

    if task == "classification" and labelled:
        said = f"int8 top-1 >= {g:.0%} of fp32's"
        at_least("int8 top-1", figures["top1_int8"], g * figures["top1_fp32"])
    elif task == "classification":
        said = f"top-1 agreement with fp32 >= {g:.0%}"
        at_least("top-1 agreement", figures["top1_agreement"], g)
    elif task == "detection":
        said = f"int8 keeps >= {g:.0%} of fp32's {'correct ' if labelled else ''}detections, no more false ones"
        kept, base = ((figures["kept_int8"], figures["kept_fp32"]) if labelled else
                      (figures["kept"], figures["detections_fp32"]))
        if kept < g * base - 1e-9:
            missed.append(f"kept {kept} of {base} ({kept / base:.2%} < {g:.0%})")
        extra = figures["false_int8"] - figures["false_fp32"] if labelled else figures["false"]
        if extra > 0:
            missed.append(f"{extra} more false detection(s)")
    elif task == "ocr":
        said = f"int8 reads >= {g:.0%} of the characters fp32 reads"
        at_least("characters", figures["characters_int8"] / figures["characters_fp32"]
                 if labelled and figures["characters_fp32"] else figures["characters"], g)
    elif task == "segmentation":
        said = f"mask IoU >= {g:.0%}" + (" of fp32's" if labelled else " with fp32's masks")
        at_least("mask IoU", figures["iou_int8"] / figures["iou_fp32"]
                 if labelled and figures["iou_fp32"] else figures["iou"], g)
    else:
        said = f"cosine >= {g} on every output"
        for name, f in figures["outputs"].items():
            if f["cosine"] < g:
                missed.append(f"{name}: cosine {f['cosine']:.4f} < {g}")
    return {"met": not missed, "goal": said, "missed": missed}


def summary(result: Mapping) -> str:
    """One line of a task's figures and verdict, for the build's log and `inspect`."""
    task, labelled = result["task"], result["against"] == "labels"
    pct = lambda v: "n/a" if v is None else f"{v:.1%}"  # noqa: E731
    if task == "classification":
        text = (f"top-1 fp32 {pct(result['top1_fp32'])}, int8 {pct(result['top1_int8'])}"
                + (f", top-5 fp32 {pct(result['top5_fp32'])}, int8 {pct(result['top5_int8'])}"
                   if result["top5_fp32"] is not None else "") + "; " if labelled else "")
        text += f"top-1 agreement with fp32 {pct(result['top1_agreement'])} on {result['rows']} row(s)"
    elif task == "detection":
        text = (f"{result['detections_fp32']} fp32 detection(s) on {result['images']} image(s): {result['kept']} kept, "
                f"{result['lost']} lost, {result['false']} false (IoU >= {result['decoder']['match']})")
        if labelled:
            text += (f"; of {result['objects']} labelled object(s) fp32 finds {result['kept_fp32']} "
                     f"({result['false_fp32']} false), int8 {result['kept_int8']} ({result['false_int8']} false)")
    elif task == "ocr":
        text = (f"characters fp32 {pct(result['characters_fp32'])}, int8 {pct(result['characters_int8'])}; "
                if labelled else "") + (f"int8 reads {pct(result['characters'])} of fp32's characters on "
                                        f"{result['lines']} line(s)")
    elif task == "segmentation":
        text = (f"mask IoU with labels fp32 {pct(result['iou_fp32'])}, int8 {pct(result['iou_int8'])}; " if labelled
                else "") + f"mask IoU with fp32 {pct(result['iou'])}, pixels {pct(result['pixels'])}"
    else:
        text = "; ".join(f"{n}: cosine {f['cosine']:.5f}, max error {f['max_error']:.2%} of its range"
                         for n, f in result["outputs"].items())
    v = result["verdict"]
    return f"{text}; goal: {v['goal']}: " + ("met" if v["met"] else "MISSED (" + "; ".join(v["missed"]) + ")")
