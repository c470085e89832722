"""Mixed precision for LiteRT's int8 CPU segments: the ops whose int8 kernels cost the most accuracy
stay float, the rest int8, until the segment meets an accuracy target on its calibration samples.

Full int8 of a whole segment misses a 0.99 cosine gate on real models (the pretrained PP-OCRv4 detector
reaches 0.915 against its fp32 model on text lines): a few ops' quantization error is amplified by
everything after them. TensorFlow's quantizer keeps listed ops float (`denylisted_nodes`: an op named
by its first output tensor in the calibrated model; it puts DEQUANTIZE before and QUANTIZE after it),
and re-quantizing a calibrated model takes a fraction of a second, so the search is cheap:

1. **rank**: each op alone int8 with every other op float, scored by how far the segment's outputs
   then are from the float model's (1 - the least cosine similarity over `RANK_SAMPLES` calibration
   samples). This measures an op's error where it matters, at the outputs. TFLite's own per-layer
   statistics (the QuantizationDebugger's rmse/scale) rank worse: on the detector they single out the
   squeeze-excitation convolutions, whose error the hard sigmoid after them clamps away, and keeping
   those float changes nothing (measured: 0.915 to 0.927 with 48 ops float, against 0.994 ranked here).
2. **search**: the `k` highest-ranked ops float, for the least `k` at which every output meets the
   target on all calibration samples (`k` doubles until one does, then bisection between the last
   two). More than `MAX_FLOAT_SHARE` of the ops float is no longer an int8 segment: the search gives
   up, saying how close it came.

The calibration samples pick the ops, so the held-out samples still judge the result (the tune
stage's accuracy gate): a segment that meets the target here and misses it there is refused there.
A mixed model takes and gives float (its int8 first and last ops quantize and dequantize inside
it): a float last op then hands on its values unquantized, and LiteRT's QUANTIZE kernel converts a
large input faster than the runtime's numpy does (two builds of the PP-OCRv4 detector measured 15.6 ms
with int8 inputs and outputs, 61 ops float, and 8.5 ms with float ones, 59 ops float). Full int8 keeps
int8 inputs and outputs, as the Edge TPU's models have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ...errors import UserError
from ...ir.numeric import fidelity

RANK_SAMPLES = 8  # calibration samples each op's sensitivity is measured on
MAX_FLOAT_SHARE = 0.5  # of the segment's ops, at most this many kept float


@dataclass(frozen=True)
class Mixed:
    """What the search found: the ops kept float (most sensitive first), of how many, and the
    fidelity the calibration samples measured."""

    float_ops: tuple[str, ...]
    ops: int
    cosine: float | None  # the least over outputs, on the calibration samples (None: not searched)
    top1: float | None
    searched: bool  # False where the ops were given (a rebuild replaying an earlier search)

    def record(self) -> dict:
        out: dict = {"float_ops": list(self.float_ops), "ops": self.ops}
        if self.searched:
            out.update(calibration_cosine=self.cosine, calibration_top1=self.top1)
        return out


def op_names(calibrated: bytes) -> list[str]:
    """The calibrated model's ops as `denylisted_nodes` names them (each op's first output tensor), in
    execution order; the calibration ops the converter added are not among them."""
    from ai_edge_litert.interpreter import Interpreter

    interp = Interpreter(model_content=calibrated)
    tensors = {d["index"]: d["name"] for d in interp.get_tensor_details()}
    return [tensors[op["outputs"][0]] for op in interp._get_ops_details()  # pylint: disable=protected-access
            if op["op_name"] not in ("QUANTIZE", "DEQUANTIZE") and len(op["outputs"])]


def search(names: Sequence[str], quantize: Callable[[tuple[str, ...]], bytes],
           run: Callable[[bytes, int], list[dict[str, np.ndarray]]], reference: list[dict[str, np.ndarray]],
           target, log: Callable[[str], None]) -> tuple[bytes, Mixed]:
    """The quantized model with the fewest float ops that meets `target` (a registry.AccuracyTarget)
    on the calibration samples, and what the search found. `quantize(float_ops)` gives a model with
    those ops float; `run(model, n)` its outputs on the first `n` calibration samples (all for n <= 0);
    `reference` the float model's outputs on them. Raises UserError where even `MAX_FLOAT_SHARE` of
    the ops float misses the target."""

    def measured(model: bytes, n: int = 0) -> tuple[float, float | None, str]:
        want = reference[:n] if n > 0 else reference
        cosines, top1s = fidelity(run(model, n), want, target.class_outputs)
        worst = min(cosines, key=cosines.get)
        least_top1 = min(top1s.values()) if top1s else None
        short = ""
        if cosines[worst] < target.cosine:
            short = f"{worst}'s cosine similarity {cosines[worst]:.4f} < {target.cosine}"
        elif least_top1 is not None and least_top1 < target.top1:
            short = f"top-1 agreement {least_top1:.0%} < {target.top1:.0%}"
        return cosines[worst], least_top1, short

    full = quantize(())
    cosine, top1, short = measured(full)
    if not short:
        return full, Mixed((), len(names), cosine, top1, True)
    log(f"full int8 misses the target on the calibration samples ({short}): ranking {len(names)} ops by the "
        f"error each adds alone")
    scores = {}
    for i, name in enumerate(names):
        alone = quantize(tuple(n for n in names if n != name))
        scores[name] = 1.0 - measured(alone, RANK_SAMPLES)[0]
        if (i + 1) % 50 == 0:
            log(f"  ranked {i + 1} of {len(names)} ops")
    ranked = sorted(names, key=lambda n: (-scores[n], names.index(n)))
    limit = max(1, int(len(names) * MAX_FLOAT_SHARE))
    tried: dict[int, tuple[bytes, float, float | None, str]] = {}

    def trial(k: int) -> str:
        if k not in tried:
            model = quantize(tuple(ranked[:k]))
            tried[k] = (model, *measured(model))
            log(f"  {k} of {len(names)} ops float: cosine {tried[k][1]:.4f}" + (f" ({tried[k][3]})" if tried[k][3] else ""))
        return tried[k][3]

    k = 1
    while trial(k) and k < limit:
        k = min(2 * k, limit)
    if trial(k):
        best = max(tried, key=lambda j: tried[j][1])
        raise UserError("tune.mixed-precision",
                        f"mixed precision misses the accuracy target even with {k} of {len(names)} ops float "
                        f"({tried[k][3]}; the best tried, {best} float, reached cosine {tried[best][1]:.4f})",
                        "keep this span fp32, or give calibration samples closer to the real inputs (--calib)")
    low = max((j for j in tried if j < k and tried[j][3]), default=0)  # misses; k meets it
    while k - low > 1:
        mid = (low + k) // 2
        if trial(mid):
            low = mid
        else:
            k = mid
    model, cosine, top1, _ = tried[k]
    return model, Mixed(tuple(ranked[:k]), len(names), cosine, top1, True)
