"""Placement DP (`scheduling.placement`): segment costs against the definition, the DP against brute
force over its space and over all per-node assignments, round-robin over identical instances, the
infeasible case, a 1,200-node graph, and the gap to the unrestricted optimum.

About 2.5 s on the 2-core build machine (1.4 s of it the gap test, 3^8 assignments twice per graph).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgesdk.scheduling.placement import (
    Plan,
    SegmentCosts,
    Span as Segment,
    exhaustive_assignments,
    exhaustive_segments,
    gap_to_unrestricted,
    place,
    segment_ms,
    sequential_ms,
)
from edgesdk.scheduling.problem import Link, Problem, Tensor
from tests.scheduling.graphs import random_problem

TOL = 1e-9
DEVICE_SETS = [("cpu",), ("cpu", "edgetpu:0"), ("cpu", "edgetpu:0", "edgetpu:1"), ("cpu", "edgetpu:0", "gpu:0")]


@st.composite
def problems(draw, max_nodes=10, chain=None):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return random_problem(rng, draw(st.integers(1, max_nodes)), draw(st.sampled_from(DEVICE_SETS)),
                          chain=draw(st.booleans()) if chain is None else chain,
                          p_edge=draw(st.sampled_from([0.0, 0.3, 0.8])),
                          capable_fraction=draw(st.sampled_from([0.0, 0.5, 0.9, 1.0])))


def check_plan(problem: Problem, plan: Plan):
    """Segments cover 0..n-1 in order, each on a device that runs all its nodes; cost_ms is theirs."""
    n = len(problem.nodes)
    assert [s.start for s in plan.segments] == [0] + [s.stop for s in plan.segments[:-1]]
    assert plan.segments[-1].stop == n
    assert all(s.start < s.stop and all(problem.can(k, s.device) for k in range(s.start, s.stop))
               for s in plan.segments)
    assert len(plan.assignment()) == n
    assert math.isfinite(plan.cost_ms)
    assert plan.cost_ms == pytest.approx(sequential_ms(problem, plan), abs=TOL)


def chain(costs: list[dict[str, float]], nbytes: list[int], links: dict[str, Link],
          overhead: dict[str, float] | None = None) -> Problem:
    """Nodes n0..n{k-1} in a chain: tensor t0 (graph input) -> n0 -> t1 -> ... -> t{k} (graph output)."""
    k = len(costs)
    tensors = tuple(Tensor(f"t{s}", nbytes[s], None if s == 0 else s - 1, (s,) if s < k else (), s == k)
                    for s in range(k + 1))
    devices = ("cpu", *sorted({d for c in costs for d in c} - {"cpu"}))
    return Problem(tuple(f"n{i}" for i in range(k)), devices, tuple(costs), tensors, overhead or {}, links)


def test_segment_ms_by_hand():
    link = Link(latency_ms=0.5, ms_per_byte=0.001)
    p = chain([{"cpu": 4.0, "edgetpu:0": 1.0}, {"cpu": 6.0, "edgetpu:0": 2.0}], [1000, 2000, 3000],
              {"edgetpu:0": link}, {"cpu": 0.1, "edgetpu:0": 0.25})
    # both nodes on the TPU: overhead + compute + in t0 + out t2; t1 stays on the chip
    assert segment_ms(p, 0, 2, "edgetpu:0") == pytest.approx(0.25 + 3.0 + (0.5 + 1.0) + (0.5 + 3.0))
    # n0 alone: t1 leaves over the link
    assert segment_ms(p, 0, 1, "edgetpu:0") == pytest.approx(0.25 + 1.0 + (0.5 + 1.0) + (0.5 + 2.0))
    assert segment_ms(p, 0, 2, "cpu") == pytest.approx(0.1 + 10.0)        # no link on the host
    assert segment_ms(p, 0, 2, "gpu:0") == math.inf
    rows = SegmentCosts(p).row(0, p.devices)
    assert rows["edgetpu:0"].tolist() == pytest.approx([0.25 + 1.0 + 1.5 + 2.5, 0.25 + 3.0 + 1.5 + 3.5])
    plan = place(p)
    assert plan.segments == (Segment(0, 2, "edgetpu:0"),) and plan.cost_ms == pytest.approx(8.25)


def test_input_used_twice_counts_once_and_graph_output_leaves():
    # t0 feeds n0 and n1; n0's output t1 is a graph output that n1 also reads; n1 -> t2
    link = Link(latency_ms=1.0, ms_per_byte=0.0)
    tensors = (Tensor("t0", 10, None, (0, 1)), Tensor("t1", 10, 0, (1,), graph_output=True),
               Tensor("t2", 10, 1, (), graph_output=True))
    p = Problem(("n0", "n1"), ("cpu", "edgetpu:0"), ({"cpu": 1.0, "edgetpu:0": 0.0},) * 2, tensors,
                {}, {"edgetpu:0": link})
    assert segment_ms(p, 0, 2, "edgetpu:0") == 3.0       # t0 in once; t1 and t2 out
    assert segment_ms(p, 1, 2, "edgetpu:0") == 3.0       # t0 and t1 in; t2 out
    assert SegmentCosts(p).row(0, p.devices)["edgetpu:0"].tolist() == [2.0, 3.0]
    assert SegmentCosts(p).row(1, p.devices)["edgetpu:0"].tolist() == [3.0]


@settings(max_examples=60, deadline=None)
@given(problems())
def test_segment_rows_match_the_definition(p):
    costs = SegmentCosts(p)
    n = len(p.nodes)
    for i in range(n):
        row = costs.row(i, p.devices)
        for d in p.devices:
            expected = [segment_ms(p, i, j, d) for j in range(i + 1, n + 1)]
            assert row[d].tolist() == pytest.approx(expected, abs=TOL)


@settings(max_examples=80, deadline=None)
@given(problems())
def test_dp_equals_brute_force_over_segments(p):
    plan, brute = place(p), exhaustive_segments(p)
    check_plan(p, plan)
    assert plan.cost_ms == pytest.approx(brute.cost_ms, abs=TOL)


@settings(max_examples=40, deadline=None)
@given(problems(max_nodes=9, chain=True))
def test_dp_equals_all_assignments_on_chains(p):
    _, best = exhaustive_assignments(p)
    assert place(p).cost_ms == pytest.approx(best, abs=TOL)


@settings(max_examples=80, deadline=None)
@given(problems(max_nodes=30))
def test_never_worse_than_all_cpu_and_no_adjacent_segments_on_one_instance(p):
    plan = place(p)
    check_plan(p, plan)
    assert plan.cost_ms <= segment_ms(p, 0, len(p.nodes), "cpu") + TOL
    # the DP's plan is the run decomposition of its own assignment (gap_to_unrestricted relies on it)
    assert all(a.device != b.device for a, b in zip(plan.segments, plan.segments[1:]))


def test_identical_tpus_alternate():
    link = Link(0.1, 1e-6)
    tpu = {"cpu": 10.0, "edgetpu:0": 1.0, "edgetpu:1": 1.0}
    p = chain([tpu, {"cpu": 1.0}, tpu, {"cpu": 1.0}, tpu], [100] * 6, {"edgetpu:0": link, "edgetpu:1": link})
    assert [s.device for s in place(p).segments] == ["edgetpu:0", "cpu", "edgetpu:1", "cpu", "edgetpu:0"]


def test_different_tpus_are_not_dealt_round_robin():
    # edgetpu:1 sits behind a slower link: every TPU segment goes to edgetpu:0
    tpu = {"cpu": 10.0, "edgetpu:0": 1.0, "edgetpu:1": 1.0}
    p = chain([tpu, {"cpu": 1.0}, tpu], [100] * 4, {"edgetpu:0": Link(0.1, 1e-6), "edgetpu:1": Link(0.2, 1e-6)})
    assert [s.device for s in place(p).segments] == ["edgetpu:0", "cpu", "edgetpu:0"]


def test_a_node_no_device_runs_is_named():
    p = chain([{"cpu": 1.0}, {}, {"edgetpu:0": 1.0}, {}], [10] * 5, {"edgetpu:0": Link(0.1, 0.0)})
    with pytest.raises(ValueError, match=r"no device can run node\(s\) n1, n3"):
        place(p)
    with pytest.raises(ValueError, match="n1, n3"):
        exhaustive_segments(p)


def test_empty_single_device_and_ties():
    empty = Problem((), ("cpu",), (), (Tensor("x", 4, None, (), True),))
    assert place(empty) == Plan((), 0.0)
    p = chain([{"cpu": 1.0}, {"cpu": 2.0}], [1, 1, 1], {}, {"cpu": 0.5})
    assert place(p) == Plan((Segment(0, 2, "cpu"),), 3.5)
    # no overhead: every split costs the same as one segment, and the tie keeps one segment
    p = chain([{"cpu": 1.0}, {"cpu": 2.0}, {"cpu": 0.5}], [1] * 4, {})
    assert place(p) == Plan((Segment(0, 3, "cpu"),), 3.5)


def test_1200_nodes_three_devices_is_quick():
    p = random_problem(np.random.default_rng(0), 1200, ("cpu", "edgetpu:0", "edgetpu:1"))
    start = time.perf_counter()
    plan = place(p)
    seconds = time.perf_counter() - start
    print(f"place: 1200 nodes, {len(p.tensors)} tensors, 3 devices in {seconds:.3f} s, "
          f"{len(plan.segments)} segments, {plan.cost_ms:.1f} ms (all-CPU {segment_ms(p, 0, 1200, 'cpu'):.1f} ms)")
    assert seconds < 30
    check_plan(p, plan)


def overlapped_ms(problem: Problem, plan: Plan) -> float:
    """A stand-in for the simulator: segments start in plan order once their device is free and the
    segments that produce their inputs have finished; the makespan. Segments on different devices
    overlap, which the sequential objective does not credit."""
    finish: list[float] = []
    free: dict[str, float] = {}
    where = {}
    for k, s in enumerate(plan.segments):
        for node in range(s.start, s.stop):
            where[node] = k
        needs = {where[t.producer] for t in problem.tensors
                 if t.producer is not None and t.producer < s.start and any(s.start <= c < s.stop for c in t.consumers)}
        start = max([free.get(s.device, 0.0)] + [finish[m] for m in needs])
        finish.append(start + segment_ms(problem, *s))
        free[s.device] = finish[-1]
    return max(finish, default=0.0)


def test_gap_to_unrestricted():
    gaps = {"sequential": [], "overlapped": []}
    for seed in range(6):
        p = random_problem(np.random.default_rng(seed), 8, ("cpu", "edgetpu:0", "gpu:0"), p_edge=0.5)
        dp, best = gap_to_unrestricted(p)
        assert dp == pytest.approx(best, abs=TOL)          # equal under the sequential objective
        gaps["sequential"].append(dp / best - 1)
        dp, best = gap_to_unrestricted(p, overlapped_ms)
        assert dp >= best - TOL
        gaps["overlapped"].append(dp / best - 1)
    for objective, values in gaps.items():
        print(f"gap of the DP to the best assignment, {objective}: "
              + ", ".join(f"{100 * g:.1f}%" for g in values))
