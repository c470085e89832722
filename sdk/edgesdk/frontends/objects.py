"""A model object in memory, from the Python API, as the file the command line would read: written to
OUT/.build/source/NAME.<format> (whole, or not at all), then built as that file is.

Objects: an `onnx.ModelProto`; a PyTorch `nn.Module` (with example inputs) or `torch.export.ExportedProgram`,
exported to ONNX here (`torch_export`); a Keras model, saved as .keras and converted as a .keras file is;
TFLite flatbuffer bytes (what `tf.lite.TFLiteConverter.convert()` returns). A path is taken as it is. No
library is imported to recognise an object: torch and Keras only where the caller has imported them.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .formats import TFLITE_IDENTIFIER

SOURCE_DIR = "source"  # under OUT/.build, beside the stages' directories

READABLE_OBJECTS = ("a path (.onnx, .keras, .h5, .tflite, .pt2, a SavedModel directory), an onnx.ModelProto, a "
                    "torch nn.Module (with example_inputs) or torch.export.ExportedProgram, a Keras model, or "
                    "TFLite flatbuffer bytes")


def kind(model: Any) -> str:
    """"path", "onnx", "torch", "keras" or "tflite"; UsageError `api.unknown-model` for anything else."""
    if isinstance(model, (str, os.PathLike)):
        return "path"
    if isinstance(model, (bytes, bytearray, memoryview)):
        head = bytes(model[:8])
        if head[4:8] == TFLITE_IDENTIFIER:
            return "tflite"
        raise UsageError("api.unknown-model", "the bytes given are not a TFLite flatbuffer (no 'TFL3' at byte 4)",
                         f"give {READABLE_OBJECTS}")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, (torch.nn.Module, torch.export.ExportedProgram)):
        return "torch"
    keras = sys.modules.get("keras")
    if keras is not None and isinstance(model, keras.Model):
        return "keras"
    import onnx

    if isinstance(model, onnx.ModelProto):
        return "onnx"
    raise UsageError("api.unknown-model", f"cannot build a {type(model).__module__}.{type(model).__qualname__}",
                     f"give {READABLE_OBJECTS}")


def model_file(model: Any, out: Path, *, example_inputs: Any = None, name: str | None = None,
               log: Callable[[str], None] = lambda s: None) -> Path:
    """The file a build reads for `model`: a path as given; an object written under OUT/.build/source/."""
    k = kind(model)
    if k == "path":
        if example_inputs is not None:
            raise UsageError("api.example-inputs", "example_inputs go with a PyTorch module in memory, not a path",
                             "a .pt2 program carries its own example inputs; fix a dynamic dimension with "
                             "input_shapes")
        return Path(os.fspath(model))
    if example_inputs is not None and k != "torch":
        raise UsageError("api.example-inputs", f"example_inputs go with a PyTorch module, not a {k} model",
                         "fix a dynamic dimension with input_shapes")
    stem = _safe(name or _default_name(model, k))
    where = Path(out) / ".build" / SOURCE_DIR
    where.mkdir(parents=True, exist_ok=True)
    suffix = {"onnx": ".onnx", "torch": ".onnx", "keras": ".keras", "tflite": ".tflite"}[k]
    dest = where / f"{stem}{suffix}"
    partial = where / f".{stem}.partial{suffix}"
    for stale in (partial, partial.with_name(partial.name + ".data")):
        stale.unlink(missing_ok=True)
    try:
        if k == "onnx":
            _save_onnx(model, partial)
        elif k == "torch":
            from .torch_export import export

            log(f"import: exporting the PyTorch model {stem} with torch.export and torch.onnx")
            for note in export(model, example_inputs, partial, shown=f"the PyTorch model {stem}")["notes"]:
                log(f"import: {note}")
        elif k == "keras":
            model.save(str(partial))
        else:
            partial.write_bytes(bytes(model))
        data = partial.with_name(partial.name + ".data")
        if data.exists():  # external weights: the model names its data file, so the file keeps its name
            _rename_external_data(partial, data, dest)
        partial.replace(dest)
    except BaseException:
        partial.unlink(missing_ok=True)
        partial.with_name(partial.name + ".data").unlink(missing_ok=True)
        raise
    return dest


def _save_onnx(model: Any, dest: Path) -> None:
    import onnx

    if model.ByteSize() < 2**31 - 2**20:
        dest.write_bytes(model.SerializeToString(deterministic=True))
    else:  # past protobuf's 2 GB: the weights beside it, as any large ONNX model keeps them
        onnx.save_model(model, str(dest), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=dest.name + ".data")


def _rename_external_data(model_path: Path, data: Path, dest: Path) -> None:
    import onnx

    proto = onnx.load(str(model_path), load_external_data=False)
    target = dest.name + ".data"
    for t in _external(proto):
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = target
    data.replace(dest.parent / target)
    model_path.write_bytes(proto.SerializeToString(deterministic=True))


def _external(proto: Any):
    from onnx import external_data_helper

    return [t for t in external_data_helper._get_all_tensors(proto) if external_data_helper.uses_external_data(t)]


def _default_name(model: Any, k: str) -> str:
    if k == "onnx":
        return model.graph.name or "model"
    if k == "keras":
        return getattr(model, "name", None) or "model"
    if k == "torch":
        return "program" if type(model).__name__ == "ExportedProgram" else type(model).__name__.lower()
    return "model"


def _safe(name: str) -> str:
    """A file name from a model's name: letters, digits, '.', '_' and '-'."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(name)).strip("._") or "model"
    return safe[:100]
