"""The command line's spellings of option values, and the checks of options that must go together: the CLI
(cli.py) and the Python API (api.py) read a build's options through these, so both refuse the same values
with the same errors (UsageError, exit code 2), before anything runs.

Above options.py: the checks read what compression, the backends and the scheduler accept.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

from .errors import UsageError
from .options import BuildOptions, flag_of, flagged

def _parse_duration(text: str | None, flag: str) -> float | None:
    """90, 90s, 20m, 1.5h -> seconds."""
    if text is None:
        return None
    units = {"s": 1, "m": 60, "h": 3600}
    t = text.strip().lower()
    scale = units.get(t[-1:], None)
    number = t[:-1] if scale else t
    try:
        seconds = float(number) * (scale or 1)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise UsageError("cli.bad-duration", f"{flag} {text}: not a duration", "e.g. 90s, 20m, 1.5h, or seconds")
    return seconds



def _check_prune_options(prune: str | None, plan: str | None, budget: float | None,
                         layers: str | None, correct: bool, kernels: str) -> str | None:
    """The pruning options refused where they do not go together (exit 2, before anything runs); `--prune`
    in its canonical spelling (a list with `--prune-plan auto`)."""
    from .compression import parse_method
    from .compression.plan import parse_candidates

    if plan is None and budget is not None:
        raise UsageError("cli.prune-options", "--latency-budget needs --prune-plan auto",
                         "e.g. --prune-plan auto --latency-budget 40 --prune 2:4,1:4")
    if plan == "auto":
        if budget is None or budget <= 0:
            raise UsageError("cli.prune-options", "--prune-plan auto needs --latency-budget MS (above 0)",
                             "the model's CPU time per inference on this host that the plan must fit, e.g. "
                             "--latency-budget 40")
        if prune is not None:
            prune = ",".join(m.text for m in parse_candidates(prune))
    elif plan is not None:
        if not Path(plan).is_file():
            raise UsageError("prune.plan-unreadable", f"--prune-plan {plan}: no such file",
                             "give 'auto' or a plan file written by an earlier build (its OUT/.build/4-tune/prune_plan.json)")
        if prune is not None or layers is not None:
            raise UsageError("cli.prune-options", "--prune-plan FILE names each layer's method: --prune and "
                             "--prune-layers do not go with it", "edit the plan file instead")
    elif prune is not None:
        if "," in prune:
            raise UsageError("cli.prune-options", f"--prune {prune}: a list of methods needs --prune-plan auto",
                             "one method prunes every chosen layer alike, e.g. --prune 2:4")
        prune = parse_method(prune).text
    elif layers is not None or correct or kernels != "measured":
        raise UsageError("cli.prune-options",
                         "--prune-layers, --prune-correct and --sparse-kernels need --prune or --prune-plan",
                         "e.g. --prune 2:4 --prune-layers 'conv2*,conv3*'")
    return prune


def _check_eval_options(eval_data: Path | None, task: str | None, decoder: str | None, options: str | None) -> None:
    """`--eval` and the task it measures, refused where they do not go together (exit 2, before anything runs)."""
    if eval_data is None:
        if task is not None or decoder is not None or options is not None:
            raise UsageError("cli.task-options", "--task, --decoder and --task-options need --eval DIR",
                             "the task is measured on held-out samples, e.g. --eval heldout/ --task ocr")
        return
    if not Path(eval_data).is_dir():
        raise UsageError("cli.eval-not-found", f"--eval {eval_data}: not a directory",
                         "give a directory of held-out samples: .npy/.npz files or images, and labels.txt where "
                         "you have labels")
    from .compression.tasks import parse_options

    if task is None and (decoder is not None or options is not None):
        raise UsageError("cli.task-options", "--decoder and --task-options need --task",
                         "e.g. --task detection --decoder yolov8 --task-options score=0.25")
    if task is not None:
        parse_options(task, decoder, options)


def _parse_cpu_backends(value: str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    from .backends import cpu_candidates
    from .scheduling.selection import PLANNED
    known = cpu_candidates()

    names = tuple(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
    unknown = [n for n in names if n not in (PLANNED, *known)]
    if unknown or not names:
        raise UsageError("cli.bad-cpu-backends", f"--cpu-backends {value!r}: " + (
            f"unknown backend {', '.join(repr(n) for n in unknown)}" if unknown else "names no backend"),
            f"choose among {','.join(known)}, or {PLANNED} alone for the schedule's own cut, unmeasured")
    return names


def _parse_shapes(values: list[str]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for v in values:
        name, sep, dims = v.rpartition("=")
        try:
            shape = tuple(int(d) for d in dims.lower().split("x"))
            if not sep or not name or any(d <= 0 for d in shape):
                raise ValueError
        except ValueError:
            raise UsageError("cli.bad-shape", f"--input-shape {v}: expected NAME=DIMS like x=1x3x224x224",
                             "dimensions are positive integers joined by 'x'") from None
        shapes[name] = shape
    return shapes


def _parse_values(values: list[str]) -> dict[str, tuple[float, ...]]:
    frozen = {}
    for v in values:
        name, sep, numbers = v.partition("=")
        try:
            parsed = tuple(float(x) for x in numbers.split(","))
            if not sep or not name:
                raise ValueError
        except ValueError:
            raise UsageError("cli.bad-value", f"--input-value {v}: expected NAME=VALUE like sr=16000 or NAME=1,2,3",
                             "values are numbers joined by ','") from None
        frozen[name] = parsed
    return frozen


def _parse_ranges(values: list[str]) -> dict[str, tuple[float, float]]:
    """--input-range NAME=LOW,HIGH (repeatable): finite numbers, LOW < HIGH, each input once."""
    ranges: dict[str, tuple[float, float]] = {}
    for v in values:
        name, sep, numbers = v.partition("=")
        try:
            low, high = (float(x) for x in numbers.split(","))
            if not sep or not name or not (math.isfinite(low) and math.isfinite(high)):
                raise ValueError
        except ValueError:
            raise UsageError("cli.bad-input-range", f"--input-range {v}: expected NAME=LOW,HIGH like x=0,1",
                             "LOW and HIGH are finite numbers; give the option once per input") from None
        if not low < high:
            raise UsageError("cli.bad-input-range", f"--input-range {v}: LOW must be less than HIGH",
                             f"e.g. --input-range {name}=0,1 for images in [0, 1], {name}=0,255 for 8-bit pixels")
        if name in ranges:
            raise UsageError("cli.bad-input-range", f"--input-range names '{name}' twice", "give each input one range")
        ranges[name] = (low, high)
    return ranges


def _parse_activations(values: list[str]) -> dict[str, str]:
    """--output-activation NAME=sigmoid|softmax (repeatable): each output once."""
    from .compression.accuracy import ACTIVATIONS

    declared: dict[str, str] = {}
    for v in values:
        name, sep, activation = (s.strip() for s in v.partition("="))
        if not sep or not name or activation not in ACTIVATIONS:
            raise UsageError("cli.bad-output-activation", f"--output-activation {v}: expected NAME=ACTIVATION with "
                             f"ACTIVATION one of {', '.join(ACTIVATIONS)}",
                             "e.g. --output-activation classificators=sigmoid for a detector's class logits")
        if name in declared:
            raise UsageError("cli.bad-output-activation", f"--output-activation names '{name}' twice",
                             "give each output one activation")
        declared[name] = activation
    return declared


def _node_names(values: list[str]) -> tuple[str, ...]:
    """--keep-on-cpu NODE,... (repeatable): each name once, in the order given."""
    return tuple(dict.fromkeys(n.strip() for v in values for n in v.split(",") if n.strip()))



# How a field's command-line spelling (options.py `Flag.spelled`) becomes its value; a bound of 0 is none
# given (the target's), as it always was on the command line.
SPELLINGS = {
    "input_shapes": _parse_shapes,
    "input_values": _parse_values,
    "time_budget": functools.partial(_parse_duration, flag="--time-budget"),
    "input_ranges": _parse_ranges,
    "max_abs_error": lambda bound: bound or None,
    "max_error_lsb": lambda bound: bound or None,
    "cpu_backends": _parse_cpu_backends,
    "output_activations": _parse_activations,
    "keep_on_cpu": _node_names,
}



def from_given(given: dict[str, Any], **fixed: Any) -> BuildOptions:
    """BuildOptions from a command's `**given` (`_with_options`): each spelled field parsed, each negated
    flag inverted; `fixed`: fields the command sets itself."""
    values = {}
    for name in (n for n in flagged() if n in given):
        value = given[name]
        if flag_of(name).negated:
            value = not value
        elif name in SPELLINGS:
            value = SPELLINGS[name](value)
        values[name] = value
    return BuildOptions(**values, **fixed)



def checked_together(given: dict[str, Any]) -> dict[str, Any]:
    """The build's options refused where a value is out of range or values do not go together (exit 2,
    before anything runs); `--prune` in its canonical spelling."""
    if not 50.0 < given["calib_percentile"] <= 100.0:
        raise UsageError("cli.bad-calib-percentile", f"--calib-percentile {given['calib_percentile']}: outside "
                         "(50, 100]", "99.99 keeps all but one value in 10,000 per tail")
    if bool(given["rpc_tracker"]) != bool(given["rpc_key"]):
        raise UsageError("cli.rpc", "--rpc-tracker and --rpc-key go together",
                         "--rpc-tracker HOST:PORT --rpc-key KEY: the tracker and the key the boards registered with")
    prune = _check_prune_options(given["prune"], given["prune_plan"], given["latency_budget"], given["prune_layers"],
                                 given["prune_correct"], given["sparse_kernels"])
    _check_eval_options(given["eval_data"], given["task"], given["decoder"], given["task_options"])
    return {**given, "prune": prune}
