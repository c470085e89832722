"""What every exact-rule test does: build a small model inline, run `exact.apply` with the one rule
under test, check that the result is a valid model with the same signature, count the firings,
and compare outputs with the original under onnxruntime (graph optimizations off, so the
comparison sees our rewrites only). Models are built with `tests.passes.harness.model`.

Tolerances (numpy's assert_allclose: |got - want| <= atol + rtol * |want|):
- BITWISE: rules marked "exact": equal values (a zero's sign aside).
- ONE_ULP: Div -> Mul by the reciprocal: 1 ulp is at most 2^-23 relative.
- REASSOCIATED: sums in another order, or scales folded into weights: rtol 1e-5, atol 1e-6.
"""

from __future__ import annotations

import onnx

from edgesdk.legalization import exact
from tests.passes.harness import assert_same, ops, signature

BITWISE = {"rtol": 0.0, "atol": 0.0}
ONE_ULP = {"rtol": 2.0**-23, "atol": 0.0}
REASSOCIATED = {"rtol": 1e-5, "atol": 1e-6}


def legalized(m: onnx.ModelProto, only=None) -> tuple[onnx.ModelProto, dict]:
    """exact.apply(), plus what every result must satisfy."""
    original = m.SerializeToString()
    out, counts = exact.apply(m, only)
    assert m.SerializeToString() == original, "apply() changed its input"
    assert out.ir_version <= 10
    onnx.checker.check_model(out, full_check=True)
    onnx.shape_inference.infer_shapes(out, strict_mode=True)
    assert signature(out) == signature(m)
    return out, counts


def check_fires(m: onnx.ModelProto, rule: str, times: int = 1, *, gone: tuple = (), tolerance=BITWISE,
                feeds: dict | None = None) -> onnx.ModelProto:
    """Only `rule` runs: it fires `times` times, the ops in `gone` vanish, the outputs stay the same."""
    out, counts = legalized(m, only=[rule])
    assert counts == {rule: times}, counts
    for op in gone:
        assert ops(out)[op] == 0, (op, ops(out))
    assert_same(m, out, **tolerance, feeds=feeds)
    return out


def check_does_not_fire(m: onnx.ModelProto, rule: str, *, feeds: dict | None = None) -> onnx.ModelProto:
    """Only `rule` runs: it does not fire, the op counts are unchanged, and so are the outputs."""
    out, counts = legalized(m, only=[rule])
    assert counts == {rule: 0}, counts
    assert ops(out) == ops(m), (ops(out), ops(m))
    assert_same(m, out, **BITWISE, feeds=feeds)
    return out
