"""Frontends: every model format a user brings, read into ONNX.

ONNX files are read in this process: protobuf fails cleanly on bad bytes. The TensorFlow formats
(SavedModel, Keras `.keras` / `.h5`, TFLite) are converted by tf2onnx in a child process
(`conversion`), because TensorFlow and the TFLite flatbuffer reader can crash natively on a
malformed file, and such a crash must cost the user an error message, not the build.

Guarantees of `load`: a checked ONNX model (external data loaded) whose ops are all standard ONNX
ops and whose inputs and outputs are tensors, opset >= 11, IR version <= 10; the original input and
output names where the source format has them. Unsupported constructs are reported together, one
note per node.

The import stage's domain: `import_model` reads the model (`load`) and makes it the canonical graph
(`canonical`: static input shapes, opset >= 17, shapes inferred); after the graph optimizations
(`edgesdk.passes`, which the stage runs: frontends may not import them), `finish_import` requires
every shape static and words `import.json`.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx

from ..ir import index_ranges
from ..ir import model as irm
from ..ir.digest import file_sha256, tree_sha256
from ..ir.model import IR_VERSION
from . import canonical, conversion, formats, metadata, onnx_file
from .canonical import CANONICAL_OPSET
from .formats import FORMATS, detect

__all__ = ["CANONICAL_OPSET", "FORMATS", "Imported", "detect", "finish_import", "import_model", "load"]


def load(path: Path, work: Path, *, batch: int = 1, input_shapes: dict[str, tuple[int, ...]] | None = None,
         log: Callable[[str], None] | None = None) -> tuple[onnx.ModelProto, dict]:
    """The model as ONNX (external data loaded), and info: {"format", "converter" ("tf2onnx 1.17.0"
    or None), "opset", "seconds", "notes", and for a converted format "converter_peak_rss"}. `work` is
    a scratch directory the caller owns; `log` gets the converter's progress lines."""
    t0 = time.perf_counter()
    path = Path(path)
    fmt = detect(path)
    if fmt == "savedmodel" and path.is_file():  # the user named saved_model.pb itself
        path = path.parent
    formats.check_container(path, fmt)
    if fmt == "onnx":
        model, info = onnx_file.load(path)
    else:
        model, info = conversion.convert(path, fmt, Path(work), batch=batch, input_shapes=dict(input_shapes or {}),
                                         log=log)
    onnx_file.reject_non_tensor_io(model, path)
    model.ir_version = min(model.ir_version, IR_VERSION)
    info["seconds"] = round(time.perf_counter() - t0, 3)
    return model, info


# the import stage's copy of a quantized TFLite file as given: the accuracy gate's reference runs it
OWN_TFLITE = "source.tflite"


@dataclass(frozen=True)
class Imported:
    """A model read into the canonical graph (not yet optimized), and what the import knows of its source."""
    model: onnx.ModelProto              # opset >= CANONICAL_OPSET where ONNX could upgrade it, inputs static
    converted: onnx.ModelProto | None   # the converter's own output, as it came (TensorFlow formats); None for ONNX
    source: dict                        # `load`'s info: format, converter, opset, seconds, notes
    nodes_source: dict[str, int]        # nodes by op type as read, before any change
    convert_s: float                    # seconds to read (and convert) the file


def import_model(path: Path, options, *, log: Callable[[str], None], warn: Callable[[str], None]) -> Imported:
    """Read the model and make it canonical; `options`: any object with batch, input_shapes, input_values."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="edgesdk-import-") as work:
        model, source = load(path, Path(work), batch=options.batch, input_shapes=options.input_shapes, log=log)
    convert_s = time.perf_counter() - t0
    converted = None
    if source["format"] != "onnx":
        converted = onnx.ModelProto()
        converted.CopyFrom(model)  # the steps below change `model` in place
        log(f"import: {source['format']} converted by {source['converter']} in {convert_s:.1f} s "
            f"(the converter's peak memory {source['converter_peak_rss'] / 2**20:.0f} MiB)")
    for note in source.get("notes", []):
        warn(note)
    nodes_source = irm.op_counts(model)

    canonical.fix_input_shapes(model, options.input_shapes, options.batch, path, frozen=set(options.input_values))
    if options.input_values:
        canonical.freeze_inputs(model, options.input_values, path)
        log("import: frozen input(s) " + ", ".join(f"{k}={','.join(f'{x:g}' for x in v)}"
                                                 for k, v in options.input_values.items()))
    model = canonical.canonical_opset(model, path, log=log, warn=warn)
    model = canonical.infer_shapes(model, path, warn)
    return Imported(model, converted, source, nodes_source, convert_s)


def finish_import(model: onnx.ModelProto, imported: Imported, path: Path, *,
                  max_trip_count: int) -> tuple[onnx.ModelProto, dict]:
    """The optimized graph with its shapes inferred again and required static, and `import.json`'s content."""
    model = canonical.require_static(model, path, max_trip_count=max_trip_count)
    return model, describe(model, path, imported.source)


def describe(model: onnx.ModelProto, path: Path, source: dict) -> dict:
    """`import.json`: the inputs (initializers excepted) and outputs, shape and dtype each, and where it
    is known the range an input takes (`input_ranges`); the source file."""
    shapes = irm.static_shapes(model)
    types = irm.elem_types(model)
    consts = irm.constant_names(model)
    digest = tree_sha256(path) if Path(path).is_dir() else file_sha256(path)
    inputs = [{"name": i.name, "shape": list(shapes[i.name]), "dtype": irm.dtype_name(types[i.name])}
              for i in model.graph.input if i.name not in consts]
    known = input_ranges(model, path, source["format"], inputs)
    return {
        "inputs": [{**i, "range": known[i["name"]]} if i["name"] in known else i for i in inputs],
        "outputs": [{"name": o.name, "shape": list(shapes[o.name]), "dtype": irm.dtype_name(types[o.name])}
                    for o in model.graph.output],
        "source": {"path": str(path), "name": Path(path).stem, "sha256": digest,
                   "format": source["format"], "converter": source.get("converter"), "opset": source["opset"]},
    }


def input_ranges(model: onnx.ModelProto, path: Path, fmt: str, inputs: list[dict]) -> dict[str, dict]:
    """The range each input takes where the model says it (synthetic calibration samples follow it):
    what its metadata states (`metadata.input_ranges`), and for an integer input that indexes a table
    (token ids), the indices the table has (`ir.index_ranges`; non-negative ones: ids from the end
    are valid but not what real inputs hold)."""
    known = metadata.input_ranges(model, path, fmt, inputs)
    if any(not i["dtype"].startswith(("float", "bool")) for i in inputs):
        for name, r in index_ranges.infer(model).items():
            if r.valid_range is not None and name not in known:
                known[name] = {"low": [0], "high": [r.valid_range[1]], "axis": None,
                               "source": f"the table it indexes ({', '.join(r.bounded_by)})"}
    return known
