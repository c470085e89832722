"""The sparse kernel's schedules: its design space (`design`), a MetaSchedule rule for tuning, and its
default schedule where tuning left it unscheduled (`schedule_rest`).

`kernel` (sparse_kernels.py) marks its block with the rule RULE, which `register_rule` points at `design`:
MetaSchedule's search samples the tile sizes `design` samples, and the default schedule is `design`'s
decisions as they are.
"""

from __future__ import annotations

from typing import Any

from .tiling import largest_divisor, pixel_block

PIXELS = 14  # batch > 1: output pixels of a row sharing each weight load (at most; a divisor of the width)
ROWS = 7  # batch 1: output rows sharing each weight load (at most; a divisor of the height)
LANES = 8  # batch 1: the vector along the output row (at most; a divisor of the width)

RULE = "edgesdk.sparse_conv"  # the kernel block's `schedule_rule`: MetaSchedule's design space is `design`


def design(sch: Any, block: Any) -> Any:
    """The kernel's schedule in `sch`, its tile sizes sampled (MetaSchedule's search mutates them; unmutated,
    the decisions are the default schedule's): parallel over output rows (and pixel tiles), the channel blocks
    outside the output channels, then the kept weights; with a batch, the batch vectorized under a row of
    pixels; at batch 1, the output row vectorized under a few output rows. Returns `sch`."""
    o, h, w, b, k, p = sch.get_loops(block)
    oh, ow, n = (int(sch.get(loop).extent) for loop in (h, w, b))
    if n > 1:
        pixels = largest_divisor(ow, min(PIXELS, pixel_block(n)))
        wo, wi = sch.split(w, sch.sample_perfect_tile(w, n=2, max_innermost_factor=PIXELS,
                                                      decision=[ow // pixels, pixels]))
        sch.reorder(h, wo, k, o, p, wi, b)
        sch.parallel(sch.fuse(h, wo))
        sch.vectorize(b)
        sch.unroll(wi)
    else:
        rows, lanes = largest_divisor(oh, ROWS), largest_divisor(ow, LANES)
        ho, hi = sch.split(h, sch.sample_perfect_tile(h, n=2, max_innermost_factor=ROWS, decision=[oh // rows, rows]))
        wo, wi = sch.split(w, sch.sample_perfect_tile(w, n=2, max_innermost_factor=LANES,
                                                      decision=[ow // lanes, lanes]))
        sch.reorder(ho, wo, k, o, p, hi, b, wi)
        sch.parallel(sch.fuse(ho, wo))
        sch.vectorize(wi)
        sch.unroll(hi)
    sch.decompose_reduction(block, k)
    return sch


def register_rule() -> None:
    """Make `design` the design space MetaSchedule's ApplyCustomRule finds for blocks annotated RULE (it looks
    the rule up per target key: "cpu" for x86 and aarch64)."""
    import tvm

    tvm.register_global_func(f"s_tir.meta_schedule.cpu.{RULE}", lambda sch, block: [design(sch, block)],
                             override=True)


def schedule(func: Any) -> Any:
    """`func` (from `kernel`) with the default schedule (`design`'s decisions unsampled)."""
    import tvm
    from tvm import s_tir

    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    design(sch, sch.get_sblock("sparse_conv"))
    return scheduled(sch.mod["main"])


def scheduled(func: Any) -> Any:
    """`func` marked scheduled (compilation schedules nothing more in it)."""
    return func.with_attr("tirx.is_scheduled", True)


def is_kernel(func: Any) -> bool:
    """Whether `func` is an unscheduled sparse kernel (a task MetaSchedule may tune)."""
    return (func.attrs is not None and func.attrs.get("edgesdk.sparse_conv", False)
            and not func.attrs.get("tirx.is_scheduled", False))


def schedule_rest(mod: Any) -> Any:
    """Every sparse kernel in `mod` the tuning database did not schedule, with the default schedule."""
    for gvar, func in list(mod.functions_items()):
        if is_kernel(func):
            mod[gvar] = schedule(func)
    return mod
