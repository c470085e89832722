"""Numerical comparison for tests: tolerances stated relative to the output's scale.

Kernels differ in summation order and in the instructions they use (AVX2 or AVX-512 FMA, a
different accumulation in onnxruntime), so an elementwise absolute bound that holds on one CPU fails
on another: on an AVX2-only host 2 of 1,000 MobileNetV2 logits differed by 1.5e-5 from onnxruntime's
against atol=1e-5. The bundle's self-test states its float tolerance as 1e-4 of the largest expected
magnitude; tests do the same.
"""

from __future__ import annotations

import numpy as np

SCALE_RTOL = 1e-4


def assert_close(got, want, name: str = "", *, rtol: float = SCALE_RTOL) -> None:
    """Every element within `rtol` times max |want|."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    scale = max(float(np.abs(want).max()) if want.size else 0.0, 1e-30)
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * scale, err_msg=name)
