"""Reading an ONNX file: parse, external data, opset, standard ops, then onnx.checker."""

from __future__ import annotations

from pathlib import Path

import onnx

from ..errors import UserError
from ..ir import model as irm
from .standard_ops import nonstandard_ops

# Opset 11 settled Resize, Pad and the index ops into the forms every exporter since 2019 writes;
# older graphs would need onnx's version converter, which is not exact for them.
OLDEST_OPSET = 11


def load(path: Path) -> tuple[onnx.ModelProto, dict]:
    model = irm.load(path, check=False)
    opset = default_opset(model, path)
    if opset < OLDEST_OPSET:
        raise UserError("import.old-opset", f"{path}: opset {opset} is older than {OLDEST_OPSET}, the oldest edgesdk reads",
                        "re-export with a newer opset (torch.onnx.export(..., opset_version=17)), or upgrade the file with "
                        "onnx.version_converter.convert_version(model, 17)")
    reject_nonstandard(model, path, "custom ops must be replaced by standard ONNX ops before export")
    irm.check_model(model, path)
    return model, {"format": "onnx", "converter": None, "opset": opset, "notes": []}


def default_opset(model: onnx.ModelProto, path: Path) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    raise UserError("import.invalid-model", f"{path}: the model imports no standard ONNX opset",
                    "the file may be damaged, or hold only custom-domain ops; re-export it")


def reject_nonstandard(model: onnx.ModelProto, path: Path, hint: str, describe=None) -> None:
    """One `import.unsupported-op` error listing every non-standard node; `describe(site)` words a
    note for a converted model (which TF or TFLite op the node came from)."""
    sites = nonstandard_ops(model)
    if sites:
        raise UserError("import.unsupported-op", f"{path}: {len(sites)} node(s) use ops edgesdk cannot read", hint,
                        notes=[(describe or (lambda s: s.note()))(s) for s in sites])
