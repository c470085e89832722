"""import: read the model into the canonical ONNX graph, and optimize it without changing its answer.

Needs: an .onnx file (opset 11 or newer, external data beside it), a TensorFlow SavedModel directory,
a Keras .keras/.h5 file, or a TFLite file (float32, float16, int8).
Guarantees: `model.onnx` at opset >= 17 (`CANONICAL_OPSET`), every input's shape static (batch fixed
to --batch, other dynamic dimensions from --input-shape), the graph-level optimizations of
`edgesdk.passes` applied (each rule exact up to float rounding), shapes inferred for every node (a
declared output or value_info shape that contradicts the graph replaced, with a warning), IR
version readable by onnxruntime. `import.json` names the inputs and outputs; the record counts nodes
by op type before and after optimization and how often each rule fired. Converted formats also leave
the converter's own output as `converted.onnx`, to compare in Netron.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import onnx

from ... import frontends, passes
from ...errors import UsageError, UserError
from ...ir import model as irm
from ...ir.digest import file_sha256, tree_sha256

OPTIONS = ("input_shapes", "input_values", "batch")
READS = ()  # the earlier stages whose outputs it reads (its cache key covers them)
# import reads no target figure: its cache holds when only the target changes
USES_TARGET = False

# Every graph leaves import at this opset or newer: the passes and backends see one form of
# Squeeze/Unsqueeze/Split/Softmax (opset 13 moved axes to inputs and changed Softmax's coercion).
# 17 is the newest opset whose ReduceMean still takes `axes` as an attribute, which every backend reads.
CANONICAL_OPSET = 17


def run(model_path: Path, ctx) -> dict:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="edgesdk-import-") as work:
        model, source = frontends.load(model_path, Path(work), batch=ctx.options.batch,
                                       input_shapes=ctx.options.input_shapes)
    converted = time.perf_counter()
    if source["format"] != "onnx":
        irm.save(model, ctx.out / "converted.onnx")
        ctx.log(f"import: {source['format']} converted by {source['converter']} in {converted - t0:.1f} s")
    for note in source.get("notes", []):
        ctx.warn(note)
    nodes_source = passes.op_counts(model)

    _fix_input_shapes(model, ctx.options.input_shapes, ctx.options.batch, model_path,
                      frozen=set(ctx.options.input_values))
    if ctx.options.input_values:
        _freeze_inputs(model, ctx.options.input_values, model_path)
        ctx.log("import: frozen input(s) " + ", ".join(f"{k}={','.join(f'{x:g}' for x in v)}"
                                                     for k, v in ctx.options.input_values.items()))
    model = _canonical_opset(model, model_path, ctx)
    model = _infer_shapes(model, model_path, ctx.warn)
    model, optimized = passes.optimize(model)
    for rule, why in optimized.get("rule_errors", {}).items():
        ctx.warn(f"graph optimization '{rule}' was switched off for this model: {why}")
    model = _infer_shapes(model, model_path)
    _require_static(model, model_path)
    irm.save(model, ctx.out / "model.onnx")

    shapes = irm.static_shapes(model)
    types = irm.elem_types(model)
    consts = irm.constant_names(model)
    digest = tree_sha256(model_path) if Path(model_path).is_dir() else file_sha256(model_path)
    io = {
        "inputs": [{"name": i.name, "shape": list(shapes[i.name]), "dtype": irm.dtype_name(types[i.name])}
                   for i in model.graph.input if i.name not in consts],
        "outputs": [{"name": o.name, "shape": list(shapes[o.name]), "dtype": irm.dtype_name(types[o.name])}
                    for o in model.graph.output],
        "source": {"path": str(model_path), "name": Path(model_path).stem, "sha256": digest,
                   "format": source["format"], "converter": source.get("converter"), "opset": source["opset"]},
    }
    (ctx.out / "import.json").write_text(json.dumps(io, indent=2) + "\n")
    before, after = sum(optimized["nodes_before"].values()), sum(optimized["nodes_after"].values())
    fired = {k: v for k, v in optimized["rules"].items() if v}
    ctx.log(f"import: {before} nodes -> {after} after optimization ("
            + (", ".join(f"{k} x{v}" for k, v in sorted(fired.items(), key=lambda kv: -kv[1])) or "no rule fired") + ")")
    return {
        "format": source["format"],
        "converter": source.get("converter"),
        "opset": {"source": source["opset"], "canonical": _opset(model)},
        "nodes_source": nodes_source,
        "nodes_before": optimized["nodes_before"],
        "nodes_after": optimized["nodes_after"],
        "rules": optimized["rules"],
        "rounds": optimized.get("rounds"),
        "timings_s": {"convert": round(converted - t0, 3), "optimize": round(time.perf_counter() - converted, 3)},
        "inputs": io["inputs"],
        "outputs": io["outputs"],
    }


def _opset(model: onnx.ModelProto) -> int:
    return max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)


def _canonical_opset(model: onnx.ModelProto, path: Path, ctx) -> onnx.ModelProto:
    """Older graphs are upgraded by ONNX's own version converter, which keeps the function exact."""
    opset = _opset(model)
    if opset >= CANONICAL_OPSET:
        return model
    from onnx import version_converter

    try:
        upgraded = version_converter.convert_version(model, CANONICAL_OPSET)
        onnx.checker.check_model(upgraded)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        ctx.warn(f"{path}: kept at opset {opset}: onnx's version converter could not upgrade it to "
                 f"{CANONICAL_OPSET} ({first})")
        return model
    ctx.log(f"import: opset {opset} -> {CANONICAL_OPSET}")
    return upgraded


def _infer_shapes(model: onnx.ModelProto, path: Path,
                  warn: Callable[[str], None] | None = None) -> onnx.ModelProto:
    """ONNX shape inference in strict mode, from the (fixed) input shapes.

    Shapes an exporter recorded for the dynamic graph (Paddle writes -1 for a dynamic batch) would
    contradict the ones inferred from the fixed inputs: value_info is dropped, and inference starts
    from the inputs alone. Declared output shapes are kept where they agree with the graph (they
    fill dimensions inference leaves open). Some exporters declare an output shape that the graph
    does not compute (a CNN+LSTM recognizer declares [1, seqlen] and computes [T, 1, classes]);
    onnxruntime warns and runs such a model, strict inference refuses it: an output whose declared
    shape contradicts the graph gets the inferred shape instead (`_contradicted_outputs`). Graph
    inputs are not second-guessed: they are what the user feeds, so a contradiction there stays an
    error. `warn` (given on the first call, where the shapes are still the exporter's) gets one line
    per declared output or value_info shape that contradicts the inferred one."""
    declared = {vi.name: _dims(vi) for graph in irm.graphs(model.graph) for vi in graph.value_info}
    for graph in irm.graphs(model.graph):
        del graph.value_info[:]
    for out in model.graph.output:
        for dim in out.type.tensor_type.shape.dim:
            if dim.HasField("dim_value") and dim.dim_value <= 0:
                dim.Clear()
    try:
        inferred = _strict_inference(model)
    except Exception as e:
        contradicted = _contradicted_outputs(model)
        if not contradicted:
            raise _shape_inference_error(e, path) from None
        for out, computed in contradicted:
            if warn:
                warn(f"{path}: output '{out.name}' is declared {_shape(_dims(out))} but the graph computes "
                     f"{_shape(computed)}: the inferred shape replaces the declared one")
            out.type.tensor_type.ClearField("shape")  # the element type stays
        try:
            inferred = _strict_inference(model)
        except Exception as e:
            raise _shape_inference_error(e, path) from None
    if warn:
        computed = {vi.name: _dims(vi) for graph in irm.graphs(inferred.graph)
                    for vi in [*graph.input, *graph.value_info, *graph.output]}
        for name, dims in declared.items():
            if _contradicts(dims, computed.get(name)):
                warn(f"{path}: value_info '{name}' is declared {_shape(dims)} but the graph computes "
                     f"{_shape(computed[name])}: the inferred shape replaces the declared one")
    return inferred


def _strict_inference(model: onnx.ModelProto) -> onnx.ModelProto:
    return irm.infer_shapes(model)


def _contradicted_outputs(model: onnx.ModelProto) -> list[tuple[onnx.ValueInfoProto, list[int | None]]]:
    """The graph outputs whose declared shape contradicts the one the graph computes (found by
    inferring a copy whose outputs declare no shape), each with the computed shape; empty where
    the graph does not infer even then (the failure is elsewhere)."""
    free = onnx.ModelProto()
    free.CopyFrom(model)
    for out in free.graph.output:
        out.type.tensor_type.ClearField("shape")
    try:
        computed = {out.name: _dims(out) for out in _strict_inference(free).graph.output}
    except Exception:
        return []
    return [(out, computed[out.name]) for out in model.graph.output
            if _contradicts(_dims(out), computed.get(out.name))]


def _dims(value: onnx.ValueInfoProto) -> list[int | None] | None:
    """A declared shape: None where the rank is unknown, a None dimension where it is symbolic or
    not positive (-1 is how some exporters write a dynamic dimension)."""
    t = value.type.tensor_type
    if not t.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in t.shape.dim]


def _contradicts(declared: list[int | None] | None, computed: list[int | None] | None) -> bool:
    """A different rank, or a dimension known on both sides that differs. An unknown rank or
    dimension on either side is no contradiction (a symbolic dimension is merely more general)."""
    if declared is None or computed is None:
        return False
    return len(declared) != len(computed) or any(a is not None and b is not None and a != b
                                                 for a, b in zip(declared, computed))


def _shape(dims: list[int | None]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def _shape_inference_error(e: Exception, path: Path) -> UserError:
    first = str(e).splitlines()[0][:300]
    hint = "check --input-shape; run `onnx.checker.check_model` on the file for details"
    if "op_type:If" in first or "op_type:Loop" in first:
        # with static shapes, a branch the given shapes never take can be ill-typed (a batch-size switch)
        hint = ("a branch of an If or Loop does not fit the fixed shapes; if an input selects the branch "
                "(a sample rate, a mode), freeze it with --input-value NAME=VALUE; else " + hint)
    return UserError("import.shape-inference", f"{path}: shape inference failed: {first}", hint)


def _fix_input_shapes(model: onnx.ModelProto, given: dict[str, tuple[int, ...]], batch: int, path: Path,
                      frozen: set[str] = frozenset()) -> None:
    consts = irm.constant_names(model)
    inputs = {i.name: i for i in model.graph.input if i.name not in consts}
    for name in frozen:
        if name not in inputs:
            raise UsageError("import.unknown-input", f"--input-value names '{name}', which is not an input of {path}",
                             f"the model's inputs: {', '.join(inputs)}")
    inputs = {k: v for k, v in inputs.items() if k not in frozen or k in given}
    for name in given:
        if name not in inputs:
            raise UsageError("import.unknown-input", f"--input-shape names '{name}', which is not an input of {path}",
                             f"the model's inputs: {', '.join(inputs)}")
    problems = []
    for name, vi in inputs.items():
        dims = vi.type.tensor_type.shape.dim
        if name in given:
            shape = given[name]
            if len(shape) != len(dims):
                problems.append(f"input '{name}': --input-shape gives rank {len(shape)}, the model has rank {len(dims)}")
                continue
            for d, (dim, v) in enumerate(zip(dims, shape)):
                if dim.HasField("dim_value") and dim.dim_value > 0 and dim.dim_value != v:
                    problems.append(f"input '{name}': dimension {d} is {dim.dim_value} in the model, --input-shape says {v}")
                dim.Clear()
                dim.dim_value = v
            continue
        for d, dim in enumerate(dims):
            if dim.HasField("dim_value") and dim.dim_value > 0:
                if d == 0 and batch != 1 and dim.dim_value != batch:
                    problems.append(f"input '{name}': the batch dimension is fixed at {dim.dim_value} in the model, "
                                    f"--batch says {batch}")
                continue
            if d == 0:
                dim.Clear()
                dim.dim_value = batch
            else:
                problems.append(f"input '{name}': dimension {d} ('{dim.dim_param or '?'}') is dynamic")
    if problems:
        raise UsageError("import.dynamic-shape", f"{path}: {len(problems)} input dimension(s) are dynamic or do not match",
                         "give them with --input-shape NAME=1x3x224x224 (also for inputs whose first dimension "
                         "is not the batch)", notes=problems)


def _freeze_inputs(model: onnx.ModelProto, values: dict[str, tuple[float, ...]], path: Path) -> None:
    """--input-value: the input becomes an initializer, so constant folding can take the branches it selects.

    The shape is the input's declared one (fixed by --input-shape where it was dynamic); a single value
    fills a dynamic-free shape of any size.
    """
    import numpy as np
    from onnx import helper, numpy_helper

    for name, numbers in values.items():
        vi = next(i for i in model.graph.input if i.name == name)
        tt = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tt.shape.dim]
        if None in dims:
            raise UsageError("import.dynamic-shape", f"{path}: input '{name}' frozen by --input-value has a dynamic "
                             "dimension", f"give its shape too: --input-shape {name}=...")
        size = int(np.prod(dims)) if dims else 1
        if len(numbers) not in (1, size):
            raise UsageError("cli.bad-value", f"--input-value {name}: {len(numbers)} value(s) for an input of shape "
                             f"{dims or 'scalar'} ({size} element(s))", "give one value, or one per element")
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        wanted = np.broadcast_to(np.asarray(numbers, np.float64), (size,)).reshape(dims)
        array = wanted.astype(dtype)
        if not np.array_equal(array.astype(np.float64), wanted):
            raise UsageError("cli.bad-value", f"--input-value {name}: the input is {irm.dtype_name(tt.elem_type)}, "
                             f"{', '.join(f'{x:g}' for x in numbers)} does not fit it", "give values of the input's type")
        model.graph.initializer.append(numpy_helper.from_array(array, name))
        model.graph.input.remove(vi)


def _require_static(model: onnx.ModelProto, path: Path) -> None:
    shapes = irm.static_shapes(model)
    missing = [f"node '{irm.node_name(n, i)}' ({n.op_type}): output '{o}' has no static shape"
               for i, n in enumerate(model.graph.node) for o in n.output if o and o not in shapes]
    if missing:
        control = sorted({n.input[0] for n in model.graph.node if n.op_type in ("If", "Loop")
                          and any(o and o not in shapes for o in n.output)})
        hint = "fix the input shapes with --input-shape; data-dependent shapes are not supported"
        if control:
            hint = (f"an If or Loop whose shapes depend on {', '.join(control)}: if that follows from an input "
                    "(a sample rate, a mode, a sequence length), freeze the input with --input-value NAME=VALUE "
                    f"(a Loop is unrolled once its trip count is a constant up to {passes.loops.MAX_TRIP_COUNT} "
                    "and it cannot exit early); else " + hint)
        raise UserError("import.unknown-shape", f"{path}: shapes of {len(missing)} tensor(s) could not be inferred",
                        hint, notes=missing[:20])
