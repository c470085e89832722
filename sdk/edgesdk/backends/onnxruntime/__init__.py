"""onnxruntime: the reference executor, and a CPU backend (a whole CPU span where the tune stage measured it
fastest, or the ops TVM's importer lacks)."""

from __future__ import annotations

import contextlib
import io
import logging

import numpy as np
import onnx

from ...ir import model as irm


def session(model: onnx.ModelProto, *, threads: int = 0, outputs: list[onnx.ValueInfoProto] | None = None,
            optimized: bool = True):
    """A CPU session of `model` (its weights handed over, not copied: `irm.onnxruntime_session`);
    `outputs` replaces the graph's outputs; `optimized=False`: none of onnxruntime's graph optimizations."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    if outputs is not None:
        # the NCHWc layout transformer (ORT_ENABLE_ALL) fuses a Conv with the Add after it even where the Conv's
        # output is asked for: the session then fails ("Failed to find node output ... producing output",
        # NASNetMobile's tune stage), and onnxruntime's retry loses the weights handed over. The values asked for
        # are float either way; the layout only changes speed.
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    if not optimized:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return irm.onnxruntime_session(model, opts, outputs=outputs)


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], outputs: list[str] | None = None) -> dict[str, np.ndarray]:
    """Run `model` on `feeds`; `outputs` may name any intermediate tensor with a known type."""
    return run_many(model, [feeds], outputs)[0]


def run_many(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]],
             outputs: list[str] | None = None, *, optimized: bool = True) -> list[dict[str, np.ndarray]]:
    """`run` on each of `feeds`, with one session (`optimized`: as `session`)."""
    wanted = None
    if outputs is not None:
        g = model.graph
        known = {o.name: o for o in g.output}
        vinfo = {vi.name: vi for vi in list(g.value_info) + list(g.input)}
        wanted = [vinfo.get(name) or known.get(name) or onnx.helper.make_empty_tensor_value_info(name)
                  for name in outputs]
    sess = session(model, outputs=wanted, optimized=optimized)
    names = [o.name for o in sess.get_outputs()]
    return [dict(zip(names, sess.run(names, f))) for f in feeds]


def _with_ranges(quantized: onnx.ModelProto, model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], method: str,
                 percentile: float) -> tuple[onnx.ModelProto, dict]:
    """`quantized` (QDQ) with each activation's QuantizeLinear scale and zero point set from the range
    `method` gives its float values in `model` on `feeds` (auto: per tensor the method of least error on
    them, `ir.calibrators.Errors`); and the record of the ranges. int8 over [a, b] (0 in it): scale
    (b - a) / 255, zero point round(-128 - a / scale)."""
    from onnx import numpy_helper

    from ...ir import calibrators

    inits = {i.name: i for i in quantized.graph.initializer}
    uses: dict[str, int] = {}
    for node in quantized.graph.node:
        if node.op_type == "QuantizeLinear":
            for name in node.input[1:3]:
                uses[name] = uses.get(name, 0) + 1
    # an activation's own scale and zero point (never one another tensor's QuantizeLinear shares)
    q = {n.input[0]: n for n in quantized.graph.node if n.op_type == "QuantizeLinear" and n.input[0] not in inits
         and len(n.input) == 3 and uses[n.input[1]] == 1 and uses[n.input[2]] == 1}
    g = model.graph
    # the float tensors they quantize (a graph output's QuantizeLinear reads a renamed copy of it)
    in_float = {n for node in g.node for n in node.output} | {i.name for i in g.input}
    names = sorted(n for n in q if n in in_float)
    known = {vi.name: vi for vi in (*g.value_info, *g.input, *g.output)}
    sess = session(model, outputs=[known.get(n) or onnx.helper.make_empty_tensor_value_info(n) for n in names])
    seen: dict[str, tuple[float, float]] = {}
    for f in feeds:
        for name, x in zip(names, sess.run(names, f)):
            lo, hi = seen.get(name, (np.inf, -np.inf))
            seen[name] = (min(lo, float(np.min(x))), max(hi, float(np.max(x))))
    hist = {n: calibrators.Histogram(*seen[n]) for n in names}
    for f in feeds:
        for name, x in zip(names, sess.run(names, f)):
            hist[name].add(x)
    found = {n: calibrators.ranges(h, percentile) for n, h in hist.items()}
    if method == "auto":
        errors = {n: calibrators.Errors(r) for n, r in found.items()}
        for f in feeds:
            for name, x in zip(names, sess.run(names, f)):
                errors[name].add(x)
        chosen = {n: e.least() for n, e in errors.items()}
    else:
        chosen = {n: method for n in names}
    for name in names:
        lo, hi = found[name][chosen[name]]
        if hi <= lo:
            continue
        scale_init, zero_init = inits[q[name].input[1]], inits[q[name].input[2]]
        zero_type = numpy_helper.to_array(zero_init).dtype
        low = np.iinfo(zero_type).min
        scale = np.float32((hi - lo) / 255.0)
        zero = np.clip(np.round(low - lo / float(scale)), low, low + 255).astype(zero_type)
        scale_init.CopyFrom(numpy_helper.from_array(np.asarray(scale, np.float32).reshape(
            numpy_helper.to_array(scale_init).shape), scale_init.name))
        zero_init.CopyFrom(numpy_helper.from_array(zero.reshape(numpy_helper.to_array(zero_init).shape), zero_init.name))
    counts = {m: sum(1 for c in chosen.values() if c == m) for m in calibrators.METHODS}
    return quantized, {"method": method, "tensors": len(names), "methods": {m: n for m, n in counts.items() if n}}


def lowering_reason(node, shapes, consts) -> str | None:
    """onnxruntime runs every standard op; another domain's it does not know."""
    return None if not node.domain or node.domain == "ai.onnx" else f"onnxruntime has no kernel for domain {node.domain}"


def compile_segment(job):
    """A plan segment for a bundle (`registry.CompileJob`): its ONNX graph, which the runtime's
    onnxruntime runner executes, with two rewrites for onnxruntime's kernels: tf2onnx's Keras exact
    GELU as onnxruntime's Gelu (`fusions.py`: onnxruntime does not fuse that form itself), and the
    constant affine maps after convolutions as BatchNormalization (`nchwc.py`: onnxruntime's blocked
    layout keeps them)."""
    from ...ir import model as irm
    from ..registry import Compiled
    from .fusions import fuse
    from .nchwc import affine_as_batchnorm

    artifact = f"segments/{job.segment.id}.onnx"
    model, fused = fuse(job.model)
    if fused:
        job.log(f"package: {job.segment.id}: tf2onnx's Keras patterns as onnxruntime's fused ops: "
                + ", ".join(f"{op} x{n}" for op, n in fused.items()))
    model, rewritten = affine_as_batchnorm(model)
    if rewritten.maps:
        job.log(f"package: {job.segment.id}: {rewritten.maps} affine maps after convolutions "
                f"({rewritten.nodes} Mul/Add nodes) as BatchNormalization, for onnxruntime's NCHWc layout")
    irm.save(model, job.segments_dir.parent / artifact)
    return Compiled(artifact, *float_specs(job))


def float_specs(job) -> tuple[tuple, tuple]:
    """A segment's inputs and outputs as the runtime's TensorSpecs, in its ONNX graph's own shapes, dtypes and
    layout: what a backend that runs the graph as it is (onnxruntime, OpenVINO) takes and gives."""
    from ...ir import model as irm
    from ...runtime.manifest import TensorSpec

    shapes, types = irm.static_shapes(job.model), irm.elem_types(job.model)

    def spec(name: str) -> TensorSpec:
        return TensorSpec(name=name, shape=shapes[name], dtype=irm.dtype_name(types[name]))

    return tuple(spec(n) for n in job.segment.inputs), tuple(spec(n) for n in job.segment.outputs)


ACCURACY_SAMPLES = 8  # calibration samples the int8 segment is compared to the float one on


def quantize_segment(job) -> dict:
    """The `onnxruntime-int8` backend's quantizer (`registry.QuantizeJob`): the segment as onnxruntime's
    own static int8 (QDQ, per-channel int8 weights, int8 activations: `quantize_static`) calibrated on
    the job's samples by min-max or percentile ranges (onnxruntime's calibrators), or by mse, entropy or
    auto (`ir.calibrators`: each quantized activation's scale and zero point set from its range,
    `_with_ranges`); and its accuracy against the float segment."""
    import tempfile
    from pathlib import Path

    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, quantize_static

    from ...ir import model as irm
    from ...ir.numeric import compare

    seg = job.segment
    artifact = f"segments/{seg.id}.int8.onnx"
    out = job.out_dir.parent / artifact
    # every node int8: `job.target` and `keep_float` (mixed precision) are LiteRT's alone so far
    job.log(f"{'compress' if job.target is None else 'tune'}: {seg.id}: {len(seg.nodes)} nodes -> onnxruntime int8 (QDQ)")
    feeds = [{k: s[k] for k in seg.inputs} for s in job.samples]

    class _Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter(feeds)

        def get_next(self):
            return next(self._it, None)

    method = CalibrationMethod.Percentile if job.method == "percentile" else CalibrationMethod.MinMax
    with tempfile.TemporaryDirectory(prefix="edgesdk-qdq-") as tmp:
        src = Path(tmp) / "float.onnx"
        irm.save(job.model, src, link=False)  # onnx's loader in quantize_static refuses a linked file
        # calibration runs an augmented copy of the model written beside it; the quantizer's advice on
        # the root logger (pre-process the model first: our import stage has) is not the user's to read
        logging.disable(logging.WARNING)
        try:
            # its percentile calibration prints progress on stdout, where `edgesdk build --json` writes data
            with contextlib.redirect_stdout(io.StringIO()):
                quantize_static(str(src), str(out), _Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                                calibrate_method=method, extra_options={"CalibPercentile": job.percentile,
                                                                        "CalibTensorRangeSymmetric": False},
                                calibration_providers=["CPUExecutionProvider"])
        finally:
            logging.disable(logging.NOTSET)
    quantized = onnx.load(str(out))
    ranges: dict = {"method": job.method}
    if job.method not in ("minmax", "percentile"):
        quantized, ranges = _with_ranges(quantized, job.model, feeds, job.method, job.percentile)
        onnx.save(quantized, str(out))
    got = run_many(quantized, feeds[:ACCURACY_SAMPLES], list(seg.outputs))
    want = job.samples[:ACCURACY_SAMPLES]
    shapes, types = irm.static_shapes(job.model), irm.elem_types(job.model)

    def spec(name: str) -> dict:
        return {"name": name, "shape": list(shapes[name]), "dtype": irm.dtype_name(types[name])}

    return {"artifact": artifact, "inputs": [spec(n) for n in seg.inputs], "outputs": [spec(n) for n in seg.outputs],
            "format": "QDQ, per-channel int8 weights, int8 activations", "ranges": ranges,
            "accuracy_vs_float": {o: compare(np.stack([g[o] for g in got]), np.stack([w[o] for w in want]))
                                  for o in seg.outputs}}


def compile_int8_segment(job):
    """An `onnxruntime-int8` segment for a bundle: the compress stage's QDQ model, as it is."""
    import shutil
    from pathlib import Path

    from ...runtime.manifest import tensor_from_dict
    from ..registry import Compiled

    info = job.compressed
    artifact = f"segments/{job.segment.id}.int8.onnx"
    shutil.copyfile(Path(info["dir"]) / info["artifact"], job.segments_dir.parent / artifact)
    return Compiled(artifact, tuple(tensor_from_dict(t) for t in info["inputs"]),
                    tuple(tensor_from_dict(t) for t in info["outputs"]))
