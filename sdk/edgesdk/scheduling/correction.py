"""Re-costing a plan after the fact: an Edge TPU segment that Coral's compiler maps only in part.

`edgetpu_compiler` maps ops in execution order up to the first one it cannot map; that op and every
op after it run on the host CPU. The plan assumed the whole segment on the TPU. These functions cost
what will really run, with the scheduler's own cost model, so the manifest's prediction is the
corrected one.
"""

from __future__ import annotations

import onnx

from ..backends import edgetpu_compiler
from ..ir import model as irm
from . import cache, placement
from .graph import build_problem


def edgetpu_correction(seg: dict, mapped: edgetpu_compiler.Mapping, scheduled: onnx.ModelProto, target,
                       plan: list[dict] | None = None) -> dict:
    """The record of an Edge TPU segment (a plan segment) that the compiler maps only partly, with its
    cost re-computed: the leading share of its nodes (`edgetpu_compiler.leading_nodes`, the share of its
    TFLite ops the compiler maps) on its Edge TPU, the rest on the target's CPU. Each part is costed as
    the schedule stage costs a segment (`placement.segment_ms` over the problem `build_problem` makes of
    the scheduled model, priced by the caches of `plan`, the plan's segments, where given: `cache.recost`),
    so the Edge TPU part pays the link for what it hands to the CPU part."""
    problem, _ = build_problem(scheduled, target, irm.static_shapes(scheduled), irm.constant_names(scheduled))
    index = {name: i for i, name in enumerate(problem.nodes)}
    if plan:
        problem = cache.recost(problem, [[(index[s["nodes"][0]], index[s["nodes"][-1]] + 1, s["device"])
                                          for s in plan if s["nodes"]]])
    start, stop = index[seg["nodes"][0]], index[seg["nodes"][-1]] + 1
    assert [index[n] for n in seg["nodes"]] == list(range(start, stop)), f"{seg['id']} is not contiguous"
    k = edgetpu_compiler.leading_nodes(stop - start, mapped)
    head = placement.segment_ms(problem, start, start + k, seg["device"]) if k else 0.0
    tail = placement.segment_ms(problem, start + k, stop, "cpu") if start + k < stop else 0.0
    return {"segment": seg["id"], "ops": len(mapped.ops), "ops_on_tpu": mapped.on_tpu, "ops_on_cpu": mapped.on_cpu,
            "first_unmapped": mapped.first_unmapped, "status": mapped.status,
            "nodes_on_tpu": k, "nodes_on_cpu": stop - start - k, "first_cpu_node": seg["nodes"][k],
            "predicted_ms_before": seg["predicted_ms"], "predicted_ms_after": round(head + tail, 4)}


CACHE_TOLERANCE = 0.01  # a segment re-costed by the compiler's cache figures is corrected when it moves more


def cache_correction(seg: dict, on_chip: int, off_chip: int, scheduled: onnx.ModelProto, target) -> dict | None:
    """The record of an Edge TPU segment whose compiler cached another share of its weights than the
    plan priced (`cache.recost`): the segment re-costed with the share the compiler's log reports
    streaming, off_chip / (on_chip + off_chip) of its parameters (a shared model's figures for each of
    its segments), or None where that moves its time by less than `CACHE_TOLERANCE`."""
    if on_chip + off_chip <= 0:
        return None
    problem, _ = build_problem(scheduled, target, irm.static_shapes(scheduled), irm.constant_names(scheduled))
    index = {name: i for i, name in enumerate(problem.nodes)}
    start, stop = index[seg["nodes"][0]], index[seg["nodes"][-1]] + 1
    share = off_chip / (on_chip + off_chip)
    inside = range(start, stop)
    priced = cache._priced(problem, lambda k, d: share if k in inside else problem.streamed[k].get(d, 0.0))
    after = placement.segment_ms(priced, start, stop, seg["device"])
    if abs(after - seg["predicted_ms"]) <= CACHE_TOLERANCE * max(seg["predicted_ms"], 1e-9):
        return None
    return {"segment": seg["id"], "on_chip_bytes": on_chip, "off_chip_bytes": off_chip,
            "streamed_share": round(share, 4), "predicted_ms_before": seg["predicted_ms"],
            "predicted_ms_after": round(after, 4)}


def corrected_prediction(predicted: dict, corrections: list[dict]) -> dict:
    """The plan's predicted latency with the corrected segments. `sequential_ms` is the sum of the
    segments' times along the plan, so it moves by the sum of their differences. The simulated
    `latency_ms` is moved by the same sum: exact for a segment on the critical path of one inference
    (every segment, when each depends on the one before); for a segment that overlaps another device's
    work it overstates the change. `throughput_fps` stays the scheduler's simulation."""
    delta = sum(c["predicted_ms_after"] - c["predicted_ms_before"] for c in corrections)
    return {**predicted, **{k: round(predicted[k] + delta, 4) for k in ("latency_ms", "sequential_ms") if k in predicted}}
