"""What a device kind is to the compiler: the protocol each `devices/<kind>.py` implements.

A model knows one kind's cost (the terms of a node, its link, what of its weights streams) and the
facts about the kind the rest of the toolchain reads (the backends that generate code for it, which
figures a fit may free). It names backends by string: `devices` sits beside `backends` in the layers
and imports none of it. The target entry it reads (`spec`) is the kind's schema in `config`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

import onnx

from .terms import NodeTerms


class Refusal(NamedTuple):
    """Why a device does not take a node: a stable code (`edgetpu.rank`) and one lowercase sentence."""

    code: str
    reason: str


class Cache(NamedTuple):
    """An instance's parameter cache (a kind that streams the weights it cannot hold: the Edge TPU)."""

    capacity: float             # float32 bytes of weights one instance holds
    stored_per_byte: float      # bytes the device stores per float32 byte of weights (int8: 0.25)
    source: str                 # where the capacity comes from


class DeviceModel(Protocol):
    kind: str                                   # the YAML `kind` and the prefix of its logical ids
    schema: type                                # its target entry (config.CpuDevice, ...)
    preference: int                             # accelerators: lower is preferred over the CPU (edgetpu 0, gpu 1)
    backends: tuple[str, ...]                   # backend names that generate code for it, preferred first
    rate_figure: tuple[str, str | None, float]  # the rate a fit frees: (field, key or None, flop/s per unit)
    fittable_overheads: Mapping[str, str]       # fit's overhead name -> the target field ("node": "kernel_overhead")
    reasons: Mapping[str, str]                  # every refusal code it gives -> what it means
    # backend -> (refusal code, fixed sentence or None for the backend's own why) recorded when that backend
    # cannot lower a node the device itself takes; a backend not listed fails silently (onnxruntime on the CPU)
    unlowerable: Mapping[str, tuple[str, str | None]]
    approximable: frozenset[str]                # refusal codes a ReLU-sum approximation can cure (the op is missing)
    rewrite_triggers: Mapping[str, str]         # refusal code -> the exact-rewrite trigger it sets (legalize.TRIGGERS)
    int8: bool                                  # runs int8 only: legalize measures approximations after int8

    def refusal(self, node: onnx.NodeProto, shapes, consts: set[str], types) -> Refusal | None:
        """The device's own limits on `node`, whatever backend would lower it; None where it takes it."""

    def node_terms(self, spec, *, flops: float, param_bytes: int, act_bytes: int, streamed_fraction: float = 0.0,
                   grouped: bool = False, threads: int | None = None) -> NodeTerms:
        """One node on this device, term by term (`terms.terms_ms` adds them up). The host's model also
        takes `backend=`, the CPU backend of the node's segment (`cost.node_terms` passes it only when set)."""

    def link(self, spec) -> tuple[float, float] | None:
        """(latency ms, ms per float32 byte) between the host and this device; None on the host."""

    def streamed_fraction(self, specs: Sequence, param_bytes: int) -> float:
        """The share of `param_bytes` (float32) of weights placed on the target's entries `specs` of this kind
        that crosses the link on every inference (0 where the weights stay on the device)."""

    # Optional, for a kind with a parameter cache per instance (the Edge TPU): `cache(spec) -> Cache`. A kind
    # without it holds every weight placed on it (`scheduling/cache.py`).
