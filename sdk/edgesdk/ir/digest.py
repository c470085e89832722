"""Content digests for files, directories and JSON-able values (the stage cache keys)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_sha256(root: Path, exclude: tuple[str, ...] = ()) -> str:
    """Digest of every file under `root` (relative path and content), in sorted order; `exclude` names
    files (paths relative to `root`) left out."""
    h = hashlib.sha256()
    for p in sorted(q for q in Path(root).rglob("*") if q.is_file() and q.relative_to(root).as_posix() not in exclude):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(file_sha256(p).encode())
    return h.hexdigest()


def value_sha256(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def graph_structure_sha256(model) -> str:
    """A digest of what an ONNX graph computes, whatever its tensors are named: two graphs get the same
    digest when their nodes (in order: op, domain, attributes) read the same things — the k-th graph
    input, the j-th output of an earlier node, or an initializer of the same type, shape and bytes —
    and their outputs are the same node outputs in the same order, with the same input and output types
    and shapes. Node names and metadata do not count. (The schedule stage finds segments that can share
    one compiled artifact with it: a captioner's per-frame CNN.)"""
    import onnx

    from . import model as irm

    g = model.graph
    h = hashlib.sha256()
    inits = {i.name: i for i in g.initializer}
    ref: dict[str, str] = {}
    for k, i in enumerate(x for x in g.input if x.name not in inits):
        ref[i.name] = f"in{k}"
        h.update(b"I" + i.type.SerializeToString(deterministic=True))
    for name, init in inits.items():
        content = onnx.TensorProto()
        content.CopyFrom(irm.inline(init))  # a mapped weight: its bytes, not where they are
        content.name = ""
        ref[name] = "w" + hashlib.sha256(content.SerializeToString(deterministic=True)).hexdigest()
    for n_i, node in enumerate(g.node):
        attrs = sorted((a.name, a.SerializeToString(deterministic=True)) for a in node.attribute)
        h.update(json.dumps([node.op_type, node.domain, [ref.get(t, "?" + t) if t else "" for t in node.input],
                             [a[0] for a in attrs]]).encode())
        for _, blob in attrs:
            h.update(blob)
        for j, t in enumerate(node.output):
            if t:
                ref[t] = f"n{n_i}.{j}"
    for o in g.output:
        h.update(b"O" + ref.get(o.name, "?" + o.name).encode() + o.type.SerializeToString(deterministic=True))
    return h.hexdigest()
