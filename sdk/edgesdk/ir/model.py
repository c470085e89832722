"""Loading, checking and saving ONNX models; segment extraction; device annotations."""

from __future__ import annotations

import collections
import os
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import UserError

# onnxruntime 1.31 reads IR version <= 13 (DESIGN §7); we write 10, which every backend takes.
IR_VERSION = 10
DEVICE_KEY = "edgesdk.device"
CAPABLE_KEY = "edgesdk.capable"


def infer_shapes(model: onnx.ModelProto, *, strict: bool = True) -> onnx.ModelProto:
    """ONNX shape inference with data propagation (shapes computed from constant shape tensors);
    `strict` raises where a declared shape contradicts the inferred one or an op cannot be inferred."""
    return onnx.shape_inference.infer_shapes(model, strict_mode=strict, data_prop=True)


def load(path: Path, *, check: bool = True) -> onnx.ModelProto:
    """Read an ONNX file (with its external data), or fail with a user error that says why.

    `check=False` leaves `onnx.checker` to the caller (`check_model`), which first wants to report every
    non-standard op at once rather than the checker's first complaint."""
    path = Path(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and friends: the file is not a model
        raise UserError(
            "import.bad-file",
            f"{path} is not a readable ONNX model ({type(e).__name__}: {str(e)[:120] or 'parse failed'})",
            "the file may be truncated or in another format; re-export it with torch.onnx.export or tf2onnx",
        ) from None
    _load_external_data(model, path)
    if not model.graph.node:
        raise UserError("import.empty-graph", f"{path}: the model has no nodes",
                        "the file parsed but holds no graph; it may be truncated or not an ONNX model")
    if check:
        check_model(model, path)
    return model


def check_model(model: onnx.ModelProto, path: Path) -> None:
    """`onnx.checker` (full check: ops known at the model's opsets, types, topological order)."""
    try:
        onnx.checker.check_model(model)
    except Exception as e:
        # the checker's message runs over several lines (the node it is about on the second): one line
        said = " ".join(part.strip() for part in str(e).split("\n") if part.strip()) or type(e).__name__
        raise UserError("import.invalid-model", f"{path}: not a valid ONNX model: {_clipped(said, 300)}",
                        "the file may be truncated or damaged; re-export it") from None


def _clipped(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _load_external_data(model: onnx.ModelProto, path: Path) -> None:
    """Check every external-data reference before reading it, so that a missing or short `.data`
    file is named (with each tensor that needs it) instead of surfacing as onnx's first complaint."""
    from onnx import external_data_helper as ext

    base = Path(os.path.abspath(path.parent))  # as onnx resolves locations: beside the file as named
    tensors = [t for t in ext._get_all_tensors(model) if ext.uses_external_data(t)]
    if not tensors:
        return
    problems = []
    for t in tensors:
        try:
            info = ext.ExternalDataInfo(t)
        except Exception:  # offset/length that are not numbers
            problems.append(f"tensor '{t.name}': its external data reference is malformed")
            continue
        file = Path(os.path.normpath(base / info.location)) if info.location else None
        if file is None or not file.is_relative_to(base):
            problems.append(f"tensor '{t.name}': external data location '{info.location}' is outside {base}")
            continue
        try:
            size = file.stat().st_size if file.is_file() else None
        except OSError as e:  # a location the file system cannot even look up (a name too long)
            problems.append(f"tensor '{t.name}': external data location '{info.location[:80]}' cannot be read "
                            f"({e.strerror or e})")
            continue
        if size is None:
            problems.append(f"tensor '{t.name}': {file} is missing")
        else:
            offset, need = info.offset or 0, info.length or 0
            if offset + need > size:
                problems.append(f"tensor '{t.name}': {file.name} holds {size} bytes, the tensor needs "
                                f"bytes {offset}..{offset + need}")
    if problems:
        raise UserError("import.external-data", f"{path}: {len(problems)} tensor(s) stored as external data cannot be read",
                        "keep the .data file(s) beside the .onnx file, as they were saved", notes=problems)
    try:
        ext.load_external_data_for_model(model, str(base))
    except Exception as e:
        raise UserError("import.external-data", f"{path}: external data could not be read ({type(e).__name__}: {str(e)[:160]})",
                        "keep the .data file(s) beside the .onnx file, as they were saved") from None


def save(model: onnx.ModelProto, path: Path) -> None:
    """Write atomically (temporary file, then rename)."""
    model.ir_version = min(model.ir_version or IR_VERSION, IR_VERSION)
    tmp = Path(f"{path}.tmp{os.getpid()}")
    tmp.write_bytes(model.SerializeToString())
    tmp.replace(path)


def get_meta(node: onnx.NodeProto, key: str) -> str | None:
    for p in node.metadata_props:
        if p.key == key:
            return p.value
    return None


def set_meta(node: onnx.NodeProto, key: str, value: str) -> None:
    for p in node.metadata_props:
        if p.key == key:
            p.value = value
            return
    node.metadata_props.add(key=key, value=value)


def graphs(graph: onnx.GraphProto):
    """`graph` and every graph nested in it (If branches, Loop and Scan bodies), depth first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from graphs(g)


def op_counts(model: onnx.ModelProto) -> dict[str, int]:
    """Nodes by op type, sorted by op type; those in If/Loop/Scan bodies included."""
    return dict(sorted(collections.Counter(n.op_type for g in graphs(model.graph) for n in g.node).items()))


def node_name(node: onnx.NodeProto, index: int) -> str:
    return node.name or f"{node.op_type}_{index}"


def static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Every tensor's static shape that shape inference knows (graph inputs, values, outputs, initializers)."""
    shapes: dict[str, tuple[int, ...]] = {}
    g = model.graph
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        t = vi.type.tensor_type
        if t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
            shapes[vi.name] = tuple(d.dim_value for d in t.shape.dim)
    for init in g.initializer:
        shapes[init.name] = tuple(init.dims)
    return shapes


def elem_types(model: onnx.ModelProto) -> dict[str, int]:
    g = model.graph
    out = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.input) + list(g.value_info) + list(g.output)}
    out.update({i.name: i.data_type for i in g.initializer})
    return out


def dtype_name(elem_type: int) -> str:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name


def constant_names(model: onnx.ModelProto) -> set[str]:
    return {i.name for i in model.graph.initializer}


def param_bytes(model: onnx.ModelProto) -> int:
    return sum(numpy_helper.to_array(i).nbytes for i in model.graph.initializer)


def extract_segment(model: onnx.ModelProto, node_indices: list[int], inputs: list[str], outputs: list[str]) -> onnx.ModelProto:
    """A standalone ONNX model of the given nodes: their initializers, the value infos they use."""
    g = model.graph
    nodes = [g.node[i] for i in node_indices]
    used = {t for n in nodes for t in n.input if t} | set(outputs)
    inits = [i for i in g.initializer if i.name in used and i.name not in inputs]
    vinfo = {vi.name: vi for vi in list(g.input) + list(g.value_info) + list(g.output)}
    graph = helper.make_graph(
        nodes,
        "segment",
        [vinfo[n] for n in inputs],
        [vinfo[n] for n in outputs],
        initializer=inits,
        value_info=[vinfo[n] for n in sorted(used) if n in vinfo and n not in inputs and n not in outputs],
    )
    seg = helper.make_model(graph, opset_imports=list(model.opset_import), producer_name="edgesdk")
    seg.ir_version = IR_VERSION
    return seg
