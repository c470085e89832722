"""import: read the model into the canonical ONNX graph.

Needs: an .onnx file (other formats come with the import issue).
Guarantees: `model.onnx` with every input's shape static (batch fixed to --batch, other dynamic
dimensions from --input-shape), constants folded (onnxscript's optimizer), shapes inferred for
every node, IR version readable by onnxruntime; `import.json` names the inputs and outputs.
Nothing lossy happens here.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import onnx

from ...errors import UsageError, UserError
from ...ir import model as irm
from ...ir.digest import file_sha256

OPTIONS = ("input_shapes", "batch")


def run(model_path: Path, ctx) -> dict:
    model = irm.load(model_path)
    before = collections.Counter(n.op_type for n in model.graph.node)
    _reject_unknown_ops(model, model_path)
    _fix_input_shapes(model, ctx.options.input_shapes, ctx.options.batch, model_path)

    from onnxscript import optimizer

    try:
        model = optimizer.optimize(model)
        model = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    except Exception as e:
        raise UserError("import.shape-inference", f"{model_path}: shape inference failed: {str(e).splitlines()[0][:300]}",
                        "check --input-shape; run `onnx.checker.check_model` on the file for details") from None
    _require_static(model, model_path)

    irm.save(model, ctx.out / "model.onnx")
    shapes = irm.static_shapes(model)
    types = irm.elem_types(model)
    consts = irm.constant_names(model)
    io = {
        "inputs": [{"name": i.name, "shape": list(shapes[i.name]), "dtype": irm.dtype_name(types[i.name])}
                   for i in model.graph.input if i.name not in consts],
        "outputs": [{"name": o.name, "shape": list(shapes[o.name]), "dtype": irm.dtype_name(types[o.name])}
                    for o in model.graph.output],
        "source": {"path": str(model_path), "name": Path(model_path).stem, "sha256": file_sha256(model_path),
                   "format": "onnx", "opset": max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))},
    }
    (ctx.out / "import.json").write_text(json.dumps(io, indent=2) + "\n")
    after = collections.Counter(n.op_type for n in model.graph.node)
    ctx.log(f"import: {sum(before.values())} nodes -> {sum(after.values())} after constant folding")
    return {"nodes_before": dict(sorted(before.items())), "nodes_after": dict(sorted(after.items())),
            "inputs": io["inputs"], "outputs": io["outputs"]}


def _reject_unknown_ops(model: onnx.ModelProto, path: Path) -> None:
    """All ops no ONNX schema knows (custom domains, misspelled types), reported at once."""
    domains = {o.domain: o.version for o in model.opset_import}
    bad = []
    for i, n in enumerate(model.graph.node):
        domain = n.domain or ""
        try:
            onnx.defs.get_schema(n.op_type, domains.get(domain, 1), domain)
        except Exception:
            bad.append(f"node '{irm.node_name(n, i)}' (#{i}): op {domain + '::' if domain else ''}{n.op_type} is not a standard ONNX op")
    if bad:
        raise UserError("import.unsupported-op", f"{path}: {len(bad)} node(s) use ops edgesdk cannot read",
                        "custom ops must be replaced by standard ONNX ops before export", notes=bad)


def _fix_input_shapes(model: onnx.ModelProto, given: dict[str, tuple[int, ...]], batch: int, path: Path) -> None:
    consts = irm.constant_names(model)
    inputs = {i.name: i for i in model.graph.input if i.name not in consts}
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
                continue
            if d == 0:
                dim.Clear()
                dim.dim_value = batch
            else:
                problems.append(f"input '{name}': dimension {d} ('{dim.dim_param or '?'}') is dynamic")
    if problems:
        raise UsageError("import.dynamic-shape", f"{path}: {len(problems)} input dimension(s) are not fixed",
                         "give them with --input-shape NAME=1x3x224x224", notes=problems)


def _require_static(model: onnx.ModelProto, path: Path) -> None:
    shapes = irm.static_shapes(model)
    missing = [f"node '{irm.node_name(n, i)}' ({n.op_type}): output '{o}' has no static shape"
               for i, n in enumerate(model.graph.node) for o in n.output if o and o not in shapes]
    if missing:
        raise UserError("import.unknown-shape", f"{path}: shapes of {len(missing)} tensor(s) could not be inferred",
                        "fix the input shapes with --input-shape; data-dependent shapes are not supported",
                        notes=missing[:20])
