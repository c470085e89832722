"""Calibrate a host CPU's cost figures from per-op latencies measured on that host.

`edgesdk calibrate` replaces a target's estimated CPU figures with fitted ones. The model to fit is
the one the scheduler uses for every node on the CPU (`cost.node_ms`, i.e. `terms.terms_ms`):

    ms = 1e3 * ( max(flops / (peak * 1e9), bytes / (bandwidth * 1e9)) + overhead * 1e-6 )

with peak in GFLOP/s, bandwidth in GB/s, overhead in us, bytes = parameter + activation bytes.

1. `measure_ops` runs a model with onnxruntime's profiler, graph optimizations off so that no node
   is fused away (a function op onnxruntime inlines is the sum of its body's kernels), and keeps
   each node's median kernel time.
2. `fit_cpu` fits the three figures by least squares on log(predicted / measured): op latencies
   span four decades, and an absolute (or squared-ms) loss would fit the few large convolutions and
   ignore the hundreds of small ops whose overhead the scheduler weighs against link transfers.
3. `evaluate` compares the fit with measurements, per op and per model total (use a held-out model).

Per CPU backend. The per-op profile is onnxruntime's with nothing fused; a bundle's CPU segment runs on
onnxruntime with all its graph optimizations, on LiteRT (XNNPACK) or on TVM, each with fused kernels
and a per-inference cost of its own that no per-node profile of ours can see. Such a backend is timed
on whole runs of nodes as a bundle runs them (`scheduling/backend_timing.py`: each fitted model whole
and cut into `cuts` of about equal predicted time; a held-out model whole), and its figures are fitted
to those totals in the very form the scheduler adds up for a segment (`placement.segment_ms`):

    T_j = sum over the nodes i of run j of 1e3 * max(flops_i / rate_i, bytes_i / bandwidth)
          + n_j * overhead * 1e-3

4. `fit_backend` minimizes sum_j ln(T_j / measured_j)^2 over ln(peak, bandwidth, overhead[, grouped
   rate]), the loss of `fit_cpu` for the same reason (runs span three decades). One total stands for
   many nodes, so a few whole models alone would give as many equations as models; the cuts differ in
   their mix of dense convolutions, depthwise convolutions and elementwise ops, which is what
   separates the figures. A cut-out run also pays for its cut (its inputs and outputs copied, and
   transposed by a backend of another layout), which the fit takes as two more terms of such runs
   alone, a per-run overhead and the cut tensors' bytes at a bandwidth, told apart from the nodes' by
   the whole models; they stay out of the target, where a segment is the sum of its nodes. The node
   figures are effective ones of the backend's fused kernels: an elementwise op fused into the
   convolution before it costs the overhead and memory terms the fit gives it, averaged over the
   runs. Memory may have two tiers: a node whose bytes fit in a cache capacity C moves them at a cache
   bandwidth (no slower than the memory bandwidth), the others at the memory bandwidth; C is chosen
   among `CACHE_CAPACITIES_MB` by least loss, and kept only where it lowers the loss by `CACHE_GAIN`
   (XNNPACK's elementwise kernels on small tensors run from cache: EfficientNetB0's swish and
   squeeze-excite on LiteRT cost a fraction of what the same bytes from DRAM would). Every figure
   starts at the per-op fit's (a cut at ten kernels' overhead and the memory bandwidth) and stays
   within a factor `BOUND` of its start either way; one at its bound, or that no run's time depends
   on, is noted as not determined.
5. `evaluate_backend` predicts each run as the scheduler does, `cost.node_ms` of the fitted target
   with the backend's figures summed over its nodes (a held-out model whole: the scheduler's prediction
   for it as one CPU segment on that backend), against its measured time, and beside it the prediction
   with the CPU's one set of figures that every backend shared before.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from ..config import Figure
from ..errors import UserError
from ..ir import model as irm
from .cost import is_grouped, node_bytes, node_flops, node_ms
from .terms import NodeTerms, terms_ms

WARMUP_RUNS = 2
# onnxruntime's profiler stores whole microseconds: a kernel reported as 0 took less than 1 us,
# and is counted as half the resolution so that a log-space fit can use it.
PROFILER_RESOLUTION_MS = 1e-3
# ONNX Runtime turns Constant nodes into initializers when it loads a graph: they never run a kernel.
FOLDED_AT_LOAD = frozenset({"Constant"})
MIN_FIT_SAMPLES = 3  # `fit_cpu` fits three figures


@dataclass(frozen=True)
class OpSample:
    """One node's median kernel time on this host, with the quantities the cost model sees."""

    model: str
    node: str
    op_type: str
    flops: float
    param_bytes: int
    act_bytes: int
    ms: float
    grouped: bool = False  # a grouped/depthwise convolution: fitted at its own rate when the data has some

    @property
    def bytes(self) -> int:
        return self.param_bytes + self.act_bytes


@dataclass(frozen=True)
class CpuFit:
    """Fitted CPU figures, and how well they explain the samples they were fitted on.

    `residuals[i]` is ln(predicted / measured) of sample i (the quantity minimized);
    `bound[i]` says which term of the roofline predicts sample i: "compute" or "memory"."""

    peak_gflops: float
    bandwidth_gbps: float
    overhead_us: float
    residuals: tuple[float, ...]
    bound: tuple[str, ...]
    loss: str = "log"
    notes: tuple[str, ...] = field(default=())
    grouped_gflops: float | None = None  # the grouped-convolution rate, when the samples had some

    def predict_ms(self, flops: float, nbytes: float, grouped: bool = False) -> float:
        if grouped and self.grouped_gflops:
            return predict_ms(flops, nbytes, self.grouped_gflops, self.bandwidth_gbps, self.overhead_us,
                              rate="peak_gflops.float32_grouped")
        return predict_ms(flops, nbytes, self.peak_gflops, self.bandwidth_gbps, self.overhead_us)

    def figures(self, source: str) -> dict:
        """The cpu device's cost fields of a target file, with `source` saying where they came from
        (host, threads, models); the int8 peak is not fitted here and stays as it was. The fit is per
        node: a per-layer cost the input target had (`layer_overhead`) is dropped, or it would be
        counted twice."""
        peaks = {"float32": Figure(value=self.peak_gflops, unit="GFLOP/s", source=source)}
        if self.grouped_gflops:
            peaks["float32_grouped"] = Figure(value=self.grouped_gflops, unit="GFLOP/s", source=source)
        return {
            "peak_gflops": peaks,
            "memory_bandwidth": Figure(value=self.bandwidth_gbps, unit="GB/s", source=source),
            "kernel_overhead": Figure(value=self.overhead_us, unit="us", source=source),
            "layer_overhead": None,
        }


def predict_ms(flops: float, nbytes: float, peak_gflops: float, bandwidth_gbps: float, overhead_us: float, *,
               rate: str = "peak_gflops.float32") -> float:
    """`cost.node_ms` for a CPU, from bare figures: `terms.terms_ms` of its terms."""
    return terms_ms(NodeTerms(flops, rate, flops / (peak_gflops * 1e9), nbytes / (bandwidth_gbps * 1e9), 0.0,
                              (("kernel_overhead", overhead_us),)))


# --- measuring -----------------------------------------------------------------------------------


def measure_ops(model: onnx.ModelProto, threads: int, runs: int, *, warmup: int = WARMUP_RUNS,
                name: str | None = None, seed: int = 0) -> list[OpSample]:
    """Median kernel time of every node of `model` over `runs` profiled runs after `warmup` runs.

    The model needs static shapes (the import stage's output has them). onnxruntime runs it with
    graph optimizations off (no node fused away: each kernel is one node, or one op of a function
    node's body, whose kernels add up to its time), `threads` intra-op threads,
    spinning off (an idle spinning pool would steal the cores the next kernel needs), on random
    inputs drawn with `seed`. Flops and bytes are counted as the scheduler counts them
    (`scheduling/graph.build_problem`). Constant nodes run no kernel and have no sample."""
    import onnxruntime as ort

    if threads < 1 or runs < 1 or warmup < 0:
        raise ValueError(f"threads and runs must be >= 1 and warmup >= 0, got {threads}, {runs}, {warmup}")
    model_name = name or model.graph.name or "model"
    shapes, consts = _shapes(model, model_name), irm.constant_names(model)
    feeds = _random_feeds(model, shapes, consts, seed)

    # The profiler names a kernel event after its node; names in a graph may be empty or repeated,
    # so the profiled copy names node i `edgesdk_i`.
    named = onnx.ModelProto()
    named.CopyFrom(model)
    named.ir_version = min(named.ir_version, irm.IR_VERSION)
    for i, node in enumerate(named.graph.node):
        node.name = f"edgesdk_{i}"
    g = model.graph
    expected = [i for i, n in enumerate(g.node) if n.op_type not in FOLDED_AT_LOAD]

    with tempfile.TemporaryDirectory(prefix="edgesdk-calibrate-") as tmp:
        executed, parts = _executed_graph(named, _session_options(ort, threads), Path(tmp) / "resolved.onnx")
        opts = _session_options(ort, threads)
        opts.enable_profiling = True
        opts.profile_file_prefix = str(Path(tmp) / "profile")
        sess = irm.onnxruntime_session(executed, opts)
        for _ in range(warmup + runs):
            sess.run(None, feeds)
        events = json.loads(Path(sess.end_profiling()).read_text())

    # The k-th event of a kernel is its k-th run; a node's time in a run is the sum of its kernels'.
    kernel_times: dict[str, list[float]] = {}
    for ev in events:
        ev_name = ev.get("name", "")
        if ev.get("cat") == "Node" and ev_name.startswith("edgesdk_") and ev_name.endswith("_kernel_time"):
            kernel_times.setdefault(ev_name[:-len("_kernel_time")], []).append(ev["dur"] * 1e-3)
    times: dict[int, list[float]] = {}
    missing = []
    for i in expected:
        per_kernel = [kernel_times.get(k, []) for k in parts.get(i, ())]
        if not per_kernel or any(len(t) != warmup + runs for t in per_kernel):
            missing.append(f"node '{irm.node_name(g.node[i], i)}' ({g.node[i].op_type}): "
                           f"{min((len(t) for t in per_kernel), default=0)} kernel events for {warmup + runs} runs")
            continue
        times[i] = [math.fsum(run) for run in zip(*per_kernel)]
    if missing:
        raise UserError("calibrate.profile", f"{model_name}: onnxruntime's profile lacks {len(missing)} node(s)",
                        "the graph may hold control flow (If, Loop) whose nodes run inside a subgraph; "
                        "calibrate on models without it", notes=missing)

    samples = []
    for i in expected:
        n = g.node[i]
        weights, act = node_bytes(n, shapes, consts)
        ms = max(statistics.median(times[i][warmup:]), PROFILER_RESOLUTION_MS / 2)
        samples.append(OpSample(model_name, irm.node_name(n, i), n.op_type, node_flops(n, shapes), weights, act, ms,
                                is_grouped(n)))
    return samples


def _session_options(ort, threads: int):
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return opts


def _executed_graph(named: onnx.ModelProto, opts, path: Path) -> tuple[onnx.ModelProto, dict[int, list[str]]]:
    """The graph onnxruntime runs for `named` (node i named `edgesdk_i`), and node i's kernels in it.

    Even with optimizations off, onnxruntime inlines an op it has no kernel for (HardSwish, a function
    op) into the function's body, whose nodes have no names: the profile could not say whose they are.
    The resolved graph it saves shows them; an inlined node belongs to the function node whose outputs
    it computes, directly or through other inlined nodes. Those are named `edgesdk_i_k` and the resolved
    graph is what gets profiled."""
    opts.optimized_model_filepath = str(path)
    # the resolved graph's weights go beside it, where `irm.read` maps them: never into the graph's bytes
    for key, value in (("file_name", path.name + ".data"), ("min_size_in_bytes", str(irm.WEIGHT_BYTES))):
        opts.add_session_config_entry(f"session.optimized_model_external_initializers_{key}", value)
    irm.onnxruntime_session(named, opts)
    executed = irm.read(path)
    executed.ir_version = min(executed.ir_version, irm.IR_VERSION)
    parts: dict[int, list[str]] = {}
    unnamed_producer = {t: n for n in executed.graph.node if not n.name.startswith("edgesdk_") for t in n.output}
    for n in executed.graph.node:
        if n.name.startswith("edgesdk_"):
            parts.setdefault(int(n.name[len("edgesdk_"):]), []).append(n.name)
    for i, original in enumerate(named.graph.node):
        if i in parts:
            continue
        # walk back from the function node's outputs through the inlined nodes that compute them
        stack, body = [t for t in original.output if t], []
        while stack:
            producer = unnamed_producer.pop(stack.pop(), None)
            if producer is not None and producer not in body:
                body.append(producer)
                stack.extend(t for t in producer.input if t)
        for k, node in enumerate(body):
            node.name = f"edgesdk_{i}_{k}"
            parts.setdefault(i, []).append(node.name)
    return executed, parts


def _shapes(model: onnx.ModelProto, model_name: str) -> dict[str, tuple[int, ...]]:
    shapes = irm.static_shapes(model)
    produced = [t for n in model.graph.node for t in n.output if t]
    if not all(t in shapes for t in produced):
        shapes = irm.static_shapes(irm.infer_shapes(irm.weightless(model)[0], strict=False))
    unknown = [t for t in produced if t not in shapes]
    inputs = [i.name for i in model.graph.input if i.name not in shapes]
    if inputs or unknown:
        raise UserError("calibrate.dynamic-shape",
                        f"{model_name}: {len(inputs) + len(unknown)} tensor(s) have no static shape",
                        "calibrate on the import stage's model.onnx (`edgesdk build --until import`), whose "
                        "shapes are static",
                        notes=[f"input '{t}'" for t in inputs] + [f"tensor '{t}'" for t in unknown[:20]])
    return shapes


def random_feeds(model: onnx.ModelProto, name: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs for `model` (static shapes): floats drawn from a normal distribution with `seed`, integers 0."""
    return _random_feeds(model, _shapes(model, name), irm.constant_names(model), seed)


def _random_feeds(model: onnx.ModelProto, shapes, consts, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    types = irm.elem_types(model)
    feeds = {}
    for vi in model.graph.input:
        if vi.name in consts:
            continue
        dtype = onnx.helper.tensor_dtype_to_np_dtype(types[vi.name])
        shape = shapes[vi.name]
        # indices and flags read as zeros: always in range
        feeds[vi.name] = (rng.standard_normal(shape).astype(dtype) if np.issubdtype(dtype, np.floating)
                          else np.zeros(shape, dtype))
    return feeds


# --- fitting -------------------------------------------------------------------------------------


def fit_cpu(samples: list[OpSample]) -> CpuFit:
    """Least squares on r_i = ln(pred_i / meas_i) over u = ln(peak, bandwidth, overhead).

    Fitting the logarithms keeps the figures positive without bounds. The roofline's max makes the
    model piecewise smooth: on each piece the Jacobian is exact,

        d r_i / d ln peak      = -c_i / pred_i   (compute-bound nodes, c_i = flops_i / peak)
        d r_i / d ln bandwidth = -m_i / pred_i   (memory-bound nodes, m_i = bytes_i / bandwidth)
        d r_i / d ln overhead  =  o   / pred_i

    and a few starts around the data's own rates find the piece the optimum lies on. A figure whose
    term predicts no sample is not determined by the data (only bounded): `notes` says so."""
    from scipy.optimize import least_squares

    if len(samples) < MIN_FIT_SAMPLES:
        raise ValueError(f"fitting three figures needs at least {MIN_FIT_SAMPLES} samples, got {len(samples)}")
    flops = np.array([s.flops for s in samples], dtype=float)
    nbytes = np.array([s.bytes for s in samples], dtype=float)
    meas = np.array([s.ms for s in samples], dtype=float)
    grouped = np.array([s.grouped for s in samples], dtype=bool)
    # a fourth figure, the grouped-convolution rate, only when there are enough such samples to fit it
    four = int(grouped.sum()) >= 3
    if np.any(meas <= 0):
        raise ValueError("every measured time must be positive")

    def terms(u):  # terms.terms_ms's compute, memory and overhead, in ms, for every sample at once
        peak, bw, over = np.exp(u[:3])
        rate = np.where(grouped, np.exp(u[3]), peak) if four else peak
        return 1e3 * flops / (rate * 1e9), 1e3 * nbytes / (bw * 1e9), 1e3 * over * 1e-6

    def residuals(u):
        c, m, o = terms(u)
        return np.log(np.maximum(c, m) + o) - np.log(meas)

    def jacobian(u):
        c, m, o = terms(u)
        pred = np.maximum(c, m) + o
        compute = c >= m
        dc = np.where(compute, -c, 0.0) / pred
        cols = [np.where(grouped, 0.0, dc) if four else dc, np.where(compute, 0.0, -m) / pred, o / pred]
        if four:
            cols.append(np.where(grouped, dc, 0.0))
        return np.column_stack(cols)

    # starts: the rates the largest ops reach (GFLOP/s, GB/s) and the smallest op's time (us)
    peak0 = np.quantile(flops / (meas * 1e6), 0.9)
    bw0 = np.quantile(nbytes / (meas * 1e6), 0.9)
    over0 = np.min(meas) * 1e3
    grouped0 = np.quantile((flops / (meas * 1e6))[grouped], 0.9) if four else None
    best = None
    for fp in (0.3, 1.0, 3.0):
        for fb in (0.3, 1.0, 3.0):
            for fo in (0.3, 1.0):
                start = [max(peak0 * fp, 1e-3), max(bw0 * fb, 1e-3), max(over0 * fo, 1e-3)]
                if four:
                    start.append(max(grouped0 * fp, 1e-3))
                r = least_squares(residuals, np.log(start), jac=jacobian, method="lm", xtol=1e-15, ftol=1e-15,
                                  gtol=1e-15, max_nfev=2000)
                if best is None or r.cost < best.cost:
                    best = r
    peak, bw, over = (float(x) for x in np.exp(best.x[:3]))
    grouped_rate = float(np.exp(best.x[3])) if four else None
    c, m, _ = terms(best.x)
    bound = tuple("compute" if ci >= mi else "memory" for ci, mi in zip(c, m))
    notes = []
    for kind, figure in (("compute", "peak_gflops"), ("memory", "bandwidth_gbps")):
        if kind not in bound:
            notes.append(f"no sample is {kind}-bound at the fit: {figure} is a bound, not a measurement")
    return CpuFit(peak, bw, over, tuple(float(x) for x in best.fun), bound, "log", tuple(notes), grouped_rate)


# --- evaluating ----------------------------------------------------------------------------------


def evaluate(fit: CpuFit, samples: list[OpSample]) -> dict:
    """Predicted against measured: per op (|pred - meas| / meas, median and max), per op type, and per
    model total (the sum over its nodes, which is what the scheduler adds up for a CPU segment)."""
    pred = [fit.predict_ms(s.flops, s.bytes, s.grouped) for s in samples]
    err = [abs(p - s.ms) / s.ms for p, s in zip(pred, samples)]

    def summary(idx: list[int]) -> dict:
        e = [err[i] for i in idx]
        return {"ops": len(idx), "median_rel_error": statistics.median(e), "max_rel_error": max(e)}

    by_model: dict[str, list[int]] = {}
    by_type: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        by_model.setdefault(s.model, []).append(i)
        by_type.setdefault(s.op_type, []).append(i)
    models = {}
    for name, idx in by_model.items():
        measured = math.fsum(samples[i].ms for i in idx)
        predicted = math.fsum(pred[i] for i in idx)
        models[name] = {"measured_ms": measured, "predicted_ms": predicted,
                        "total_rel_error": abs(predicted - measured) / measured, **summary(idx)}
    worst = max(range(len(samples)), key=err.__getitem__)
    return {
        "ops": summary(list(range(len(samples)))),
        "models": models,
        "op_types": {t: summary(idx) for t, idx in sorted(by_type.items())},
        "worst_op": {"model": samples[worst].model, "node": samples[worst].node, "op_type": samples[worst].op_type,
                     "measured_ms": samples[worst].ms, "predicted_ms": pred[worst]},
    }


# --- per backend: runs of nodes timed as a bundle runs them --------------------------------------

TOLERANCE = 0.25  # a held-out model's prediction is expected within 25 % of its measured time
BOUND = 100.0  # a backend's fitted figure stays within this factor of its start (the per-op fit's), either way
WHOLE = "whole"


@dataclass(frozen=True)
class RunSample:
    """A run of a model's nodes (the whole model, or consecutive nodes of it) timed on one CPU backend as
    a bundle runs it, with every node's terms as the scheduler counts them. `cut_bytes`: the bytes of
    the tensors it takes from or gives to the rest of the model (0 for the whole model)."""

    model: str
    run: str  # WHOLE or "nodes i-j"
    backend: str
    ms: float
    flops: tuple[float, ...]
    param_bytes: tuple[int, ...]
    act_bytes: tuple[int, ...]
    grouped: tuple[bool, ...]
    cut_bytes: int = 0


@dataclass(frozen=True)
class BackendFit(CpuFit):
    """A backend's figures (`CpuFit`'s, written to the target) and what cutting a model costs on it,
    fitted beside them: per cut-out run, `cut_overhead_us` plus its `cut_bytes` at `cut_gbps`. The cut
    terms are not the target's: the scheduler costs a segment as the sum of its nodes."""

    cut_overhead_us: float | None = None
    cut_gbps: float | None = None
    cache_gbps: float | None = None  # the bandwidth of nodes whose bytes fit in cache_mb (None: one bandwidth)
    cache_mb: float | None = None

    def cut_ms(self, sample: RunSample) -> float:
        if sample.run == WHOLE or self.cut_overhead_us is None or self.cut_gbps is None:
            return 0.0
        return self.cut_overhead_us * 1e-3 + 1e3 * sample.cut_bytes / (self.cut_gbps * 1e9)


def node_terms_of(model: onnx.ModelProto, name: str) -> list[tuple[float, int, int, bool]]:
    """(flops, parameter bytes, activation bytes, grouped) of every node of `model`, as the scheduler
    counts them (`scheduling/graph.build_problem`); the model needs static shapes."""
    shapes, consts = _shapes(model, name), irm.constant_names(model)
    return [(node_flops(n, shapes), *node_bytes(n, shapes, consts), is_grouped(n)) for n in model.graph.node]


def run_sample(model: str, run: str, backend: str, ms: float, terms: Sequence[tuple[float, int, int, bool]],
               cut_bytes: int = 0) -> RunSample:
    flops, params, acts, grouped = zip(*terms) if terms else ((), (), (), ())
    return RunSample(model, run, backend, ms, tuple(flops), tuple(params), tuple(acts), tuple(grouped), cut_bytes)


def cuts(ms: Sequence[float], parts: int) -> list[range]:
    """Consecutive runs of nodes, `parts` of them (fewer where nodes are fewer), of about equal total
    `ms` (a node's predicted time): run k ends at the first node where the running total reaches k /
    parts of the whole."""
    if not ms:
        return []
    cum = np.cumsum(np.asarray(ms, dtype=float))
    ends = sorted({int(np.searchsorted(cum, cum[-1] * k / parts)) + 1 for k in range(1, parts)} - {0, len(ms)})
    edges = [0, *(e for e in ends if 0 < e < len(ms)), len(ms)]
    return [range(a, b) for a, b in itertools.pairwise(edges)]


def fit_backend(samples: Sequence[RunSample], base: CpuFit) -> BackendFit:
    """The backend's figures (module docstring, 4.) from its timed runs, started at `base` (the per-op
    fit). The grouped-convolution rate is free only when the runs hold grouped convolutions; otherwise
    the result has none and a target keeps the CPU's own for that backend.

    A run cut out of a model costs more than its nodes: its inputs and outputs are copied in and out of
    the runtime, and a backend whose layout differs from ONNX's (LiteRT's NHWC) transposes them. Where
    there are such runs (and whole models beside them), that cost is fitted too, as a per-run overhead
    plus the cut tensors' bytes at a bandwidth (`BackendFit.cut_ms`), so that it does not leak into the
    node figures; a whole model has no such term, as a segment has none in the scheduler's cost.

    Memory in two tiers (module docstring, 4.): for each capacity of `CACHE_CAPACITIES_MB` the figures
    are fitted again with a cache bandwidth (at least the memory bandwidth) for the nodes whose bytes
    fit in it; the capacity with the least loss is kept where it lowers the loss by `CACHE_GAIN` or more.
    `residuals[j]` is ln(T_j / measured_j); `bound[j]` names the term that carries most of run j's
    predicted time ("compute", "memory", "overhead" or "cut")."""
    if len({s.backend for s in samples}) > 1:
        raise ValueError(f"runs of several backends: {sorted({s.backend for s in samples})}")
    runs = _Runs.of(samples)
    one = _fit_runs(runs, base, None)
    # a capacity with every node on one side is not told apart from the memory bandwidth; a tier is one
    # more figure, which needs one more run
    capacities = [c for c in CACHE_CAPACITIES_MB if 0 < np.count_nonzero(runs.nbytes <= c * 2**20) < len(runs.nbytes)]
    tiered = [_fit_runs(runs, base, c) for c in capacities] if len(samples) > len(one.names) + 1 else []
    best = min(tiered, key=lambda t: t.loss, default=None)
    if best is not None and best.loss < one.loss * (1 - CACHE_GAIN) - LOSS_FLOOR:
        return best.result
    return one.result


# Memory's two tiers (fit_backend): the capacities tried, in MiB, and the gain in loss that keeps one
CACHE_CAPACITIES_MB = (0.5, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
CACHE_GAIN = 0.02
LOSS_FLOOR = 1e-9  # runs a fit already explains exactly gain nothing from a tier


@dataclass(frozen=True)
class _Runs:
    """Timed runs as the arrays the fit works on: one entry per node (`run_of` its run), or per run."""

    samples: Sequence[RunSample]
    run_of: np.ndarray
    flops: np.ndarray
    nbytes: np.ndarray
    grouped: np.ndarray
    nodes: np.ndarray
    meas: np.ndarray
    cut: np.ndarray
    cut_bytes: np.ndarray

    @classmethod
    def of(cls, samples: Sequence[RunSample]) -> _Runs:
        run_of = np.concatenate([np.full(len(s.flops), j) for j, s in enumerate(samples)]) if samples else np.zeros(0)
        cut = np.array([s.run != WHOLE for s in samples], dtype=bool)
        return cls(samples, run_of.astype(int),
                   np.array([f for s in samples for f in s.flops], dtype=float),
                   np.array([p + a for s in samples for p, a in zip(s.param_bytes, s.act_bytes)], dtype=float),
                   np.array([g for s in samples for g in s.grouped], dtype=bool),
                   np.array([len(s.flops) for s in samples], dtype=float),
                   np.array([s.ms for s in samples], dtype=float),
                   cut, np.where(cut, [float(s.cut_bytes) for s in samples], 0.0) if samples else np.zeros(0))


@dataclass(frozen=True)
class _Fitted:
    result: BackendFit
    loss: float
    names: tuple[str, ...]


def _fit_runs(runs: _Runs, base: CpuFit, capacity_mb: float | None) -> _Fitted:
    """fit_backend's least squares, with a cache tier of `capacity_mb` (None: one memory bandwidth)."""
    from scipy.optimize import least_squares

    samples, run_of, flops, nbytes, grouped = runs.samples, runs.run_of, runs.flops, runs.nbytes, runs.grouped
    nodes, meas, cut, cut_bytes = runs.nodes, runs.meas, runs.cut, runs.cut_bytes
    small = nbytes <= capacity_mb * 2**20 if capacity_mb is not None else np.zeros(len(nbytes), dtype=bool)
    tiered = capacity_mb is not None
    four = bool(np.any(grouped & (flops > 0)))
    cutting = bool(cut.any() and (~cut).any())  # the cut terms are told apart from the nodes' by whole models
    names = (["peak_gflops", "bandwidth_gbps", "overhead_us"] + (["grouped_gflops"] if four else [])
             + (["cut_overhead_us", "cut_gbps"] if cutting else []) + (["cache_gbps"] if tiered else []))
    if len(samples) < len(names) + 1:
        raise ValueError(f"fitting {len(names)} figures needs at least {len(names) + 1} timed runs, got {len(samples)}")
    if np.any(meas <= 0) or np.any(nodes == 0):
        raise ValueError("every run needs nodes and a positive measured time")
    fixed_grouped = base.grouped_gflops or base.peak_gflops  # the rate grouped nodes get when it is not free
    # starts: the per-op fit's figures; a cut at ten kernels' overhead, its bytes at the memory bandwidth; the
    # cache as fast as memory (the tier's figure is ln(cache / memory bandwidth) >= 0)
    x0 = np.log([base.peak_gflops, base.bandwidth_gbps, base.overhead_us] + ([fixed_grouped] if four else [])
                + ([10 * base.overhead_us, base.bandwidth_gbps] if cutting else []))
    x0 = np.concatenate([x0, [0.0] if tiered else []])
    g_at, c_at = 3, (4 if four else 3)  # where the grouped rate, the cut terms and the cache tier sit in u
    t_at = c_at + (2 if cutting else 0)
    count = len(samples)

    def terms(u):  # per node: compute and memory ms; the overhead ms every node pays; per run: the cut's ms
        peak, bw, over = np.exp(u[:3])
        rate = np.where(grouped, np.exp(u[g_at]) if four else fixed_grouped, peak)
        bandwidth = np.where(small, bw * np.exp(u[t_at]), bw) if tiered else bw
        cut_ms = (np.where(cut, np.exp(u[c_at]) * 1e-3, 0.0) + 1e3 * cut_bytes / (np.exp(u[c_at + 1]) * 1e9)
                  if cutting else np.zeros(count))
        return 1e3 * flops / (rate * 1e9), 1e3 * nbytes / (bandwidth * 1e9), over * 1e-3, cut_ms

    def totals(u):
        c, m, o, k = terms(u)
        return np.bincount(run_of, np.maximum(c, m), minlength=count) + nodes * o + k

    def residuals(u):
        return np.log(totals(u)) - np.log(meas)

    def jacobian(u):
        c, m, o, _ = terms(u)
        compute = c >= m
        cols = [-np.bincount(run_of, np.where(compute & ~grouped, c, 0.0), minlength=count),
                -np.bincount(run_of, np.where(compute, 0.0, m), minlength=count),
                nodes * o]
        if four:
            cols.append(-np.bincount(run_of, np.where(compute & grouped, c, 0.0), minlength=count))
        if cutting:
            cols += [np.where(cut, np.exp(u[c_at]) * 1e-3, 0.0), -1e3 * cut_bytes / (np.exp(u[c_at + 1]) * 1e9)]
        if tiered:
            cols.append(-np.bincount(run_of, np.where(~compute & small, m, 0.0), minlength=count))
        return np.column_stack(cols) / totals(u)[:, None]

    lo, hi = x0 - math.log(BOUND), x0 + math.log(BOUND)
    if tiered:
        lo[t_at] = 0.0  # a cache is no slower than memory
    best = None
    for fp in (1 / 3, 1.0, 3.0):  # a few starts around the per-op fit: the max() makes the loss piecewise smooth
        for fo in (1 / 3, 1.0, 3.0):
            start = x0.copy()
            start[0] += math.log(fp)
            start[2] += math.log(fo)
            if tiered:
                start[t_at] = math.log(3.0)  # inside its bounds
            r = least_squares(residuals, start, jac=jacobian, bounds=(lo, hi), method="trf", xtol=1e-12, ftol=1e-12,
                              gtol=1e-12, max_nfev=2000)
            if best is None or r.cost < best.cost:
                best = r
    u = best.x.copy()
    # a figure no run's time depends on at the optimum sits anywhere on a flat stretch of the loss:
    # it goes back to its start where the loss stays as it is there
    for k in np.flatnonzero(np.abs(jacobian(u)).max(axis=0) < 1e-9):
        back = u.copy()
        back[k] = x0[k]
        if np.sum(residuals(back) ** 2) <= np.sum(residuals(u) ** 2) * (1 + 1e-9) + 1e-24:
            u = back
    c, m, o, k = terms(u)
    shares = np.column_stack([np.bincount(run_of, np.where(c >= m, c, 0.0), minlength=count),
                              np.bincount(run_of, np.where(c >= m, 0.0, m), minlength=count), nodes * o, k])
    bound = tuple(("compute", "memory", "overhead", "cut")[int(j)] for j in np.argmax(shares, axis=1))
    notes = []
    column = np.abs(jacobian(u)).max(axis=0)
    for j, name in enumerate(names):
        if column[j] < 1e-9:
            notes.append(f"no run's time depends on {name}: it is left at its start" if u[j] == x0[j] else
                         f"no run's time depends on {name} at the fit: a bound, not a measurement")
        elif math.isclose(u[j], lo[j], abs_tol=1e-6) or math.isclose(u[j], hi[j], abs_tol=1e-6):
            if tiered and j == t_at and math.isclose(u[j], lo[j], abs_tol=1e-6):
                continue  # the cache as fast as memory: a fit without the tier, which fit_backend prefers
            notes.append(f"{name} is at its bound ({BOUND:g}x its start): the runs do not determine it")
    peak, bw, over = (float(x) for x in np.exp(u[:3]))
    if tiered:
        notes.append(f"nodes of at most {capacity_mb:g} MiB move their bytes at the cache bandwidth, "
                     f"the others at the memory bandwidth (the capacity of least loss)")
    fit = BackendFit(peak, bw, over, tuple(float(x) for x in residuals(u)), bound, "log, runs", tuple(notes),
                     float(np.exp(u[g_at])) if four else None,
                     float(np.exp(u[c_at])) if cutting else None, float(np.exp(u[c_at + 1])) if cutting else None,
                     bw * float(np.exp(u[t_at])) if tiered else None, capacity_mb)
    return _Fitted(fit, float(np.sum(residuals(u) ** 2)), tuple(names))


def backend_figures(fit: CpuFit, source: str) -> dict:
    """A backend's entry under the CPU's `backends` in a target file: the figures `fit_backend` fitted
    (a grouped rate only where it fitted one, a per-layer cost never)."""
    figures = fit.figures(source)
    figures.pop("layer_overhead")
    if getattr(fit, "cache_gbps", None) is not None:
        figures["cache_bandwidth"] = Figure(value=fit.cache_gbps, unit="GB/s", source=source)
        figures["cache_capacity"] = Figure(value=fit.cache_mb, unit="MiB", source=source)
    return figures


def predict_run_ms(target, sample: RunSample, backend: str | None) -> float:
    """The scheduler's prediction for the run as one CPU segment: `cost.node_ms` summed over its nodes,
    with `backend`'s figures (None: the CPU's own)."""
    return math.fsum(node_ms(target, "cpu", flops=f, param_bytes=p, act_bytes=a, grouped=g, backend=backend)
                     for f, p, a, g in zip(sample.flops, sample.param_bytes, sample.act_bytes, sample.grouped))


def evaluate_backend(target, backend: str, samples: Sequence[RunSample], fit: BackendFit | None = None) -> dict:
    """Predicted against measured for each whole model among `samples` (the error |pred - meas| / meas,
    whether it is within TOLERANCE, and the prediction with the CPU's own figures beside it), and the
    error of every run (the cuts included, with what `fit` says cutting costs), one by one and summed up."""
    errors, models, per_run = [], {}, []
    for s in samples:
        predicted = predict_run_ms(target, s, backend) + (fit.cut_ms(s) if fit is not None else 0.0)
        errors.append(abs(predicted - s.ms) / s.ms)
        per_run.append({"model": s.model, "run": s.run, "nodes": len(s.flops), "measured_ms": s.ms,
                        "predicted_ms": predicted, "rel_error": errors[-1]})
        if s.run == WHOLE:
            shared = predict_run_ms(target, s, None)
            models[s.model] = {"measured_ms": s.ms, "predicted_ms": predicted, "rel_error": errors[-1],
                               "within_tolerance": errors[-1] <= TOLERANCE, "predicted_shared_ms": shared,
                               "shared_rel_error": abs(shared - s.ms) / s.ms}
    return {"models": models,
            "runs": {"count": len(samples), "median_rel_error": statistics.median(errors) if errors else None,
                     "max_rel_error": max(errors) if errors else None},
            "per_run": per_run, "tolerance": TOLERANCE}
