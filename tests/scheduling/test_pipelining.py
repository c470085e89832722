"""Pipelining (`scheduling.pipelining`): the two-pass DP against brute force over all cuts and injective
device assignments, a stream that two TPUs and the CPU serve faster than any single placement,
and the infeasible cases.

Under 1 s on the 2-core build machine.
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgesdk.scheduling.placement import Span as Segment, place, segment_ms
from edgesdk.scheduling.problem import Link, Problem
from edgesdk.scheduling.pipelining import Pipeline, pipeline
from tests.scheduling.graphs import random_problem
from tests.scheduling.test_placement import DEVICE_SETS, TOL, chain


def brute_force(problem: Problem, max_stages: int) -> tuple[float, float] | None:
    """(least bottleneck, least latency among pipelines within TOL of it), or None if none exists."""
    n, found = len(problem.nodes), []
    for k in range(1, min(max_stages, len(problem.devices), n) + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = (0, *cuts, n)
            for devices in itertools.permutations(problem.devices, k):
                stage_ms = [segment_ms(problem, a, b, d) for a, b, d in zip(bounds, bounds[1:], devices)]
                if all(map(math.isfinite, stage_ms)):
                    found.append((max(stage_ms), sum(stage_ms)))
    if not found:
        return None
    bottleneck = min(b for b, _ in found)
    return bottleneck, min(latency for b, latency in found if b <= bottleneck + TOL)


def check_pipeline(problem: Problem, result: Pipeline, max_stages: int):
    n = len(problem.nodes)
    stages = result.stages
    assert [s.start for s in stages] == [0] + [s.stop for s in stages[:-1]] and stages[-1].stop == n
    assert len({s.device for s in stages}) == len(stages) <= max_stages
    stage_ms = [segment_ms(problem, *s) for s in stages]
    assert result.bottleneck_ms == pytest.approx(max(stage_ms), abs=TOL)
    assert result.latency_ms == pytest.approx(sum(stage_ms), abs=TOL)
    assert result.throughput_fps == pytest.approx(1000 / result.bottleneck_ms)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 10), devices=st.sampled_from(DEVICE_SETS),
       chained=st.booleans(), capable_fraction=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
       max_stages=st.sampled_from([None, 1, 2]))
def test_dp_equals_brute_force(seed, n, devices, chained, capable_fraction, max_stages):
    p = random_problem(np.random.default_rng(seed), n, devices, chain=chained, capable_fraction=capable_fraction)
    limit = len(devices) if max_stages is None else max_stages
    expected = brute_force(p, limit)
    if expected is None:
        with pytest.raises(ValueError, match="no pipeline of at most"):
            pipeline(p, max_stages)
        return
    result = pipeline(p, max_stages)
    check_pipeline(p, result, limit)
    assert (result.bottleneck_ms, result.latency_ms) == pytest.approx(expected, abs=TOL)


def test_two_tpus_and_the_cpu_beat_any_single_placement():
    # six convolutions the TPUs run at 2 ms each, then a 3 ms post-processing step only the CPU runs
    link = Link(latency_ms=0.1, ms_per_byte=1e-6)
    tpu = {"cpu": 8.0, "edgetpu:0": 2.0, "edgetpu:1": 2.0}
    p = chain([tpu] * 6 + [{"cpu": 3.0}], [100_000] * 8, {"edgetpu:0": link, "edgetpu:1": link},
              {"cpu": 0.0, "edgetpu:0": 0.5, "edgetpu:1": 0.5})
    single = place(p)
    assert single.segments == (Segment(0, 6, "edgetpu:0"), Segment(6, 7, "cpu"))
    assert single.cost_ms == pytest.approx(0.5 + 12 + 0.2 + 0.2 + 3)         # 15.9 ms a frame
    result = pipeline(p)
    assert result.stages == (Segment(0, 3, "edgetpu:0"), Segment(3, 6, "edgetpu:1"), Segment(6, 7, "cpu"))
    assert result.bottleneck_ms == pytest.approx(0.5 + 6 + 0.2 + 0.2)          # 6.9 ms: 145 frames/s
    assert result.latency_ms == pytest.approx(2 * 6.9 + 3)
    assert result.throughput_fps > 2 * 1000 / single.cost_ms
    # two stages: the CPU takes one convolution off the TPU (10.9 ms) and the post-processing (11 ms)
    two = pipeline(p, max_stages=2)
    assert two.stages == (Segment(0, 5, "edgetpu:0"), Segment(5, 7, "cpu"))
    assert two.bottleneck_ms == pytest.approx(8 + 3)


def test_a_node_no_device_runs_is_named():
    p = chain([{"cpu": 1.0}, {"edgetpu:0": 1.0}, {}], [10] * 4, {"edgetpu:0": Link(0.1, 0.0)})
    with pytest.raises(ValueError, match=r"no device can run node\(s\) n2"):
        pipeline(p)


def test_no_pipeline_of_distinct_devices():
    # cpu, tpu, cpu: the CPU would need two stages
    p = chain([{"cpu": 1.0}, {"edgetpu:0": 1.0}, {"cpu": 1.0}], [10] * 4, {"edgetpu:0": Link(0.1, 0.0)})
    with pytest.raises(ValueError, match=r"no pipeline of at most 2 stage\(s\) on distinct devices"):
        pipeline(p)
    assert len(place(p).segments) == 3
    with pytest.raises(ValueError, match="max_stages must be at least 1"):
        pipeline(p, max_stages=0)


def test_1200_nodes():
    p = random_problem(np.random.default_rng(0), 1200, ("cpu", "edgetpu:0", "edgetpu:1"))
    start = time.perf_counter()
    result = pipeline(p)
    print(f"pipeline: 1200 nodes, 3 devices in {time.perf_counter() - start:.3f} s")
    check_pipeline(p, result, 3)
    assert result.bottleneck_ms <= segment_ms(p, 0, 1200, "cpu")   # one CPU stage is a pipeline
