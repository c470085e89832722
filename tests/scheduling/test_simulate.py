"""The simulator against hand-computed timelines and against the two bounds any schedule obeys."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgesdk.scheduling.problem import Link, Problem, Tensor
from edgesdk.scheduling.simulate import link_of, one_inference, stream

TPU0, TPU1 = "edgetpu:0", "edgetpu:1"
LINK = Link(latency_ms=0.5, ms_per_byte=0.001)


def build(costs, tensors, overhead=None, link=LINK) -> Problem:
    """costs: per node {device: ms}; tensors: (nbytes, producer, consumers[, graph_output])."""
    accelerators = sorted({d for c in costs for d in c} - {"cpu"})
    return Problem(
        nodes=tuple(f"n{k}" for k in range(len(costs))),
        devices=("cpu", *accelerators),
        cost=tuple(costs),
        tensors=tuple(Tensor(f"t{i}", b, p, tuple(c), *rest) for i, (b, p, c, *rest) in enumerate(tensors)),
        overhead_ms=overhead or {},
        links={d: link for d in accelerators},
    )


def chain(costs, nbytes=1000, overhead=None) -> Problem:
    """x -> n0 -> t1 -> n1 -> ... -> graph output."""
    n = len(costs)
    tensors = [(nbytes, None, [0])] + [(nbytes, k, [k + 1] if k + 1 < n else [], k + 1 == n) for k in range(n)]
    return build(costs, tensors, overhead)


def io(p: Problem, i: int, j: int):
    made_here = lambda t: t.producer is not None and i <= t.producer < j
    ins = [t for t in p.tensors if not made_here(t) and any(i <= c < j for c in t.consumers)]
    outs = [t for t in p.tensors if made_here(t) and (t.graph_output or any(not i <= c < j for c in t.consumers))]
    return ins, outs


def segment_ms(p: Problem, i: int, j: int, d: str) -> float:
    """problem.py's formula, written out again here so the simulator is checked against it."""
    ms = p.overhead_ms.get(d, 0.0) + sum(p.cost[k][d] for k in range(i, j))
    if d != "cpu":
        ins, outs = io(p, i, j)
        ms += sum(p.links[d].ms(t.nbytes) for t in ins + outs)
    return ms


def critical_path(p: Problem, plan) -> float:
    """The finish time with unlimited devices and links: only data dependencies delay a task."""
    on_host = {t.name: 0.0 for t in p.tensors if t.producer is None}
    finish = 0.0
    for i, j, d in plan:
        hop = (lambda t: p.links[d].ms(t.nbytes)) if d != "cpu" else (lambda t: 0.0)
        ins, outs = io(p, i, j)
        end = max((on_host[t.name] + hop(t) for t in ins), default=0.0)
        end += p.overhead_ms.get(d, 0.0) + sum(p.cost[k][d] for k in range(i, j))
        on_host.update({t.name: end + hop(t) for t in outs})
        finish = max(finish, end, *(on_host[t.name] for t in outs))
    return finish


def assert_well_formed(p: Problem, tl, frames=1):
    for r in tl.resources:
        mine = sorted((e for e in tl.events if e.resource == r), key=lambda e: e.start_ms)
        for a, b in zip(mine, mine[1:]):
            assert a.end_ms <= b.start_ms + 1e-9, f"{r}: {a} overlaps {b}"
            assert a.frame <= b.frame, f"{r}: frame {b.frame} ran before frame {a.frame}"
        assert tl.busy_ms[r] <= tl.makespan_ms + 1e-9
        assert 0.0 <= tl.utilization[r] <= 1.0 + 1e-12
    assert len(tl.latency_ms) == frames


def test_chain_makespan_is_the_sum_of_segment_costs():
    p = chain([{"cpu": 3.0}, {"cpu": 9.0, TPU0: 1.0}, {"cpu": 9.0, TPU0: 2.0, TPU1: 1.5}, {"cpu": 1.0}],
              overhead={"cpu": 0.1, TPU0: 0.25, TPU1: 0.25})
    plan = [(0, 1, "cpu"), (1, 2, TPU0), (2, 3, TPU1), (3, 4, "cpu")]
    tl = one_inference(p, plan)
    expected = sum(segment_ms(p, *s) for s in plan)
    assert tl.makespan_ms == pytest.approx(expected, abs=1e-9)
    assert expected == pytest.approx(3.1 + (0.25 + 1.0 + 2 * 1.5) + (0.25 + 1.5 + 2 * 1.5) + 1.1)
    assert tl.latency_ms == (pytest.approx(expected),)
    # Each accelerator and its link together are busy exactly for their segments' cost.
    for s in plan[1:3]:
        assert tl.busy_ms[s[2]] + tl.busy_ms[link_of(s[2])] == pytest.approx(segment_ms(p, *s))
    assert_well_formed(p, tl)


def test_independent_branches_on_two_devices_overlap():
    # x feeds n0 (cpu) and n1 (edgetpu:0); both results are graph outputs.
    p = build([{"cpu": 4.0}, {"cpu": 9.0, TPU0: 2.0}],
              [(1000, None, [0, 1]), (1000, 0, [], True), (1000, 1, [], True)])
    plan = [(0, 1, "cpu"), (1, 2, TPU0)]
    tl = one_inference(p, plan)
    total = segment_ms(p, 0, 1, "cpu") + segment_ms(p, 1, 2, TPU0)
    assert tl.makespan_ms == pytest.approx(max(4.0, 1.5 + 2.0 + 1.5))
    assert tl.makespan_ms < total
    assert_well_formed(p, tl)


def test_two_transfers_on_one_link_take_turns():
    # n0 on edgetpu:0 reads two graph inputs: both cross the same link, one after the other.
    p = build([{"cpu": 9.0, TPU0: 1.0}], [(1000, None, [0]), (3000, None, [0]), (500, 0, [], True)])
    tl = one_inference(p, [(0, 1, TPU0)])
    transfers = sorted((e for e in tl.events if e.resource == link_of(TPU0)), key=lambda e: e.start_ms)
    assert [e.tensor for e in transfers] == ["t0", "t1", "t2"]
    assert transfers[0].end_ms == pytest.approx(1.5) and transfers[1].start_ms == pytest.approx(1.5)
    compute = next(e for e in tl.events if e.kind == "compute")
    assert compute.start_ms == pytest.approx(1.5 + 3.5)
    assert tl.makespan_ms == pytest.approx(1.5 + 3.5 + 1.0 + 1.0)


def test_transfers_on_two_links_do_not_wait_for_each_other():
    # The same two inputs, each read by a different accelerator: both transfers start at t=0.
    p = build([{"cpu": 9.0, TPU0: 1.0}, {"cpu": 9.0, TPU1: 1.0}],
              [(1000, None, [0]), (3000, None, [1]), (500, 0, [], True), (500, 1, [], True)])
    tl = one_inference(p, [(0, 1, TPU0), (1, 2, TPU1)])
    assert [e.start_ms for e in tl.events if e.kind == "transfer" and e.tensor in ("t0", "t1")] == [0.0, 0.0]
    assert tl.makespan_ms == pytest.approx(3.5 + 1.0 + 1.0)


def test_a_segment_waits_for_its_producer_transfer_out():
    # n0 on edgetpu:0, n1 on the cpu: n1 starts only once t1 is back on the host.
    p = chain([{"cpu": 9.0, TPU0: 2.0}, {"cpu": 1.0}])
    tl = one_inference(p, [(0, 1, TPU0), (1, 2, "cpu")])
    cpu = next(e for e in tl.events if e.resource == "cpu")
    assert cpu.start_ms == pytest.approx(1.5 + 2.0 + 1.5)


def test_pipeline_throughput_approaches_the_bottleneck_stage():
    p = chain([{"cpu": 4.0}, {"cpu": 9.0, TPU0: 3.0}, {"cpu": 9.0, TPU1: 2.0}], overhead={TPU0: 0.5, TPU1: 0.5})
    plan = [(0, 1, "cpu"), (1, 2, TPU0), (2, 3, TPU1)]
    stages = [segment_ms(p, *s) for s in plan]      # 4.0, 6.5, 5.5
    tl = stream(p, plan, frames=50)
    assert tl.throughput_fps == pytest.approx(1000.0 / max(stages), rel=0.02)
    assert tl.latency_ms[0] == pytest.approx(sum(stages))
    assert tl.makespan_ms < 50 * sum(stages) * 0.5     # frames really overlap
    assert_well_formed(p, tl, frames=50)
    # All frames at once queue up in front of edgetpu:0; paced at the bottleneck, none waits.
    assert tl.latency_ms[-1] > 5 * sum(stages)
    paced = stream(p, plan, frames=50, interval_ms=max(stages))
    assert paced.latency_ms == pytest.approx([sum(stages)] * 50)
    assert paced.throughput_fps == pytest.approx(1000.0 / max(stages))


def test_one_device_stream_gets_no_speedup():
    p = chain([{"cpu": 2.0}, {"cpu": 3.0}])
    tl = stream(p, [(0, 1, "cpu"), (1, 2, "cpu")], frames=10)
    assert tl.makespan_ms == pytest.approx(50.0)
    assert tl.throughput_fps == pytest.approx(200.0)
    assert tl.utilization["cpu"] == pytest.approx(1.0)


def test_replicas_take_frames_in_turn_and_share_the_cpu():
    """The model on two TPUs, frames dealt in turn: each TPU takes every other frame, so a TPU-bound
    stream runs twice as fast as on one TPU; the CPU tail they share is then the bottleneck if longer."""
    p = chain([{"cpu": 9.0, TPU0: 4.0, TPU1: 4.0}, {"cpu": 1.0}], overhead={TPU0: 0.5, TPU1: 0.5})
    on = {tpu: [(0, 1, tpu), (1, 2, "cpu")] for tpu in (TPU0, TPU1)}
    one = stream(p, on[TPU0], frames=60)
    two = stream(p, on[TPU0], frames=60, replicas=[on[TPU1]])
    tpu_stage = segment_ms(p, 0, 1, TPU0)                      # 0.5 + 4 + two link transfers of 1000 bytes
    assert one.throughput_fps == pytest.approx(1000.0 / tpu_stage, rel=0.02)
    assert two.throughput_fps == pytest.approx(2 * one.throughput_fps, rel=0.02)
    assert two.latency_ms[0] == pytest.approx(one.latency_ms[0])
    frames_on = {tpu: {e.frame for e in two.events if e.resource == tpu} for tpu in (TPU0, TPU1)}
    assert frames_on[TPU0] == set(range(0, 60, 2)) and frames_on[TPU1] == set(range(1, 60, 2))
    assert_well_formed(p, two, frames=60)
    # a CPU tail longer than half a TPU stage: the shared CPU bounds the replicated stream
    slow_tail = chain([{"cpu": 9.0, TPU0: 4.0, TPU1: 4.0}, {"cpu": 4.0}], overhead={TPU0: 0.5, TPU1: 0.5})
    bound = stream(slow_tail, on[TPU0], frames=60, replicas=[on[TPU1]])
    assert bound.throughput_fps == pytest.approx(1000.0 / 4.0, rel=0.02)
    with pytest.raises(ValueError, match="n1 cannot run on edgetpu:1"):
        stream(p, on[TPU0], frames=2, replicas=[[(0, 2, TPU1)]])


@pytest.mark.parametrize("plan, says", [
    ([(0, 1, "cpu")], "plan ends at node 1"),
    ([(0, 1, "cpu"), (2, 2, "cpu")], "does not continue at node 1"),
    ([(0, 2, TPU0)], "n0 cannot run on edgetpu:0"),
    ([(0, 2, "gpu:0")], "no device gpu:0"),
])
def test_bad_plans_are_refused(plan, says):
    p = chain([{"cpu": 1.0}, {"cpu": 1.0, TPU0: 1.0}])
    with pytest.raises(ValueError, match=says):
        one_inference(p, plan)


ms = st.floats(0.0, 10.0, allow_nan=False).map(lambda x: round(x, 2))


@st.composite
def problems_and_plans(draw):
    n = draw(st.integers(1, 6))
    costs = [{"cpu": draw(ms), **{d: draw(ms) for d in (TPU0, TPU1) if draw(st.booleans())}} for _ in range(n)]
    costs[0].setdefault(TPU0, 1.0)    # so both links exist
    costs[0].setdefault(TPU1, 1.0)
    later = lambda k: st.lists(st.integers(k + 1, n - 1), unique=True).map(sorted) if k + 1 < n else st.just([])
    tensors = [(draw(st.integers(0, 4000)), None, draw(later(-1)))]
    for k in range(n):
        consumers = draw(later(k))
        tensors.append((draw(st.integers(0, 4000)), k, consumers, not consumers or draw(st.booleans())))
    link = Link(draw(ms), draw(st.sampled_from([0.0, 0.0005, 0.002])))
    p = build(costs, tensors, {d: draw(ms) for d in ("cpu", TPU0, TPU1)}, link)
    cuts = sorted(draw(st.sets(st.integers(1, n - 1)))) if n > 1 else []
    bounds = [0, *cuts, n]
    plan = [(i, j, draw(st.sampled_from([d for d in p.devices if all(p.can(k, d) for k in range(i, j))])))
            for i, j in zip(bounds, bounds[1:])]
    return p, plan


@settings(max_examples=300, deadline=None)
@given(problems_and_plans(), st.integers(1, 4))
def test_makespan_lies_between_critical_path_and_no_overlap(case, frames):
    p, plan = case
    tl = one_inference(p, plan)
    total = sum(segment_ms(p, *s) for s in plan)
    assert critical_path(p, plan) - 1e-9 <= tl.makespan_ms <= total + 1e-9
    for d in p.devices:
        assert tl.busy_ms[d] + tl.busy_ms.get(link_of(d), 0.0) == pytest.approx(
            sum(segment_ms(p, *s) for s in plan if s[2] == d), abs=1e-9)
    assert_well_formed(p, tl)
    many = stream(p, plan, frames)
    assert many.makespan_ms <= frames * total + 1e-9
    assert many.latency_ms[0] == pytest.approx(tl.makespan_ms)
    assert_well_formed(p, many, frames)


def test_gantt_writes_a_png(tmp_path):
    from edgesdk.scheduling.simulate import gantt, one_inference

    p = build([{"cpu": 4.0}, {"cpu": 9.0, TPU0: 2.0}],
              [(1000, None, [0, 1]), (1000, 0, [], True), (1000, 1, [], True)])
    out = gantt(one_inference(p, [(0, 1, "cpu"), (1, 2, TPU0)]), tmp_path / "g.png", "two branches")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000


@settings(max_examples=200, deadline=None)
@given(problems_and_plans(), st.integers(1, 4), st.integers(1, 3))
def test_the_runtimes_stream_is_costed_by_segment_and_bounded(case, frames, depth):
    """`tasks` gives each segment its `placement.segment_ms` (the reference definition) and waits for
    the segments producing its inputs; `worker_stream` keeps each device busy exactly the sum of its
    tasks, finishes no later than everything one after another and no sooner than one frame's
    critical path, and one frame in flight at a time takes frames times one frame's time."""
    from edgesdk.scheduling.placement import segment_ms as reference
    from edgesdk.scheduling.simulate import tasks, worker_stream

    p, plan = case
    run = tasks(p, plan)
    assert [t.ms for t in run] == pytest.approx([reference(p, *s) for s in plan], abs=1e-9)
    for s, t in enumerate(run):
        ins = {p.tensors[x].producer for x in range(len(p.tensors)) if p.tensors[x].producer is not None
               and not plan[s][0] <= p.tensors[x].producer < plan[s][1]
               and any(plan[s][0] <= c < plan[s][1] for c in p.tensors[x].consumers)}
        assert set(t.after) == {f"s{k}" for k, (i, j, _) in enumerate(plan) if any(i <= q < j for q in ins)}
    total = sum(t.ms for t in run)
    flow = worker_stream([run], frames, depth)
    for d in {t.device for t in run}:
        assert flow.busy_ms[d] == pytest.approx(frames * sum(t.ms for t in run if t.device == d), abs=1e-9)
    assert critical_path(p, plan) - 1e-9 <= flow.makespan_ms <= frames * total + 1e-9
    one = worker_stream([run], 1, 1).makespan_ms
    assert worker_stream([run], frames, 1).makespan_ms == pytest.approx(frames * one, abs=1e-9)
