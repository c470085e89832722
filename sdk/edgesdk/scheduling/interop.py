"""Inter-operator parallelism in a plan: each CPU run of the placement re-scheduled by the IOS-style DP
of `scheduling.parallel` into stages whose independent groups run at once on worker threads.

A stage of several groups becomes one segment per group (a parallel step); a plan is taken only when
`parallel.refusal` finds nothing against it (its predicted gain reaches `parallel.MIN_GAIN`),
otherwise the run stays one segment and the summary says why.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from ..devices.cost import is_grouped, node_bytes, node_flops, node_ms, tensor_bytes
from . import parallel
from .problem import Problem
from .segments import PlannedSegment

SEARCH = ("sequences of stages inside blocks of at most 14 units of the run's topological order "
          "(cut where fewest edges cross), units being linear clusters or single nodes (both solved, "
          "the better kept); a stage's groups are its weakly connected components, at most one per "
          "core; optimal within that space (IOS-style DP)")


@dataclass(frozen=True)
class InterOp:
    runs: list[PlannedSegment]  # a taken parallel stage's groups are runs of their own, next to each other
    steps: list[list[str]]  # the parallel steps as segment ids
    plans: dict[int, parallel.ParallelPlan]  # per placed run that takes one, its parallel plan
    not_taken: dict[int, tuple[parallel.ParallelPlan, str]]  # per placed run the DP saw that stays one segment


class _CpuCosts:
    """Per node of the graph, the terms of `parallel.Run` on the target's CPU: its time on some threads,
    the copy of its outputs out of one segment into the next, its memory traffic."""

    def __init__(self, model: onnx.ModelProto, target, problem: Problem, shapes, consts, backend: dict[int, str]):
        g = model.graph
        self.backend = backend  # node -> the CPU backend of its run: its figures cost the node
        cpu = target.host
        self.graph, self.target, self.cores = g, target, cpu.cores
        self.dispatch_ms = cpu.step_dispatch.value * 1e-3
        self.terms = [(node_flops(n, shapes), *node_bytes(n, shapes, consts), is_grouped(n)) for n in g.node]
        self.out_bytes = [sum(tensor_bytes(shapes.get(t)) for t in n.output if t) for n in g.node]
        self.producer = {t.name: t.producer for t in problem.tensors if t.producer is not None}
        self.copy_ms_per_byte = 2e3 / (cpu.memory_bandwidth.value * 1e9)  # out of one segment, into the next
        self.memory_ms = [1e3 * (params + acts) / (cpu.memory_bandwidth.value * 1e9)
                          for _, params, acts, _ in self.terms]

    def cost(self, n: int, threads: int) -> float:
        flops, params, acts, grouped = self.terms[n]
        return node_ms(self.target, "cpu", flops=flops, param_bytes=params, act_bytes=acts, grouped=grouped,
                       threads=threads, backend=self.backend.get(n))

    def schedule(self, nodes: list[int]) -> parallel.ParallelPlan:
        inside = set(nodes)
        preds = {n: frozenset(self.producer[t] for t in self.graph.node[n].input if self.producer.get(t) in inside)
                 for n in nodes}
        return parallel.schedule(parallel.Run(tuple(nodes), preds,
                                              {n: self.out_bytes[n] * self.copy_ms_per_byte for n in nodes},
                                              {n: self.memory_ms[n] for n in nodes}),
                                 self.cost, self.cores, dispatch_ms=self.dispatch_ms)


def parallelize(placed: list[PlannedSegment], problem: Problem, model: onnx.ModelProto, target, shapes, consts,
                enabled: bool) -> InterOp:
    """Re-schedule each CPU run of three nodes or more into stages of concurrent groups, where the
    target's CPU has more than one core and a `step_dispatch` figure."""
    cpu = target.host
    if not enabled or cpu.cores < 2 or cpu.step_dispatch is None:
        return InterOp(placed, [], {}, {})
    costs = _CpuCosts(model, target, problem, shapes, consts,
                      {n: r.backend for r in placed if r.device == "cpu" for n in r.nodes})
    runs: list[PlannedSegment] = []
    steps: list[list[str]] = []
    plans: dict[int, parallel.ParallelPlan] = {}
    not_taken: dict[int, tuple[parallel.ParallelPlan, str]] = {}
    for i, r in enumerate(placed):
        if r.device != "cpu" or len(r.nodes) < 3:
            runs.append(r)
            continue
        found = costs.schedule(r.nodes)
        why = parallel.refusal(found)
        if why is not None:
            not_taken[i] = found, why
            runs.append(r)
            continue
        plans[i] = found
        _append_stages(runs, steps, r, found, costs)
    return InterOp(runs, steps, plans, not_taken)


def _append_stages(runs: list[PlannedSegment], steps: list[list[str]], r: PlannedSegment,
                   found: parallel.ParallelPlan, costs: _CpuCosts) -> None:
    """The run `r` as `found` stages it: consecutive one-group stages as one run, each group of a
    parallel stage as a run of its own (a parallel step)."""
    inside = set(r.nodes)
    for st in found.stages:
        if not st.parallel:
            if runs and runs[-1].device == "cpu" and runs[-1].threads == 0 and runs[-1].backend == r.backend \
                    and runs[-1].nodes and runs[-1].nodes[-1] in inside:
                runs[-1].nodes.extend(st.groups[0])
            else:
                runs.append(PlannedSegment("cpu", r.backend, list(st.groups[0])))
            continue
        steps.append([f"s{len(runs) + k}" for k in range(len(st.groups))])
        for group, threads in zip(st.groups, st.threads):
            runs.append(PlannedSegment("cpu", r.backend, list(group), threads,
                                       sum(costs.cost(n, threads) for n in group)))


def summary(inter_op: InterOp, placed: list[PlannedSegment]) -> dict:
    """The plan's `inter_op`: the runs that take a parallel plan, those that do not and why (empty when
    the DP saw no run)."""
    if not inter_op.plans and not inter_op.not_taken:
        return {}

    def one(i: int, p: parallel.ParallelPlan) -> dict:
        return {"nodes": len(placed[i].nodes), "sequential_ms": round(p.sequential_ms, 4),
                "parallel_ms": round(p.ms, 4), "stages": len(p.stages),
                "parallel_stages": sum(st.parallel for st in p.stages), "blocks": p.blocks, "split_blocks": p.splits}

    return {"runs": [one(i, p) for i, p in sorted(inter_op.plans.items())],
            "not_taken": [{**one(i, p), "reason": f"inter-op parallelism not taken: {why}"}
                          for i, (p, why) in sorted(inter_op.not_taken.items())],
            "min_gain": parallel.MIN_GAIN,
            "search": SEARCH}
