"""Each documented placement rule on hand-built chains: which nodes go where."""

from __future__ import annotations

from dataclasses import replace

import pytest

from edgesdk.scheduling.baselines import all_cpu, coral_default, coral_replicated, coral_segments, greedy
from edgesdk.scheduling.problem import Link, Problem, Tensor
from edgesdk.scheduling.simulate import one_inference

TPU0, TPU1, TPU2, GPU = "edgetpu:0", "edgetpu:1", "edgetpu:2", "gpu:0"


def chain(runs_on: list[str], devices=("cpu", TPU0, TPU1), weights=None) -> Problem:
    """Node k runs on the cpu and on each device of kind in runs_on[k] ("tpu", "gpu", "both", "cpu")."""
    kinds = {"tpu": {"edgetpu"}, "gpu": {"gpu"}, "both": {"edgetpu", "gpu"}, "cpu": set()}
    cost = tuple({"cpu": 5.0, **{d: 1.0 for d in devices if d.split(":")[0] in kinds[r]}} for r in runs_on)
    n = len(runs_on)
    return Problem(
        nodes=tuple(f"n{k}" for k in range(n)), devices=tuple(devices), cost=cost,
        tensors=(Tensor("x", 100, None, (0,)),
                 *(Tensor(f"t{k}", 100, k, (k + 1,) if k + 1 < n else (), k + 1 == n) for k in range(n))),
        links={d: Link(0.1, 0.0) for d in devices if d != "cpu"},
        weights_bytes=tuple(weights or [0] * n),
    )


def test_all_cpu():
    assert all_cpu(chain(["tpu", "tpu", "cpu"])) == [(0, 3, "cpu")]


@pytest.mark.parametrize("runs_on, plan", [
    (["tpu", "tpu", "cpu", "tpu"], [(0, 2, TPU0), (2, 4, "cpu")]),   # n3 could run on the TPU: stays on the CPU
    (["tpu", "tpu", "tpu"], [(0, 3, TPU0)]),
    (["cpu", "tpu", "tpu"], [(0, 3, "cpu")]),                        # first op unsupported: nothing on the TPU
])
def test_coral_default_cuts_at_the_first_unsupported_node(runs_on, plan):
    assert coral_default(chain(runs_on)) == plan


def test_coral_default_without_an_edge_tpu_is_all_cpu():
    assert coral_default(chain(["gpu", "gpu"], devices=("cpu", GPU))) == [(0, 2, "cpu")]


def test_coral_segments_splits_by_parameter_bytes_not_node_count():
    # W(i) = 0 5 6 7 8 12 16: half of 16 is reached after 4 nodes, not 3.
    p = chain(["tpu"] * 6 + ["cpu", "tpu"], weights=[5, 1, 1, 1, 4, 4, 0, 9], devices=("cpu", TPU0, TPU1, TPU2))
    assert coral_segments(p, 2) == [(0, 4, TPU0), (4, 6, TPU1), (6, 8, "cpu")]
    # Thirds of 16 are 5.33 and 10.67: the closest prefixes are W(1) = 5 and W(5) = 12.
    assert coral_segments(p, 3) == [(0, 1, TPU0), (1, 5, TPU1), (5, 6, TPU2), (6, 8, "cpu")]
    assert coral_segments(p, 1) == coral_default(p) == [(0, 6, TPU0), (6, 8, "cpu")]


def test_coral_segments_keeps_every_segment_non_empty():
    # All weight in the last node: 2/3 of it is closest to W(4) = 100, but the last segment needs a node.
    p = chain(["tpu"] * 4, weights=[0, 0, 0, 100], devices=("cpu", TPU0, TPU1, TPU2))
    assert coral_segments(p, 3) == [(0, 1, TPU0), (1, 2, TPU1), (2, 4, TPU2)]


def test_coral_segments_refuses_what_it_cannot_place():
    with pytest.raises(ValueError, match=r"devices missing: \['edgetpu:2'\]"):
        coral_segments(chain(["tpu"] * 4, weights=[1] * 4), 3)
    with pytest.raises(ValueError, match="2-node Edge TPU prefix into 3"):
        coral_segments(chain(["tpu", "tpu", "cpu"], weights=[1] * 3, devices=("cpu", TPU0, TPU1, TPU2)), 3)
    with pytest.raises(ValueError, match="weights_bytes given for 0 of 2"):
        coral_segments(replace(chain(["tpu", "tpu"]), weights_bytes=()), 2)
    # Nothing the TPU can start with: no segments to make, all on the CPU.
    assert coral_segments(chain(["cpu", "tpu"], weights=[1, 1]), 2) == [(0, 2, "cpu")]


def test_greedy_deals_accelerator_runs_round_robin():
    p = chain(["tpu", "tpu", "cpu", "tpu", "cpu", "tpu"])
    assert greedy(p) == [(0, 2, TPU0), (2, 3, "cpu"), (3, 4, TPU1), (4, 5, "cpu"), (5, 6, TPU0)]


def test_greedy_follows_device_priority_not_cost():
    # The GPU comes first in the device list, so a node both can run goes there even though it is
    # no faster; only TPU-only nodes reach the TPU.
    p = chain(["both", "tpu", "gpu", "cpu"], devices=("cpu", GPU, TPU0))
    assert greedy(p) == [(0, 1, GPU), (1, 2, TPU0), (2, 3, GPU), (3, 4, "cpu")]


def test_greedy_on_a_cpu_only_problem():
    assert greedy(chain(["cpu", "cpu"], devices=("cpu",))) == [(0, 2, "cpu")]


def test_every_baseline_gives_a_plan_the_simulator_accepts():
    p = chain(["tpu", "tpu", "cpu", "tpu", "tpu"], weights=[3, 1, 0, 2, 2])
    for plan in (all_cpu(p), coral_default(p), coral_segments(p, 2), greedy(p)):
        assert one_inference(p, plan).makespan_ms > 0


def test_coral_replicated_is_coral_default_on_each_tpu():
    p = chain(["tpu", "tpu", "cpu", "tpu"])
    assert coral_replicated(p, [TPU0, TPU1]) == [[(0, 2, TPU0), (2, 4, "cpu")], [(0, 2, TPU1), (2, 4, "cpu")]]
    with pytest.raises(ValueError, match="nothing to replicate"):
        coral_replicated(chain(["cpu", "tpu"]), [TPU0, TPU1])
