"""A plan run on the build host from the compress stage's files: the int8 segments named by LiteRT, every
other segment in float by onnxruntime on its scheduled ONNX graph, chained as the plan runs them.

What `auto` weighs its calibration candidates by, and what the accuracy probe (probe.py) runs with one
int8 segment after another in float: no bundle is compiled for either. A CPU segment compiled by TVM
computes what onnxruntime does within float rounding, so the float segments stand for it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..backends import onnxruntime as ort_backend
from ..ir import model as irm
from ..runtime.manifest import Segment, tensor_from_dict


def run(plan, scheduled: Path, out: Path, int8: dict[str, dict], samples: list[dict],
        cache: dict | None = None) -> list[dict]:
    """The model's outputs on `samples`, its segments run in plan order: those in `int8` (segment id ->
    artifact under `out` and tensor specs, as compress.json records them) by LiteRT, the others float by
    onnxruntime on `scheduled`'s segment graphs. `cache` (a dict the caller keeps) holds the runners opened,
    for a caller that runs the same plan with one set of int8 segments after another."""
    from ..runtime.backends import tflite_runner

    cache = {} if cache is None else cache
    runners = {}
    for s in plan.segments:
        if s.id in int8:
            c = int8[s.id]
            key = ("int8", s.id, c["artifact"], tuple(t["name"] for t in c["inputs"] + c["outputs"]))
            if key not in cache:
                cache[key] = tflite_runner.open_runner(out, Segment(
                    id=s.id, device="cpu", backend="tflite", artifact=c["artifact"], fallback_artifact=c["artifact"],
                    inputs=tuple(tensor_from_dict(t) for t in c["inputs"]),
                    outputs=tuple(tensor_from_dict(t) for t in c["outputs"])), None).run
        else:
            key = ("float", s.id)
            if key not in cache:
                session = ort_backend.session(irm.read(scheduled / s.artifact))
                names = [o.name for o in session.get_outputs()]
                cache[key] = lambda feeds, session=session, names=names: dict(zip(names, session.run(names, feeds)))
        runners[s.id] = cache[key]
    got = []
    for sample in samples:
        values = dict(sample)
        for s in plan.segments:
            values.update(runners[s.id]({k: values[k] for k in s.inputs}))
        got.append({k: np.asarray(values[k]) for k in plan.outputs})
    return got
