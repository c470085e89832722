"""Weight pruning: zero a share of a layer's weights by a fixed pattern, in an ONNX model.

Methods (`parse_method` reads their spelling):
- `N:M` (1 <= N < M <= 16): for each output channel and kernel position, the input channels fall in
  consecutive groups of M and each group keeps its N largest |w|: the 2:4 pattern that sparse tensor
  cores run. A last partial group of r < M channels keeps min(N, r).
- `magnitude:S` (0 < S < 1, or a percent): per layer, the round((1 - S) * size) largest |w| stay
  (Python's round, half to even; at least one): unstructured, the finest choice and the hardest to
  run fast.
- `column-combine[:G]` (2 <= G <= 16, default 4): Kung et al., "Packing sparse convolutional neural
  networks for efficient systolic array implementations: column combining" (ASPLOS 2019). Input
  channels fall in consecutive groups of G; for each output channel and group, the channel whose whole
  kernel has the largest L2 norm stays, so G filter columns combine into one dense column.

Ties go to the lower index, so a mask is a function of the weight values alone.

Weight layouts: a Conv weight is (Co, Ci, *kernel); a Gemm/MatMul weight is seen as (out, in), the
stored (in, out) transposed where the op reads it that way. Input channels are axis 1 of that view.

Needs: a valid ONNX model whose prunable weights are initializers. Guarantees: a copy with the same
graph inputs, outputs and ops, each selected layer's weight multiplied by its mask, and one record
per pruned layer; the input model is never modified.
"""

from __future__ import annotations

import collections
import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import UsageError
from ..ir import model as irm
from ..ir.model import graphs, infer_shapes, static_shapes

MAX_GROUP = 16
DEFAULT_COLUMN_GROUP = 4
METHOD_HINT = "one of 2:4, 1:4, magnitude:0.75, column-combine[:G]"

_N_OF_M = re.compile(r"(\d+):(\d+)")
_MAGNITUDE = re.compile(r"magnitude:((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)(%?)")
_COLUMN_COMBINE = re.compile(r"column-combine(?::(\d+))?")


@dataclass(frozen=True)
class PruneMethod:
    """A pruning pattern: `n` of every `m` ("n:m"), a share `sparsity` ("magnitude"), or one input
    channel of every `group` ("column-combine")."""

    kind: Literal["n:m", "magnitude", "column-combine"]
    n: int = 0
    m: int = 0
    sparsity: float = 0.0
    group: int = 0

    @property
    def text(self) -> str:
        """The canonical spelling, which `parse_method` reads back to an equal method."""
        if self.kind == "n:m":
            return f"{self.n}:{self.m}"
        if self.kind == "magnitude":
            return f"magnitude:{float(self.sparsity)!r}"
        return f"column-combine:{self.group}"

    @property
    def expected_sparsity(self) -> float:
        """The share of zeros where every group is whole (a partial last group keeps more)."""
        if self.kind == "n:m":
            return 1 - self.n / self.m
        if self.kind == "magnitude":
            return self.sparsity
        return 1 - 1 / self.group


def parse_method(text: str) -> PruneMethod:
    """`2:4`, `N:M`, `magnitude:0.75` (or `magnitude:75%`), `column-combine`, `column-combine:G`."""
    spec = text.strip()

    def bad(what: str) -> UsageError:
        return UsageError("prune.bad-method", f"prune method '{text}' {what}", hint=METHOD_HINT)

    if match := _N_OF_M.fullmatch(spec):
        n, m = int(match[1]), int(match[2])
        if not 1 <= n < m <= MAX_GROUP:
            raise bad(f"keeps {n} of every {m}: n:m needs 1 <= n < m <= {MAX_GROUP}")
        return PruneMethod("n:m", n=n, m=m)
    if match := _MAGNITUDE.fullmatch(spec):
        sparsity = float(match[1]) / (100 if match[2] else 1)
        if not 0 < sparsity < 1:
            raise bad(f"asks for sparsity {sparsity:g}: it must lie strictly between 0 and 1 (0% and 100%)")
        return PruneMethod("magnitude", sparsity=sparsity)
    if match := _COLUMN_COMBINE.fullmatch(spec):
        group = int(match[1]) if match[1] else DEFAULT_COLUMN_GROUP
        if not 2 <= group <= MAX_GROUP:
            raise bad(f"combines groups of {group} channels: the group must be 2 to {MAX_GROUP}")
        return PruneMethod("column-combine", group=group)
    raise bad("is not a prune method")


def _top_in_groups(scores: np.ndarray, n: int, m: int) -> np.ndarray:
    """True at the `n` largest scores of each consecutive group of `m` along the last axis (ties to
    the lower index); a last partial group of r keeps min(n, r). Scores are >= 0."""
    c = scores.shape[-1]
    groups = -(-c // m)
    # pad with -1, below every score, so padding is only ever picked after a partial group's own entries
    padded = np.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(0, groups * m - c)], constant_values=-1.0)
    padded = padded.reshape(*scores.shape[:-1], groups, m)
    order = np.argsort(-padded, axis=-1, kind="stable")
    keep = np.zeros(padded.shape, dtype=bool)
    np.put_along_axis(keep, order[..., :n], True, axis=-1)
    return keep.reshape(*scores.shape[:-1], groups * m)[..., :c]


def mask(weight: np.ndarray, method: PruneMethod) -> np.ndarray:
    """The kept entries (True) of a weight seen as (out, in, *kernel), by `method`; same shape."""
    w = np.abs(np.asarray(weight, dtype=np.float64))
    if w.ndim < 2:
        raise ValueError(f"a weight to prune has rank 2 or more, not {w.ndim}")
    if method.kind == "magnitude":
        keep = max(1, round((1 - method.sparsity) * w.size))
        flat = np.zeros(w.size, dtype=bool)
        flat[np.argsort(-w.ravel(), kind="stable")[:keep]] = True
        return flat.reshape(w.shape)
    if method.kind == "n:m":
        return np.moveaxis(_top_in_groups(np.moveaxis(w, 1, -1), method.n, method.m), -1, 1)
    # column-combine: one input channel per group, judged by its whole kernel's L2 norm
    norms = np.sqrt(np.sum(w.reshape(*w.shape[:2], -1) ** 2, axis=-1))
    keep = _top_in_groups(norms, 1, method.group)
    return np.broadcast_to(keep.reshape(*keep.shape, *[1] * (w.ndim - 2)), w.shape).copy()


@dataclass(frozen=True)
class Layer:
    """A Conv (group 1), Gemm or MatMul whose weight is an initializer: what pruning may touch."""

    name: str  # the node's name, or its first output's name where the node has none
    op: str
    weight: str  # the weight initializer
    shape: tuple[int, ...]  # as stored
    macs: int | None  # multiply-accumulates per run; None where the output shape is not static
    input: str  # the activation the weight multiplies
    output: str
    transposed: bool = False  # stored (in, out): MatMul, Gemm with transB=0


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def prunable(model: onnx.ModelProto) -> list[Layer]:
    """Every prunable layer of the main graph, in graph order."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    try:
        shapes = static_shapes(infer_shapes(model, strict=False))
    except (onnx.shape_inference.InferenceError, ValueError):  # MACs only inform: such a model still prunes
        shapes = {}
    layers = []
    for node in g.node:
        if node.domain not in ("", "ai.onnx") or len(node.input) < 2 or node.input[1] not in inits:
            continue
        dims = tuple(inits[node.input[1]].dims)
        if node.op_type == "Conv" and _attr(node, "group", 1) == 1 and len(dims) >= 3:
            transposed, out_channels = False, dims[0]
        elif node.op_type in ("Gemm", "MatMul") and len(dims) == 2:
            transposed = node.op_type == "MatMul" or not _attr(node, "transB", 0)
            out_channels = dims[1] if transposed else dims[0]
        else:
            continue
        out_shape = shapes.get(node.output[0])
        macs = int(np.prod(dims)) * int(np.prod(out_shape)) // out_channels if out_shape else None
        layers.append(Layer(node.name or node.output[0], node.op_type, node.input[1], dims, macs,
                            node.input[0], node.output[0], transposed))
    return layers


def select_layers(layers: list[Layer], spec: str | None) -> list[Layer]:
    """`None`: all but the first and the last (they stay dense: the first sees raw input with few
    channels, the last decides the answer). Else comma-separated names, fnmatch globs, or `all`."""
    if spec is None:
        return layers[1:-1]
    entries = [e.strip() for e in spec.split(",") if e.strip()]
    unknown = [e for e in entries if e != "all" and not any(fnmatch.fnmatchcase(x.name, e) for x in layers)]
    if unknown:
        names = [x.name for x in layers]
        more = f" (and {len(names) - 10} more)" if len(names) > 10 else ""
        hint = (f"prunable layers: {', '.join(names[:10])}{more}" if names else
                "the model has no prunable layer (Conv with group 1, Gemm or MatMul with a 2-D weight initializer)")
        quoted = ", ".join(f"'{e}'" for e in unknown)
        raise UsageError("prune.unknown-layer", f"no prunable layer matches {quoted}", hint=hint)
    return [x for x in layers if any(e == "all" or fnmatch.fnmatchcase(x.name, e) for e in entries)]


def oriented(weight: np.ndarray, layer: Layer) -> np.ndarray:
    """The weight seen as (out, in, *kernel); the same call turns such a view back to the stored layout."""
    return weight.T if layer.transposed else weight


def prune_model(model: onnx.ModelProto, method: PruneMethod | Mapping[str, PruneMethod],
                layers: list[Layer]) -> tuple[onnx.ModelProto, list[dict]]:
    """A copy of `model` with each layer's weight multiplied by its mask, and a record per layer.
    `method`: one for every layer, or each layer's by its name (a per-layer plan, `plan.py`).

    A weight is pruned in place where the selected layers are its only users and want the same mask;
    otherwise each selected layer gets its own pruned copy, `<weight>__pruned` (numbered if taken),
    so that other users keep the dense weight; a dense weight left with no user is dropped.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    inits = {i.name: i for i in g.initializer}
    nodes = {n.output[0]: n for n in g.node if n.output}
    uses = collections.Counter(name for sub in graphs(g) for n in sub.node for name in n.input)
    uses.update(v.name for v in (*g.input, *g.output))
    taken = set(inits) | set(uses) | {o for sub in graphs(g) for n in sub.node for o in n.output}

    methods = method if isinstance(method, Mapping) else {x.name: method for x in layers}
    by_weight: dict[str, list[tuple[Layer, np.ndarray]]] = collections.defaultdict(list)
    for layer in layers:
        dense = irm.array(inits[layer.weight])
        by_weight[layer.weight].append((layer, oriented(mask(oriented(dense, layer), methods[layer.name]), layer)))

    records = []
    for name, group in by_weight.items():
        dense = irm.array(inits[name])
        in_place = uses[name] == len(group) and all(np.array_equal(k, group[0][1]) for _, k in group)
        for layer, keep in group:
            pruned = np.where(keep, dense, np.zeros((), dense.dtype))
            target = name
            if in_place:
                inits[name].CopyFrom(numpy_helper.from_array(pruned, name))
            else:
                target, suffix = f"{name}__pruned", 2
                while target in taken:
                    target, suffix = f"{name}__pruned_{suffix}", suffix + 1
                taken.add(target)
                uses[name] -= 1
                g.initializer.append(numpy_helper.from_array(pruned, target))
                nodes[layer.output].input[1] = target
            records.append({"layer": layer.name, "op": layer.op, "weight": target, "shape": list(dense.shape),
                            "method": methods[layer.name].text, "sparsity": round(float(np.mean(pruned == 0)), 6),
                            "kept": int(keep.sum()), "size": int(keep.size)})
        if not in_place and uses[name] == 0:
            g.initializer.remove(inits[name])
    order = {x.name: i for i, x in enumerate(layers)}
    return out, sorted(records, key=lambda r: order[r["layer"]])
