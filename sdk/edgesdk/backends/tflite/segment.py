"""A plan segment for a bundle: the compress stage's full-int8 model, which the CPU interpreter also
runs when the Edge TPU is missing (`edgetpu_compiler`, when installed, compiles it afterwards)."""

from __future__ import annotations

import shutil
from pathlib import Path

from ...runtime.manifest import tensor_from_dict
from ..registry import CompileJob, Compiled


def compile_segment(job: CompileJob) -> Compiled:
    info = job.compressed
    artifact = f"segments/{job.segment.id}.tflite"
    shutil.copyfile(Path(info["dir"]) / info["artifact"], job.segments_dir.parent / artifact)
    return Compiled(artifact, tuple(tensor_from_dict(t) for t in info["inputs"]),
                    tuple(tensor_from_dict(t) for t in info["outputs"]), fallback_artifact=artifact)
