"""OpenVINO: a CPU backend the tune stage measures for whole CPU spans beside TVM, onnxruntime and LiteRT.

An x86 team picks OpenVINO's runtime as readily as onnxruntime: its CPU plugin (oneDNN kernels, its own
graph fusions) is often the faster of the two. A segment is read by OpenVINO's ONNX frontend and saved as
OpenVINO IR (`segments/<id>.xml` and its `.bin`), which the runtime's OpenVINO runner compiles for the CPU
it runs on (`runtime/backends/ov_runner.py`). The IR keeps every weight in float32 (OpenVINO's saver
would halve them to float16 by default) and names in its runtime information the precision its runner
asks OpenVINO to compute in (`PRECISION_KEY`): float32 for the `openvino` backend, since OpenVINO's default
on a CPU with AVX512_BF16 or AMX is bfloat16, which changes what the model computes; bfloat16 for the
`openvino-bf16` backend and float16 for `openvino-fp16`, candidates only behind the accuracy gate.

Only OpenVINO's runtime is used (`read_model`, `save_model`): its model converter (`convert_model`,
`ovc`) reports usage over the network, and no build or bundle of edgesdk reaches the network."""

from __future__ import annotations

import tempfile
from pathlib import Path

from ..runtime.backends.ov_runner import PRECISION_KEY  # where the runner reads the precision to compute in

FP32, BF16, FP16 = "f32", "bf16", "f16"


def lowering_reason(node, shapes, consts) -> str | None:
    """OpenVINO's ONNX frontend reads the standard ops; a segment it still cannot read (an op or attribute
    it lacks) fails to compile, and the tune stage skips the candidate with OpenVINO's own message."""
    return None if not node.domain or node.domain == "ai.onnx" else f"OpenVINO has no kernel for domain {node.domain}"


def compile_segment(job):
    """A plan segment for a bundle (`registry.CompileJob`): its ONNX graph as OpenVINO IR, computed in float32."""
    return _compile(job, FP32)


def compile_bf16_segment(job):
    """The `openvino-bf16` backend: the same IR, computed in bfloat16 where the CPU has AVX512_BF16 or AMX (the
    tune stage offers it only for such a target CPU, and admits it only behind the accuracy gate)."""
    return _compile(job, BF16)


def compile_fp16_segment(job):
    """The `openvino-fp16` backend: the same IR, computed in float16 where the CPU has AVX512-FP16 (offered only
    for such a target CPU, admitted only behind the accuracy gate)."""
    return _compile(job, FP16)


def _compile(job, precision: str):
    import openvino as ov

    from ..ir import model as irm
    from .onnxruntime import float_specs
    from .registry import Compiled

    artifact = f"segments/{job.segment.id}.xml"
    dest = job.segments_dir.parent / artifact
    with tempfile.TemporaryDirectory(prefix="edgesdk-openvino-") as tmp:
        src = Path(tmp) / "segment.onnx"
        irm.save(job.model, src)  # a large segment's weights stay in its .data, which the frontend maps
        try:
            model = ov.Core().read_model(str(src))
        except RuntimeError as e:
            raise ValueError(f"OpenVINO cannot read segment {job.segment.id}: {_said(e)}") from None
        model.set_rt_info(precision, list(PRECISION_KEY))
        _name_in_order(model)
        ov.save_model(model, str(dest), compress_to_fp16=False)
    return Compiled(artifact, *float_specs(job))


def _name_in_order(model) -> None:
    """Each op the frontend left unnamed named by its place in the graph: OpenVINO numbers unnamed ops from a
    counter of the whole process (`Constant_2` in one build, `Constant_3145` in a build that read other models
    first), and the IR would differ from build to build."""
    for k, op in enumerate(model.get_ordered_ops()):
        if op.get_friendly_name() == op.get_name():
            op.set_friendly_name(f"{op.get_type_name()}_{k}")


def _said(e: Exception) -> str:
    """What OpenVINO's frontend said, without the source locations it starts with: the summary that names
    the ops it could not convert, where it gives one."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if "Summary:" in lines:
        lines = lines[lines.index("Summary:") + 1:]
    lines = [line.lstrip("- ") for line in lines if not line.startswith(("Exception from", "Check "))]
    return "; ".join(lines)[:300] or type(e).__name__
