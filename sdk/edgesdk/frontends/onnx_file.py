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
    reject_unproduced_function_outputs(model, path)
    reject_undefined_tensor_types(model, path)
    return model, {"format": "onnx", "converter": None, "opset": opset, "notes": []}


def reject_unproduced_function_outputs(model: onnx.ModelProto, path: Path) -> None:
    """Each output of a model-local function is one of its inputs or computed by its body: onnx.checker
    does not check it, and the graph optimizations (onnx_ir) cannot read a function that breaks it."""
    problems = [f"function {f.domain}::{f.name}: output '{o}' is computed by no node of its body"
                for f in model.functions
                for o in f.output if o not in {*f.input, *(out for n in f.node for out in n.output)}]
    if problems:
        raise UserError("import.invalid-model", f"{path}: not a valid ONNX model: {len(problems)} function output(s) "
                        "are never computed", "the file may be truncated or damaged; re-export it", notes=problems)


def reject_undefined_tensor_types(model: onnx.ModelProto, path: Path) -> None:
    """Every tensor the file holds (initializers, sparse ones, attribute tensors, in subgraphs and
    functions too) has an element type ONNX defines: onnx.checker passes an initializer of type
    2147483647, which the graph optimizations (onnx_ir) cannot read."""
    from onnx.external_data_helper import _get_all_tensors

    sparse = [t for s in model.graph.sparse_initializer for t in (s.values, s.indices)]
    problems = [f"tensor '{t.name}': element type {t.data_type}" for t in [*_get_all_tensors(model), *sparse]
                if t.data_type not in _ELEMENT_TYPES]
    if problems:
        raise UserError("import.invalid-model", f"{path}: not a valid ONNX model: {len(problems)} tensor(s) of an "
                        "element type ONNX does not define", "the file may be truncated or damaged; re-export it",
                        notes=problems[:20])


# what the other kinds of ONNX value are called in a message
_VALUE_KINDS = {"sequence_type": "a sequence", "map_type": "a map", "optional_type": "an optional",
                "sparse_tensor_type": "a sparse tensor", "opaque_type": "an opaque value", None: "of no type"}
_ELEMENT_TYPES = frozenset(onnx.helper.get_all_tensor_dtypes()) - {onnx.TensorProto.UNDEFINED}


def reject_non_tensor_io(model: onnx.ModelProto, path: Path) -> None:
    """One `import.unsupported-type` error naming every graph input and output that is not a tensor of an
    element type ONNX defines: the stages and the bundle's runtime exchange tensors only."""
    problems = []
    for kind, values in (("input", model.graph.input), ("output", model.graph.output)):
        for vi in values:
            which = vi.type.WhichOneof("value")
            if which != "tensor_type":
                problems.append(f"{kind} '{vi.name}' is {_VALUE_KINDS.get(which, which)}")
            elif vi.type.tensor_type.elem_type not in _ELEMENT_TYPES:
                problems.append(f"{kind} '{vi.name}' has element type {vi.type.tensor_type.elem_type}, which ONNX "
                                "does not define")
    if problems:
        raise UserError("import.unsupported-type", f"{path}: {len(problems)} graph input(s) or output(s) are not "
                        "tensors edgesdk can compile", "edgesdk compiles models whose inputs and outputs are tensors; "
                        "export the model with tensor inputs and outputs (the file may also be damaged)",
                        notes=problems)


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
