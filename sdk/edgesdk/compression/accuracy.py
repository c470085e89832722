"""What a reduced-precision build keeps of the fp32 model's outputs, judged by what each output means.

One cosine over a whole output hides what matters: a YOLOv8 head's [1, 4 + C, anchors] is box
coordinates in pixels (hundreds) and class scores in [0, 1]; its cosine stays 0.9999 while every score
collapses. And a softmax compared as logits hides nothing but is not what the user reads. So each model
output is cut into the parts it is judged by (`views`), found from the graph: where the output is,
through Reshape/Transpose/Concat, partly a Sigmoid or Softmax, those rows are `scores` (compared as the
model gives them, after the activation) and the rest `values`. Each part gets its measures (`measure`):

    cosine      the cosine similarity of the reduced-precision part to fp32, over all samples; not judged
                for scores none of which reaches DECIDES in fp32 (`decides: false`; their mean error is)
    max_error   max |q - f| / range(f), range(f) = max f - min f over all samples (fp32's); for a
                declared activation's scores, their own range, 1; for other scores at least DECIDES
    mean_error  mean |q - f| / range(f)
    top1        scores with classes: how often the arg max over the class axis agrees, at the positions
                where fp32 decides (its best score at least CONFIDENT: a sequence's steps, a detector's
                detections); None where there are no classes or no such position

An output the model gives as logits that the user's own code passes through a sigmoid or a softmax
(BlazeFace's classificators, a face-landmark model's face flag: the activation is in MediaPipe's graph,
not in the model) is judged as those scores, once the build is told (`--output-activation NAME=sigmoid`,
or a detection decoder's `activation=`): `views(model, declared)`, whose View applies the activation
(`applies`). A logit's range is mostly a tail no reader sees (a background anchor at -300 reads 0 as
well as one at -8), and judged as values its error is a share of that tail.

`judge` compares them with the target's `accuracy:` thresholds (`Gate`, per kind). By default
scores are judged by cosine, mean error and top-1, values by cosine and mean error; max error is
measured but judged only where a target asks (a segmentation mask's edge pixel or a recognizer's step
between two characters flips a score from 0 to 1 in a bundle that reads and segments as fp32 does).
docs/accuracy.md gives the defaults and the measurements they come from.

Needs: the fp32 model (static shapes) for `views`; samples as dicts of output arrays. Guarantees:
nothing is run here, every figure is over all samples together, and a NaN fails every threshold.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from ..ir import model as irm
from . import tasks
from .activations import ACTIVATIONS, activated

SCORES, VALUES = "scores", "values"
CONFIDENT = 0.9  # fp32 decides where its best score is at least this: top-1 is taken there
# scores none of which reaches this (a person mask of photographs without a person, a detector's scores
# on background) have no cosine: fp32 decides nothing there, and the cosine of near-zero vectors said 0.0
# of a selfie segmenter whose masks agreed with fp32's at IoU 1.0
DECIDES = 0.5
# ops an output's meaning passes through unchanged (elementwise or a move of its elements)
_SAME = ("Identity", "Cast", "Dropout")
_MOVES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")


@dataclass(frozen=True)
class View:
    """One part of a model output: `output[..., start:stop, ...]` along `axis` (the whole output where
    `axis` is None), of `kind` scores or values; `activation` (sigmoid, softmax) for scores, and the axis
    of the part its classes lie along (`class_axis`, None where it has none)."""

    output: str
    kind: str
    axis: int | None = None
    start: int = 0
    stop: int = 0
    activation: str | None = None
    class_axis: int | None = None
    applies: bool = False  # the output is the activation's input (logits): `of` applies it
    # the output is the part quantized (a QuantizeLinear's, scale and zero point): `of` dequantizes it first,
    # so that a full-int8 model's softmax is judged as the probabilities it stands for, not as int8 codes
    # whose constant zero point (-128 for every class but the best) makes any two cosines near 1
    dequantize: tuple[float, float] | None = None

    @property
    def name(self) -> str:
        """How messages and records name the part: `output0`, or `output0[:, 4:22]` (numpy's slice)."""
        if self.axis is None:
            return self.output
        return f"{self.output}[{':, ' * self.axis}{self.start}:{self.stop}]"

    def of(self, a: np.ndarray, batched: bool = True) -> np.ndarray:
        """This part of `a` (the output's values; `batched`: samples stacked on a new first axis), after
        the activation where the view `applies` it (a quantized output dequantized first)."""
        if self.dequantize is not None:
            scale, zero = self.dequantize
            a = (np.asarray(a, np.float64) - zero) * scale
        if self.applies:
            a = activated(np.asarray(a, np.float64), self.activation,
                          None if self.class_axis is None else self.class_axis + batched)
        if self.axis is None:
            return a
        index = [slice(None)] * a.ndim
        index[self.axis + batched] = slice(self.start, self.stop)
        return a[tuple(index)]

    def describe(self) -> str:
        if self.applies:
            return f"scores, after the {self.activation} the build was told the output goes through"
        if self.kind == SCORES:
            return f"scores, after its {self.activation}"
        return "values"


def declared(options) -> dict[str, str]:
    """The outputs a build's `options` say are logits read through an activation, by name: its
    `output_activations` (--output-activation), and the scores output of an SSD-style decoder whose
    `activation=` is sigmoid or softmax (--task detection --decoder ssd --task-options scores=NAME,...)."""
    out = {}
    if getattr(options, "decoder", None) == "ssd" and getattr(options, "task", None) == "detection":
        spec = tasks.parse_options("detection", "ssd", getattr(options, "task_options", None))
        if spec.get("activation") in ACTIVATIONS and spec.get("scores"):
            out[spec["scores"]] = spec["activation"]
    out.update(getattr(options, "output_activations", None) or {})
    return out


@dataclass(frozen=True)
class _Whole:
    kind: str
    activation: str | None = None
    class_axis: int | None = None


@dataclass(frozen=True)
class _Split:
    axis: int
    parts: tuple[tuple[int, int, _Whole], ...]


_PLAIN = _Whole(VALUES)


def views(model: onnx.ModelProto, declared: Mapping[str, str] | None = None) -> dict[str, list[View]]:
    """Each graph output of `model` and the parts it is judged by, found by following its producers
    back through moves (Reshape, Transpose, Squeeze, ...) and Concats to a Sigmoid or a Softmax; an
    output in `declared` (name -> sigmoid or softmax, `declared(options)`) is those scores, whole, the
    view applying the activation (a softmax along the last axis)."""
    shell, _ = irm.weightless(model)
    shapes = irm.static_shapes(onnx.shape_inference.infer_shapes(shell))
    producer = {o: n for n in model.graph.node for o in n.output if o}
    constants = {i.name: i for i in model.graph.initializer}
    constants.update({n.output[0]: a.t for n in model.graph.node if n.op_type == "Constant"
                      for a in n.attribute if a.name == "value"})
    memo: dict[str, _Whole | _Split] = {}

    def walk(name: str, depth: int = 0) -> _Whole | _Split:
        if name not in memo:
            node = producer.get(name)
            memo[name] = _PLAIN if node is None or depth > 64 else _of(node, name, shapes, lambda t: walk(t, depth + 1))
        return memo[name]

    out = {}
    for o in model.graph.output:
        if declared and o.name in declared:
            rank = len(shapes.get(o.name, ()))
            softmax = declared[o.name] == "softmax" and rank
            out[o.name] = [View(o.name, SCORES, activation=declared[o.name], applies=True,
                                class_axis=rank - 1 if softmax else None)]
            continue
        grid = _quantized(producer.get(o.name), constants)
        d = walk(producer[o.name].input[0] if grid else o.name)
        if isinstance(d, _Whole):
            out[o.name] = [View(o.name, d.kind, activation=d.activation, class_axis=d.class_axis, dequantize=grid)]
        else:
            out[o.name] = [View(o.name, w.kind, d.axis, a, b, w.activation,
                                w.class_axis if w.class_axis is not None else (d.axis if w.kind == SCORES and b - a > 1
                                                                                else None), dequantize=grid)
                           for a, b, w in d.parts]
    return out


def _quantized(node: onnx.NodeProto | None, constants: Mapping[str, onnx.TensorProto]) -> tuple[float, float] | None:
    """(scale, zero point) of an output a QuantizeLinear of one scale makes (a full-int8 model's), else None."""
    if node is None or node.op_type != "QuantizeLinear" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
        return None
    scale = constants.get(node.input[1])
    zero = constants.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if scale is None or (len(node.input) > 2 and node.input[2] and zero is None):
        return None
    scale = irm.array(scale)
    zero = irm.array(zero) if zero is not None else np.zeros(())
    if scale.size != 1 or zero.size != 1:
        return None
    return float(scale.reshape(())), float(zero.reshape(()))


def declared_chain(model: onnx.ModelProto, declared: Mapping[str, str] | None) -> dict[str, list[View]]:
    """The tensors before each `declared` output whose values reach it only moved or concatenated (Reshape,
    Transpose, Concat, ...: what shares the output's int8 quantization), each judged as the output is, after
    its activation: the culprit search must not name the Reshape before BlazeFace's classificators for
    logits below -8 that its sigmoid reads as the fp32 ones do."""
    producer = {o: n for n in model.graph.node for o in n.output if o}
    out: dict[str, list[View]] = {}
    todo = [(o, a) for o, a in (declared or {}).items()]
    while todo:
        name, activation = todo.pop()
        node = producer.get(name)
        if node is None or node.op_type not in (*_SAME, *_MOVES, "Transpose", "Concat"):
            continue
        for i in node.input:
            if i and i not in out and i in producer:
                out[i] = [View(i, SCORES, activation=activation, applies=True)]
                todo.append((i, activation))
    return out


def _of(node: onnx.NodeProto, name: str, shapes: dict, walk) -> _Whole | _Split:
    """What `name`, an output of `node`, is made of (`walk` tells the same of another tensor)."""
    op = node.op_type
    rank = len(shapes.get(name, ()))
    if op in ("Sigmoid", "HardSigmoid"):
        return _Whole(SCORES, "sigmoid")
    if op == "Softmax":
        axis = _attr(node, "axis", -1)
        return _Whole(SCORES, "softmax", axis % rank if rank else None)
    if op in _SAME:
        return walk(node.input[0])
    if op == "Transpose":
        d = walk(node.input[0])
        perm = list(_attr(node, "perm", list(range(rank))[::-1]))
        moved = lambda a: perm.index(a) if a is not None and a in perm else None  # noqa: E731
        if isinstance(d, _Whole):
            return _Whole(d.kind, d.activation, moved(d.class_axis))
        return _Split(moved(d.axis), d.parts) if moved(d.axis) is not None else _PLAIN
    if op in _MOVES:
        d = walk(node.input[0])
        before, after = shapes.get(node.input[0]), shapes.get(name)
        if before is None or after is None:
            return _PLAIN if isinstance(d, _Split) else _Whole(d.kind, d.activation)
        moved = lambda a: _kept_axis(before, after, a)  # noqa: E731
        if isinstance(d, _Whole):
            return _Whole(d.kind, d.activation, moved(d.class_axis) if d.class_axis is not None else None)
        return _Split(moved(d.axis), d.parts) if moved(d.axis) is not None else _PLAIN
    if op == "Concat":
        return _concat(node, name, shapes, walk)
    if op in ("Mul", "Min", "Max") and all(isinstance(walk(i), _Whole) and walk(i).kind == SCORES for i in node.input):
        return _Whole(SCORES, "sigmoid")  # a product of scores (YOLOv5's class score times objectness) is one
    return _PLAIN


def _concat(node: onnx.NodeProto, name: str, shapes: dict, walk) -> _Whole | _Split:
    rank = len(shapes.get(name, ()))
    if not rank:
        return _PLAIN
    axis = _attr(node, "axis", 0) % rank
    parts: list[tuple[int, int, _Whole]] = []
    offset = 0
    for i in node.input:
        shape = shapes.get(i)
        if shape is None or len(shape) != rank:
            return _PLAIN
        d = walk(i)
        n = shape[axis]
        if isinstance(d, _Whole):
            # a part's classes along the Concat's axis (YOLOv8's rows 4..) are named when the View is made
            parts.append((offset, offset + n, _Whole(d.kind, d.activation, d.class_axis if d.class_axis != axis else None)))
        elif d.axis == axis:
            parts += [(offset + a, offset + b, w) for a, b, w in d.parts]
        else:
            parts.append((offset, offset + n, _PLAIN))  # split along another axis: judged as values
        offset += n
    merged: list[tuple[int, int, _Whole]] = []
    for a, b, w in parts:
        if merged and merged[-1][2] == w and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b, w)
        else:
            merged.append((a, b, w))
    if len(merged) == 1:
        return merged[0][2]
    return _Split(axis, tuple(merged))


def _kept_axis(before: Sequence[int], after: Sequence[int], axis: int) -> int | None:
    """The axis of `after` that holds `before`'s `axis` whole (the same elements before it, the same
    length), or None where a reshape mixes it with others."""
    lead = math.prod(before[:axis])
    for j in range(len(after)):
        if math.prod(after[:j]) == lead and after[j] == before[axis]:
            return j
    return None


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def measure(fp32: Sequence[Mapping[str, np.ndarray]], reduced: Sequence[Mapping[str, np.ndarray]],
            parts: Mapping[str, Sequence[View]]) -> dict[str, dict]:
    """Per part (by `View.name`): the measures of the module docstring, over all samples; `fp32` and
    `reduced` are per sample the outputs by name (`reduced` may lack none of those in `parts`)."""
    out = {}
    for name, vs in parts.items():
        f_all = np.stack([np.asarray(s[name]) for s in fp32]).astype(np.float64)
        q_all = np.stack([np.asarray(s[name]) for s in reduced]).astype(np.float64)
        for v in vs:
            out[v.name] = {"output": name, "kind": v.kind, **({"activation": v.activation} if v.activation else {}),
                           **({"declared": True} if v.applies else {}),
                           **_measures(v.of(f_all), v.of(q_all), v), "samples": len(fp32)}
    return out


def _measures(f: np.ndarray, q: np.ndarray, v: View) -> dict:
    if f.shape != q.shape:
        raise ValueError(f"{v.name}: fp32 has shape {f.shape[1:]}, the reduced-precision model {q.shape[1:]}")
    fr, qr = f.ravel(), q.ravel()
    norms = float(np.linalg.norm(fr) * np.linalg.norm(qr))
    cosine = 1.0 if np.array_equal(fr, qr) else (float(fr @ qr / norms) if norms > 0 else 0.0)
    # fp32 decides nothing here: the direction of its near-zero scores means nothing, and is not judged
    decides = not (v.kind == SCORES and fr.size and float(fr.max()) < DECIDES)
    span = float(fr.max() - fr.min()) if fr.size else 0.0
    scale = span or float(np.abs(fr).max(initial=0.0)) or 1.0  # a constant part: its magnitude, or 1
    if v.applies:  # a probability the user's code makes of logits: its own range is [0, 1], whatever the
        scale = 1.0  # few held-out samples spread over (a face flag on 8 faces: 0.8 to 1)
    elif v.kind == SCORES:  # scores spread over less than DECIDES (background only) are errors of at least it
        scale = max(scale, DECIDES)
    err = np.abs(qr - fr)
    top1 = None
    if v.kind == SCORES and v.class_axis is not None and f.shape[v.class_axis + 1] > 1:
        fa, qa = np.argmax(f, axis=v.class_axis + 1), np.argmax(q, axis=v.class_axis + 1)
        where = np.max(f, axis=v.class_axis + 1) >= CONFIDENT
        top1 = round(float(np.mean(fa[where] == qa[where])), 4) if where.any() else None
    return {"cosine": round(cosine, 6), **({} if decides else {"decides": False}), "max_error": round(float(err.max(initial=0.0)) / scale, 6),
            "mean_error": round(float(err.mean()) / scale if err.size else 0.0, 6), "top1": top1,
            "range": [float(fr.min(initial=0.0)), float(fr.max(initial=0.0))]}


# how each measure is held to its threshold: at least it, or at most it
_SIDES = {"cosine": "min", "top1": "min", "max_error": "max", "mean_error": "max"}


@dataclass(frozen=True)
class Gate:
    """The thresholds a part must meet, per kind: measure -> threshold, a measure left out is not judged
    (the target's `accuracy:` section; config/target.py has the defaults and docs/accuracy.md why)."""

    scores: Mapping[str, float]
    values: Mapping[str, float]

    @staticmethod
    def of(policy) -> "Gate":
        """From a target's `accuracy` (config.target.AccuracyPolicy)."""
        return Gate(_set(policy.scores), _set(policy.values))

    def thresholds(self, kind: str) -> dict[str, tuple[str, float]]:
        """measure -> ("min" or "max", its threshold) for parts of `kind`."""
        return {m: (_SIDES[m], t) for m, t in (self.scores if kind == SCORES else self.values).items()}

    def to_json(self) -> dict:
        return {SCORES: dict(self.scores), VALUES: dict(self.values)}


def _set(thresholds) -> dict[str, float]:
    return {m: t for m, t in thresholds.model_dump().items() if t is not None}


@dataclass(frozen=True)
class Failure:
    """A part under the gate: the measures it misses, each (value, threshold)."""

    part: str
    kind: str
    missed: dict[str, tuple[float, float]]

    def describe(self) -> str:
        """`output0[:, 4:22] (scores): cosine 0.878 < 0.99, max error 94.1% of its range > 25.0%`."""
        said = []
        for m, (value, limit) in self.missed.items():
            if m == "cosine":
                said.append(f"cosine {value:.4f} < {limit:g}")
            elif m == "top1":
                said.append(f"top-1 agreement {value:.1%} < {limit:.0%}")
            else:
                said.append(f"{m.replace('_', ' ')} {value:.1%} of its range > {limit:.1%}")
        return f"{self.part} ({self.kind}): " + ", ".join(said)

    def to_json(self) -> dict:
        return {"part": self.part, "kind": self.kind,
                "missed": {m: {"value": v, "threshold": t} for m, (v, t) in self.missed.items()}}


def unjudged(measures: Mapping[str, dict]) -> dict[str, str]:
    """The scores parts the gate has no say on, part -> why: fp32 decides nothing on the samples (no score
    reaches DECIDES: no cosine) and at no position is it CONFIDENT (no top-1), so only their error is
    held, as a share of at least DECIDES. A 1000-way softmax of a classifier unsure of every sample (each
    class near 0.001) is one: int8 may pick any class and stay within 0.5% of that. Not a failure (fp32
    itself chose nothing to keep), but nothing the user reads was checked, and the build must say so."""
    out = {}
    for part, m in measures.items():
        if m["kind"] == SCORES and m.get("decides") is False and m.get("top1") is None:
            best = m["range"][1] if m.get("range") else float("nan")
            out[part] = (f"fp32 decides nothing on these samples (its best score {best:.3g} < {DECIDES:g}), so "
                         "neither its cosine nor its top-1 is judged")
    return out


def judge(measures: Mapping[str, dict], gate: Gate) -> list[Failure]:
    """The parts whose measures miss the gate's thresholds, in the order of `measures` (a NaN misses
    every one; a top-1 of None is not taken)."""
    failures = []
    for part, m in measures.items():
        missed = {}
        for key, (side, limit) in gate.thresholds(m["kind"]).items():
            value = m.get(key)
            if value is None or (key == "cosine" and m.get("decides") is False):
                continue
            ok = value >= limit if side == "min" else value <= limit
            if not ok:  # NaN compares false both ways
                missed[key] = (float(value), limit)
        if missed:
            failures.append(Failure(part, m["kind"], missed))
    return failures
