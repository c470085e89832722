"""Which kernel a pruned convolution gets, sparse or dense, where nothing is timed: a choice is a function
of the convolution's shape and weight that returns `{"kernel": "sparse" | "dense", "why": ..., ...}`
(`Choice`), and every choice is recorded (compile.py's `TvmResult.sparse_choices`).

`by_policy` takes the sparse kernel wherever the pass offers one (a weight with at least MIN_SPARSITY
zeros); `forced` takes the kernel `edgesdk build --sparse-kernels` names. The choice by timing both kernels
on this host, `Measured`, is in sparse_measured.py: it needs the backend's own lowering, which this module
sits below.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np

from .sparse_format import ConvShape

MIN_SPARSITY = 0.5  # a constant convolution weight with at least this share of zeros gets the sparse kernel
Choice = Callable[[ConvShape, np.ndarray], dict]  # a convolution's shape and weight -> its kernel, and why


def by_policy(shape: ConvShape, weight: np.ndarray) -> dict:
    """The choice where this host cannot run the target's code: the sparse kernel, untimed."""
    return {"kernel": "sparse", "why": f"policy: at least {MIN_SPARSITY:.0%} zeros (not timed: this host cannot "
                                       "run the target's code)"}


def weight_digest(weight: np.ndarray) -> str:
    return hashlib.sha256(str(weight.shape).encode() + np.ascontiguousarray(weight, np.float32).tobytes()).hexdigest()


def forced(kernels: dict[str, str], otherwise: Choice) -> Choice:
    """A choice that takes the kernel `kernels` forces on a weight (by `weight_digest`: `edgesdk build
    --sparse-kernels sparse|dense`), else asks `otherwise`."""
    def choose(shape: ConvShape, weight: np.ndarray) -> dict:
        kernel = kernels.get(weight_digest(weight))
        if kernel is None:
            return otherwise(shape, weight)
        return {"kernel": kernel, "why": f"forced: --sparse-kernels {kernel}"}

    return choose
