"""Every ONNX tensor a converted int8 TFLite segment computes, as its int8 kernels compute it: the
int8 side of the culprit search (compression/culprits.py), which compares each with the float segment.

The trace names the TF ops of each ONNX node in a scope of its own (`trace.node_scope`), and the
converter names a TFLite tensor after the TF ops fused into it, so a tensor names the nodes it
computes. The tensor of node k is the last one made by an op whose tensor names node k as its latest
node: a fused Conv+Relu's output stands for the Relu (its value), a transpose the Conv's lowering put
before the convolution stands for nothing (an op of node k came after it). The segment's outputs are
the signature's. An ONNX tensor the converter folded into another op's (a Conv's output fused into its
Relu) has no int8 tensor of its own and is left out.

The interpreter keeps every tensor (`experimental_preserve_all_tensors`) and runs LiteRT's builtin
kernels without a delegate, so that each intermediate tensor holds its value after the run.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from .int8_ops import SHARED_QUANTIZATION_OPS
from .trace import NODE_SCOPE, _lower, _static_shapes


def int8_layers(job) -> dict[str, dict]:
    """For a `registry.LayersJob`: per ONNX tensor of the segment that has an int8 tensor of its own (the
    segment's inputs too, as int8 takes them), `{"node": index of its node in the segment (None for an input), "op": the TFLite op that computes it, "values": per feed
    its values dequantized, in ONNX layout, "representable": [lo, hi] int8 represents, or None for a float
    tensor, "step": its scale or None, "at_limits": per feed the share of its int8 values at -128 or 127,
    "shared": the TFLite ops next to it whose activation inputs and outputs all have its quantization}`."""
    return _layers(job, cpu=False)


def int8_cpu_layers(job) -> dict[str, dict]:
    """`int8_layers` for LiteRT's int8 segments on the CPU (`litert-int8`: the CPU's lowerings too)."""
    return _layers(job, cpu=True)


def _layers(job, *, cpu: bool) -> dict[str, dict]:
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    from ...runtime.backends.tflite_runner import dequantized, quantized

    model = job.model
    layouts = {name: tuple(p) for name, p in job.record.get("layouts", {}).items()}
    if not layouts:  # a record from before the quantizer kept them: the trace says them again
        lowered = _lower(model, cpu=cpu)
        layouts = dict(lowered.layouts)
        lowered.release()
    with warnings.catch_warnings():  # LiteRT warns that keeping every tensor is for debugging: it is
        warnings.simplefilter("ignore")
        interpreter = Interpreter(model_path=str(job.artifact), experimental_preserve_all_tensors=True,
                                  experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
    interpreter.allocate_tensors()
    details = {d["index"]: d for d in interpreter.get_tensor_details()}
    ops = interpreter._get_ops_details()  # pylint: disable=protected-access
    runner = interpreter.get_signature_runner()
    ins, outs = runner.get_input_details(), runner.get_output_details()
    specs = {t["key"]: t for t in (*job.record["inputs"], *job.record["outputs"])}

    found = tensors_of_nodes(model, ops, details)
    found.update({specs[key]["name"]: (int(d["index"]), _producer(ops, int(d["index"]))) for key, d in outs.items()})
    found.update({specs[key]["name"]: (int(d["index"]), "") for key, d in ins.items()})
    layouts.update({t["name"]: tuple(t["perm"]) if t.get("perm") else tuple(range(len(t["shape"])))
                    for t in job.record["inputs"]})
    shapes = _static_shapes(model)
    kept: dict[str, tuple[int, str]] = {}
    for name, (index, op) in found.items():
        perm = layouts.get(name)
        shape = tuple(details[index]["shape"])
        if perm is not None and tuple(shape[i] for i in perm) == shapes.get(name, ()):
            kept[name] = (index, op)
    node_of = {o: k for k, n in enumerate(model.graph.node) for o in n.output}

    out = {name: {"node": node_of.get(name), "op": op, "values": [], "at_limits": [],
                  **_quantization(details[index]), "shared": _shared(ops, details, index)}
           for name, (index, op) in kept.items()}
    for feed in job.feeds:
        runner(**{spec["key"]: quantized(ins[spec["key"]], np.transpose(np.asarray(feed[spec["name"]], np.float32),
                                                                         np.argsort(spec["perm"]))
                                         if spec.get("perm") else np.asarray(feed[spec["name"]], np.float32))
                  for spec in job.record["inputs"]})
        for name, (index, _) in kept.items():
            raw = interpreter.get_tensor(index)
            value = dequantized(details[index], raw)
            out[name]["values"].append(np.transpose(value, layouts[name]))
            if np.dtype(details[index]["dtype"]).kind in "iu":
                info = np.iinfo(details[index]["dtype"])
                out[name]["at_limits"].append(float(np.mean((raw == info.min) | (raw == info.max))))
            else:
                out[name]["at_limits"].append(0.0)
    return out


def tensors_of_nodes(model, ops: list[dict], details: dict[int, dict]) -> dict[str, tuple[int, str]]:
    """Per ONNX tensor, the TFLite tensor that holds it and the op that computes it (module docstring)."""
    last: dict[int, dict] = {}  # node index -> the last op whose outputs name it as their latest node
    for op in ops:
        if op["op_name"] == "DELEGATE":
            continue
        nodes = [int(k) for i in op["outputs"] for k in NODE_SCOPE.findall(details[int(i)]["name"])]
        if nodes:
            last[max(nodes)] = op
    found = {}
    for k, op in last.items():
        node = model.graph.node[k] if k < len(model.graph.node) else None
        if node is None:
            continue
        names = [o for o in node.output if o]
        outputs = [int(i) for i in op["outputs"]]
        if len(outputs) == len(names):
            found.update({n: (i, op["op_name"]) for n, i in zip(names, outputs)})
    return found


def _producer(ops: list[dict], index: int) -> str:
    return next((op["op_name"] for op in ops if index in [int(i) for i in op["outputs"]]), "")


def _quantization(detail: dict) -> dict[str, Any]:
    dtype = np.dtype(detail["dtype"])
    scale, zero = detail["quantization"]
    if dtype.kind not in "iu" or not scale:
        return {"representable": None, "step": None}
    info = np.iinfo(dtype)
    return {"representable": [float((info.min - zero) * scale), float((info.max - zero) * scale)], "step": float(scale)}


def _shared(ops: list[dict], details: dict[int, dict], index: int) -> list[str]:
    """The ops that take or give tensor `index` and whose activations (the tensors an op or the caller
    writes; weights and constants aside) all have its scale and zero point because the converter makes
    them share one (SHARED_QUANTIZATION_OPS, measured): int8 kernels that move values without
    requantizing them."""
    mine = details[index]["quantization"]
    if not mine[0]:
        return []
    written = {int(i) for op in ops for i in op["outputs"]}
    out = []
    for op in ops:
        if op["op_name"] not in SHARED_QUANTIZATION_OPS:
            continue
        outputs = [int(i) for i in op["outputs"]]
        activations = [int(i) for i in op["inputs"] if int(i) >= 0 and (int(i) in written or _is_input(details[int(i)]))] + outputs
        if index in activations and len(activations) > 1 and all(
                details[i]["quantization"] == mine for i in activations):
            out.append(op["op_name"])
    return sorted(set(out))


def _is_input(detail: dict) -> bool:
    """A signature input (the converter names it `serving_default_<key>:0`)."""
    return str(detail["name"]).startswith("serving_default_")
