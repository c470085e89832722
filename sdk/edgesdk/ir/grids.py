"""A quantized model's own int8 grids, kept where legalize made it float (`legalization/quantized.py`).

The model's metadata entry `GRIDS` holds, by tensor name, the float range [lo, hi] of the int8 grid a removed
QuantizeLinear -> DequantizeLinear pair rounded the tensor to (and of the model's int8 input and output): s (qmin
- z) to s (qmax - z), the min and max from which a converter quantizes to scale s and zero point z again. The
compress and tune stages pin those tensors' ranges to them.
"""

from __future__ import annotations

import json

import onnx_ir as ir

GRIDS = "edgesdk.quantized_grids"


def grids(model) -> dict[str, tuple[float, float]]:
    """The ranges kept (`GRIDS`), by tensor name, of an ir.Model or an onnx.ModelProto; {} for a model that has
    none."""
    if isinstance(model, ir.Model):
        text = model.metadata_props.get(GRIDS)
    else:
        text = next((p.value for p in model.metadata_props if p.key == GRIDS), None)
    return {k: (float(lo), float(hi)) for k, (lo, hi) in json.loads(text).items()} if text else {}
