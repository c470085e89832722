"""Numeric comparisons used by reports and tests."""

from __future__ import annotations

import numpy as np


def compare(got: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """Cosine similarity, max abs error and max error relative to the reference's range."""
    g = np.asarray(got, dtype=np.float64).ravel()
    r = np.asarray(ref, dtype=np.float64).ravel()
    denom = np.linalg.norm(g) * np.linalg.norm(r)
    cos = float(g @ r / denom) if denom > 0 else float(np.array_equal(g, r))
    err = float(np.max(np.abs(g - r))) if g.size else 0.0
    scale = float(np.max(np.abs(r))) if r.size else 0.0
    return {"cosine": round(cos, 6), "max_abs_error": err, "max_rel_error": err / scale if scale else err}
