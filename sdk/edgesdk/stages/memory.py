"""The build's peak memory, estimated from the model's weights once import has read them, so that a
build the machine cannot hold stops at once with the estimate and a hint, instead of being killed by
the kernel (which picks a process, often not the build) an hour in.

    peak = BASE_BYTES + HELD_COPIES x weights + the hungriest compiler the build may run

(MAPPED_HELD_COPIES instead of HELD_COPIES past `irm.EXTERNAL_FROM`, where the stages map the weights.)
Made twice: after import, every compiler the target may run priced on the whole model; after schedule,
those of the devices the plan uses, on the weights each compiles at once (`check`).

A compiler's share is its backend's `compile_base_bytes + compile_bytes_per_weight_byte x weights`
(`backends/__init__.py`, each measured). The compilers a build may run: each accelerator's backends,
and on the CPU the backends the tune stage measures (`--cpu-backends`) besides the host's own; with
`--low-memory`, onnxruntime alone on the CPU. A CPU candidate whose format cannot hold the weights (a
TFLite FlatBuffer past 2 GiB) is never run; an accelerator's segments are each at most that big. The
figures are upper bounds for the models measured (benchmarks/results/build-memory.json: the estimate beside
the peak of each build).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .. import backends
from ..config import HOST
from ..devices import registry
from ..errors import UsageError, UserError
from ..ir import model as irm
from ..ir.memory import GiB, available_bytes, shown

# the build of a model of one 3x3 convolution: TensorFlow, TVM and the runtime loaded, no weights to
# speak of (benchmarks/results/build-memory.json "tiny": 1.05 GiB)
BASE_BYTES = int(1.1 * GiB)
# copies of the weights the build itself holds at once, at most, beside a compiler's: the model, a segment
# cut from it and a reference session's (tune); the model, the optimized model and a transient (import);
# the float model, its session and the bundle's self-test (package). Measured: 2.3 to 4.3 (build-memory.json)
HELD_COPIES = 4
# the same past `irm.EXTERNAL_FROM`, where the stages map the weights from their files instead of holding
# them (`irm.read`): a session's copy and the self-test's, and the file's pages while they are read.
# Measured: 2.0 (the 2.25 GiB MLP, --low-memory)
MAPPED_HELD_COPIES = 2
# the CPU backends a `--low-memory` build compiles: onnxruntime reads the weights where they are
LOW_MEMORY_BACKENDS = ("onnxruntime",)
# EDGESDK_MEMORY_CHECK=off builds whatever the estimate says
CHECK_ENV = "EDGESDK_MEMORY_CHECK"


@dataclass(frozen=True)
class Estimate:
    weights: int      # bytes of the model's initializers
    peak: int         # the estimated peak of the whole build
    compiler: str     # the backend whose compile sets it ("" where none compiles)

    def describe(self) -> str:
        by = f", while {self.compiler} compiles" if self.compiler else ""
        return f"about {shown(self.peak)} at its peak{by} ({shown(self.weights)} of weights)"


def compilers(target, options) -> list[str]:
    """The backends that may compile segments of this build."""
    names = [b for dev in target.devices if dev.kind != HOST for b in registry.model(dev.kind).backends]
    return list(dict.fromkeys([*names, *_cpu_compilers(options)]))


def _cpu_compilers(options) -> list[str]:
    """The backends that may compile the CPU's segments: the host's own and those tune measures, or with
    `--low-memory` onnxruntime alone."""
    if options.low_memory:
        return list(LOW_MEMORY_BACKENDS)
    cpu = list(registry.model(HOST).backends)
    measured = options.cpu_backends
    if measured != ("planned",):
        cpu += [b for b in backends.cpu_candidates() if measured is None or b in measured]
    return list(dict.fromkeys(cpu))


def estimate(weights: int, target, options, plan=None) -> Estimate:
    """The build's peak for `weights` of model. Without `plan` (after import), every compiler the target may
    run is priced on all of the weights (an accelerator's on its format's bound); with the schedule's `plan`,
    only the compilers of the devices it uses, each on the most weights it compiles at once: an accelerator's
    largest segment, the CPU's segments together (tune compiles a CPU span whole)."""
    held = held_bytes(weights)
    best = Estimate(weights, held, "")
    accelerated = {b for dev in target.devices if dev.kind != HOST for b in registry.model(dev.kind).backends}
    for name, share in _shares(weights, target, options, plan).items():
        b = backends.backend(name)
        if b.max_weight_bytes and share >= b.max_weight_bytes:
            if name not in accelerated:
                continue  # a CPU candidate compiles a whole span: refused before it starts (tflite.too-large)
            share = b.max_weight_bytes  # an accelerator's segments: each of them under the format's bound
        need = held + b.compile_base_bytes + int(b.compile_bytes_per_weight_byte * share)
        if need > best.peak:
            best = Estimate(weights, need, name)
    return best


def held_bytes(weights: int) -> int:
    """What the build itself holds at most for `weights` of model, no compiler counted."""
    return BASE_BYTES + (MAPPED_HELD_COPIES if weights > irm.EXTERNAL_FROM else HELD_COPIES) * weights


def _shares(weights: int, target, options, plan) -> dict[str, int]:
    """Each backend that may compile, and the most weight bytes it compiles at once."""
    if plan is None:
        return dict.fromkeys(compilers(target, options), weights)
    shares: dict[str, int] = {}
    on_cpu = [seg for seg in plan.segments if seg.device.split(":")[0] == HOST]
    for seg in plan.segments:
        if seg not in on_cpu:
            for name in registry.model(seg.device.split(":")[0]).backends:
                shares[name] = max(shares.get(name, 0), seg.param_bytes)
    if on_cpu:
        cpu = sum(seg.param_bytes for seg in on_cpu)
        for name in _cpu_compilers(options):
            shares[name] = max(shares.get(name, 0), cpu)
    return shares


def check(weights: int, target, options, log, *, converter_peak: int | None = None, plan=None) -> Estimate:
    """The estimate of the stages after import, logged (with `converter_peak`, what import's converter
    child held at its peak: import has run by now, and its converter is watched on its own), and a
    `build.out-of-memory` error where it passes the memory this machine has available (unless
    EDGESDK_MEMORY_CHECK=off).

    After import (`plan` None) the estimate prices every compiler the target may run, and the build stops
    only where the weights its stages hold, no compiler counted, already pass what is available: legalize
    and schedule hold little (under 0.6 GiB for 2.25 GiB of weights) and take seconds. After schedule,
    with its `plan`, the estimate prices the compilers of the devices the plan uses (`estimate`), and the
    build stops where that passes: an arm_2tpu build whose plan has no Edge TPU segment never runs TFLite's
    int8 converter, which the first estimate counted at 7 bytes per byte."""
    found = estimate(weights, target, options, plan)
    available = available_bytes()
    converter = f"; import's converter held {shown(converter_peak)} at its peak" if converter_peak else ""
    when = "as planned" if plan is not None else "before the plan"
    log(f"build: memory: {found.describe()}, {when}{converter}; " + (f"{shown(available)} available" if available
                                                                      is not None else "available memory unknown"))
    switch = os.environ.get(CHECK_ENV, "on").strip().lower()
    if switch not in ("on", "off"):
        raise UsageError("build.bad-env", f"{CHECK_ENV}={os.environ[CHECK_ENV]!r}: expected on or off",
                         f"unset {CHECK_ENV}, or set it to off to build whatever the memory estimate says")
    needed = found.peak if plan is not None else held_bytes(weights)
    if available is None or needed <= available or switch == "off":
        return found
    low = estimate(weights, target, dataclasses.replace(options, low_memory=True), plan)
    if options.low_memory or low.peak >= found.peak:
        bigger = "build on a machine with more memory"
    elif low.peak <= available:  # the trade that fits, first
        bigger = (f"--low-memory compiles the CPU segments with onnxruntime alone (about {shown(low.peak)}), "
                  "or build on a machine with more memory")
    else:
        bigger = (f"build on a machine with more memory (--low-memory, onnxruntime alone on the CPU, would still "
                  f"need about {shown(low.peak)})")
    raise UserError(
        "build.out-of-memory",
        f"this build needs {found.describe()}, and this machine has {shown(available)} available",
        f"{bigger}; {CHECK_ENV}=off builds anyway (the kernel may then kill it)")
