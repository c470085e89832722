"""The TVM backend's entry points in the registry: a plan segment compiled for a bundle (a TVM library
for the segment's device, with the tuning database's records applied, and a twin for the build host
when the bundle's library cannot run here), and the segments of one device kind tuned."""

from __future__ import annotations

import functools
import platform

from ...ir.memory import shown
from ..registry import KERNEL_TIMES, CompileJob, Compiled, TuneJob
from .compile import compile_onnx, importer_ops
from .targets import missing_host_features, target_arch
from .tuning import tune_onnx, untuned_reason

# The build host's own CPU, for the twins that produce golden outputs of foreign bundles.
HOST_CODEGEN = {"kind": "llvm"}
CUDA_NEEDS = ("CUDA segments carry CUDA source that TVM compiles when the library is loaded: the device",
              "needs the CUDA toolkit's nvcc (TVM_CUDA_COMPILE_MODE=nvcc) or NVRTC, and an NVIDIA driver")


def compile_segment(job: CompileJob) -> Compiled:
    seg, codegen = job.segment, job.device.codegen
    sid = seg.id
    job.log(f"package: {sid}: compiling {len(seg.nodes)} nodes with TVM for {describe(codegen)}")
    db = job.tuning_db if (job.tuning_db / "database_workload.json").exists() else None
    res = compile_onnx(job.model, codegen, job.segments_dir / f"{sid}.so", tuning_db=db,
                       kernel_times=job.tuning_db / KERNEL_TIMES, keep_kernel_times=job.keep_kernel_times)
    if res.weight_bytes:
        job.log(f"package: {sid}: {res.weights} weights ({shown(res.weight_bytes)}) in segments/{sid}.weights, "
                "beside the library")
    if res.rewrites:
        job.log(f"package: {sid}: rewritten for TVM: " + ", ".join(f"{k} x{n}" for k, n in res.rewrites.items()))
    if res.sparse_choices:
        dense = sum(c["kernel"] != "sparse" for c in res.sparse_choices)
        job.log(f"package: {sid}: pruned convolutions: {len(res.sparse_choices) - dense} on sparse kernels, {dense} "
                f"kept on the dense kernel ({res.sparse_choices[0]['why'].split(':')[0].split(' faster')[0]})")
    twin = None
    if needs_twin(codegen):
        job.twin_dir.mkdir(exist_ok=True)
        twin = job.twin_dir / f"{sid}.so"
        compile_onnx(job.model, HOST_CODEGEN, twin)
    return Compiled(f"segments/{sid}.so", res.inputs, res.outputs, twin=twin,
                    tuned={"tasks": res.tasks, "tuned": res.tuned, "default_scheduled": res.default_scheduled,
                           **({"sparse_kernels": res.sparse_kernels, "sparse_choices": list(res.sparse_choices)}
                              if res.sparse_choices else {})},
                    device_needs=CUDA_NEEDS if codegen.get("kind") == "cuda" else ())


def lowering_reason(node, shapes, consts) -> str | None:
    """Why TVM cannot compile `node`: its ONNX importer has no converter for the op type."""
    return None if node.op_type in _importer_ops() else "TVM's ONNX importer has no converter for it"


@functools.cache
def _importer_ops() -> frozenset[str]:
    return importer_ops()


def tune_segments(job: TuneJob) -> dict:
    """MetaSchedule over the segments' fused functions together (`tune_onnx`): the summary per task."""
    return tune_onnx(
        list(job.models), job.device.codegen, job.tuning_db,
        trials=job.trials, time_budget_s=job.time_budget_s, seed=job.seed,
        progress=job.progress, log=job.log, boards=job.boards,
        # a board's cores bound the builders that feed it; a GPU entry has none (its boards' CPUs build)
        num_cores=getattr(job.device, "cores", None) if job.boards else None,
        log_dir=job.log_dir,
    )


def untuned(models, device, tuning_db) -> str | None:
    """Why the database does not hold tuned records for every function of these segments (None when
    it does): what the tune stage's policy asks where it cannot measure the target's CPU."""
    return untuned_reason(list(models), device.codegen, tuning_db)


def describe(codegen: dict) -> str:
    return " ".join(str(codegen.get(k)) for k in ("kind", "mtriple", "mcpu", "arch") if codegen.get(k))


def needs_twin(codegen: dict) -> bool:
    """Code the build host cannot run: another architecture, a GPU, or instructions this host's CPU
    lacks (an x86 target naming an AVX-512 CPU, built on an AVX2-only host)."""
    if codegen.get("kind") != "llvm":
        return True
    return target_arch(codegen) != platform.machine() or bool(missing_host_features(codegen))
