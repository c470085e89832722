"""Fitting a device's free cost parameters to published latencies, in the form of `cost.node_ms`.

For one device kind, `node_ms` summed over the nodes of one inference is

    T(x, o) = sum_i max(flops_i * x, floor_i) + n * o + fixed

with two free parameters: x = ms per flop (1 / the effective rate; the peak of the target file is
x's lower bound: an efficiency above 1 is not physical) and o = one of the device's overheads in ms,
either `kernel_overhead`, which every node pays (n = the node count), or on a CPU `layer_overhead`,
which only convolutions and matrix products pay (n = their count, `cost.is_mac_layer`). floor_i is
the node's memory-roofline time (CPU, GPU; 0 on the Edge TPU, whose node_ms has no memory term);
`fixed` is everything the fit leaves at the target's value: the other overhead, grouped convolutions
at a `float32_grouped` rate, link transfers, weights streamed over the link, nodes on other devices.

The fit minimizes sum_j r_j^2 with relative residuals r_j = (T_j - y_j) / y_j: published figures
span 2 ms to 2 s, and an absolute error would let the slowest model decide alone.

T is linear in o and convex piecewise linear in x, with breaks where a node turns from memory- to
compute-bound (x = floor_i / flops_i). On one piece every max() picks a fixed side, T is affine in
(x, o), and the objective is a convex quadratic, so its minimum over the box (bounds intersected
with the piece) is the unconstrained stationary point when that lies inside, else the 1-D minimum
along one of the box's edges. Checking those candidates on every piece and keeping the best is
exact: no iteration, no starting point, no tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..config import Target
from . import cost, registry
from .terms import NodeTerms


class _RateFields(Mapping):
    """kind -> (field, key or None, flop/s per unit) of the rate a fit frees: the device models' `rate_figure`."""

    def __getitem__(self, kind: str) -> tuple[str, str | None, float]:
        if kind not in self:
            raise KeyError(kind)
        return registry.model(kind).rate_figure

    def __iter__(self) -> Iterator[str]:
        return iter([m.kind for m in registry.models()])

    def __len__(self) -> int:
        return len(registry.models())

    def __contains__(self, kind: object) -> bool:
        return any(m.kind == kind for m in registry.models())


class _Overheads(Mapping):
    """overhead -> (its target field, the kinds that have it): the device models' `fittable_overheads`."""

    def _table(self) -> dict[str, tuple[str, tuple[str, ...]]]:
        table: dict[str, tuple[str, tuple[str, ...]]] = {}
        for m in registry.models():
            for name, field in m.fittable_overheads.items():
                if name in table and table[name][0] != field:
                    raise ValueError(f"the {m.kind} model frees the {name!r} overhead as {field}, "
                                     f"others as {table[name][0]}")
                table[name] = (field, (*table.get(name, (field, ()))[1], m.kind))
        return table

    def __getitem__(self, overhead: str) -> tuple[str, tuple[str, ...]]:
        return self._table()[overhead]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


# the field that carries each device kind's compute rate, and that field's unit in flop/s
RATE_FIELD: Mapping[str, tuple[str, str | None, float]] = _RateFields()
PARAMETERS = 2  # ms per flop and one overhead
# which overhead a fit frees: the target field, and the devices that have it
OVERHEADS: Mapping[str, tuple[str, tuple[str, ...]]] = _Overheads()


@dataclass(frozen=True)
class Observation:
    """One published latency and the terms of the model that predicts it."""

    name: str
    measured_ms: float
    flops: tuple[float, ...]        # per node the fitted device runs
    floor_ms: tuple[float, ...]     # per node: its memory-roofline time; 0 where there is none
    ops: int                        # nodes that pay the fitted overhead
    fixed_ms: float = 0.0           # the terms the fit does not touch
    overhead: str = "node"          # the fitted overhead: "node" (kernel_overhead) or "layer" (layer_overhead)

    def predict_ms(self, ms_per_flop: float, overhead_ms: float) -> float:
        compute = sum(max(f * ms_per_flop, m) for f, m in zip(self.flops, self.floor_ms))
        return compute + self.ops * overhead_ms + self.fixed_ms


@dataclass(frozen=True)
class Fit:
    kind: str
    ms_per_flop: float
    overhead_ms: float
    residuals: tuple[float, ...]    # relative, (predicted - measured) / measured, per observation
    at_bound: tuple[str, ...]       # the bounds the optimum sits on (empty: an interior optimum)
    overhead: str = "node"          # which overhead overhead_ms is (OVERHEADS)

    @property
    def rate(self) -> float:
        """Effective flop/s (ops/s on the Edge TPU)."""
        return 1e3 / self.ms_per_flop

    @property
    def overhead_us(self) -> float:
        return self.overhead_ms * 1e3

    @property
    def exact(self) -> bool:
        """Every fitted figure reproduced: with as many figures as parameters, an interior optimum."""
        return all(abs(r) < 1e-9 for r in self.residuals)


def node_terms(target: Target, kind: str, *, flops: float, param_bytes: int, act_bytes: int,
               streamed_fraction: float = 0.0, grouped: bool = False,
               overhead: str = "node") -> tuple[float, float, float, bool]:
    """(fitted flops, memory floor ms, fixed ms, pays the fitted overhead) of one node, such that
    `cost.node_ms` equals max(flops * x, floor) + fixed + (o if it pays) at the target's own x and o."""
    _check_overhead(kind, overhead)
    terms = cost.node_terms(target, kind, flops=flops, param_bytes=param_bytes, act_bytes=act_bytes,
                            streamed_fraction=streamed_fraction, grouped=grouped)
    field, key, _ = RATE_FIELD[kind]
    return fit_terms(terms, f"{field}.{key}" if key else field, OVERHEADS[overhead][0])


def fit_terms(t: NodeTerms, fitted_rate: str, fitted_overhead: str) -> tuple[float, float, float, bool]:
    """`terms.terms_ms` split for a fit that frees the rate named `fitted_rate` (as x = ms per flop) and
    the overhead named `fitted_overhead` (as o): (flops, floor ms, fixed ms, pays o) with
    terms_ms(t) = max(flops * x, floor) + fixed + (o if pays) at the figures t was taken at. A node at
    another rate (a CPU's grouped convolutions) keeps its whole roofline fixed; the link is fixed."""
    others = sum(us for name, us in t.overheads if name != fitted_overhead) * 1e-3
    pays = any(name == fitted_overhead for name, _ in t.overheads)
    if t.rate != fitted_rate:  # at its own rate, which the fit leaves alone
        return 0.0, 0.0, others + 1e3 * (max(t.compute, t.memory) + t.link), pays
    return t.flops, 1e3 * t.memory, others + 1e3 * t.link, pays


def observation(target: Target, kind: str, name: str, measured_ms: float, nodes: Iterable[tuple],
                *, streamed_fraction: float = 0.0, fixed_ms: float = 0.0, overhead: str = "node") -> Observation:
    """The observation of a published figure from its nodes' (flops, param_bytes, act_bytes[, grouped])
    on `kind`, plus `fixed_ms` of other terms; `overhead` is the overhead the fit will free."""
    flops, floors, ops = [], [], 0
    for f, p, a, *grouped in nodes:
        f, floor, fixed, pays = node_terms(target, kind, flops=f, param_bytes=p, act_bytes=a,
                                           streamed_fraction=streamed_fraction, grouped=bool(grouped and grouped[0]),
                                           overhead=overhead)
        flops.append(f)
        floors.append(floor)
        fixed_ms += fixed
        ops += pays
    return Observation(name, measured_ms, tuple(flops), tuple(floors), ops, fixed_ms, overhead)


def target_parameters(target: Target, kind: str, overhead: str = "node") -> tuple[float, float]:
    """(ms per flop, overhead ms) of `kind` as the target file states them (an absent overhead is 0)."""
    _check_overhead(kind, overhead)
    dev = target.device(kind)
    field, key, scale = RATE_FIELD[kind]
    figure = getattr(dev, field)
    figure = figure[key] if key else figure
    over = getattr(dev, OVERHEADS[overhead][0])
    return 1e3 / (figure.value * scale), over.value * 1e-3 if over is not None else 0.0


def _check_overhead(kind: str, overhead: str) -> None:
    if overhead not in OVERHEADS or kind not in OVERHEADS[overhead][1]:
        raise ValueError(f"the {kind} device has no {overhead!r} overhead to fit (it has: "
                         f"{', '.join(o for o, (_, kinds) in OVERHEADS.items() if kind in kinds)})")


def fit_roofline(kind: str, observations: Sequence[Observation], *, max_rate: float,
                 min_rate: float = 0.0, min_overhead_us: float = 0.0,
                 max_overhead_us: float = math.inf) -> Fit:
    """The least-squares (x, o) of the module docstring within rate in [min_rate, max_rate] flop/s
    and overhead in [min_overhead_us, max_overhead_us]."""
    if len(observations) < PARAMETERS:
        raise ValueError(f"fitting the rate and the per-op overhead of {kind} needs at least {PARAMETERS} "
                         f"published figures, got {len(observations)}"
                         + (f" ({', '.join(o.name for o in observations)})" if observations else ""))
    if not 0 <= min_rate < max_rate or not 0 <= min_overhead_us <= max_overhead_us:
        raise ValueError(f"empty or negative bounds: rate [{min_rate}, {max_rate}] flop/s, "
                         f"overhead [{min_overhead_us}, {max_overhead_us}] us")
    if len({o.overhead for o in observations}) > 1:
        raise ValueError(f"the observations of {kind} free different overheads: "
                         f"{', '.join(f'{o.name} ({o.overhead})' for o in observations)}")
    bad = [o.name for o in observations if not o.measured_ms > 0]
    if bad:
        raise ValueError(f"published figures must be positive: {', '.join(bad)}")
    totals = np.array([[sum(o.flops), o.ops] for o in observations], dtype=float)
    if np.linalg.matrix_rank(totals / np.abs(totals).max(axis=0).clip(min=1e-300)) < PARAMETERS:
        raise ValueError(f"the figures of {', '.join(o.name for o in observations)} cannot separate the rate "
                         f"of {kind} from its per-op overhead: their flops and op counts are proportional")

    x_lo = 1e3 / max_rate
    x_hi = 1e3 / min_rate if min_rate > 0 else math.inf
    o_lo, o_hi = min_overhead_us * 1e-3, max_overhead_us * 1e-3
    breaks = sorted({m / f for o in observations for f, m in zip(o.flops, o.floor_ms)
                     if f > 0 and m > 0 and x_lo < m / f < x_hi})
    edges = [x_lo, *breaks, x_hi]
    y = np.array([o.measured_ms for o in observations])

    def objective(x: float, ov: float) -> float:
        return float(sum((o.predict_ms(x, ov) / o.measured_ms - 1.0) ** 2 for o in observations))

    best = None
    for lo, hi in zip(edges, edges[1:]):
        # on this piece T_j = a_j x + n_j o + c_j: which side of its max() a node takes is read at a
        # point strictly inside the piece (at an edge, rounding could put a node on the wrong side)
        probe = 2.0 * lo if math.isinf(hi) else 0.5 * (lo + hi)
        a = np.array([sum(f for f, m in zip(o.flops, o.floor_ms) if f * probe >= m) for o in observations])
        c = np.array([o.fixed_ms + sum(m for f, m in zip(o.flops, o.floor_ms) if f * probe < m)
                      for o in observations])
        n = np.array([float(o.ops) for o in observations])
        for x, ov in _box_candidates(a / y, n / y, 1.0 - c / y, (lo, hi), (o_lo, o_hi)):
            value = objective(x, ov)
            if best is None or value < best[0]:
                best = (value, x, ov)
    _, x, ov = best
    residuals = tuple(float(o.predict_ms(x, ov) / o.measured_ms - 1.0) for o in observations)
    at = [name for name, v, b in (("rate = max_rate (efficiency 1)", x, x_lo), ("rate = min_rate", x, x_hi),
                                  ("overhead = min", ov, o_lo), ("overhead = max", ov, o_hi))
          if math.isfinite(b) and math.isclose(v, b, rel_tol=1e-12, abs_tol=0.0 if b else 1e-15)]
    return Fit(kind, float(x), float(ov), residuals, tuple(at), observations[0].overhead)


def _box_candidates(a: np.ndarray, n: np.ndarray, b: np.ndarray, xs: tuple[float, float],
                    overheads: tuple[float, float]) -> list[tuple[float, float]]:
    """Minimizers of ||a x + n o - b||^2 over x in xs, o in overheads: the stationary point when it is
    inside, and the clipped 1-D minimum along each finite edge (a convex quadratic's box minimum is
    one of them)."""
    out = []
    # columns scaled to unit norm: x ~ 1e-10 ms/flop and o ~ 1e-2 ms differ by eight orders
    sa, sn = np.linalg.norm(a) or 1.0, np.linalg.norm(n) or 1.0
    m = np.column_stack([a / sa, n / sn])
    if np.linalg.matrix_rank(m) == PARAMETERS:
        (u, v), *_ = np.linalg.lstsq(m, b, rcond=None)
        x, ov = u / sa, v / sn
        if xs[0] <= x <= xs[1] and overheads[0] <= ov <= overheads[1]:
            out.append((x, ov))
    for x in xs:
        if math.isfinite(x):
            out.append((x, _clip(_line_min(n, b - a * x), overheads)))
    for ov in overheads:
        if math.isfinite(ov):
            out.append((_clip(_line_min(a, b - n * ov), xs), ov))
    return out


def _line_min(col: np.ndarray, rhs: np.ndarray) -> float:
    denom = float(col @ col)
    return float(col @ rhs) / denom if denom > 0 else 0.0


def _clip(v: float, bounds: tuple[float, float]) -> float:
    return min(max(v, bounds[0]), bounds[1])


def refit_target(target: Target, kind: str, fit: Fit, source: str) -> Target:
    """`target` with `kind`'s rate field and the fitted overhead (`kernel_overhead` or `layer_overhead`)
    replaced by the fit, each naming `source`. The rate field of today's schema is called a peak: the
    fitted value is an effective rate, and its source says so."""
    _check_overhead(kind, fit.overhead)
    over = OVERHEADS[fit.overhead][0]
    if not fit.overhead_us > 0:
        raise ValueError(f"the fit puts the {over} of {kind} at 0 us ({', '.join(fit.at_bound)}): a target "
                         "file's figures are > 0; fit with min_overhead_us > 0 or fix the model instead")
    field, key, scale = RATE_FIELD[kind]
    data = target.model_dump(mode="json")
    for dev in data["devices"]:
        if dev["kind"] != kind:
            continue
        rate = dev[field][key] if key else dev[field]
        rate["value"] = fit.rate / scale
        rate["source"] = source
        dev[over] = {"value": fit.overhead_us, "unit": "us", "source": source}
    return Target.model_validate(data)
