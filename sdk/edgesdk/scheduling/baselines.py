"""Documented placement rules, reimplemented over the same fixed node order as our DP, so that a plan
from each can be costed and simulated side by side. Each returns segments `[(start, stop, device)]`
tiling 0..n. These are our readings of the documentation, not the vendors' code.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate, groupby

from .problem import Problem

TPU = "edgetpu:0"
Rule = Callable[[Problem], list[tuple[int, int, str]]]


def all_cpu(problem: Problem) -> list[tuple[int, int, str]]:
    return [(0, len(problem.nodes), "cpu")]


def _tpu_prefix(problem: Problem) -> int:
    """Coral's compiler maps ops to the Edge TPU up to the first one it cannot run; that op and
    everything after it stay on the CPU, even ops the TPU could run (coral.ai/docs/edgetpu/models-intro)."""
    n = len(problem.nodes)
    if TPU not in problem.devices:
        return 0
    return next((k for k in range(n) if not problem.can(k, TPU)), n)


def _with_cpu_tail(problem: Problem, tpu_segments: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    stop = tpu_segments[-1][1] if tpu_segments else 0
    tail = [(stop, len(problem.nodes), "cpu")] if stop < len(problem.nodes) else []
    return tpu_segments + tail


def coral_default(problem: Problem) -> list[tuple[int, int, str]]:
    """The TPU-capable prefix on edgetpu:0, the rest on the CPU (all CPU when node 0 cannot)."""
    m = _tpu_prefix(problem)
    return _with_cpu_tail(problem, [(0, m, TPU)] if m else [])


def coral_segments(problem: Problem, n: int) -> list[tuple[int, int, str]]:
    """`edgetpu_compiler --num_segments=n`: the TPU-capable prefix cut into n contiguous segments with
    about equal parameter data, segment s on edgetpu:s; the rest on the CPU.

    With W(i) the parameter bytes of nodes 0..i-1 and T = W(m), cut k (k = 1..n-1) is the i closest to
    k*T/n (the earliest on a tie), kept after cut k-1 and leaving a node for each later segment."""
    m = _tpu_prefix(problem)
    if m == 0:
        return all_cpu(problem)
    missing = [f"edgetpu:{s}" for s in range(n) if f"edgetpu:{s}" not in problem.devices]
    if n < 1 or missing or m < n or len(problem.weights_bytes) != len(problem.nodes):
        raise ValueError(f"cannot split a {m}-node Edge TPU prefix into {n} segments "
                         f"(devices missing: {missing or 'none'}, weights_bytes given for "
                         f"{len(problem.weights_bytes)} of {len(problem.nodes)} nodes)")
    w = [0, *accumulate(problem.weights_bytes[:m])]
    cuts = [0]
    for k in range(1, n):
        cuts.append(min(range(cuts[-1] + 1, m - (n - k) + 1), key=lambda i: abs(w[i] - k * w[m] / n)))
    cuts.append(m)
    return _with_cpu_tail(problem, [(a, b, f"edgetpu:{s}") for s, (a, b) in enumerate(zip(cuts, cuts[1:]))])


def _coral(ids: list[str]) -> dict[str, Rule]:
    rules: dict[str, Rule] = {"coral default (first unsupported op onwards on the cpu)": coral_default}
    if len(ids) > 1:
        rules[f"coral --num_segments {len(ids)} (parameter-count split)"] = lambda p: coral_segments(p, len(ids))
    return rules


def coral_replicated(problem: Problem, ids: list[str]) -> list[list[tuple[int, int, str]]]:
    """Coral's data parallelism: the same model loaded on every TPU, a new input going to a TPU that is
    not busy; its documentation (coral.ai/docs/edgetpu/pipeline) says this works best when the model
    fits one TPU's cache (~8 MB), and recommends pipelining otherwise. One plan per TPU of `ids`:
    Coral's default with that TPU in edgetpu:0's place, for `simulate.worker_stream` to
    deal frames to in turn (a fixed rotation: with equal TPUs, the one that is free), each TPU holding
    all the weights (`cache.recost` over the plans prices them so)."""
    if _tpu_prefix(problem) == 0:
        raise ValueError("no node at the start of the graph runs on the Edge TPU: nothing to replicate")
    base = coral_default(problem)
    return [[(i, j, tpu if d == TPU else d) for i, j, d in base] for tpu in ids]


# a device kind's vendor rules, by the kind's instance ids in the target -> {name shown in the plan: rule}
VENDOR_RULES: dict[str, Callable[[list[str]], dict[str, Rule]]] = {"edgetpu": _coral}
# a device kind's vendor's data-parallel advice: (name shown in the plan, plans per instance)
VENDOR_REPLICATION: dict[str, tuple[str, Callable[[Problem, list[str]], list[list[tuple[int, int, str]]]]]] = {
    "edgetpu": ("coral replication (the model on every edge tpu, frames dealt in turn)", coral_replicated)}


def vendor_rules(kind: str, ids: list[str]) -> dict[str, Rule]:
    """The documented placement rules of `kind`'s vendor for a target with the instances `ids` of it."""
    return VENDOR_RULES[kind](ids) if kind in VENDOR_RULES and ids else {}


def greedy(problem: Problem) -> list[tuple[int, int, str]]:
    """ONNX Runtime-style priority assignment: each node goes to the first accelerator kind (in the
    problem's device order) that can run it, else the CPU; maximal runs of one kind form segments,
    and the runs of a kind are dealt round-robin over its instances."""
    instances: dict[str, list[str]] = {}
    for d in problem.devices:
        if d != "cpu":
            instances.setdefault(problem.kind(d), []).append(d)
    kind_of = [next((kind for kind, ds in instances.items() if problem.can(k, ds[0])), "cpu")
               for k in range(len(problem.nodes))]
    segments, dealt, start = [], dict.fromkeys(instances, 0), 0
    for kind, run in groupby(kind_of):
        stop = start + len(list(run))
        if kind == "cpu":
            device = "cpu"
        else:
            device = instances[kind][dealt[kind] % len(instances[kind])]
            dealt[kind] += 1
        segments.append((start, stop, device))
        start = stop
    return segments
