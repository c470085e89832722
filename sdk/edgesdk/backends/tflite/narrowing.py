"""Percentile calibration: activation ranges narrowed to percentiles of the values seen.

The converter's calibration keeps each activation's min and max; a rare outlier then widens the
int8 step of every other value. Here each range becomes the `percentile`-th and
(100 - `percentile`)-th percentiles of a 2,048-bin histogram over the min-max range.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from .trace import _Lowered

_HISTOGRAM_BINS = 2048


def _narrow_to_percentile(model: Any, calibrated: bytes, lowered: _Lowered, samples: list[list[np.ndarray]],
                          percentile: float) -> dict[str, Any]:
    """Replace the min/max of every calibrated activation in `model` (the flatbuffer's object form)
    by percentiles of the values the float model computes on `samples`."""
    from ai_edge_litert.interpreter import Interpreter

    graph = model.subgraphs[0]
    stats = {i: (float(t.quantization.min[0]), float(t.quantization.max[0])) for i, t in enumerate(graph.tensors)
             if t.quantization is not None and t.quantization.min is not None and len(t.quantization.min) == 1}
    with warnings.catch_warnings():  # "for debugging only": reading every activation is the point here
        warnings.simplefilter("ignore")
        interpreter = Interpreter(model_content=calibrated, experimental_preserve_all_tensors=True)
    runner = interpreter.get_signature_runner()
    keys = [spec.key for spec in lowered.inputs]
    hist = {i: np.zeros(_HISTOGRAM_BINS, np.int64) for i in stats}
    for sample in samples:
        runner(**dict(zip(keys, sample)))
        for i, (lo, hi) in stats.items():
            if hi > lo:
                hist[i] += np.histogram(interpreter.get_tensor(i), _HISTOGRAM_BINS, (lo, hi))[0]
    tail = (100.0 - percentile) / 100.0
    kept = []
    for i, (lo, hi) in stats.items():
        counts = hist[i]
        if hi <= lo or not counts.sum():
            continue
        cdf = np.cumsum(counts) / counts.sum()
        edges = np.linspace(lo, hi, _HISTOGRAM_BINS + 1)
        # outwards to bin edges: the first bin whose cumulative share passes the lower tail, the
        # last bin still holding values inside the upper one
        new_lo = float(edges[int(np.searchsorted(cdf, tail, side="right"))])
        new_hi = float(edges[int(np.searchsorted(cdf, 1.0 - tail, side="left")) + 1])
        new_lo, new_hi = max(new_lo, lo), min(new_hi, hi)
        if new_hi > new_lo:
            graph.tensors[i].quantization.min = [new_lo]
            graph.tensors[i].quantization.max = [new_hi]
            kept.append((new_hi - new_lo) / (hi - lo))
    return {"percentile": percentile, "tensors": len(stats), "narrowed": int(sum(k < 1.0 for k in kept)),
            "median_range_kept": round(float(np.median(kept)), 4) if kept else 1.0}
