"""Default schedules: what a TIR function without a tuning record gets.

CPU: MetaSchedule's own design space for the function with every sampled decision fixed by a
heuristic, nothing measured (`_cpu_default_schedules` for a module, `_cpu_default_schedule` for one
function, with its trace: tuning commits it as the untuned baseline's record). GPU: dlight's
rule-based schedules (`_gpu_default_schedules`). `_runs_every_instance` is the soundness check
that default schedules, tuning records and tuning candidates all pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .sparse_schedules import design, is_kernel
from .tensor_intrin import _tensor_intrin_importer
from .tiling import largest_divisor


def _gpu_default_schedules(mod: Any) -> Any:
    """Give every unscheduled function of `mod` dlight's rule-based GPU schedule.

    A GPU kernel without thread bindings does not compile, so nothing may stay
    unscheduled. Rules are tried per function, most specific first: a rule whose pattern
    matches may still fail to schedule a fused function (dlight's Matmul asserts on a
    conv2d fused with a clip, as in MobileNetV2), and then the next rule gets it, as it does
    where a rule's blocks allocate more static shared memory than the target's block may
    (`_shared_bytes`); `Fallback` schedules any function, with none.
    """
    import tvm
    from tvm import tirx
    from tvm.s_tir import dlight as dl

    rules = [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
    current = tvm.target.Target.current()  # targets.py gives every CUDA target its limit
    limit = int(current.attrs.get("max_shared_memory_per_block", 49152)) if current is not None else 49152
    for gvar, func in list(mod.functions_items()):
        if not isinstance(func, tirx.PrimFunc) or func.attrs.get("tirx.is_scheduled", False):
            continue
        for rule in rules:
            try:
                scheduled = dl.ApplyDefaultSchedule(rule)(tvm.IRModule({gvar: func}))[gvar]
            except Exception:  # noqa: BLE001 -- dlight asserts where a rule does not fit
                continue
            if not scheduled.attrs.get("tirx.is_scheduled", False):
                continue
            if _shared_bytes(scheduled.body) > limit:  # ptxas refuses the kernel: the next rule gets it
                continue
            mod[gvar] = scheduled
            break
    return mod


def _shared_bytes(stmt: Any) -> int:
    """The static shared memory a scheduled function's blocks allocate, in bytes. dlight's GeneralReduction
    stages a reduction's whole output in shared memory where the function goes on past it: a convolution
    fused with the Pad after it (a MobileNetV3's) took 16 x 112 x 112 floats, 784 KiB, and ptxas refused
    the library (48 KiB is the static limit of every CUDA architecture)."""
    if stmt is None:
        return 0
    if isinstance(stmt, (list, tuple)) or type(stmt).__name__ == "Array":
        return sum(_shared_bytes(s) for s in stmt)
    total = 0
    for buffer in getattr(stmt, "alloc_buffers", None) or ():
        if buffer.scope().startswith("shared"):
            total += math.prod(int(d) for d in buffer.shape) * ((_bits(buffer.dtype) + 7) // 8)
    for field in ("body", "seq", "block", "init", "then_case", "else_case"):
        total += _shared_bytes(getattr(stmt, field, None))
    return total


def _bits(dtype: Any) -> int:
    import tvm

    return tvm.runtime.DataType(str(dtype)).bits


# MetaSchedule sizes parallel loops by the target's core count (16 jobs per core at most).
# A target without `num-cores` gets this fixed count, not the build host's, so that the
# same target builds the same library on any host.
_DEFAULT_NUM_CORES = 4
# The vector block of the innermost spatial loop and the register block of the output
# channels (floats): 4 x 8 accumulators fill 4 AVX2 or 8 NEON registers.
_VECTOR_BLOCK = 8
_REGISTER_BLOCK = 4
# Channels-last convolutions (x86, lowering.py): the register block is a row of up to this
# many output pixels, each an accumulator vector of `_VECTOR_BLOCK` output channels, all fed
# by one weight vector. 8 (7 where the row is a multiple of 7, as in most CNNs) x 1 vector
# measured faster than 4 x 2, 7 x 2 (spills) or 2 x 4 on ResNet50 and MobileNetV2 (AVX2).
_PIXEL_BLOCK = 8
_UNROLL = 64


def _cpu_default_schedules(mod: Any, target: dict) -> tuple[Any, int]:
    """Give every unscheduled function of `mod` a fixed, untuned CPU schedule.

    The schedule is MetaSchedule's own design space for the function (its default LLVM
    rules: inlining, multi-level tiling of reductions, parallel/vectorize/unroll) with
    each sampled decision replaced by a fixed heuristic instead of a search: the outer
    spatial tiles run in parallel, the reduction loops sit outside a register block of
    `_REGISTER_BLOCK` x `_VECTOR_BLOCK` outputs (output channels x the last spatial axis
    for an NCHW convolution, rows x columns for a matrix product; `_PIXEL_BLOCK` pixels x
    `_VECTOR_BLOCK` channels for an NHWC one), and the innermost spatial tile is
    vectorized. Nothing is measured, so the same function and target always give the same schedule. A function the
    rules fail on stays unscheduled (TVM's default loop nest). Returns the module and how
    many functions got a schedule.
    """
    import tvm
    from tvm import tirx

    tvm_target = tvm.target.Target({**target, "num-cores": target.get("num-cores", _DEFAULT_NUM_CORES)})

    todo = [
        (gvar, func)
        for gvar, func in mod.functions_items()
        if isinstance(func, tirx.PrimFunc) and not func.attrs.get("tirx.is_scheduled", False)
    ]
    scheduled = 0
    for gvar, func in todo:
        try:
            sch = _cpu_default_schedule(func, tvm_target, _cpu_default_postprocs)
            new = None if sch is None else sch.mod["main"].with_attr("tirx.is_scheduled", True)
        except Exception:  # noqa: BLE001 -- a rule that does not fit leaves the loop nest
            new = None
        if new is not None:
            mod[gvar] = new
            scheduled += 1
    return mod, scheduled


def _cpu_default_postprocs() -> list:
    """Fresh postprocessors for one function: the tuning context initializes them."""
    from tvm.s_tir import meta_schedule as ms

    return [
        ms.postproc.DisallowDynamicLoop(),
        ms.postproc.RewriteParallelVectorizeUnroll(),
        ms.postproc.RewriteReductionBlock(),
    ]


def _cpu_default_schedule(func: Any, tvm_target: Any, postprocs: Callable[[], list]) -> Any:
    """`func` scheduled by `_cpu_default_schedules`' heuristic: the schedule, with its trace so
    that it can be a tuning record too, or None."""
    import tvm
    from tvm import s_tir
    from tvm.s_tir import meta_schedule as ms

    _tensor_intrin_importer(tvm_target.kind.name)()  # before TuneContext does it the slow way
    context = ms.TuneContext(
        mod=tvm.IRModule({"main": func}),
        target=tvm_target,
        space_generator=ms.space_generator.PostOrderApply(postprocs=postprocs(), mutator_probs={}),
        rand_state=1,
    )
    if is_kernel(func):  # its own design space (sparse_schedules.design), its default decisions as they are
        sch = s_tir.Schedule(tvm.IRModule({"main": func}), seed=1)
        design(sch, sch.get_sblock("sparse_conv"))
        sch.enter_postproc()
        return sch if all(p.apply(sch) for p in context.space_generator.postprocs) else None
    spaces = context.generate_design_space()
    if not spaces:
        return None
    # MultiLevelTiling's variants: the epilogue a loop nest of its own (the first), or
    # computed per output tile while it is in cache (the others; innermost first, ~25%
    # faster on MobileNetV2). TVM 0.27 leaves the border of a padding epilogue (a conv2d
    # fused with the next layer's pad) unwritten in the latter, so a schedule that does
    # not run every block instance is refused for the next variant.
    fused = [s for s in spaces if any(i.kind.name == "ReverseComputeAt" for i in s.trace.insts)]
    for space in fused[:1] + spaces[:1]:
        sch = _replay(func, space.trace)
        if not _runs_every_instance(sch.copy()):  # a copy: its queries stay out of the trace
            continue
        # the marker MetaSchedule puts before postprocessing: a search that mutates this trace
        # (it is a tuning record too) replays the decisions and postprocesses afresh
        sch.enter_postproc()
        if all(p.apply(sch) for p in context.space_generator.postprocs):
            return sch
    return None


def _replay(func: Any, trace: Any) -> Any:
    """`func` scheduled by `trace` with `_cpu_default_schedules`' fixed decisions."""
    import tvm
    from tvm import s_tir

    sch = s_tir.Schedule(tvm.IRModule({"main": func}), seed=1)
    roles = iter(_tile_roles(trace, channels_last=_channels_last(sch)))

    def decide(inst: Any, inputs: list, attrs: list, decision: Any) -> Any:
        kind = inst.kind.name
        if kind == "SamplePerfectTile":
            return _tile(int(sch.get(inputs[0]).extent), int(attrs[0]), next(roles))
        if kind == "SampleCategorical":  # the unroll limit
            values = [int(v) for v in attrs[0]]
            return values.index(_UNROLL) if _UNROLL in values else decision
        if kind == "SampleComputeLocation":
            return -1  # at the root: computed once, never recomputed per tile
        return decision

    trace.apply_to_schedule(sch, remove_postproc=True, decision_provider=decide)
    return sch


def _runs_every_instance(sch: Any) -> bool:
    """Whether the loops around each block of `sch` run at least its whole iteration domain."""
    root = sch.get_sblock("root", func_name="main")
    for block in sch.get_child_blocks(root):
        runs = math.prod(int(sch.get(loop).extent) for loop in sch.get_loops(block))
        domain = math.prod(int(v.dom.extent) for v in sch.get(block).iter_vars)
        if runs < domain:
            return False
    return True


def _channels_last(sch: Any) -> bool:
    """Whether the function of `sch` computes a channels-last convolution (TOPI names its
    block `conv2d_nhwc`, grouped or not)."""
    root = sch.get_sblock("root", func_name="main")
    return any("nhwc" in sch.get(block).name_hint for block in sch.get_child_blocks(root))


def _tile_roles(trace: Any, channels_last: bool = False) -> list[str]:
    """The role of each SamplePerfectTile of `trace`, in order: "vector" (a tiled block's
    last spatial loop), "register" (the spatial loop blocked in registers), "pixels" (that
    loop in a channels-last convolution: the output row), "spatial" (other spatial loops),
    "reduction" (a tiled block's reduction loops) or "other".

    MultiLevelTiling samples the tiles of one block back to back (each followed by its
    split), spatial loops (4 tiles on CPU) before reduction loops (2 tiles).
    """
    groups: list[list[int]] = []  # the tile counts of each block's loops
    previous = None
    for inst in trace.insts:
        kind = inst.kind.name
        if kind == "SamplePerfectTile":
            if previous != "Split" or not groups:
                groups.append([])
            groups[-1].append(int(inst.attrs[0]))
        previous = kind
    roles: list[str] = []
    for group in groups:
        spatial = [i for i, n in enumerate(group) if n == 4]
        # The register block's axis: the output channel of a 2-D convolution (NCHW: the
        # third from last of four or more), the row of a matrix product (the one before
        # the last). Blocking channels reuses each input vector for `_REGISTER_BLOCK`
        # outputs; blocking image rows reuses nothing (MobileNetV2 224: 2x slower).
        # Channels-last (NHWC): the channels are the vector, and blocking the pixels of a
        # row (the one before the last) reuses each weight vector for all of them.
        pixels = channels_last and len(spatial) >= 4
        if pixels or 2 <= len(spatial) < 4:
            register = spatial[-2]
        else:
            register = spatial[-3] if len(spatial) >= 4 else None
        for i, n in enumerate(group):
            if n != 4:
                roles.append("reduction" if spatial else "other")
            elif i == spatial[-1]:
                roles.append("vector")
            elif i == register:
                roles.append("pixels" if pixels else "register")
            else:
                roles.append("spatial")
    return roles


def _tile(extent: int, n: int, role: str) -> list[int]:
    """Tile sizes (outermost first, product `extent`) of a loop split in `n` by `role`."""

    def divisor(limit: int) -> int:
        return largest_divisor(extent, limit)

    if n == 4 and role == "vector":
        inner = divisor(_VECTOR_BLOCK)
        return [extent // inner, 1, 1, inner]
    if n == 4 and role in ("register", "pixels"):
        inner = divisor(_PIXEL_BLOCK if role == "pixels" else _REGISTER_BLOCK)
        return [extent // inner, 1, inner, 1]
    if n == 4:
        return [extent, 1, 1, 1]
    return [extent] + [1] * (n - 1)
