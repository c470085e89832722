"""A per-layer pruning plan: which method prunes which layer. Given as a file (`--prune-plan FILE`), or
chosen by dynamic programming under a latency budget (`--prune-plan auto --latency-budget MS`), as the
ICPADS 2023 N:M compiler chose each layer's sparsity under a time budget.

The auto plan, for the candidate layers (prunable, on the CPU, chosen by `--prune-layers`):
- **options**: each layer stays dense or takes one of the candidate methods (`--prune 2:4,1:4`);
- **time** of an option: the layer's kernel measured alone on this host (the backend's `time_layers`): the
  dense kernel, or for a method the faster of its sparse kernel and the dense one, since the build keeps
  the dense kernel where the sparse one is not faster;
- **loss** of an option: its sensitivity, 1 - the cosine similarity of the model's outputs to the dense
  model's with only this layer pruned by this method (the smallest over the outputs), on calibration samples
  holding at most `SENSITIVITY_ROWS` batch rows (8 samples of a batch-4 model, 2 of a batch-16 one, at least
  1). Losses are added up, a first-order estimate: the chosen plan's own fidelity is then measured whole
  (the compress stage's report);
- **predicted time** of a plan: the dense CPU segments' measured time less what each pruned layer's kernel
  saves over its dense kernel;
- **the choice**: the least total loss whose predicted time is within the budget. A knapsack over the time
  to save: savings counted in steps of `1/RESOLUTION` of it, each rounded down, so the plan chosen never
  predicts more than the budget (where rounding leaves no plan but the fastest within it, that one). An
  unreachable budget is refused with the fastest plan's prediction.

A plan file is JSON: `{"format": "edgesdk-prune-plan/1", "layers": {"<layer>": "<method>" | "dense"}}`;
the auto plan is written in the same format with its table (`options`, `dense_ms`, `predicted_ms`), so a release
build can pin a plan measured once (`--prune-plan prune_plan.json`) and get the same weights on any host.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ..errors import UsageError, UserError
from ..ir.calibration import open_regular_file, utf8_text
from ..runtime.files import write_whole
from .fidelity import _joined, compare, run_samples
from .prune import Layer, PruneMethod, parse_method, prune_model

FORMAT = "edgesdk-prune-plan/1"
DENSE = "dense"
DEFAULT_CANDIDATES = "2:4,1:4"  # --prune-plan auto without --prune: the N:M levels
SENSITIVITY_ROWS = 32  # the sensitivities are measured on calibration samples holding at most this many batch rows
RESOLUTION = 2000  # the knapsack's steps over the time to save
MAX_PLAN_BYTES = 16 << 20  # a plan file: a line per layer and the auto plan's table
MAX_PLAN_DEPTH = 32  # a plan nests 4 levels (its table's options)


def parse_candidates(text: str) -> list[PruneMethod]:
    """`--prune` with `--prune-plan auto`: one method or several joined by ',' (each as `parse_method`)."""
    methods: dict[str, PruneMethod] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            raise UsageError("prune.bad-method", f"--prune {text!r}: an empty method in the list",
                             hint="join methods with ',', e.g. --prune 2:4,1:4")
        m = parse_method(part)
        methods.setdefault(m.text, m)
    return list(methods.values())


@dataclass(frozen=True)
class Option:
    """One way to run a layer: `method` (or DENSE), its kernel's measured time, and its sensitivity."""

    method: str
    ms: float
    loss: float
    kernel: str = "dense"  # the kernel the build will choose for it: "sparse" where measured faster


def sensitivity(dense: onnx.ModelProto, layers: Sequence[Layer], methods: Sequence[PruneMethod],
                samples: Sequence[Mapping[str, np.ndarray]],
                progress: Callable[[int, int], None] | None = None) -> dict[str, dict[str, float]]:
    """Each layer's loss under each method, alone: 1 - the least cosine similarity over the graph outputs
    of the model with that one layer pruned to the dense model, on `samples` (onnxruntime). `progress(i, n)`
    is called before each layer."""
    outputs = [o.name for o in dense.graph.output]
    reference = run_samples(dense, samples)
    out: dict[str, dict[str, float]] = {}
    for i, layer in enumerate(layers):
        if progress is not None:
            progress(i, len(layers))
        out[layer.name] = {}
        for method in methods:
            pruned, _ = prune_model(dense, method, [layer])
            runs = run_samples(pruned, samples)
            cosines = [compare(_joined(reference, o), _joined(runs, o))["cosine"] for o in outputs]
            out[layer.name][method.text] = max(0.0, 1.0 - min(cosines))
    return out


def options(layers: Sequence[Layer], times: Mapping[str, dict], loss: Mapping[str, Mapping[str, float]],
            methods: Sequence[PruneMethod], kernels: str = "measured") -> dict[str, list[Option]]:
    """Each layer's options: DENSE at its dense kernel's time, and each method at the time of the kernel the
    build will run it on (`kernels` "measured": the faster of the two; "sparse" or "dense": forced). `times`:
    by layer output, {"dense_ms", "sparse_ms": {method: ms}} (a backend's `time_layers`); a layer without
    times (no sparse kernel: Gemm, MatMul) has DENSE alone, since pruning it would save nothing."""
    out: dict[str, list[Option]] = {}
    for x in layers:
        t = times.get(x.output)
        if t is None:
            out[x.name] = [Option(DENSE, 0.0, 0.0)]
            continue
        out[x.name] = [Option(DENSE, t["dense_ms"], 0.0)]
        for m in methods:
            sparse_ms = t["sparse_ms"][m.text]
            kernel = kernels if kernels != "measured" else ("sparse" if sparse_ms < t["dense_ms"] else "dense")
            out[x.name].append(Option(m.text, sparse_ms if kernel == "sparse" else t["dense_ms"],
                                      loss[x.name][m.text], kernel))
    return out


def table(record: dict, chosen: Mapping[str, str]) -> list[str]:
    """An auto plan's record as log lines: each layer's options (time, loss, kernel) and its choice."""
    head = "tune: prune plan:"
    lines = [f"{head} {'layer':<28} {'option':<16} {'ms':>8} {'loss':>9}  chosen"]
    for name, opts in record["options"].items():
        for o in opts:
            label = name if o is opts[0] else ""
            label = label if len(label) <= 28 else label[:25] + "..."
            kernel = f" ({o['kernel']})" if o["method"] != DENSE else ""
            mark = "<-" if chosen.get(name) == o["method"] else ""
            lines.append(f"{head} {label:<28} {o['method'] + kernel:<16} {o['ms']:>8.3f} {o['loss']:>9.5f}  {mark}")
    lines.append(f"{head} dense {record['dense_ms']:.3f} ms, predicted {record['predicted_ms']:.3f} ms (budget "
                 f"{record['budget_ms']:g} ms, fastest {record['fastest_ms']:.3f} ms; the kernels' savings alone "
                 f"scaled by {record.get('scale', 1.0):.2f} to the whole segments'), summed loss {record['loss']:.5f}")
    return lines


@dataclass(frozen=True)
class Chosen:
    layers: dict[str, str]  # every candidate layer: its method, or DENSE
    predicted_ms: float  # the plan's predicted CPU time
    dense_ms: float  # the dense model's
    fastest_ms: float  # the fastest plan's
    loss: float  # the summed sensitivity of the choice
    scale: float = 1.0  # the whole model's saving per millisecond its kernels save alone


def fastest(options: Mapping[str, Sequence[Option]]) -> dict[str, str]:
    """The fastest plan: each layer on its option that saves the most over its DENSE one (of equal savings,
    the least loss), DENSE where none saves anything."""
    out = {}
    for n, opts in options.items():
        base = next(o.ms for o in opts if o.method == DENSE)
        out[n] = min(opts, key=lambda o: (-max(0.0, base - o.ms), o.loss, o.method != DENSE)).method
    return out


def choose(options: Mapping[str, Sequence[Option]], dense_ms: float, budget_ms: float,
           fastest_ms: float | None = None) -> Chosen:
    """The options of least summed loss whose predicted time is at most `budget_ms`: `dense_ms` less each
    layer's saving over its DENSE option, the savings scaled so that the fastest plan (`fastest`) predicts
    `fastest_ms` where that was measured whole (else unscaled). Each layer's options must include DENSE.
    Raises UserError "prune.budget-unreachable" when even the fastest plan predicts more than the budget."""
    names = list(options)
    base = {n: next(o.ms for o in options[n] if o.method == DENSE) for n in names}
    saving = {n: [max(0.0, base[n] - o.ms) for o in options[n]] for n in names}
    most = sum(max(s) for s in saving.values())
    # the kernels' savings, timed alone, to the whole model's: the layout edges and fusion they change
    scale = (dense_ms - fastest_ms) / most if fastest_ms is not None and most > 0 else 1.0
    saving = {n: [max(0.0, v * scale) for v in s] for n, s in saving.items()}
    fastest_ms = dense_ms - sum(max(s) for s in saving.values())
    need = dense_ms - budget_ms
    if need <= 0:
        return Chosen({n: DENSE for n in names}, dense_ms, dense_ms, fastest_ms, 0.0, scale)
    if fastest_ms > budget_ms + 1e-9:
        faster = sum(max(s) > 0 for s in saving.values())
        raise UserError("prune.budget-unreachable",
                        f"--latency-budget {budget_ms:g} ms cannot be met: the fastest plan (each of the {faster} "
                        f"layer(s) whose sparse kernel is faster pruned) is predicted at {fastest_ms:.3f} ms, the dense "
                        f"model at {dense_ms:.3f} ms",
                        hint=f"raise the budget to at least {math.ceil(fastest_ms * 100) / 100:g} ms, or add a "
                             "sparser method to --prune (e.g. --prune 2:4,1:4,magnitude:0.9)")
    steps = RESOLUTION
    unit = need / steps
    # savings in whole steps, rounded down (a hair under a whole step counts it)
    units = {n: [min(steps, int(math.floor(v / unit + 1e-9))) for v in saving[n]] for n in names}
    # cost[s]: the least loss of the layers so far that saves s steps (s = steps: at least that many);
    # back[i][s]: layer i's option and the state it came from
    cost = np.full(steps + 1, np.inf)
    cost[0] = 0.0
    back = []
    index = np.arange(steps + 1)
    for n in names:
        new = np.full(steps + 1, np.inf)
        option = np.zeros(steps + 1, dtype=np.int32)
        source = np.zeros(steps + 1, dtype=np.int64)
        for k, o in enumerate(options[n]):
            u = units[n][k]
            came = index - u  # the state each one comes from (< 0: unreachable by saving u)
            reached = np.where(came >= 0, cost[np.maximum(came, 0)], np.inf)
            if u:  # the cap: the best of every state that reaches it
                tail = steps - u + int(np.argmin(cost[steps - u:]))
                reached[steps], came[steps] = cost[tail], tail
            reached = reached + o.loss
            better = reached < new
            new[better], option[better], source[better] = reached[better], k, came[better]
        cost = new
        back.append((option, source))
    chosen: dict[str, str] = {}
    if np.isfinite(cost[steps]):
        s = steps
        for n, (option, source) in zip(reversed(names), reversed(back)):
            chosen[n] = options[n][int(option[s])].method
            s = int(source[s])
    else:  # only the fastest plans fit, with nothing to spare that whole steps could count: the least lossy
        for n in names:
            top = max(saving[n])
            chosen[n] = min((o for o, v in zip(options[n], saving[n]) if v == top), key=lambda o: o.loss).method
    chosen = {n: chosen[n] for n in names}
    pick = {n: [o.method for o in options[n]].index(chosen[n]) for n in names}
    predicted = dense_ms - sum(saving[n][pick[n]] for n in names)
    loss = sum(options[n][pick[n]].loss for n in names)
    return Chosen(chosen, predicted, dense_ms, fastest_ms, loss, scale)


def read_plan(path: Path, layers: Sequence[Layer]) -> dict[str, PruneMethod | None]:
    """A plan file: each named layer's method (None: dense). Refuses, naming the file and line, what is not
    such a file, a layer the model does not have among `layers` (its prunable ones), and a bad method."""
    where = str(path)
    with open_regular_file(Path(path), MAX_PLAN_BYTES, "prune.plan-unreadable", "give a plan file written by an "
                           "earlier build (OUT/.build/4-tune/prune_plan.json), or 'auto'", UsageError) as f:
        text = utf8_text(f.read(), where, "prune.plan-invalid", "save the plan as UTF-8 text (JSON)", UsageError)
    deep = _line_nested_past(text, MAX_PLAN_DEPTH)
    if deep is not None:  # the JSON parser recurses once per level: refused before it runs out of stack
        raise UsageError("prune.plan-invalid", f"{where}:{deep}: nested more than {MAX_PLAN_DEPTH} levels deep",
                         hint=f'a plan is {{"format": "{FORMAT}", "layers": {{"<layer>": "2:4" | "dense", ...}}}}')
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError("prune.plan-invalid", f"{where}:{e.lineno}: not JSON: {e.msg}",
                         hint=f'a plan is {{"format": "{FORMAT}", "layers": {{"<layer>": "2:4" | "dense", ...}}}}') from None
    if not isinstance(data, dict) or not isinstance(data.get("layers"), dict):
        raise UsageError("prune.plan-invalid", f"{where}: no \"layers\" object",
                         hint=f'a plan is {{"format": "{FORMAT}", "layers": {{"<layer>": "2:4" | "dense", ...}}}}')
    if data.get("format", FORMAT) != FORMAT:
        raise UsageError("prune.plan-invalid", f"{where}: format {data.get('format')!r}, expected {FORMAT!r}",
                         hint="write the plan again with this version of edgesdk")
    known = {x.name for x in layers}
    plan: dict[str, PruneMethod | None] = {}
    for name, method in data["layers"].items():
        line = _line_of(text, name)
        if name not in known:
            names = sorted(known)
            more = f" (and {len(names) - 10} more)" if len(names) > 10 else ""
            raise UsageError("prune.unknown-layer", f"{where}:{line}: the model has no prunable layer '{name}'",
                             hint=f"prunable layers: {', '.join(names[:10])}{more}" if names else
                             "the model has no prunable layer")
        if not isinstance(method, str):
            raise UsageError("prune.plan-invalid", f"{where}:{line}: layer '{name}': method {method!r} is not a string",
                             hint='a method such as "2:4", "magnitude:0.75", or "dense"')
        try:
            plan[name] = None if method == DENSE else parse_method(method)
        except UsageError as e:
            raise UsageError(e.code, f"{where}:{line}: layer '{name}': {e.message}", hint=e.hint) from None
    return plan


def _line_nested_past(text: str, depth: int) -> int | None:
    """The line where JSON `text` opens its (depth + 1)-th nested list or object, if it does (brackets
    inside strings do not count)."""
    level, line, in_string, escaped = 0, 1, False, False
    for c in text:
        if c == "\n":
            line += 1
        elif in_string:
            in_string = escaped or c != '"'
            escaped = not escaped and c == "\\"
        elif c == '"':
            in_string = True
        elif c in "[{":
            level += 1
            if level > depth:
                return line
        elif c in "]}":
            level -= 1
    return None


def _line_of(text: str, key: str) -> int:
    needle = json.dumps(key) + ":"
    for i, line in enumerate(text.splitlines(), 1):
        if needle in line.replace('" :', '":'):
            return i
    return 1


def write_plan(path: Path, layers: Mapping[str, str], **record) -> None:
    """The plan as a file `read_plan` reads back (written whole or not at all), with `record` beside."""
    data = {"format": FORMAT, "layers": dict(layers), **record}
    text = json.dumps(data, indent=2) + "\n"
    write_whole(path, lambda f: f.write(text.encode()))
