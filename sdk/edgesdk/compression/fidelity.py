"""How closely a pruned model follows its dense original, and the weight correction that brings it closer.

Fidelity, not accuracy: both models run on the same samples and the pruned one's outputs are compared
with the dense one's (cosine similarity, max error, top-1 agreement); no labels are involved.

Weight correction (optional, post-training): each pruned layer is a linear map y = W x before its bias.
With X the rows of the layer's input as the dense model computes it (im2col rows for a Conv), W_d the
dense weight and S_o the kept entries of output channel o, the corrected row solves

    min over w supported on S_o of  ||X w_d,o - X w||^2 + lambda ||w - w_p,o||^2,

lambda = DAMP * mean(diag(X^T X)), w_p the pruned row: least squares on the surviving weights, damped
toward the pruned row as SparseGPT damps its Hessian, so that a layer with fewer rows than kept
weights (deep layers on few samples) is not fitted to the calibration set exactly.

A `numpy.linalg.lstsq` per output channel takes 50-220 ms a row on a ResNet-18's layers, about 5 minutes
in all on 2 CPU cores. Instead, all rows of a layer are solved at once by conjugate gradients on the normal
equations (M (G + lambda) M) delta = M G (w_d - w_p), G = X^T X, M the mask, with a Jacobi
preconditioner: each step is one matrix product for the whole layer, in float32. CG from delta = 0
lowers the damped objective at every step, hence the residual; it stops after ITERATIONS steps
(ResNet-18, 8 samples, 2:4 on its 19 inner layers: relative residuals 0.36 -> 0.04..0.11, end-to-end
cosine 0.901 -> 0.9996, 3.7 s on 2 CPU cores; further steps gain little). A row whose residual, measured
in float64 on the weights as stored, came out larger keeps its pruned weights. Entries outside the mask
are never touched: zeros stay zero.

Needs: models onnxruntime runs on the CPU; samples as dicts of graph inputs. Guarantees: `fidelity`
changes no model; `correct_weights` returns a copy with only the kept weights of pruned layers changed.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..ir import model as irm
from .prune import Layer, oriented

THREADS = 2
SEED = 0  # the row subsample of each layer
DAMP = 0.01
ITERATIONS = 10  # CG steps per layer (module docstring)
TOLERANCE = 1e-4  # CG stops when every row's preconditioned residual fell by this factor


def compare(dense: np.ndarray, pruned: np.ndarray) -> dict:
    """Cosine similarity, max abs error, that error over max |dense|, and top-1 agreement: the share
    of rows (all axes but the last) whose arg max agrees, for outputs of rank >= 2 with a last axis
    of 2 or more (else None)."""
    d = np.asarray(dense, dtype=np.float64)
    p = np.asarray(pruned, dtype=np.float64)
    if d.shape != p.shape:
        raise ValueError(f"shapes differ: dense {d.shape}, pruned {p.shape}")
    norms = np.linalg.norm(d) * np.linalg.norm(p)
    if np.array_equal(d, p):
        cosine = 1.0
    else:
        cosine = float(np.clip(d.ravel() @ p.ravel() / norms, -1, 1)) if norms > 0 else 0.0
    error = float(np.max(np.abs(d - p))) if d.size else 0.0
    scale = float(np.max(np.abs(d))) if d.size else 0.0
    top1 = None
    if d.ndim >= 2 and d.shape[-1] > 1:
        rows = d.reshape(-1, d.shape[-1]), p.reshape(-1, d.shape[-1])
        top1 = float(np.mean(np.argmax(rows[0], -1) == np.argmax(rows[1], -1)))
    return {"cosine": cosine, "max_abs_error": error, "max_error_of_scale": error / scale if scale else error,
            "top1_agreement": top1}


def run_samples(model: onnx.ModelProto, samples: Sequence[Mapping[str, np.ndarray]],
        tensors: Sequence[str] = ()) -> list[dict[str, np.ndarray]]:
    """Every graph output and each of `tensors` for each sample, by onnxruntime on the CPU."""
    import onnxruntime as ort

    g = model.graph
    inits = {i.name for i in g.initializer}
    inputs = [i.name for i in g.input if i.name not in inits]
    present = set(inputs) | {o.name for o in g.output}
    outputs = [*g.output, *(helper.make_empty_tensor_value_info(t) for t in dict.fromkeys(tensors) if t not in present)]
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = THREADS, 1
    session = irm.onnxruntime_session(model, opts, outputs=outputs)  # the weights handed over, not copied
    names = [o.name for o in session.get_outputs()]
    results = []
    for sample in samples:
        feed = {k: np.asarray(sample[k]) for k in inputs}
        results.append({**feed, **dict(zip(names, session.run(names, feed)))})
    return results


def _joined(runs: list[dict[str, np.ndarray]], name: str) -> np.ndarray:
    return np.concatenate([np.atleast_1d(r[name]) for r in runs])


def fidelity(dense_model: onnx.ModelProto, pruned_model: onnx.ModelProto,
             samples: Sequence[Mapping[str, np.ndarray]], layer_outputs: Sequence[str]) -> dict:
    """`compare` of the pruned model's outputs against the dense model's, over all samples joined along
    the first axis: for each graph output ("end_to_end") and each tensor in `layer_outputs` ("layers")."""
    if not samples:
        raise ValueError("fidelity needs at least one sample")
    dense = run_samples(dense_model, samples, layer_outputs)
    pruned = run_samples(pruned_model, samples, layer_outputs)

    def over(name: str) -> dict:
        return compare(_joined(dense, name), _joined(pruned, name))

    return {"samples": len(samples), "end_to_end": {o.name: over(o.name) for o in dense_model.graph.output},
            "layers": {t: over(t) for t in layer_outputs}}


def _ints(node: onnx.NodeProto, name: str, default: list[int]) -> list[int]:
    return next((list(a.ints) for a in node.attribute if a.name == name), default)


def _im2col(x: np.ndarray, node: onnx.NodeProto, kernel: tuple[int, ...], max_rows: int) -> np.ndarray:
    """Rows (output pixel, channel * kernel position) of a Conv's input `x` (N, C, *spatial), the
    kernel positions in C order as the weight (Co, Ci, *kernel) flattens; at most `max_rows` pixels,
    drawn without replacement by a generator seeded with SEED."""
    k = len(kernel)
    strides, dilations = _ints(node, "strides", [1] * k), _ints(node, "dilations", [1] * k)
    pads = _ints(node, "pads", [0] * 2 * k)
    auto_pad = next((a.s.decode() for a in node.attribute if a.name == "auto_pad"), "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        for i, (size, s, d, w) in enumerate(zip(x.shape[2:], strides, dilations, kernel)):
            total = max(0, (-(-size // s) - 1) * s + (w - 1) * d + 1 - size)
            small, large = total // 2, total - total // 2
            pads[i], pads[i + k] = (small, large) if auto_pad == "SAME_UPPER" else (large, small)
    elif auto_pad == "VALID":
        pads = [0] * 2 * k
    xp = np.pad(x, [(0, 0), (0, 0), *((pads[i], pads[i + k]) for i in range(k))])
    out = [(xp.shape[2 + i] - dilations[i] * (kernel[i] - 1) - 1) // strides[i] + 1 for i in range(k)]
    total = x.shape[0] * int(np.prod(out))
    picked = np.arange(total) if total <= max_rows else np.sort(
        np.random.default_rng(SEED).choice(total, max_rows, replace=False))
    where = np.unravel_index(picked, (x.shape[0], *out))
    offsets = np.indices(kernel).reshape(k, -1)
    coords = [where[1 + i][:, None, None] * strides[i] + offsets[i] * dilations[i] for i in range(k)]
    cols = xp[(where[0][:, None, None], np.arange(x.shape[1])[None, :, None], *coords)]
    return cols.reshape(len(picked), -1)


def _rows(node: onnx.NodeProto, layer: Layer, inputs: list[np.ndarray], max_rows: int) -> np.ndarray:
    """The layer's input as the rows X its weight (out, D) multiplies: y = X W^T."""
    if layer.op == "Conv":
        return _im2col(np.concatenate(inputs), node, layer.shape[2:], max_rows)
    transpose_a = layer.op == "Gemm" and any(a.name == "transA" and a.i for a in node.attribute)
    x = np.concatenate([a.T if transpose_a else a.reshape(-1, a.shape[-1]) for a in inputs])
    if len(x) > max_rows:
        x = x[np.sort(np.random.default_rng(SEED).choice(len(x), max_rows, replace=False))]
    return x


def _fit(x: np.ndarray, removed: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """The change delta (D, out) to the kept weights that best restores X @ removed, the output the pruned
    weights lost: damped least squares, all rows at once by preconditioned CG (the module docstring gives
    the problem), in x's dtype."""
    m = keep.astype(x.dtype)
    gram = x.T @ x if x.shape[0] >= x.shape[1] else None  # else G v = X^T (X v) is cheaper

    def apply_g(v: np.ndarray) -> np.ndarray:
        return gram @ v if gram is not None else x.T @ (x @ v)

    diag = np.einsum("pd,pd->d", x, x)
    damp = DAMP * float(np.mean(diag))
    delta = np.zeros_like(removed)
    if damp == 0:  # the input is all zeros: every weight gives the same output
        return delta
    precondition = (1 / (diag + damp))[:, None]
    r = m * apply_g(removed)
    z = precondition * r
    p, rz = z, np.sum(r * z, axis=0)
    stop = TOLERANCE**2 * rz
    for _ in range(ITERATIONS):
        if np.all(rz <= stop):
            break
        q = m * apply_g(p) + damp * p  # p, like r, is zero outside the mask
        pq = np.sum(p * q, axis=0)
        alpha = np.divide(rz, pq, out=np.zeros_like(rz), where=pq > 0)
        delta += alpha * p
        r -= alpha * q
        z = precondition * r
        rz_next = np.sum(r * z, axis=0)
        p = z + np.divide(rz_next, rz, out=np.zeros_like(rz), where=rz > 0) * p
        rz = rz_next
    return delta


def correct_weights(dense_model: onnx.ModelProto, pruned_model: onnx.ModelProto, layers: Sequence[Layer],
                    masks_or_records: Mapping[str, np.ndarray] | Sequence[Mapping],
                    samples: Sequence[Mapping[str, np.ndarray]],
                    max_rows: int = 4096) -> tuple[onnx.ModelProto, dict]:
    """A copy of `pruned_model` whose pruned layers' kept weights are refitted to the dense layers'
    outputs on `samples`, and per layer {"residual_before", "residual_after", "rows"}.

    `masks_or_records`: layer name -> kept entries (bool, the stored weight's shape), or the records
    of `prune_model`, whose layers keep their nonzero weights. `layers` (from `prunable` on the dense
    model) name each layer's node, weight and input; those with no mask are left alone, as is a weight
    several nodes of the pruned model share (its record says "skipped", residual_after = residual_before).
    Needs: every layer's weight float. Guarantees: residual_after <= residual_before.
    """
    out = onnx.ModelProto()
    out.CopyFrom(pruned_model)
    inits = {i.name: i for i in out.graph.initializer}
    nodes = {n.output[0]: n for n in out.graph.node if n.output}
    dense_weights = {i.name: i for i in dense_model.graph.initializer}
    uses = collections.Counter(name for n in out.graph.node for name in n.input)

    def pruned_weight(layer: Layer) -> onnx.TensorProto:
        return inits[nodes[layer.output].input[1]]

    if isinstance(masks_or_records, Mapping):
        masks = {k: np.asarray(v, dtype=bool) for k, v in masks_or_records.items()}
    else:
        by_name = {x.name: x for x in layers}
        masks = {r["layer"]: irm.array(pruned_weight(by_name[r["layer"]])) != 0
                 for r in masks_or_records if r["layer"] in by_name}
    todo = [x for x in layers if x.name in masks]
    activations = run_samples(dense_model, samples, [x.input for x in todo])
    report: dict[str, dict] = {}
    for layer in todo:
        weight = pruned_weight(layer)
        stored = irm.array(weight)
        view = oriented(stored, layer)
        flat = (view.shape[0], -1)
        dense = oriented(irm.array(dense_weights[layer.weight]), layer).reshape(flat).astype(np.float64)
        pruned = view.reshape(flat).astype(np.float64)
        keep = oriented(masks[layer.name], layer).reshape(flat)
        x = _rows(nodes[layer.output], layer, [a[layer.input] for a in activations], max_rows)
        shared = uses[weight.name] > 1  # one fit cannot serve the inputs of several nodes
        # the fit in float32 (the activations' precision); residuals in float64, of the weights as stored
        fitted = pruned.copy()
        if not shared:
            delta = _fit(x.astype(np.float32), (dense - pruned).T.astype(np.float32), keep.T)
            fitted = (pruned + delta.T).astype(stored.dtype).astype(np.float64)
        lost = x.astype(np.float64) @ np.concatenate([dense - pruned, dense - fitted, dense]).T
        before, after, target = (np.linalg.norm(e, axis=0) for e in np.split(lost, 3, axis=1))
        worse = after > before  # rounding can undo a fit that gained nothing: keep the pruned row
        fitted[worse], after[worse] = pruned[worse], before[worse]
        scale = float(np.linalg.norm(target)) or 1.0
        report[layer.name] = {"residual_before": float(np.linalg.norm(before)) / scale,
                              "residual_after": float(np.linalg.norm(after)) / scale, "rows": len(x)}
        if shared:
            report[layer.name]["skipped"] = f"weight {weight.name} is shared by {uses[weight.name]} nodes"
        else:
            corrected = oriented(fitted.reshape(view.shape).astype(stored.dtype), layer)
            weight.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(corrected), weight.name))
    return out, report


def accuracy(models: Mapping[str, onnx.ModelProto], samples: Sequence[Mapping[str, np.ndarray]],
             labels: np.ndarray) -> dict:
    """Top-1 accuracy of each of `models` (by name) on labelled `samples`: the arg max over the last axis of
    the first graph output, one row per label (all axes but the last joined, over the samples in order).
    Raises ValueError where the rows and the labels do not match."""
    out: dict = {}
    for name, model in models.items():
        output = model.graph.output[0].name
        scores = _joined(run_samples(model, samples), output)
        if scores.ndim < 2 or scores.shape[-1] < 2:
            raise ValueError(f"output '{output}' has shape {list(scores.shape)}: not class scores (rows of 2 or more)")
        rows = scores.reshape(-1, scores.shape[-1])
        if len(rows) != len(labels):
            raise ValueError(f"{len(labels)} labels for {len(rows)} rows of output '{output}' "
                             f"({len(samples)} sample(s) of {len(rows) // max(1, len(samples))} row(s))")
        if labels.min(initial=0) < 0 or labels.max(initial=0) >= rows.shape[1]:
            raise ValueError(f"labels must be classes 0..{rows.shape[1] - 1} of output '{output}'")
        out[name] = round(float(np.mean(np.argmax(rows, -1) == labels)), 6)
    return {"output": models[next(iter(models))].graph.output[0].name, "labels": int(len(labels)), "top1": out}
