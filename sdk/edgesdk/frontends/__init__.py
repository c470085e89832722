"""Frontends: every model format a user brings, read into ONNX.

ONNX files are read in this process: protobuf fails cleanly on bad bytes. The TensorFlow formats
(SavedModel, Keras `.keras` / `.h5`, TFLite) are converted by tf2onnx in a child process
(`conversion`), because TensorFlow and the TFLite flatbuffer reader can crash natively on a
malformed file, and such a crash must cost the user an error message, not the build.

Guarantees of `load`: a checked ONNX model (external data loaded) whose ops are all standard ONNX
ops, opset >= 11, IR version <= 10; the original input and output names where the source format
has them. Unsupported constructs are reported together, one note per node.
"""

from __future__ import annotations

import time
from pathlib import Path

import onnx

from ..ir.model import IR_VERSION
from . import conversion, formats, onnx_file
from .formats import FORMATS, detect

__all__ = ["FORMATS", "detect", "load"]


def load(path: Path, work: Path, *, batch: int = 1,
         input_shapes: dict[str, tuple[int, ...]] | None = None) -> tuple[onnx.ModelProto, dict]:
    """The model as ONNX (external data loaded), and info: {"format", "converter" ("tf2onnx 1.17.0"
    or None), "opset", "seconds", "notes"}. `work` is a scratch directory the caller owns."""
    t0 = time.perf_counter()
    path = Path(path)
    fmt = detect(path)
    if fmt == "savedmodel" and path.is_file():  # the user named saved_model.pb itself
        path = path.parent
    formats.check_container(path, fmt)
    if fmt == "onnx":
        model, info = onnx_file.load(path)
    else:
        model, info = conversion.convert(path, fmt, Path(work), batch=batch, input_shapes=dict(input_shapes or {}))
    model.ir_version = min(model.ir_version, IR_VERSION)
    info["seconds"] = round(time.perf_counter() - t0, 3)
    return model, info
