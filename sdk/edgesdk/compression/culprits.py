"""The layers that lose an int8 segment's accuracy, found by comparing it with its float segment tensor by
tensor, each with its probable cause.

The int8 model's own tensors come from its backend (`Backend.int8_layers`: each ONNX tensor that has an
int8 tensor of its own, dequantized, in ONNX layout, with the range int8 represents there); the float
segment runs on onnxruntime on the same inputs (the segment's own, as the fp32 model computes them on
held-out samples), so each segment's figures are its own, not what the segments before it lost. Every
layer after a clipped one is off too, so a tensor q is compared twice, with f, the float segment's
value, and with l, the float op computed from the int8 model's own values of what it reads (the nodes
back to the nearest tensors that have int8 values, run anew: `_local`):

    error, snr_db              max |q - f| / range(f); 10 log10(sum f^2 / sum (q - f)^2): lost so far
    added_error, added_snr_db  the same of q - l: what this layer lost itself

(per part, for a model output that is judged in parts: accuracy.views). Layers are ranked by
`added_error`. A culprit's cause is the first that holds of

    approximation         legalize put a sum of ReLUs in place of its node (its name starts with the
                          prefix of the approximation's nodes)
    shared-quantization   an int8 op next to it keeps one scale for its input and output (MINIMUM,
                          MAXIMUM, CONCATENATION, PAD, RESHAPE, ...: the backend names them), and that
                          range clips its values or is too coarse for them (fewer than COARSE steps over
                          its fp32 range): a PReLU lowered as Min(x, 0) gives x the range [min, 0];
                          scores concatenated with pixel boxes get the boxes' step
    calibration-clipping  l leaves the range int8 represents there (CLIPPED of its values or more, by
                          EXCESS of that range or more, or by half of what the layer loses or more) and
                          so does fp32: calibration gave it a narrower range than these inputs need
    saturation            l leaves the range where fp32 stays inside: the error before it drives it out
    lowering              it adds MIN_ADDED of its range or more, LOWERING_DB or more under the SNR its own
                          int8 step allows (rounding noise of variance step^2 / 12 against its signal):
                          the int8 graph computes it otherwise than float
    unknown               none of these

Needs: the float segment (static shapes) and the int8 side for the same feeds. Guarantees: nothing is
written; the names are the segment's own node names, which are the model's (an approximation's nodes are
named by the nodes it replaced).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import onnx

from .accuracy import View
from .fidelity import run_samples

# The TFLite int8 kernels whose input and output share one scale and zero point (TFLite's quantization
# specification: "input and outputs must all have same scale/zero_point"). The lowering part's audit of
# the lowerings is meant to expose this table in backends/tflite; compression may not import backends, so
# the table the culprit search names causes by lives here.
CAUSES = ("calibration-clipping", "shared-quantization", "saturation", "approximation", "lowering", "unknown")
SNR_CAP = 99.0  # dB: an exact tensor, or one with no signal
CLIPPED = 0.01  # the share of fp32 values outside the int8 range that counts as clipping
EXCESS = 0.25  # or how far beyond it, as a share of the range int8 represents
COARSE = 16  # a shared range with fewer int8 steps than this over the tensor's own fp32 range is too coarse

LOWERING_DB = 10.0
MIN_ADDED = 0.02  # a layer that adds less error than this share of its range is no culprit
LOCAL_NODES = 32  # the most nodes between a tensor and the int8 values it is computed from anew
TOP = 5  # culprits named per search


@dataclass(frozen=True)
class Culprit:
    node: str  # the model's own node name (an approximation: the nodes it replaced)
    segment: str
    tensor: str  # the ONNX tensor compared (with its part, for a model output judged in parts)
    op: str  # the ONNX op type
    int8_op: str  # the int8 kernel that computes it
    error: float  # max |q - f| over the fp32 range: what the int8 model has lost up to here
    snr_db: float
    added_error: float  # max |q - l| over the fp32 range, l the float op on the int8 inputs: lost here
    added_snr_db: float
    cause: str
    why: str

    def describe(self) -> str:
        """One line: `/m/cv3/Conv in s0 (Conv, CONV_2D): 26.5% of its range lost here (SNR 11.6 dB, 26.9 dB
        so far); calibration-clipping: ...`."""
        return (f"{self.node} in {self.segment} ({self.op} -> {self.int8_op or 'no int8 kernel'}): "
                f"{self.added_error:.1%} of its range lost here (SNR {self.added_snr_db:.1f} dB; "
                f"{self.snr_db:.1f} dB against fp32); {self.cause}: {self.why}")

    def to_json(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def rank(model: onnx.ModelProto, int8: Mapping[str, dict], feeds: Sequence[Mapping[str, np.ndarray]], *,
         segment: str, parts: Mapping[str, Sequence[View]] | None = None,
         approximations: Sequence[dict] = (), top: int = TOP, least: float = MIN_ADDED) -> list[Culprit]:
    """The `top` layers of the segment `model` that lose the most here (module docstring), from `int8`
    (its backend's `int8_layers` on `feeds`) against onnxruntime on `feeds`, each adding at least `least` of
    its range. `parts`: how a model output among the tensors is judged (`accuracy.views`); `approximations`:
    legalize's record of its ReLU sums."""
    layers = compare(model, int8, feeds, segment=segment, parts=parts or {}, approximations=approximations)
    return sorted((c for c in layers if c.added_error >= least and c.added_error > 0),
                  key=lambda c: (-c.added_error, c.added_snr_db, c.node))[:top]


def compare(model: onnx.ModelProto, int8: Mapping[str, dict], feeds: Sequence[Mapping[str, np.ndarray]], *,
            segment: str, parts: Mapping[str, Sequence[View]], approximations: Sequence[dict] = ()) -> list[Culprit]:
    """Every tensor of `int8` that a node of `model` computes, compared with the float segment: one
    Culprit each (per part for a model output judged in parts), unranked."""
    names = [n for n in int8 if int8[n]["values"]]
    fp32 = run_samples(model, feeds, names)
    local = _local(model, int8, names, feeds)
    producer = {o: (k, n) for k, n in enumerate(model.graph.node) for o in n.output}
    approximated = _approximated(approximations)
    found = []
    for name in names:
        if name not in producer:
            continue  # a segment input
        k, node = producer[name]
        entry = int8[name]
        f_all = np.stack([np.asarray(s[name], np.float64) for s in fp32])
        q_all = np.stack([np.asarray(v, np.float64) for v in entry["values"]])
        l_all = np.stack([np.asarray(s[name], np.float64) for s in local]) if name in local[0] else f_all
        mark = next((p for p in approximated if node.name.startswith(p)), None)
        for v in parts.get(name) or [View(name, "values")]:
            f, q, here = v.of(f_all), v.of(q_all), v.of(l_all)
            scale = _scale(f)
            cause, why = _cause(entry, f, q, here, scale, approximated[mark]["nodes"] if mark else None)
            found.append(Culprit(approximated[mark]["nodes"] if mark else node.name or f"{node.op_type}_{k}",
                                 segment, v.name if v.axis is not None else name, node.op_type, entry.get("op", ""),
                                 _max_error(f, q, scale), _snr(f, q - f), _max_error(here, q, scale),
                                 _snr(f, q - here), cause, why))
    return found


def _local(model: onnx.ModelProto, int8: Mapping[str, dict], names: list[str],
           feeds: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """Per feed, each tensor of `names` as the float nodes compute it from the int8 model's own values of
    what they read: the nodes back to the nearest tensors with int8 values (those fused into their
    consumer have none), run by onnxruntime as one model in which every such region is a copy of its
    own. A tensor whose region would pass LOCAL_NODES nodes is left out (its cumulative error stands)."""
    g = model.graph
    producer = {o: n for n in g.node for o in n.output if o}
    constants = {i.name for i in g.initializer}
    available = set(names)
    nodes, inputs, outputs = [], {}, []
    for target in names:
        if target not in producer:
            continue
        region, todo = [], [producer[target]]
        while todo and len(region) <= LOCAL_NODES:
            n = todo.pop()
            if any(n is r for r in region):
                continue
            region.append(n)
            todo += [producer[i] for i in n.input if i and i in producer and i not in available]
        if len(region) > LOCAL_NODES:
            continue
        made = {o for n in region for o in n.output if o}
        own = lambda t: f"{t}@{target}" if t in made else (f"{t}@int8" if t in available else t)  # noqa: E731
        for n in sorted(region, key=lambda n: next(k for k, m in enumerate(g.node) if m is n)):
            copy = onnx.NodeProto()
            copy.CopyFrom(n)
            copy.name = f"{n.name}@{target}"
            copy.ClearField("input")
            copy.input.extend(own(i) if i else "" for i in n.input)
            copy.ClearField("output")
            copy.output.extend(own(o) if o else "" for o in n.output)
            nodes.append(copy)
        for i in {i for n in region for i in n.input if i and i not in made and i not in constants}:
            inputs[own(i)] = i
        outputs.append(f"{target}@{target}")
    if not outputs:
        return [{} for _ in feeds]
    local = onnx.ModelProto()
    local.CopyFrom(model)
    local.graph.ClearField("node")
    local.graph.node.extend(nodes)
    local.graph.ClearField("input")
    first = {k: np.asarray(int8[t]["values"][0]) if t in available else np.asarray(feeds[0][t])
             for k, t in inputs.items()}
    local.graph.input.extend(onnx.helper.make_tensor_value_info(k, onnx.TensorProto.FLOAT, first[k].shape)
                             for k in inputs)
    local.graph.ClearField("output")
    local.graph.output.extend(onnx.helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in outputs)
    local.graph.ClearField("value_info")
    samples = [{k: np.asarray(int8[t]["values"][s] if t in available else feeds[s][t], np.float32)
                for k, t in inputs.items()} for s in range(len(feeds))]
    try:
        ran = run_samples(local, samples)
    except Exception:  # noqa: BLE001 - an op onnxruntime takes only in its context: cumulative figures stand
        return [{} for _ in feeds]
    return [{o[: -len(o.split("@")[-1]) - 1]: r[o] for o in outputs} for r in ran]


def _approximated(approximations: Sequence[dict]) -> dict[str, dict]:
    """Legalize's approximations by the prefix that every node it made starts with (`relu_sum`)."""
    return {a["prefix"]: {"nodes": ", ".join(a.get("nodes", ())), "entry": a}
            for a in approximations if a.get("prefix")}


def _scale(f: np.ndarray) -> float:
    span = float(f.max() - f.min()) if f.size else 0.0
    return span or float(np.abs(f).max(initial=0.0)) or 1.0


def _max_error(reference: np.ndarray, q: np.ndarray, scale: float) -> float:
    return float(np.abs(q - reference).max(initial=0.0)) / scale


def _snr(f: np.ndarray, noise: np.ndarray) -> float:
    signal, power = float(np.sum(f * f)), float(np.sum(noise * noise))
    if power == 0:
        return SNR_CAP
    if signal == 0:
        return -SNR_CAP
    return max(-SNR_CAP, min(SNR_CAP, 10 * math.log10(signal / power)))


def _cause(entry: dict, f: np.ndarray, q: np.ndarray, here: np.ndarray, scale: float,
           approximation: str | None) -> tuple[str, str]:
    """The first cause of the module docstring that holds, and a sentence with its figures."""
    if approximation is not None:
        return "approximation", f"a sum of ReLUs that legalize put in place of {approximation}"
    lo_hi, step = entry.get("representable"), entry.get("step")
    fmin, fmax = float(f.min(initial=0.0)), float(f.max(initial=0.0))
    seen = f"fp32 reaches [{fmin:.4g}, {fmax:.4g}]"
    added_snr = _snr(f, q - here)
    if lo_hi is None or not step:
        if _max_error(here, q, scale) >= MIN_ADDED and added_snr < SNR_CAP - LOWERING_DB:
            return "lowering", f"a float tensor of the int8 model, {added_snr:.1f} dB off the float op"
        return "unknown", "a float tensor of the int8 model"
    lo, hi = lo_hi
    shared = sorted(entry.get("shared", ()))
    ops = " and ".join(shared)

    added = float(np.abs(q - here).max(initial=0.0))

    def outside(x: np.ndarray) -> bool:
        """Whether `x` leaves [lo, hi] often, far, or by most of what this layer loses."""
        share = float(np.mean((x < lo - step / 2) | (x > hi + step / 2))) if x.size else 0.0
        beyond = max(lo - float(x.min(initial=lo)), float(x.max(initial=hi)) - hi, 0.0)
        return (share >= CLIPPED or beyond >= EXCESS * (hi - lo)
                or (added >= MIN_ADDED * scale and beyond >= added / 2))

    if outside(here):
        clipped = float(np.mean((here < lo - step / 2) | (here > hi + step / 2)))
        beyond = max(lo - float(here.min()), float(here.max()) - hi)
        where = (f"its values leave [{lo:.4g}, {hi:.4g}], the range int8 represents there, by up to {beyond:.4g} "
                 f"({clipped:.2%} of them)")
        if shared:
            return "shared-quantization", f"{ops} keeps one quantization for its input and output: {where} ({seen})"
        if outside(f):
            return "calibration-clipping", f"{where} ({seen}): calibration gave it a narrower range"
        return "saturation", f"{where}, though fp32's stay inside ({seen}): the error before it drives them there"
    span = fmax - fmin
    if shared and span and span / step < COARSE:
        return "shared-quantization", (f"{ops} keeps one quantization for its input and output: a step of {step:.4g} "
                                       f"over [{lo:.4g}, {hi:.4g}] leaves its values ({seen}) {span / step:.1f} steps")
    floor = _snr_floor(f, step)
    if _max_error(here, q, scale) >= MIN_ADDED and added_snr < floor - LOWERING_DB:
        return "lowering", (f"{added_snr:.1f} dB off the float op on the same int8 inputs, where its int8 step "
                            f"({step:.4g}) alone allows {floor:.1f} dB: the int8 graph computes it otherwise")
    if span and span / step < COARSE:
        return "unknown", (f"its int8 step ({step:.4g}, over [{lo:.4g}, {hi:.4g}]) is {step / span:.0%} of what its "
                           f"values span on these inputs ({seen})")
    return "unknown", f"its int8 step is {step:.4g} over [{lo:.4g}, {hi:.4g}] ({seen})"


def _snr_floor(f: np.ndarray, step: float) -> float:
    """The SNR an int8 tensor of this step reaches by its own rounding: uniform noise of variance step^2/12."""
    power = float(np.mean(f * f)) if f.size else 0.0
    if power == 0:
        return SNR_CAP
    return max(-SNR_CAP, min(SNR_CAP, 10 * math.log10(power / (step * step / 12))))
