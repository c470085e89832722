"""The CPU names a target's `mcpu` may give, per architecture: LLVM's names, as data.

Taken from `tvm.target.codegen.llvm_get_cpu_archlist` of the LLVM that TVM is built with (LLVM 22),
less, for x86_64, the 32-bit-only CPUs (i386 .. pentium4, k6, athlon-xp, geode, ...) and the
underscore spellings (`skylake_avx512`) that LLVM keeps for `__builtin_cpu_is`. A test checks every
name against TVM's LLVM, so a name here is one LLVM accepts; validating a target file never imports
TVM. `native` is the build host's CPU: the TVM backend resolves it when it compiles.
"""

from __future__ import annotations

import difflib

NATIVE = "native"

LLVM_CPUS: dict[str, frozenset[str]] = {
    "x86_64": frozenset(
        # the psABI levels: baseline, +SSE4.2, +AVX2, +AVX-512
        "generic x86-64 x86-64-v2 x86-64-v3 x86-64-v4 "
        # Intel cores, client and server
        "core2 penryn nehalem corei7 westmere sandybridge corei7-avx ivybridge core-avx-i haswell core-avx2 "
        "broadwell skylake skylake-avx512 skx cascadelake cooperlake cannonlake icelake-client icelake-server "
        "tigerlake rocketlake alderlake raptorlake meteorlake arrowlake arrowlake-s lunarlake pantherlake "
        "wildcatlake novalake sapphirerapids emeraldrapids graniterapids graniterapids-d diamondrapids "
        # Intel Atom and E-cores, Xeon Phi, the 64-bit Pentium 4
        "bonnell atom silvermont slm goldmont goldmont-plus tremont gracemont sierraforest grandridge "
        "clearwaterforest knl knm nocona "
        # AMD: K8 and K10, Bobcat/Jaguar, Bulldozer, Zen
        "k8 opteron athlon64 athlon-fx k8-sse3 opteron-sse3 athlon64-sse3 amdfam10 barcelona btver1 btver2 "
        "bdver1 bdver2 bdver3 bdver4 znver1 znver2 znver3 znver4 znver5".split()
    ),
    "aarch64": frozenset(
        "generic "
        # Arm Cortex and Neoverse
        "cortex-a34 cortex-a35 cortex-a53 cortex-a55 cortex-a57 cortex-a65 cortex-a65ae cortex-a72 cortex-a73 "
        "cortex-a75 cortex-a76 cortex-a76ae cortex-a77 cortex-a78 cortex-a78ae cortex-a78c cortex-a320 "
        "cortex-a510 cortex-a520 cortex-a520ae cortex-a710 cortex-a715 cortex-a720 cortex-a720ae cortex-a725 "
        "cortex-r82 cortex-r82ae cortex-x1 cortex-x1c cortex-x2 cortex-x3 cortex-x4 cortex-x925 "
        "c1-nano c1-pro c1-premium c1-ultra "
        "neoverse-e1 neoverse-n1 neoverse-n2 neoverse-n3 neoverse-v1 neoverse-v2 neoverse-v3 neoverse-v3ae "
        "neoverse-512tvb "
        # NVIDIA, Ampere, Apple, Fujitsu, Samsung, Qualcomm, Marvell/Cavium, HiSilicon
        "carmel grace gb10 olympus ampere1 ampere1a ampere1b ampere1c "
        "apple-a7 apple-a10 apple-a11 apple-a12 apple-a13 apple-a14 apple-a15 apple-a16 apple-a17 apple-m4 "
        "apple-m5 a64fx fujitsu-monaka exynos-m3 exynos-m4 exynos-m5 falkor kryo saphira oryon-1 "
        "thunderx thunderxt81 thunderxt83 thunderxt88 thunderx2t99 thunderx3t110 tsv110".split()
    ),
}

# What the hint offers when no name is close to the one given.
COMMON_CPUS = {
    "x86_64": ("x86-64-v3", "haswell", "skylake-avx512", "icelake-server", "sapphirerapids", "znver4"),
    "aarch64": ("generic", "cortex-a53", "cortex-a55", "cortex-a72", "cortex-a76", "neoverse-n1"),
}


def cpu_arch(name: str) -> str | None:
    """The architecture whose table holds `name` (x86_64 first for `generic`); None when none does."""
    return next((arch for arch, names in LLVM_CPUS.items() if name in names), None)


def close_cpus(name: str, arch: str | None) -> list[str]:
    """Names in `arch`'s table (every table's when None) that look like `name`, closest first."""
    names = LLVM_CPUS[arch] if arch else frozenset().union(*LLVM_CPUS.values())
    return difflib.get_close_matches(name, sorted(names), n=4, cutoff=0.6)
