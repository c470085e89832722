"""Numeric comparisons used by reports and tests."""

from __future__ import annotations

from typing import Iterable

import numpy as np


def largest_difference(a, b) -> float:
    """The largest absolute difference of two arrays, in float64; 0 for empty ones."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def nudged(value, rng: np.random.Generator, step: float):
    """A float array with each element moved by `step` of its value, a random sign each (from `rng`); any other
    as it is: how far a model's output moves under it says how far rounding alone moves it."""
    value = np.asarray(value)
    if not np.issubdtype(value.dtype, np.floating):
        return value
    signs = rng.choice(np.array([-1.0, 1.0]), value.shape)
    return (value * (1.0 + step * signs)).astype(value.dtype)


def compare(got: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """Cosine similarity, max abs error and max error relative to the reference's range."""
    g = np.asarray(got, dtype=np.float64).ravel()
    r = np.asarray(ref, dtype=np.float64).ravel()
    denom = np.linalg.norm(g) * np.linalg.norm(r)
    cos = float(g @ r / denom) if denom > 0 else float(np.array_equal(g, r))
    err = float(np.max(np.abs(g - r))) if g.size else 0.0
    scale = float(np.max(np.abs(r))) if r.size else 0.0
    return {"cosine": round(cos, 6), "max_abs_error": err, "max_rel_error": err / scale if scale else err}


def fidelity(got: list[dict[str, np.ndarray]], want: list[dict[str, np.ndarray]],
             class_outputs: Iterable[str] = ()) -> tuple[dict[str, float], dict[str, float]]:
    """How closely `got` follows `want` over samples (each a dict of output arrays; `want` may hold
    more tensors): per output of `got`, the cosine similarity over all samples; and for the outputs
    named in `class_outputs` that hold class scores (rank 2 or 3, a last axis of 2 or more), how often
    the arg max of the last axis agrees, over all rows of all samples."""
    classes = set(class_outputs)
    cosines, top1 = {}, {}
    for name in got[0] if got else ():
        g = np.stack([x[name] for x in got]).astype(np.float64)
        w = np.stack([x[name] for x in want]).astype(np.float64)
        cosines[name] = compare(g, w)["cosine"]
        if name in classes and g.ndim - 1 in (2, 3) and g.shape[-1] >= 2:
            top1[name] = round(float(np.mean(np.argmax(g, -1) == np.argmax(w, -1))), 4)
    return cosines, top1
