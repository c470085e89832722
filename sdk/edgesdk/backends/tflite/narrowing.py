"""Activation ranges chosen by a calibration method between the converter's two int8 steps.

The converter's calibration keeps each activation's min and max; a rare outlier then widens the int8
step of every other value. Here the float model runs on the calibration samples again (LiteRT, every
tensor kept), each calibrated activation's values are binned over its min-max range, and its range
becomes the one `ir.calibrators` gives for the method (percentile, mse, entropy). With "auto", a second
run measures the error of each tensor's values read back through int8 over each method's range, and
each tensor takes the method of least error (`assign`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from ...ir import calibrators
from ...ir.calibrators import METHODS, Errors, Histogram, Range
from .trace import _Lowered


@dataclass
class Measured:
    """What the calibration samples showed of each calibrated activation (by tensor index): its name,
    the min-max range the converter saw, each method's range, and with `errors` (for "auto") each
    method's error on the values."""

    names: dict[int, str]
    seen: dict[int, Range]
    ranges: dict[int, dict[str, Range]]
    errors: dict[int, Errors] | None = None


def measure(calibrated: bytes, lowered: _Lowered, samples: list[list[np.ndarray]], percentile: float,
            errors: bool = False) -> Measured:
    """Each calibrated activation's range by every method, from the float model (`calibrated`, the
    converter's first step) run on `samples`; with `errors`, each method's error measured by a second run."""
    from tensorflow.lite.tools import flatbuffer_utils

    graph = flatbuffer_utils.convert_bytearray_to_object(calibrated).subgraphs[0]
    seen = {i: (float(t.quantization.min[0]), float(t.quantization.max[0])) for i, t in enumerate(graph.tensors)
            if t.quantization is not None and t.quantization.min is not None and len(t.quantization.min) == 1}
    names = {i: _name(graph.tensors[i].name) for i in seen}
    hist = {i: Histogram(lo, hi) for i, (lo, hi) in seen.items()}
    for values in _activations(calibrated, lowered, samples, list(seen)):
        for i, x in values.items():
            hist[i].add(x)
    found = Measured(names, seen, {i: calibrators.ranges(h, percentile) for i, h in hist.items()})
    if errors:
        found.errors = {i: Errors(r) for i, r in found.ranges.items()}
        for values in _activations(calibrated, lowered, samples, list(seen)):
            for i, x in values.items():
                found.errors[i].add(x)
    return found


def _name(name: Any) -> str:
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


def _activations(calibrated: bytes, lowered: _Lowered, samples: list[list[np.ndarray]], tensors: list[int]
                 ) -> Iterator[dict[int, np.ndarray]]:
    """Per sample, the float values of `tensors` (LiteRT, every tensor kept)."""
    from ai_edge_litert.interpreter import Interpreter

    with warnings.catch_warnings():  # "for debugging only": reading every activation is the point here
        warnings.simplefilter("ignore")
        interpreter = Interpreter(model_content=calibrated, experimental_preserve_all_tensors=True)
    runner = interpreter.get_signature_runner()
    keys = [spec.key for spec in lowered.inputs]
    for sample in samples:
        runner(**dict(zip(keys, sample)))
        yield {i: interpreter.get_tensor(i) for i in tensors}


def assign(found: Measured, method: str) -> dict[int, tuple[str, Range]]:
    """Each activation's method and range: `method`'s, or with "auto" the method of least measured error."""
    if method == "auto":
        if found.errors is None:
            raise ValueError("auto needs the errors measured (measure(..., errors=True))")
        return {i: (e.least(), found.ranges[i][e.least()]) for i, e in found.errors.items()}
    return {i: (method, r[method]) for i, r in found.ranges.items()}


def with_ranges(calibrated: bytes, assigned: dict[int, tuple[str, Range]]) -> bytes:
    """The calibrated model with each activation's min and max replaced by its assigned range."""
    return Ranges(calibrated).model(assigned)


class Ranges:
    """The calibrated model in object form (made once: it is most of the cost), written out with one
    assignment of ranges after another."""

    def __init__(self, calibrated: bytes):
        from tensorflow.lite.tools import flatbuffer_utils

        self._model = flatbuffer_utils.convert_bytearray_to_object(calibrated)

    def model(self, assigned: dict[int, tuple[str, Range]]) -> bytes:
        from tensorflow.lite.tools import flatbuffer_utils

        tensors = self._model.subgraphs[0].tensors
        for i, (_, (lo, hi)) in assigned.items():
            tensors[i].quantization.min = [lo]
            tensors[i].quantization.max = [hi]
        return bytes(flatbuffer_utils.convert_object_to_bytearray(self._model))


# a sigmoid's input past +-8 reads within 3.4e-4 of 0 or 1: the int8 range of logits that the user's code passes
# through a sigmoid ends there (an SSD head's background anchors reach -300, and their min-max range left one
# int8 step of 1.55 logits, a face's score reading 0.5 or 0.825 and nothing between)
SIGMOID_LOGITS = 8.0


def saturating(calibrated: bytes, outputs: dict[str, str]) -> dict[int, Range]:
    """The range of each tensor holding one of `outputs` (signature output key -> the activation the
    user's code applies to it), by tensor index: for a sigmoid, from its smallest value seen (at least
    -SIGMOID_LOGITS) up to SIGMOID_LOGITS, wherever the calibration samples stopped: a logit's high tail is
    the confident detections, which a calibration set with few of them does not reach (BlazeFace calibrated
    on faces whose best logit was 1.66 read every more confident face as 0.84); the same range for every
    tensor that shares the output's quantization back through the ops before it
    (int8_ops.SHARED_QUANTIZATION_OPS: the Reshape and the Concatenation of a detector's heads). A softmax
    reads differences, so its logits keep their ranges."""
    from ai_edge_litert import schema_py_generated as schema

    from .flatbuffer import operators
    from .int8_ops import SHARED_QUANTIZATION_OPS

    wanted = {k for k, a in outputs.items() if a == "sigmoid"}
    m = schema.Model.GetRootAs(calibrated, 0)
    graph = m.Subgraphs(0)
    if not wanted or not m.SignatureDefsLength():
        return {}
    op_names = operators(calibrated)[0]  # the main subgraph's, by operator index
    producer = {}
    for k in range(graph.OperatorsLength()):
        op = graph.Operators(k)
        for t in op.OutputsAsNumpy():
            producer[int(t)] = (op, op_names[k])
    signature = m.SignatureDefs(0)
    out: dict[int, Range] = {}
    for j in range(signature.OutputsLength()):
        if _name(signature.Outputs(j).Name()) not in wanted:
            continue
        index = signature.Outputs(j).TensorIndex()
        q = graph.Tensors(index).Quantization()
        if q is None or q.MinLength() != 1:
            continue
        r = (min(max(float(q.Min(0)), -SIGMOID_LOGITS), 0.0), SIGMOID_LOGITS)
        todo = [index]
        while todo:
            i = todo.pop()
            if i in out:
                continue
            t = graph.Tensors(i).Quantization()
            if t is None or t.MinLength() != 1:
                continue
            out[i] = r
            op, name = producer.get(i, (None, ""))
            if op is not None and name in SHARED_QUANTIZATION_OPS:
                todo += [int(x) for x in op.InputsAsNumpy() if x >= 0]
    return out


def signature_inputs(calibrated: bytes, keys: set[str]) -> list[int]:
    """The tensor indices of the signature inputs named `keys`."""
    from ai_edge_litert import schema_py_generated as schema

    m = schema.Model.GetRootAs(calibrated, 0)
    if not keys or not m.SignatureDefsLength():
        return []
    signature = m.SignatureDefs(0)
    return [signature.Inputs(j).TensorIndex() for j in range(signature.InputsLength())
            if _name(signature.Inputs(j).Name()) in keys]


def exact_grid(lo: float, hi: float, levels: int = 255) -> Range:
    """The float32 min and max (a flatbuffer holds float32) from which the converter computes the grid of
    [lo, hi] again to the bit: its scale, (max - min) / 255 in float32 arithmetic, is the grid's float32
    scale (max and min rounded alone to float32 give one ulp of the scale more or less one time in a few:
    a convolution's output then differs by one step in a few elements of a hundred thousand)."""
    want = np.float32((hi - lo) / levels)
    low, high = np.float32(lo), np.float32(hi)
    moves = sorted(((a, b) for a in range(-4, 5) for b in range(-4, 5)), key=lambda ab: (abs(ab[0]) + abs(ab[1]), ab))
    for a, b in moves:  # the nearest float32 ends, moved by a few ulps each, whose scale is the grid's
        if (_ulps(high, b) - _ulps(low, a)) / np.float32(levels) == want:
            return float(_ulps(low, a)), float(_ulps(high, b))
    return float(low), float(high)


def _ulps(x: np.float32, n: int) -> np.float32:
    """`x` moved by `n` float32 ulps."""
    for _ in range(abs(n)):
        x = np.nextafter(x, np.float32(np.inf) if n > 0 else np.float32(-np.inf))
    return x


def signature_tensors(calibrated: bytes, keys: dict[str, str]) -> dict[str, int]:
    """The tensor indices of the signature inputs and outputs whose keys are in `keys` (key -> a name),
    by that name."""
    from ai_edge_litert import schema_py_generated as schema

    m = schema.Model.GetRootAs(calibrated, 0)
    if not m.SignatureDefsLength():
        return {}
    signature = m.SignatureDefs(0)
    ends = [signature.Inputs(j) for j in range(signature.InputsLength())] + \
        [signature.Outputs(j) for j in range(signature.OutputsLength())]
    return {keys[key]: t.TensorIndex() for t in ends if (key := _name(t.Name())) in keys}


def ranged_tensors(calibrated: bytes) -> set[int]:
    """The tensors of the main subgraph that carry a calibrated range (one min and max)."""
    from ai_edge_litert import schema_py_generated as schema

    graph = schema.Model.GetRootAs(calibrated, 0).Subgraphs(0)
    return {i for i in range(graph.TensorsLength())
            if (q := graph.Tensors(i).Quantization()) is not None and q.MinLength() == 1}


DEGENERATE_SPAN = 1e-6  # a calibrated range narrower than this (a tensor constant on every sample) is widened


def widen_degenerate(calibrated: bytes) -> tuple[bytes, list[str]]:
    """The calibrated model with every activation whose range is (about) one value on the calibration samples
    (a ReLU no sample lights up) given a range as wide as its producing op's first calibrated input (a graph
    input: its first consumer's output), about its value and holding 0 (the int8 step it had, about 1e-8,
    made the kernels refuse the model: XNNPACK takes no output step that much finer than its input's); and
    the tensors widened, by name. The ops are
    visited in the order they run, so a chain of such activations (a network whose activations vanish,
    as a MobileNet's do with its weights drawn at a small deviation) takes the width each one's input was
    given, not an arbitrary one: an output step some 1e8 times its input's is refused as well."""
    from tensorflow.lite.python import schema_py_generated as schema

    graph = schema.Model.GetRootAsModel(calibrated, 0).Subgraphs(0)

    def span(i: int) -> float | None:
        q = graph.Tensors(i).Quantization()
        return None if q is None or q.MinLength() != 1 else float(q.Max(0) - q.Min(0))

    spans = {i: s for i in range(graph.TensorsLength()) if (s := span(i)) is not None}
    if all(s >= DEGENERATE_SPAN for s in spans.values()):
        return calibrated, []
    from tensorflow.lite.tools import flatbuffer_utils

    model = flatbuffer_utils.convert_bytearray_to_object(calibrated)
    g = model.subgraphs[0]
    widened = []

    def widen(i: int, inputs: list[int]) -> None:
        wide = [spans[t] for t in inputs if t in spans and spans[t] >= DEGENERATE_SPAN]
        width = wide[0] if wide else 1.0
        q = g.tensors[i].quantization
        value = float(q.min[0])
        lo, hi = calibrators.with_zero(value - width / 2, value + width / 2)
        q.min, q.max = [lo], [hi]
        spans[i] = hi - lo
        widened.append(_name(g.tensors[i].name))

    for op in g.operators:  # in the order they run: an op's inputs are widened before its outputs
        inputs = [int(t) for t in (op.inputs if op.inputs is not None else []) if t >= 0]
        for o in (op.outputs if op.outputs is not None else []):
            if spans.get(int(o), DEGENERATE_SPAN) < DEGENERATE_SPAN:
                widen(int(o), inputs)
    for i in sorted(i for i, s in spans.items() if s < DEGENERATE_SPAN):  # no op makes it: a graph input (a
        # segment's input where an earlier segment's activations vanished) takes the width of what it makes
        widen(i, [int(o) for op in g.operators if op.inputs is not None and i in op.inputs
                  for o in (op.outputs if op.outputs is not None else [])])
    return bytes(flatbuffer_utils.convert_object_to_bytearray(model)), widened


def summary(found: Measured, assigned: dict[int, tuple[str, Range]], percentile: float) -> dict[str, Any]:
    """The record of the ranges chosen: how many tensors, how many narrowed, the median share of its
    min-max range a tensor keeps, the count per method; with errors measured, `per_tensor`: each tensor's
    method and range, the min-max range seen, every method's range, the method of least error on its
    values (`least`, what auto's per-tensor candidate takes) and the error (the root mean square of its
    values' error through int8, as a share of its min-max range) by every method."""
    out: dict[str, Any] = {"tensors": len(assigned), **kept({i: r for i, (_, r) in assigned.items()}, found.seen),
                           "methods": counts(m for m, _ in assigned.values())}
    if "percentile" in out["methods"]:
        out["percentile"] = percentile
    if found.errors is not None:
        out["per_tensor"] = [_tensor_record(found, i, method, r) for i, (method, r) in sorted(assigned.items())]
    return out


def kept(ranges: dict, seen: dict) -> dict[str, Any]:
    """How many of `ranges` are narrower than the min-max range `seen` (both by tensor), and the median
    share of it they keep."""
    shares = []
    for i, (lo, hi) in ranges.items():
        full = calibrators.with_zero(*seen[i])
        if full[1] > full[0]:
            shares.append((hi - lo) / (full[1] - full[0]))
    return {"narrowed": int(sum(k < 1.0 for k in shares)),
            "median_range_kept": round(float(np.median(shares)), 4) if shares else 1.0}


def counts(methods) -> dict[str, int]:
    """How many tensors each method calibrated, in METHODS order, those of none left out."""
    methods = list(methods)
    return {m: n for m in METHODS if (n := methods.count(m))}


def _tensor_record(found: Measured, i: int, method: str, r: Range) -> dict[str, Any]:
    lo, hi = calibrators.with_zero(*found.seen[i])
    span = (hi - lo) or 1.0
    errors = found.errors[i]
    return {"tensor": found.names[i], "method": method, "range": [_round(r[0]), _round(r[1])],
            "least": errors.least(), "error": {m: _round(errors.rms(m) / span) for m in METHODS},
            "seen": [_round(found.seen[i][0]), _round(found.seen[i][1])],
            "ranges": {m: [_round(a), _round(b)] for m, (a, b) in found.ranges[i].items()}}


def _round(x: float) -> float:
    return float(f"{x:.6g}")
