"""Targets: the CPU a library is built for and runs on, and the library's export.

`target_arch` names the architecture a target's code runs on. `_resolve_target` turns `mcpu: native`
into this host's CPU name and the features it really has (`host_cpu`: LLVM's host map less what
/proc/cpuinfo hides); `missing_host_features` says what code for a target uses that this host
lacks. `_export` links a library atomically, cross-linked by `_cross_compiler` for a foreign CPU.
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ...errors import UserError


_ARCHES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


def target_arch(target: dict) -> str:
    """The CPU architecture that runs the library built for `target`: x86_64 or aarch64.

    A CUDA target's library runs on its host CPU. An LLVM target without `mtriple` is the
    build host itself.
    """
    host = target.get("host", {"kind": "llvm"}) if target.get("kind") == "cuda" else target
    if host.get("kind") != "llvm":
        raise UserError(
            "tvm.unsupported-target",
            f"tvm targets are llvm or cuda with an llvm host, got {target!r}",
            hint='use e.g. {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]}',
        )
    machine = str(host.get("mtriple") or platform.machine()).split("-")[0].lower()
    if machine not in _ARCHES:
        raise UserError(
            "tvm.unsupported-target",
            f"unsupported cpu architecture {machine!r} in target {target!r}",
            hint="edgesdk builds for x86_64 and aarch64",
        )
    return _ARCHES[machine]


# What `mcpu: native` means, when set: a CPU name LLVM knows (haswell, znver3) taken as this host's.
# On an AVX-512 host, EDGESDK_HOST_CPU=haswell builds what an AVX2-only host would, so that host's
# numerics can be checked here. Features the named CPU has and this host lacks stay off.
HOST_CPU_ENV = "EDGESDK_HOST_CPU"


def host_cpu() -> tuple[str, list[str]]:
    """This host's CPU as LLVM names it (or as EDGESDK_HOST_CPU forces it) and the `mattr` that
    makes the name's features this host's own.

    A CPU name implies a feature set, and a virtual machine may hide some of it: a KVM guest on
    Zen 5 reports `znver5`, whose movdiri, pku or wbnoinvd its hypervisor masks, and a Zen 4 name
    under a hypervisor that masks AVX-512 would give code that dies with SIGILL. The host's
    features (`_host_features`: what the guest may really execute) decide instead: `mattr` turns
    on what the host has beyond the name and off what the name has beyond the host; with a
    forced CPU it only turns off.
    """
    import tvm
    from tvm.target import codegen

    forced = os.environ.get(HOST_CPU_ENV, "").strip()
    triple = str(codegen.llvm_get_system_triple())
    if forced and not codegen.llvm_is_valid_cpu(forced, triple):
        raise UserError(
            "tvm.bad-host-cpu",
            f"{HOST_CPU_ENV}={forced} is not a cpu llvm knows for {triple}",
            hint=f"name one such as haswell or znver3, or unset {HOST_CPU_ENV}",
        )
    name = forced or str(codegen.llvm_get_system_cpu())
    host = _host_features()
    named = codegen.llvm_get_cpu_features(tvm.target.Target({"kind": "llvm", "mcpu": name})) & host.keys()
    has = {f for f, on in host.items() if on}
    wanted = has & named if forced else has
    flags = [f"+{f}" for f in wanted - named] + [f"-{f}" for f in named - wanted]
    return name, sorted(flags, key=lambda flag: flag[1:])


# Instruction-set extensions that compiled kernels use (vector, FMA, bit manipulation, crypto),
# by prefix of LLVM's feature names. A CPU name's system features (pku, movdiri, invpcid, ...)
# never appear in a kernel, and hypervisors often hide them: they do not make code unrunnable.
_KERNEL_ISA = ("sse", "ssse3", "avx", "fma", "f16c", "amx", "bmi", "lzcnt", "popcnt", "aes", "vaes", "pclmul",
               "vpclmulqdq", "gfni", "sha", "neon", "fp-armv8", "fullfp16", "dotprod", "i8mm", "bf16", "sve", "sme")


def missing_host_features(target: dict) -> list[str]:
    """The instruction-set extensions that code built for `target` may use and this host lacks:
    such code may die here with SIGILL. None for a foreign architecture, which this host does
    not run."""
    import tvm
    from tvm.target import codegen

    if target_arch(target) != _ARCHES.get(platform.machine().lower()):
        return []
    cpu = target.get("host", {"kind": "llvm"}) if target.get("kind") == "cuda" else target
    cpu, _ = _resolve_target(cpu)
    host = _host_features()
    used = codegen.llvm_get_cpu_features(tvm.target.Target(cpu))
    return sorted(f for f in used if f in host and not host[f] and f.startswith(_KERNEL_ISA))


def target_features(target: dict) -> set[str]:
    """LLVM's names of the features code built for a CPU `target` may use (its `mcpu` and `mattr`; `native`:
    this host's)."""
    import tvm
    from tvm.target import codegen

    cpu = target.get("host", {"kind": "llvm"}) if target.get("kind") == "cuda" else target
    cpu, _ = _resolve_target(cpu)
    return set(codegen.llvm_get_cpu_features(tvm.target.Target(cpu)))


# LLVM's name of an x86 feature -> Linux's flag in /proc/cpuinfo, for the features that kernels use
# and the system features that CPU names imply and hypervisors or kernels hide.
_CPUINFO_FLAG = {
    "sse3": "pni", "ssse3": "ssse3", "sse4.1": "sse4_1", "sse4.2": "sse4_2", "sse4a": "sse4a", "avx": "avx",
    "avx2": "avx2", "fma": "fma", "f16c": "f16c", "bmi": "bmi1", "bmi2": "bmi2", "lzcnt": "abm", "popcnt": "popcnt",
    "movbe": "movbe", "aes": "aes", "pclmul": "pclmulqdq", "vaes": "vaes", "vpclmulqdq": "vpclmulqdq", "gfni": "gfni",
    "sha": "sha_ni", "adx": "adx", "rdrnd": "rdrand", "rdseed": "rdseed", "avx512f": "avx512f",
    "avx512cd": "avx512cd", "avx512bw": "avx512bw", "avx512dq": "avx512dq", "avx512vl": "avx512vl",
    "avx512ifma": "avx512ifma", "avx512vbmi": "avx512vbmi", "avx512vbmi2": "avx512_vbmi2",
    "avx512vnni": "avx512_vnni", "avx512bitalg": "avx512_bitalg", "avx512vpopcntdq": "avx512_vpopcntdq",
    "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16", "avx512vp2intersect": "avx512_vp2intersect",
    "avxvnni": "avx_vnni", "amx-tile": "amx_tile", "amx-int8": "amx_int8", "amx-bf16": "amx_bf16",
    "movdiri": "movdiri", "movdir64b": "movdir64b", "wbnoinvd": "wbnoinvd", "pku": "pku", "mwaitx": "mwaitx",
    "rdpru": "rdpru", "clwb": "clwb", "clflushopt": "clflushopt", "invpcid": "invpcid", "fsgsbase": "fsgsbase",
}


def _host_features() -> dict[str, bool]:
    """LLVM's feature map of this host's CPU (every feature LLVM knows for it, on or off), less
    what the kernel turned off.

    LLVM reads CPUID and XGETBV; Linux clears the flags it does not let programs rely on (a
    `clearcpuid=` boot option, an erratum: this Zen 5 build host's kernel hides the RDSEED that
    CPUID reports), and /proc/cpuinfo has the last word on x86 Linux.
    """
    import tvm

    features = {str(k): bool(v) for k, v in tvm.get_global_func("tvm.codegen.llvm.GetHostCPUFeatures")().items()}
    flags = cpuinfo_flags()
    if flags:
        for feature, flag in _CPUINFO_FLAG.items():
            if features.get(feature) and flag not in flags:
                features[feature] = False
    return features


def cpuinfo_flags() -> set[str]:
    """The CPU flags of /proc/cpuinfo on x86 Linux, or an empty set (elsewhere; aarch64 lists
    `Features`, which LLVM's host map is read from there)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def _resolve_target(target: dict) -> tuple[dict, Any]:
    """The target dict with `mcpu: native` replaced by this host's CPU and features (`host_cpu`),
    and its tvm Target.

    LLVM refuses `-mcpu=native` with the triple TVM's LLVM was built for, so "native" is
    resolved here; the resolved name and `mattr` are what the build records. An `mattr` the
    target gives comes after the host's: an explicit setting wins.
    """
    import tvm

    def resolve(t: dict) -> dict:
        t = dict(t)
        if t.get("kind") == "llvm" and t.get("mcpu") == "native":
            t["mcpu"], flags = host_cpu()
            if flags or t.get("mattr"):
                t["mattr"] = [*flags, *t.get("mattr", [])]
        if isinstance(t.get("host"), dict):
            t["host"] = resolve(t["host"])
        return t

    target_arch(target)  # validates kind and architecture
    target = resolve(target)
    if target.get("kind") == "cuda":
        target.setdefault("host", {"kind": "llvm"})
        # The static shared memory a block may use: 48 KiB on every CUDA architecture.
        # dlight reads it from the target and warns once per function when it is absent.
        target.setdefault("max_shared_memory_per_block", 49152)
    try:
        return target, tvm.target.Target(target)
    except Exception as exc:
        raise UserError("tvm.bad-target", f"tvm does not accept target {target!r}: {exc}",
                        hint="see the tvm target dicts in targets/*.yaml") from exc


def _cross_compiler(target: dict) -> str | None:
    """The gcc that links a library for `target` when its CPU is not this host's; None when it is."""
    arch = target_arch(target)
    if arch == _ARCHES.get(platform.machine().lower()):
        return None
    compiler = f"{arch}-linux-gnu-gcc"
    if shutil.which(compiler) is None:
        raise UserError(
            "tvm.no-cross-compiler",
            f"linking for {arch} needs {compiler}, which is not on PATH",
            hint=f"install it: apt-get install gcc-{arch}-linux-gnu",
        )
    return compiler


def _export(executable: Any, target: dict, out_path: Path) -> None:
    """Link `executable` into `out_path` atomically, cross-linking for a foreign CPU."""
    from tvm.support import cc

    compiler = _cross_compiler(target)
    options: dict[str, Any] = {"fcompile": cc.cross_compiler(compiler)} if compiler else {}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out_path.name + ".", suffix=".so", dir=out_path.parent)
    os.close(fd)
    try:
        executable.export_library(tmp, **options)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would follow the file into the bundle
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
