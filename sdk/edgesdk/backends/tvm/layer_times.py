"""What `--prune-plan auto` chooses by (compression/plan.py): each candidate convolution's kernel timed
alone on this host, dense and with each method's pruned weights, and sets of CPU segments timed whole (the
dense ones, and the fastest plan's: the whole model's saving that the kernels' savings are scaled to).

A layer's times are those `sparse_measured.Measured` takes to choose its kernel when the segment compiles (the
same cache, `KERNEL_TIMES` in the CPU's tuning database, the same keys), so the plan and the build agree on
which layers run sparse. The sparse kernel's time depends on the packed format's loop lengths, not on the
values, and the dense kernel's on the shape alone. A segment's time (compiled as the build compiles it, a
pruned one with its measured kernel choices) is the median of `kernel_timing.TIMING_RUNS`
runs of its library on random inputs after a warm-up, kept in the same cache under the segment's digest.
Only 2-D convolutions with one group have a sparse kernel; pruned Gemm and MatMul layers run dense and
are not timed (absent from the result).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import numpy as np
import onnx

from ...ir.model import infer_shapes, sha256, static_shapes
from ...runtime.backends.tvm_runner import load_weights
from ..registry import KERNEL_TIMES, LayerTimesJob
from . import kernel_timing
from .compile import compile_onnx
from .sparse_format import ConvShape
from .sparse_measured import REVISION, Measured
from .targets import _resolve_target, host_cpu


def time_layers(job: LayerTimesJob) -> dict:
    target = _resolve_target(job.device.codegen)[0]  # `mcpu: native` resolved, as compilation resolves it
    database = job.tuning_db if (job.tuning_db / "database_workload.json").exists() else None
    measured = Measured(target, job.tuning_db / KERNEL_TIMES, database)
    shapes = static_shapes(infer_shapes(job.model, strict=False))
    nodes = {n.output[0]: n for n in job.model.graph.node if n.output}
    layers: dict[str, dict] = {}
    for n, (output, weights) in enumerate(job.weights.items()):
        node = nodes[output]
        shape = conv_shape(node, shapes.get(node.input[0]), next(iter(weights.values())).shape) \
            if node.op_type == "Conv" else None
        if shape is None:
            continue
        entry: dict = {"sparse_ms": {}}
        for method, weight in weights.items():
            times = measured(shape, weight)
            entry["dense_ms"] = times["dense_ms"]
            entry["sparse_ms"][method] = times["sparse_ms"]
        layers[output] = entry
        job.log(f"tune: prune plan: timed {node.name or output} ({n + 1}/{len(job.weights)}): dense "
                f"{entry['dense_ms']:.3f} ms, " + ", ".join(f"{m} {t:.3f} ms" for m, t in entry["sparse_ms"].items()))
    totals = {}
    for name, models in job.segments.items():
        total = 0.0
        for model in models:
            key = "segment:" + hashlib.sha256(json.dumps([sha256(model),
                                                          target, host_cpu(), REVISION],
                                                         default=str).encode()).hexdigest()
            total += measured.cached(key, lambda m=model: {"ms": _segment_ms(m, target, database, job.tuning_db)})["ms"]
        totals[name] = round(total, 4)
        job.log(f"tune: prune plan: timed the {name} CPU segments whole: {total:.3f} ms")
    return {"segments_ms": totals, "layers": layers}


def conv_shape(node: onnx.NodeProto, input_shape: tuple[int, ...] | None,
               weight_shape: tuple[int, ...]) -> ConvShape | None:
    """The ConvShape of a 2-D Conv with one group and a static input, or None."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if input_shape is None or len(input_shape) != 4 or len(weight_shape) != 4 or attrs.get("group", 1) != 1:
        return None
    n, ci, h, w = input_shape
    kh, kw = weight_shape[2:]
    stride = tuple(attrs.get("strides", (1, 1)))
    dilation = tuple(attrs.get("dilations", (1, 1)))
    auto = attrs.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        pads = []
        for size, k, s, d in ((h, kh, stride[0], dilation[0]), (w, kw, stride[1], dilation[1])):
            total = max(0, (-(-size // s) - 1) * s + (k - 1) * d + 1 - size)
            small, big = total // 2, total - total // 2
            pads.append((small, big) if auto == "SAME_UPPER" else (big, small))
        top_left_bottom_right = (pads[0][0], pads[1][0], pads[0][1], pads[1][1])
    elif auto == "VALID":
        top_left_bottom_right = (0, 0, 0, 0)
    else:
        top_left_bottom_right = tuple(attrs.get("pads", (0, 0, 0, 0)))
    return ConvShape(n, ci, h, w, weight_shape[0], kh, kw, top_left_bottom_right, stride, dilation)


def _segment_ms(model: onnx.ModelProto, target: dict, database: Path | None, tuning_db: Path) -> float:
    """One dense segment compiled as the build compiles it, run on random inputs: the median time."""
    import tvm
    from tvm.runtime.vm import VirtualMachine

    with tempfile.TemporaryDirectory(prefix="edgesdk-plan-") as tmp:
        lib_path = Path(tmp) / "segment.so"
        res = compile_onnx(model, target, lib_path, tuning_db=database, kernel_times=tuning_db / KERNEL_TIMES,
                           keep_kernel_times=True)
        vm = VirtualMachine(tvm.runtime.load_module(str(lib_path)), tvm.cpu(0))
        rng = np.random.default_rng(0)
        args = [tvm.runtime.tensor(rng.standard_normal(s.shape).astype(s.dtype) if s.dtype.startswith("float")
                                   else np.zeros(s.shape, s.dtype))
                for s in sorted(res.inputs, key=lambda s: int(s.key))]
        args += load_weights(lib_path, res.weights, tvm.cpu(0), "timed")
        main = vm["main"]
        return kernel_timing.median_ms(lambda: main(*args))
