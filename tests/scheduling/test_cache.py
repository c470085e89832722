"""Each Edge TPU's parameter cache (scheduling/cache.py): distinct weights per instance, cache priority,
recosting a plan by its own caches, and place-and-recost on problems where the cache decides the plan."""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgesdk.config import load_target
from edgesdk.ir import model as irm
from edgesdk.scheduling import cache, placement, simulate
from edgesdk.scheduling.graph import build_problem
from edgesdk.scheduling.problem import Link, Problem, Tensor

TPUS = ("edgetpu:0", "edgetpu:1")
MB = 1e6


def _chain(keys: list[str], sizes: dict[str, float], *, capacity: float = 8 * MB, cpu_ms: float = 10.0,
           tpu_ms: float = 1.0, stream_ms_per_mb: float = 3.0) -> Problem:
    """A chain of nodes, node k reading weight `keys[k]`: `cpu_ms` on the CPU, `tpu_ms` on either Edge
    TPU with its weight cached, plus `stream_ms_per_mb` per MB of it streamed. The costs start with
    every weight cached."""
    n = len(keys)
    tensors = [Tensor("x", 4, None, (0,))] + [
        Tensor(f"t{k}", 4, k, (k + 1,) if k + 1 < n else (), k + 1 == n) for k in range(n)]
    stream = tuple({d: stream_ms_per_mb * sizes[keys[k]] / MB for d in TPUS} for k in range(n))
    return Problem(
        nodes=tuple(f"n{k}" for k in range(n)), devices=("cpu", *TPUS),
        cost=tuple({"cpu": cpu_ms, **{d: tpu_ms for d in TPUS}} for _ in range(n)), tensors=tuple(tensors),
        overhead_ms={"cpu": 0.0, **{d: 0.0 for d in TPUS}}, links={d: Link(0.01, 0.0) for d in TPUS},
        weights_bytes=tuple(int(sizes[k]) for k in keys), weight_keys=tuple((k,) for k in keys),
        key_bytes={k: int(v) for k, v in sizes.items()}, cache_bytes={d: capacity for d in TPUS},
        stream_ms=stream, streamed=tuple({d: 0.0 for d in TPUS} for _ in range(n)))


def test_a_weight_read_by_several_segments_is_held_once():
    p = _chain(["a", "b", "a", "b"], {"a": 3 * MB, "b": 2 * MB})
    occ = cache.occupancy(p, [[(0, 1, "edgetpu:0"), (1, 2, "cpu"), (2, 3, "edgetpu:0"), (3, 4, "edgetpu:1")]])
    assert occ["edgetpu:0"].placed == 3 * MB and occ["edgetpu:0"].streamed == 0
    assert occ["edgetpu:1"].placed == 2 * MB
    # the same weights on one TPU four times over: still 5 MB, all cached
    whole = cache.occupancy(p, [[(0, 4, "edgetpu:0")]])["edgetpu:0"]
    assert whole.placed == 5 * MB and whole.cached == 5 * MB and not whole.uncached


def test_the_segment_read_most_is_cached_first_and_the_rest_streams():
    """Capacity 4 MB; segment [0, 1) reads 'big' (3 MB) once, segments [1, 2) and [3, 4) read 'hot'
    (2 MB) twice: 'hot' is cached first, 'big' gets the 2 MB left and streams a third of itself."""
    p = _chain(["big", "hot", "x", "hot"], {"big": 3 * MB, "hot": 2 * MB, "x": 0.0}, capacity=4 * MB)
    plan = [(0, 1, "edgetpu:0"), (1, 2, "edgetpu:0"), (2, 3, "cpu"), (3, 4, "edgetpu:0")]
    assert cache.priority(p, [s for s in plan if s[2] == "edgetpu:0"]) == [1, 2, 0]
    occ = cache.occupancy(p, [plan])["edgetpu:0"]
    assert occ.order[0] == "hot" and list(occ.uncached) == ["big"] and math.isclose(occ.uncached["big"], 1 / 3)
    priced = cache.recost(p, [plan])
    assert math.isclose(priced.cost[0]["edgetpu:0"], 1.0 + 3.0 * 3 / 3)       # 1 MB of 'big' streams: 3 ms
    assert priced.cost[1]["edgetpu:0"] == 1.0 and priced.cost[3]["edgetpu:0"] == 1.0
    assert math.isclose(priced.streamed[0]["edgetpu:0"], 1 / 3)
    # the CPU and the TPU nobody uses keep their costs
    assert priced.cost[0]["cpu"] == p.cost[0]["cpu"] and priced.cost[0]["edgetpu:1"] == p.cost[0]["edgetpu:1"]


def test_recost_undoes_the_fraction_a_problem_was_built_with():
    p = _chain(["a", "b"], {"a": 6 * MB, "b": 6 * MB})
    spread = cache._priced(p, lambda k, d: 0.5)                 # as if half of every weight streamed
    assert spread.cost[0]["edgetpu:0"] == 1.0 + 0.5 * 18.0
    alone = cache.recost(spread, [[(0, 1, "edgetpu:0"), (1, 2, "edgetpu:1")]])   # 6 MB each: both fit
    assert alone.cost[0]["edgetpu:0"] == 1.0 and alone.cost[1]["edgetpu:1"] == 1.0
    both = cache.recost(spread, [[(0, 2, "edgetpu:0")]])        # 12 MB on one 8 MB cache: 4 MB of b streams
    assert math.isclose(both.cost[1]["edgetpu:0"], 1.0 + 3.0 * 4)
    assert both.cost[0]["edgetpu:0"] == 1.0


def _sequential(problem: Problem, plan) -> float:
    return simulate.one_inference(problem, plan).makespan_ms


def test_place_and_recost_splits_weights_that_do_not_fit_one_cache():
    """Two 6 MB layers: on one TPU 4 MB stream (12 ms); on one TPU each nothing streams. The view
    with every weight cached sees both TPUs as equal and round-robins the two segments only if it cuts
    there; the recost prices whatever it picks, and the result streams nothing."""
    p = _chain(["a", "b"], {"a": 6 * MB, "b": 6 * MB})
    placed = cache.place(p, lambda view: [[tuple(s) for s in placement.place(view).segments]], _sequential)
    occ = cache.occupancy(p, [placed.plan])
    assert all(o.streamed == 0 for o in occ.values()), placed.plan
    assert {d for _, _, d in placed.plan} == set(TPUS)
    assert placed.score == _sequential(cache.recost(p, [placed.plan]), placed.plan)
    assert placed.problem.cost == cache.recost(p, [placed.plan]).cost


def test_place_and_recost_is_never_worse_than_the_first_view_and_iterates():
    """Eight frame layers sharing one 7 MB weight, then a 20 MB layer read once. Spread over both
    caches the model 'streams' 27/16 of its bytes... per use the frames count 8 x 7 MB: the first view
    prices every TPU node as streaming and leaves work on the CPU. Recosted, a TPU holding the shared
    weight streams nothing for the frames: the iteration finds the plan with every frame on a TPU."""
    keys = ["f"] * 8 + ["big"]
    p = _chain(keys, {"f": 7 * MB, "big": 20 * MB}, cpu_ms=12.0, tpu_ms=1.0)
    counted = 8 * 7 * MB + 20 * MB                                   # every use counted, as the built view does
    first = cache._priced(p, lambda k, d: max(0.0, 1 - 16 * MB / counted))
    placer = lambda view: [[tuple(s) for s in placement.place(view).segments]]   # noqa: E731
    placed = cache.place(first, placer, _sequential)
    naive = placer(first)[0]
    assert placed.score <= _sequential(cache.recost(first, [naive]), naive)
    frames_on_tpu = sum(j - i for i, j, d in placed.plan if d != "cpu" and j <= 8)
    assert frames_on_tpu == 8
    assert len(placed.rounds) >= 2


def _shared_model() -> onnx.ModelProto:
    """Three 1x1 convolutions; the first and the third read the same weight tensor, and a fourth
    initializer has the same bytes as the second under another name."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 64, 1, 1)).astype(np.float32)
    v = rng.standard_normal((64, 64, 1, 1)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["a"]), helper.make_node("Conv", ["a", "v"], ["b"]),
             helper.make_node("Conv", ["b", "w"], ["c"]), helper.make_node("Conv", ["c", "v_copy"], ["y"])]
    for n in nodes:
        irm.set_meta(n, irm.CAPABLE_KEY, "edgetpu,cpu/onnxruntime")
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, 64, 8, 8))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(v, "v"),
                           numpy_helper.from_array(v, "v_copy")])
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def test_the_built_problem_keys_shared_and_identical_weights_once():
    m = _shared_model()
    target, _ = load_target("arm_2tpu")
    p, _ = build_problem(m, target, irm.static_shapes(m), irm.constant_names(m))
    assert p.weight_keys == (("w",), ("v",), ("w",), ("v",))           # v_copy has v's bytes
    assert p.key_bytes == {"w": 64 * 64 * 4, "v": 64 * 64 * 4}
    assert p.cache_bytes == {d: 8.0 * MB * 4 for d in TPUS}             # 8 MB of int8 = 32 MB of float32
    assert all(p.stream_ms[k][d] > 0 for k in range(4) for d in TPUS)
    occ = cache.occupancy(p, [[(0, 4, "edgetpu:0")]])["edgetpu:0"]
    assert occ.placed == 2 * 64 * 64 * 4
