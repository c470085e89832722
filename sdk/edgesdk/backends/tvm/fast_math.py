"""Transcendental functions that a CPU's vector units compute: float32 exp, sigmoid, tanh, erf and the
activations and softmax built on them, legalized with TOPI's polynomial forms (`topi.fast_exp`,
`fast_tanh`, `fast_erf`) instead of the C library's.

LLVM has no vector form of `expf`, `tanhf` or `erff` on a target without a vector math library: a
vectorized `exp` becomes one libm call per lane. EfficientNetB0's swish (x * sigmoid(x), after 49 of
its convolutions) spent a third of its untuned TVM time in `expf` on this project's x86 host
(the bundle 14.8 -> 9.8 ms with these forms; docs/design-notes.md, "TVM's x86 code"). The polynomial forms are
plain arithmetic and bit operations, which the default schedules vectorize.

Their error, measured against float64 over 4 million points in [-100, 100] on this project's x86
host: exp 4.1e-6 relative on [-87, 88]; sigmoid 9e-8 absolute; tanh and erf 4.2e-7 absolute
(`tests/backends/test_tvm_fast_math.py` checks twice these, for another CPU's rounding). What differs from libm at the edges: exp is 0 below -87.3 (libm: down to
1.4e-45) and infinite above 88.376 (libm: finite to 88.72); sigmoid goes to 0 and 1 there as it should.

CPU (LLVM) targets only: NVRTC already compiles CUDA segments with fast math. Other dtypes keep TVM's
legalization.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

_FLOAT = "float32"


def legalize_map() -> dict[str, Callable[[Any, Any], Any]]:
    """Legalizations for `relax.transform.LegalizeOps(customize_legalize_map=...)`: op name -> a function
    of (block builder, call) that emits the polynomial form for a float32 call and TVM's own otherwise."""
    from tvm import te, tirx, topi

    def sigmoid(x):
        e = topi.fast_exp(topi.negative(x))
        one = tirx.const(1.0, x.dtype)
        return te.compute(x.shape, lambda *i: one / (one + e(*i)), name="fast_sigmoid", tag="elemwise")

    def silu(x):
        return topi.multiply(x, sigmoid(x))

    def gelu(x):
        erf = topi.fast_erf(topi.multiply(x, tirx.const(0.5**0.5, x.dtype)))
        return topi.multiply(topi.multiply(x, tirx.const(0.5, x.dtype)), topi.add(erf, tirx.const(1.0, x.dtype)))

    def gelu_tanh(x):
        inner = topi.multiply(
            topi.add(x, topi.multiply(topi.multiply(topi.multiply(x, x), x), tirx.const(0.044715, x.dtype))),
            tirx.const(math.sqrt(2.0 / math.pi), x.dtype))
        return topi.multiply(topi.multiply(x, tirx.const(0.5, x.dtype)),
                             topi.add(topi.fast_tanh(inner), tirx.const(1.0, x.dtype)))

    unary = {
        "relax.exp": topi.fast_exp,
        "relax.tanh": topi.fast_tanh,
        "relax.erf": topi.fast_erf,
        "relax.sigmoid": sigmoid,
        "relax.nn.silu": silu,
        "relax.nn.gelu": gelu,
        "relax.nn.gelu_tanh": gelu_tanh,
    }
    table = {name: _unary(name, form) for name, form in unary.items()}
    table["relax.nn.softmax"] = _softmax
    return table


def _unary(name: str, form: Callable) -> Callable[[Any, Any], Any]:
    def legalize(bb, call):
        if _dtype(call.args[0]) != _FLOAT:
            return _default(name)(bb, call)
        return bb.call_te(form, call.args[0], primfunc_name_hint=f"fast_{name.rsplit('.', 1)[1]}")

    return legalize


def _softmax(bb, call):
    from tvm import topi

    if _dtype(call.args[0]) != _FLOAT:
        return _default("relax.nn.softmax")(bb, call)
    return bb.call_te(topi.nn.fast_softmax, call.args[0], call.attrs.axis, primfunc_name_hint="fast_softmax")


def _dtype(expr: Any) -> str:
    return str(getattr(expr.ty, "dtype", ""))  # TVM 0.27 calls struct_info `ty`


def _default(name: str) -> Callable[[Any, Any], Any]:
    import tvm

    return tvm.ir.Op.get(name).get_attr("FLegalize")
