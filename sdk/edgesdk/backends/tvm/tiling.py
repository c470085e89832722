"""Tile arithmetic the default schedules, the sparse kernels and the graph rewrites share: a loop's
block (`largest_divisor`), the vector registers of the target being compiled (`vector_registers`) and
how many output pixels their accumulators hold (`pixel_block`).

A leaf: it imports nothing of edgesdk, so any module of this backend may use it.
"""

from __future__ import annotations


def largest_divisor(extent: int, limit: int) -> int:
    """The largest divisor of `extent` up to `limit`: the block `_tile` gives a loop of that extent."""
    return max(d for d in range(1, min(limit, extent) + 1) if extent % d == 0)


def vector_registers() -> tuple[int, int]:
    """fp32 lanes per vector register and the number of vector registers of the target being compiled
    (`tvm.target.Target.current()`): AVX-512 16 and 32, AVX2 8 and 16, aarch64 NEON 4 and 32."""
    # TVM is imported where it is used: importing this backend must not import it (the CLI imports the
    # backend registry, and TVM takes seconds to import)
    import tvm
    from tvm.target import codegen

    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "llvm":
        return 8, 16
    triple = str(target.attrs.get("mtriple", "") or "")
    if triple.startswith("aarch64"):
        return 4, 32
    features = set(codegen.llvm_get_cpu_features(target))
    return (16, 32) if "avx512f" in features else (8, 16)


def pixel_block(n: int) -> int:
    """With a batch of `n` as the vector: the most output pixels whose accumulators (n / lanes registers each)
    fit the target's vector registers beside the broadcast weight and a load (AVX-512, n 16: 14; AVX2: 6; an
    AVX2 block of 14 spilled and ran 1.5x slower)."""
    lanes, registers = vector_registers()
    return max(1, (registers - 4) // max(1, -(-n // lanes)))
