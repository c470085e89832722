"""A plan segment compiled for a bundle: a TVM library for the segment's device, with the tuning
database's records applied, and a twin for the build host when the bundle's library cannot run here."""

from __future__ import annotations

import platform

from ..registry import CompileJob, Compiled
from .compile import compile_onnx
from .targets import missing_host_features, target_arch

# The build host's own CPU, for the twins that produce golden outputs of foreign bundles.
HOST_CODEGEN = {"kind": "llvm"}


def compile_segment(job: CompileJob) -> Compiled:
    seg, codegen = job.segment, job.device.codegen
    sid = seg.id
    job.log(f"package: {sid}: compiling {len(seg.nodes)} nodes with TVM for {describe(codegen)}")
    db = job.tuning_db if (job.tuning_db / "database_workload.json").exists() else None
    res = compile_onnx(job.model, codegen, job.segments_dir / f"{sid}.so", tuning_db=db)
    twin = None
    if needs_twin(codegen):
        job.twin_dir.mkdir(exist_ok=True)
        twin = job.twin_dir / f"{sid}.so"
        compile_onnx(job.model, HOST_CODEGEN, twin)
    return Compiled(f"segments/{sid}.so", res.inputs, res.outputs, twin=twin,
                    tuned={"tasks": res.tasks, "tuned": res.tuned, "default_scheduled": res.default_scheduled})


def describe(codegen: dict) -> str:
    return " ".join(str(codegen.get(k)) for k in ("kind", "mtriple", "mcpu", "arch") if codegen.get(k))


def needs_twin(codegen: dict) -> bool:
    """Code the build host cannot run: another architecture, a GPU, or instructions this host's CPU
    lacks (an x86 target naming an AVX-512 CPU, built on an AVX2-only host)."""
    if codegen.get("kind") != "llvm":
        return True
    return target_arch(codegen) != platform.machine() or bool(missing_host_features(codegen))
