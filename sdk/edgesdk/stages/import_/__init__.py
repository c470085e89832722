"""import: read the model into the canonical ONNX graph, and optimize it without changing its answer.

Needs: an .onnx file (opset 11 or newer, external data beside it), a TensorFlow SavedModel directory,
a Keras .keras/.h5 file, or a TFLite file (float32, float16, int8).
Guarantees: `model.onnx` at opset >= 17 (`frontends.CANONICAL_OPSET`), every input's shape static (batch fixed
to --batch, other dynamic dimensions from --input-shape), the graph-level optimizations of
`edgesdk.passes` applied (each rule exact up to float rounding), shapes inferred for every node (a
declared output or value_info shape that contradicts the graph replaced, with a warning), IR
version readable by onnxruntime. `import.json` names the inputs and outputs; the record counts nodes
by op type before and after optimization and how often each rule fired. Converted formats also leave
the converter's own output as `converted.onnx`, to compare in Netron; a quantized TFLite file itself as
`source.tflite`, the reference its bundle's accuracy is judged against (LiteRT's int8 arithmetic).

Steps: `frontends.import_model` (read or convert the file; fix the input shapes, freeze the
--input-value inputs, upgrade the opset, infer shapes: `frontends.canonical`), `passes.optimize`,
`frontends.finish_import` (shapes inferred again and required static; `import.json`'s content).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from ... import frontends, passes
from ...errors import UserError
from ...frontends.canonical import opset
from ...ir import model as irm
from ...runtime.files import NotRegularFile, open_regular, write_whole

FLATBUFFER_BYTES = 2**31  # a TFLite flatbuffer's largest size

OPTIONS = ("input_shapes", "input_values", "batch")
READS = ()  # the earlier stages whose outputs it reads (its cache key covers them)
# import reads no target figure: its cache holds when only the target changes
USES_TARGET = False


def run(model_path: Path, ctx) -> dict:
    """Import, optimize, check; write converted.onnx (converted formats), model.onnx and import.json."""
    t0 = time.perf_counter()
    imported = frontends.import_model(model_path, ctx.options, log=ctx.log, warn=ctx.warn)
    if imported.converted is not None:
        irm.save(imported.converted, ctx.out / "converted.onnx")
    model, optimized = passes.optimize(imported.model)
    for rule, why in optimized.get("rule_errors", {}).items():
        ctx.warn(f"graph optimization '{rule}' was switched off for this model: {why}")
    model, io = frontends.finish_import(model, imported, model_path, max_trip_count=passes.loops.MAX_TRIP_COUNT)
    if not model.graph.node:
        outputs = ", ".join(o.name for o in model.graph.output)
        raise UserError("import.nothing-to-compute",
                        f"{model_path}: no operator is left once constants are folded: every output ({outputs}) "
                        f"is a constant or a model input, so there is nothing to compile",
                        "an output cut at a shape computation (onnx.utils.extract_model at a Shape/Concat, say) "
                        "folds to a constant: choose outputs that depend on the input values")
    irm.save(model, ctx.out / "model.onnx")
    _keep_quantized_tflite(model_path, imported, io["source"]["sha256"], ctx.out)
    (ctx.out / "import.json").write_text(json.dumps(io, indent=2) + "\n")
    ctx.log(_summary(optimized))
    return _record(imported, model, optimized, io, optimize_s=time.perf_counter() - t0 - imported.convert_s)


def _keep_quantized_tflite(model_path: Path, imported, sha256: str, out: Path) -> None:
    """A quantized TFLite model's file, kept as `frontends.OWN_TFLITE` where it is still the file imported
    (`sha256`): its own int8 arithmetic is LiteRT's, which onnxruntime's kernels for the converted QDQ graph
    round differently, and the bundle is judged against what the model computes. Read once, as a regular
    file (a FIFO or a file grown past a flatbuffer's size is not kept), hashed as it is copied."""
    quantized = {"QuantizeLinear", "DequantizeLinear"} & set(imported.nodes_source)
    if imported.source["format"] != "tflite" or not quantized:
        return
    h = hashlib.sha256()
    try:
        with open_regular(model_path, FLATBUFFER_BYTES) as src:
            def copy(f) -> None:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    h.update(chunk)
                    f.write(chunk)

            write_whole(out / frontends.OWN_TFLITE, copy)
    except (NotRegularFile, OSError):
        return
    if h.hexdigest() != sha256:  # changed since it was read: not the model imported
        (out / frontends.OWN_TFLITE).unlink()


def _summary(optimized: dict) -> str:
    """The log line: node counts before and after optimization, and the rules that fired, most first."""
    before, after = sum(optimized["nodes_before"].values()), sum(optimized["nodes_after"].values())
    fired = {k: v for k, v in optimized["rules"].items() if v}
    return (f"import: {before} nodes -> {after} after optimization ("
            + (", ".join(f"{k} x{v}" for k, v in sorted(fired.items(), key=lambda kv: -kv[1])) or "no rule fired") + ")")


def _record(imported: frontends.Imported, model, optimized: dict, io: dict, *, optimize_s: float) -> dict:
    """The stage record the build report and `--json` are made from."""
    source = imported.source
    return {
        "format": source["format"],
        "converter": source.get("converter"),
        "opset": {"source": source["opset"], "canonical": opset(model)},
        "nodes_source": imported.nodes_source,
        "nodes_before": optimized["nodes_before"],
        "nodes_after": optimized["nodes_after"],
        "rules": optimized["rules"],
        "rounds": optimized.get("rounds"),
        "timings_s": {"convert": round(imported.convert_s, 3), "optimize": round(optimize_s, 3)},
        "converter_peak_rss": source.get("converter_peak_rss"),  # bytes; None for ONNX (read in process)
        "weight_bytes": irm.param_bytes(model),  # what the build's memory estimate scales with (stages/memory.py)
        "inputs": io["inputs"],
        "outputs": io["outputs"],
    }
