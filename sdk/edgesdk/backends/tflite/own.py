"""A quantized TFLite model run as the user gave it: the file the import kept (`frontends.OWN_TFLITE`).

Its int8 arithmetic is LiteRT's on that file: onnxruntime and OpenVINO, running the QDQ graph the import
converted it to, round its requantizations their own way, and on a model whose int8 softmax holds near ties
(random weights, a sharpened head) their classes differ from the model's by up to 255 steps. So the file is
both the accuracy gate's reference (bundling/golden.py) and, where one CPU span holds the whole model, a
candidate of its own (`litert-own`): a bundle that ships it computes exactly what the model computes."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx

from ...ir import model as irm
from ...runtime.manifest import TensorSpec
from ..registry import CompileJob, Compiled


def _signature(path: Path):
    """The signature runner of the TFLite model at `path`, or why there is none (it has not exactly one
    signature); raises where LiteRT cannot open the file."""
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=str(path))
    signatures = interpreter.get_signature_list()
    if len(signatures) != 1:
        return None, f"it has {len(signatures)} signatures, not one"
    return interpreter.get_signature_runner(next(iter(signatures))), None


def outputs(path: Path, samples: list[dict], names: list[str]) -> list[dict] | None:
    """`names`' values of the TFLite model at `path` on each sample, by its one signature; None where it has
    no single signature, or its keys, shapes or types are not the samples' and `names` (an input frozen or
    reshaped at import)."""
    runner, _ = _signature(path)
    if runner is None:
        return None
    inputs, outs = runner.get_input_details(), runner.get_output_details()
    if not set(names) <= set(outs):
        return None
    out = []
    for sample in samples:
        feed = {k: sample.get(k) for k in inputs}
        if any(v is None or np.shape(v) != tuple(inputs[k]["shape"]) or np.asarray(v).dtype != inputs[k]["dtype"]
               for k, v in feed.items()):
            return None
        got = runner(**feed)
        out.append({n: np.array(got[n]) for n in names})
    return out


def mismatch(path: Path, model: onnx.ModelProto) -> str | None:
    """Why the TFLite file at `path` cannot stand for `model` (the whole imported graph): its one signature's
    inputs and outputs must be the graph's, by name, shape and type (the import names the graph's tensors by
    the signature's keys); None where it can."""
    try:
        runner, why = _signature(path)
    except (ValueError, RuntimeError) as e:
        return f"LiteRT cannot open it: {str(e).splitlines()[0][:160]}"
    if runner is None:
        return why
    inits = {i.name for i in model.graph.initializer}
    shapes, types = irm.static_shapes(model), irm.elem_types(model)
    for what, details, values in (("input", runner.get_input_details(), [i for i in model.graph.input if i.name not in inits]),
                                  ("output", runner.get_output_details(), list(model.graph.output))):
        if sorted(details) != sorted(v.name for v in values):
            return f"its {what}s are {sorted(details)}, the graph's {sorted(v.name for v in values)}"
        for v in values:
            shape, dtype = shapes.get(v.name), irm.dtype_name(types[v.name])
            d = details[v.name]
            if shape != tuple(int(x) for x in d["shape"]) or dtype != np.dtype(d["dtype"]).name:
                return (f"its {what} {v.name} is {np.dtype(d['dtype']).name}{[int(x) for x in d['shape']]}, the "
                        f"graph's {dtype}{list(shape) if shape else ' of a dynamic shape'}")
    return None


def lowering_reason(node: onnx.NodeProto, shapes, constants) -> str | None:
    """`litert-own` lowers no node of a cut: it runs the imported file whole, where one span is the whole model."""
    return "litert-own runs the imported TFLite file whole, never a part of it"


def compile_segment(job: CompileJob) -> Compiled:
    """The `litert-own` backend: the imported file itself (`job.source`) as the segment's artifact, where the
    segment is the whole imported graph; its tensors keep the graph's names, layout and types (an int8 input
    goes in as int8), so LiteRT runs exactly the model's arithmetic."""
    if job.source is None:
        raise ValueError("no TFLite file was kept at import to ship as given")
    why = mismatch(job.source, job.model)
    if why is not None:
        raise ValueError(f"the imported TFLite file cannot stand for the segment: {why}")
    artifact = f"segments/{job.segment.id}.tflite"
    job.log(f"package: {job.segment.id}: the imported TFLite file as given ({len(job.segment.nodes)} nodes, LiteRT)")
    shutil.copyfile(job.source, job.segments_dir.parent / artifact)
    inits = {i.name for i in job.model.graph.initializer}
    shapes, types = irm.static_shapes(job.model), irm.elem_types(job.model)

    def spec(name: str) -> TensorSpec:  # static: mismatch() found them the file's
        return TensorSpec(name=name, shape=shapes[name], dtype=irm.dtype_name(types[name]), key=name)

    return Compiled(artifact, tuple(spec(i.name) for i in job.model.graph.input if i.name not in inits),
                    tuple(spec(o.name) for o in job.model.graph.output))


def output_grids(path: Path) -> dict[str, tuple[float, int]]:
    """The (scale, zero point) of each integer output of the TFLite model at `path`'s one signature, by name: what
    its int8 codes stand for (none where it has no one signature)."""
    runner, _ = _signature(path)
    return {} if runner is None else {name: (float(d["quantization"][0]), int(d["quantization"][1]))
            for name, d in runner.get_output_details().items()
            if np.dtype(d["dtype"]).kind in "iu" and d["quantization"][0]}
