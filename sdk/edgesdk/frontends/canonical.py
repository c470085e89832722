"""The canonical graph an import leaves: opset 17 or newer, every input's shape static, shapes inferred.

Steps of `frontends.import_model` after the model is read: `fix_input_shapes` (--batch, --input-shape),
`freeze_inputs` (--input-value), `canonical_opset`, `infer_shapes` (strict, a declared shape the graph
contradicts replaced with a warning); after the graph optimizations, `require_static`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnx

from ..errors import UsageError, UserError
from ..ir import model as irm

# Every graph leaves import at this opset or newer: the passes and backends see one form of
# Squeeze/Unsqueeze/Split/Softmax (opset 13 moved axes to inputs and changed Softmax's coercion).
# 17 is the newest opset whose ReduceMean still takes `axes` as an attribute, which every backend reads.
CANONICAL_OPSET = 17
# The largest input dimension imported: the manifest's bound (runtime/manifest.py), far past any real
# input. Larger ones overflow onnx's shape arithmetic (a Resize that doubles 2^62 aborts the process).
MAX_DIM = 2**31 - 1


def opset(model: onnx.ModelProto) -> int:
    """The model's standard ONNX opset (0 where it imports none)."""
    return max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)


def canonical_opset(model: onnx.ModelProto, path: Path, *, log: Callable[[str], None],
                    warn: Callable[[str], None]) -> onnx.ModelProto:
    """Older graphs are upgraded by ONNX's own version converter, which keeps the function exact."""
    old = opset(model)
    if old >= CANONICAL_OPSET:
        return model
    from onnx import version_converter

    shell, weights = irm.weightless(model)  # the converter serializes what it is given: not the weights
    try:
        upgraded = version_converter.convert_version(shell, CANONICAL_OPSET)
        onnx.checker.check_model(upgraded)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        warn(f"{path}: kept at opset {old}: onnx's version converter could not upgrade it to "
             f"{CANONICAL_OPSET} ({first})")
        return model
    log(f"import: opset {old} -> {CANONICAL_OPSET}")
    # the upgraded graph, into `model` around its weights (which `shell` held as graph inputs)
    added = {t.name for t in weights} - {i.name for i in model.graph.input}
    graph = model.graph
    for field, _ in graph.ListFields():
        if field.name != "initializer":
            graph.ClearField(field.name)
    irm.copy_fields(upgraded.graph, graph, skip="initializer")
    inputs = [i for i in graph.input if i.name not in added]
    graph.ClearField("input")
    graph.input.extend(inputs)
    for t in [t for t in graph.initializer if not irm.is_weight(t)]:
        graph.initializer.remove(t)
    graph.initializer.extend(upgraded.graph.initializer)
    model.ClearField("opset_import")
    model.opset_import.extend(upgraded.opset_import)
    return model


def infer_shapes(model: onnx.ModelProto, path: Path,
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
    _drop_declared_shapes(model)
    try:
        inferred = _strict_inference(model)
    except Exception as e:
        inferred = _infer_with_outputs_replaced(model, path, e, warn)
    if warn:
        _warn_contradicted_value_info(declared, inferred, path, warn)
    return inferred


def _drop_declared_shapes(model: onnx.ModelProto) -> None:
    """value_info goes, and so do the non-positive dimensions (-1: dynamic) of the declared outputs."""
    for graph in irm.graphs(model.graph):
        del graph.value_info[:]
    for out in model.graph.output:
        for dim in out.type.tensor_type.shape.dim:
            if dim.HasField("dim_value") and dim.dim_value <= 0:
                dim.Clear()


def _infer_with_outputs_replaced(model: onnx.ModelProto, path: Path, error: Exception,
                                 warn: Callable[[str], None] | None) -> onnx.ModelProto:
    """Inference again once the outputs that contradict the graph declare no shape (else `error` is raised)."""
    contradicted = _contradicted_outputs(model)
    if not contradicted:
        raise _shape_inference_error(error, path) from None
    for out, computed in contradicted:
        if warn:
            warn(f"{path}: output '{out.name}' is declared {_shape(_dims(out))} but the graph computes "
                 f"{_shape(computed)}: the inferred shape replaces the declared one")
        out.type.tensor_type.ClearField("shape")  # the element type stays
    try:
        return _strict_inference(model)
    except Exception as e:
        raise _shape_inference_error(e, path) from None


def _warn_contradicted_value_info(declared: dict[str, list[int | None] | None], inferred: onnx.ModelProto,
                                  path: Path, warn: Callable[[str], None]) -> None:
    """One warning per declared value_info shape that contradicts the inferred one."""
    computed = {vi.name: _dims(vi) for graph in irm.graphs(inferred.graph)
                for vi in [*graph.input, *graph.value_info, *graph.output]}
    for name, dims in declared.items():
        if _contradicts(dims, computed.get(name)):
            warn(f"{path}: value_info '{name}' is declared {_shape(dims)} but the graph computes "
                 f"{_shape(computed[name])}: the inferred shape replaces the declared one")


def _strict_inference(model: onnx.ModelProto) -> onnx.ModelProto:
    """Strict ONNX shape inference (with data propagation)."""
    return irm.infer_shapes(model)


def _contradicted_outputs(model: onnx.ModelProto) -> list[tuple[onnx.ValueInfoProto, list[int | None]]]:
    """The graph outputs whose declared shape contradicts the one the graph computes (found by
    inferring a copy whose outputs declare no shape), each with the computed shape; empty where
    the graph does not infer even then (the failure is elsewhere)."""
    free, _ = irm.weightless(model)
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
    """A shape as the warnings write it: [1, ?, 128]."""
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def _shape_inference_error(e: Exception, path: Path) -> UserError:
    """The `import.shape-inference` error for a failed inference, with a hint for If/Loop branches."""
    first = str(e).splitlines()[0][:300]
    hint = "check --input-shape; run `onnx.checker.check_model` on the file for details"
    if "op_type:If" in first or "op_type:Loop" in first:
        # with static shapes, a branch the given shapes never take can be ill-typed (a batch-size switch)
        hint = ("a branch of an If or Loop does not fit the fixed shapes; if an input selects the branch "
                "(a sample rate, a mode), freeze it with --input-value NAME=VALUE; else " + hint)
    return UserError("import.shape-inference", f"{path}: shape inference failed: {first}", hint)


def fix_input_shapes(model: onnx.ModelProto, given: dict[str, tuple[int, ...]], batch: int, path: Path,
                     frozen: set[str] = frozenset()) -> None:
    """Every input's shape static (--input-shape, else --batch) and no dimension past MAX_DIM, or one
    error listing every problem."""
    consts = irm.constant_names(model)
    inputs = {i.name: i for i in model.graph.input if i.name not in consts}
    huge = [f"input '{name}': dimension {d} is {dim.dim_value}" for name, vi in inputs.items()
            for d, dim in enumerate(vi.type.tensor_type.shape.dim) if dim.dim_value > MAX_DIM and name not in given]
    if huge:
        raise UserError("import.huge-shape", f"{path}: {len(huge)} input dimension(s) are larger than {MAX_DIM}",
                        "the file may be damaged; export the model again with its real input sizes", notes=huge)
    _require_known(frozen, inputs, "--input-value", path)
    inputs = {k: v for k, v in inputs.items() if k not in frozen or k in given}
    _require_known(given, inputs, "--input-shape", path)
    problems = []
    for name, vi in inputs.items():
        dims = vi.type.tensor_type.shape.dim
        if name in given:
            problems += _give_shape(name, dims, given[name])
        else:
            problems += _fix_batch(name, dims, batch)
    if problems:
        raise UsageError("import.dynamic-shape", f"{path}: {len(problems)} input dimension(s) are dynamic or do not match",
                         "give them with --input-shape NAME=1x3x224x224 (also for inputs whose first dimension "
                         "is not the batch)", notes=problems)


def _require_known(names, inputs: dict[str, onnx.ValueInfoProto], flag: str, path: Path) -> None:
    """An `import.unknown-input` error for the first of `names` (given by `flag`) that is no input."""
    for name in names:
        if name not in inputs:
            raise UsageError("import.unknown-input", f"{flag} names '{name}', which is not an input of {path}",
                             f"the model's inputs: {', '.join(inputs)}")


def _give_shape(name: str, dims, shape: tuple[int, ...]) -> list[str]:
    """Set an input's dimensions to its --input-shape; the contradictions, one line each."""
    if len(shape) != len(dims):
        return [f"input '{name}': --input-shape gives rank {len(shape)}, the model has rank {len(dims)}"]
    if any(v > MAX_DIM for v in shape):
        return [f"input '{name}': --input-shape gives a dimension larger than {MAX_DIM}"]
    problems = []
    for d, (dim, v) in enumerate(zip(dims, shape)):
        if dim.HasField("dim_value") and dim.dim_value > 0 and dim.dim_value != v:
            problems.append(f"input '{name}': dimension {d} is {dim.dim_value} in the model, --input-shape says {v}")
        dim.Clear()
        dim.dim_value = v
    return problems


def _fix_batch(name: str, dims, batch: int) -> list[str]:
    """A dynamic first dimension becomes `batch`; other dynamic dimensions and a contradicted batch, one line each."""
    problems = []
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
    return problems


def freeze_inputs(model: onnx.ModelProto, values: dict[str, tuple[float, ...]], path: Path) -> None:
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


def require_static(model: onnx.ModelProto, path: Path, *, max_trip_count: int) -> onnx.ModelProto:
    """Shapes inferred again after the optimizations; an error names every tensor without a static one."""
    # max_trip_count: the loop unroller's limit (passes.loops), which the hint states
    model = infer_shapes(model, path)
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
                    f"(a Loop is unrolled once its trip count is a constant up to {max_trip_count} "
                    "and it cannot exit early); else " + hint)
        raise UserError("import.unknown-shape", f"{path}: shapes of {len(missing)} tensor(s) could not be inferred",
                        hint, notes=missing[:20])
    return model
