"""The cost of one node on one device, term by term, and the one formula that adds the terms up.

    node_ms = 1e3 * ( max(compute, memory) + link + sum(overheads) * 1e-6 )

compute = flops / the rate the device runs this node at (s; a CPU's scaled to the threads it gets);
memory = parameter + activation bytes / memory bandwidth (s; 0 where the device has no memory
roofline, the Edge TPU); link = weights streamed over the link on every inference (s; 0 where none);
overheads = the figures (us) the node pays, named, added in order.

Each device model says what its terms are (`devices/<kind>.py`); the scheduler's prediction
(`cost.node_ms`), the fit to published latencies (`fit.node_terms`) and a host's calibration
(`calibrate.predict_ms`) all read this one formula. It imports nothing else from `devices`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeTerms:
    """One node on one device. `rate` names the target figure `compute` was taken at ("peak_gflops.float32",
    "peak_gflops.float32_grouped", "peak_tops_int8", "peak_tflops.float32"), so that a fit knows which
    nodes its free rate governs. An overhead the node is subject to but the target lacks is listed at
    0.0 us, so that a fit can still free it."""

    flops: float
    rate: str
    compute: float
    memory: float = 0.0
    link: float = 0.0
    overheads: tuple[tuple[str, float], ...] = ()


def terms_ms(t: NodeTerms) -> float:
    """The node's time in ms (the module docstring's formula)."""
    return 1e3 * (max(t.compute, t.memory) + t.link + sum(us for _, us in t.overheads) * 1e-6)
