"""The activations a model output may be read through where the model itself does not apply them: a
leaf that both the accuracy views (accuracy.py: `--output-activation`) and the task measures (tasks.py: an
SSD decoder's `activation=`) use, so the two compute the same scores."""

from __future__ import annotations

import numpy as np

ACTIVATIONS = ("sigmoid", "softmax")  # what --output-activation may declare


def activated(a: np.ndarray, activation: str, axis: int | None = None) -> np.ndarray:
    """`a` through `activation` (sigmoid; softmax along `axis`, the last where None)."""
    if activation == "sigmoid":
        return 1 / (1 + np.exp(-np.clip(a, -100, 100)))
    if activation == "softmax":
        e = np.exp(a - a.max(axis=-1 if axis is None else axis, keepdims=True))
        return e / e.sum(axis=-1 if axis is None else axis, keepdims=True)
    raise ValueError(f"unknown activation {activation!r}")
