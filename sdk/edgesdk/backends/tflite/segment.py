"""The TFLite backend's entry points in the registry: a plan segment quantized to a full-int8 model
(the compress stage), and that model put into a bundle, which the CPU interpreter also runs when the
Edge TPU is missing (`edgetpu_compiler`, when installed, finishes it afterwards)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np

from ...ir.numeric import compare
from ...runtime.manifest import Segment, tensor_from_dict
from ..registry import CompileJob, Compiled, QuantizeJob
from .convert import convert_float, convert_int8

ACCURACY_SAMPLES = 8  # calibration samples the int8 segment is compared to the float one on


def quantize_segment(job: QuantizeJob, *, cpu: bool = False) -> dict:
    """The segment as a full-int8 TFLite model (or, with the job's `target` or `keep_float`, int8 with
    some ops kept float: mixed.py), and its accuracy against the float segment on the calibration
    samples: the compress stage's record of it. `cpu`: for LiteRT on the CPU (`litert-int8`), which
    also lowers the ops the Edge TPU lacks."""
    from ...runtime.backends import tflite_runner

    seg = job.segment
    artifact = f"segments/{seg.id}.tflite"
    stage = "compress" if job.target is None else "tune"  # the tune stage's int8 CPU candidates give a target
    mixes = job.target is not None or job.keep_float is not None
    job.log(f"{stage}: {seg.id}: {len(seg.nodes)} nodes -> " + ("int8 TFLite, mixed precision where the target needs it"
                                                                 if mixes else "full-int8 TFLite"))
    feeds = [{k: s[k] for k in seg.inputs} for s in job.samples]
    reference = [{k: s[k] for k in seg.outputs} for s in job.samples]
    result = convert_int8(job.model, feeds, job.out_dir.parent / artifact, method=job.method, percentile=job.percentile,
                          target=job.target, keep_float=job.keep_float, reference=reference,
                          log=lambda line: job.log(f"{stage}: {seg.id}: {line}"), cpu=cpu,
                          alternatives_dir=job.out_dir if job.alternatives else None,
                          activations=dict(job.activations), model_inputs=tuple(job.model_inputs),
                          grids=dict(job.grids))
    want = job.samples[:ACCURACY_SAMPLES]

    measured: dict[str, dict] = {}

    def accuracy(artifact: str, result) -> dict:
        if artifact in measured:  # candidates of the same ranges share one file
            return measured[artifact]
        runner = tflite_runner.open_runner(job.out_dir.parent, Segment(
            id=seg.id, device="cpu", backend="tflite", artifact=artifact, fallback_artifact=artifact,
            inputs=result.inputs, outputs=result.outputs), None)
        got = [runner.run(f) for f in feeds[:ACCURACY_SAMPLES]]
        measured[artifact] = {o: compare(np.stack([g[o] for g in got]), np.stack([w[o] for w in want]))
                              for o in seg.outputs}
        return measured[artifact]

    alternatives = {label: {"artifact": f"segments/{path.name}", "inputs": [_spec(t) for t in r.inputs],
                            "outputs": [_spec(t) for t in r.outputs], "accuracy_vs_float": accuracy(f"segments/{path.name}", r)}
                    for label, (path, r) in result.alternatives.items()}
    return {"artifact": artifact,
            "inputs": [_spec(t) for t in result.inputs], "outputs": [_spec(t) for t in result.outputs],
            "tflite_ops": result.op_counts, "ranges": result.ranges,
            "layouts": {name: list(p) for name, p in result.layouts.items()},
            **({"mixed": result.mixed.record()} if result.mixed is not None else {}),
            **({"alternatives": alternatives} if alternatives else {}),
            "accuracy_vs_float": accuracy(artifact, result)}


def quantize_cpu_segment(job: QuantizeJob) -> dict:
    """The `litert-int8` backend's quantizer: `quantize_segment` with the CPU's lowerings."""
    return quantize_segment(job, cpu=True)


def compile_float_segment(job: CompileJob) -> Compiled:
    """The `litert` backend: the segment as an fp32 TFLite model (our NHWC lowering), which LiteRT runs
    on the CPU with its XNNPACK kernels."""
    artifact = f"segments/{job.segment.id}.tflite"
    job.log(f"package: {job.segment.id}: converting {len(job.segment.nodes)} nodes to an fp32 TFLite model (LiteRT)")
    result = convert_float(job.model, job.segments_dir.parent / artifact, cpu=True)
    return Compiled(artifact, result.inputs, result.outputs)


def _spec(t) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(t)))


def compile_segment(job: CompileJob) -> Compiled:
    """An Edge TPU segment: the compress stage's full-int8 model, which the CPU interpreter also runs
    when the TPU is missing (`fallback_artifact`)."""
    compiled = compile_int8_segment(job)
    return dataclasses.replace(compiled, fallback_artifact=compiled.artifact)


def compile_int8_segment(job: CompileJob) -> Compiled:
    """The `litert-int8` backend: the compress stage's full-int8 model, run on the CPU by LiteRT's
    int8 kernels (XNNPACK)."""
    info = job.compressed
    artifact = f"segments/{job.segment.id}.tflite"
    shutil.copyfile(Path(info["dir"]) / info["artifact"], job.segments_dir.parent / artifact)
    return Compiled(artifact, tuple(tensor_from_dict(t) for t in info["inputs"]),
                    tuple(tensor_from_dict(t) for t in info["outputs"]))
