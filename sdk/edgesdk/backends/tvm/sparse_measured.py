"""A pruned convolution's kernel chosen by timing both on this host (`Measured`): the sparse kernel
(`sparse_runner`) and the dense kernel the backend would compile for the same convolution (`dense_runner`),
each compiled alone and timed by `kernel_timing.median_ms`.

Times are kept in a JSON cache (`KERNEL_TIMES` in the target's tuning database) so that the tune stage's
measurement, the prune plan's layer times (layer_times.py) and the package stage's compilation make the same
choice. The dense kernel is lowered as compilation lowers it (lowering.py), so this module sits above the
lowering that runs the sparse pass, and the pass's own choices (sparse_choice.py) below it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from onnx import helper, numpy_helper

from ...runtime.files import write_whole
from . import kernel_timing
from .database import _apply_database, _open_database
from .lowering import _lowered
from .schedules import _cpu_default_schedules
from .sparse_format import BlockedEll, ConvShape, pack
from .sparse_kernels import conv_kernel, row_lanes
from .sparse_schedules import schedule_rest
from .targets import _resolve_target, host_cpu

# of the kernels and their schedules: measured choices made with another are measured again (3: `row_kernel`;
# 4: strided rows on it too; 5: its output channels split into parallel parts where the tiles are few;
# 6: the kernel timed as compiled, its pixel block sized for the target's registers, not AVX2's by default)
REVISION = 6


class Measured:
    """Each pruned convolution's kernel chosen by timing both on this host: the sparse kernel, and the dense
    kernel the backend would compile for the same convolution (its tuning record where `database` holds one,
    else the default schedule), each alone. Times are kept in `cache` (JSON, keyed by the convolution's
    shapes, the packed format's loop lengths, the target, this host's CPU and REVISION) so that the tune
    stage's measurement and the package stage's compilation make the same choice; `keep` False reads the
    cache without adding to it (the package stage reads the tune stage's copy)."""

    def __init__(self, target: dict, cache: Path | None, database: Path | None = None, *, keep: bool = True):
        self.target, self.cache, self.database, self.keep = target, cache, database, keep
        self.entries = json.loads(cache.read_text()) if cache is not None and cache.exists() else {}

    def __call__(self, shape: ConvShape, weight: np.ndarray) -> dict:
        ell = pack(weight)
        key = hashlib.sha256(json.dumps([dataclasses.asdict(shape), ell.values.shape, self.target, host_cpu(),
                                         REVISION], sort_keys=True, default=str).encode()).hexdigest()
        times = self.cached(key, lambda: {
            "sparse_ms": kernel_timing.median_ms(sparse_runner(shape, ell, self.target, self.database)),
            "dense_ms": kernel_timing.median_ms(dense_runner(shape, self.target, self.database))})
        faster = times["sparse_ms"] < times["dense_ms"]
        return {"kernel": "sparse" if faster else "dense", **times,
                "why": "measured " + ("faster" if faster else "not faster") + " than the dense kernel"}

    def cached(self, key: str, measure: Callable[[], dict]) -> dict:
        """The entry under `key`, measured (and kept, with `keep`) where the cache has none."""
        times = self.entries.get(key)
        if times is None:
            times = self.entries[key] = measure()
            if self.cache is not None and self.keep:
                self.cache.parent.mkdir(parents=True, exist_ok=True)
                text = json.dumps(self.entries, indent=1, sort_keys=True) + "\n"
                write_whole(self.cache, lambda f: f.write(text.encode()))
        return times


def sparse_runner(shape: ConvShape, ell: BlockedEll, target: dict, database: Path | None = None) -> Any:
    """A function that runs the sparse kernel of `shape` and `ell` once, on random inputs: with the
    database's record where it holds one (as compilation schedules it), else the default schedule."""
    import tvm

    with tvm.target.Target(target):  # as compilation builds and schedules it: the target's registers size it
        mod = tvm.IRModule({"main": conv_kernel(shape, ell.values.shape[1], ell.values.shape[2])})
        rows = row_lanes(shape) is not None
        if database is not None and (database / "database_workload.json").exists():
            mod = _apply_database(mod, _open_database(database, target, must_exist=True))
        func = schedule_rest(mod)["main"]
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=tvm.target.Target(target))
    hp, wp = shape.padded
    oh, ow = shape.out
    rng = np.random.default_rng(0)
    layout = (shape.ci, hp, *shape.row_layout()) if rows and shape.stride[1] > 1 else (shape.ci, hp, wp, shape.n)
    args = [tvm.runtime.tensor(a) for a in (rng.standard_normal(layout).astype(np.float32), ell.values,
                                            shape.row_offsets(ell) if rows else shape.offsets(ell),
                                            np.zeros((shape.co, oh, ow, shape.n), np.float32))]
    return lambda: lib["main"](*args)


def dense_runner(shape: ConvShape, target: dict, database: Path | None = None) -> Any:
    """A function that runs, once on random inputs, the dense kernel the backend compiles for `shape`: the
    convolution's own function from the backend's lowering of it alone (x86: channels-last), with the
    database's record where it holds one, else the default schedule."""
    import tvm
    from tvm import relax

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((shape.co, shape.ci, shape.kh, shape.kw)).astype(np.float32)  # dense: no recursion
    top, left, bottom, right = shape.pads
    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[top, left, bottom, right], strides=list(shape.stride),
                            dilations=list(shape.dilation))
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("x", 1, [shape.n, shape.ci, shape.h,
                                                                                      shape.w])],
                              [helper.make_tensor_value_info("y", 1, None)], [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    resolved, tt = _resolve_target(target)
    mod = _lowered(model, tt)
    with tt, tvm.transform.PassContext(opt_level=3):
        if database is not None and (database / "database_workload.json").exists():
            mod = _apply_database(mod, _open_database(database, resolved, must_exist=True))
        mod, _ = _cpu_default_schedules(mod, resolved)
    shapes: dict[str, list] = {}

    @relax.expr_functor.visitor
    class Calls(relax.PyExprVisitor):
        def visit_call_(self, call):
            super().visit_call_(call)
            if call.op == tvm.ir.Op.get("relax.call_tir"):
                shapes[call.args[0].name_hint] = [(tuple(int(d) for d in a.ty.shape.values), str(a.ty.dtype))
                                                  for a in (*call.args[1].fields, call)]

    Calls().visit_expr(mod["main"])
    name = next(g for g in shapes if "conv2d" in g)
    lib = tvm.compile(tvm.IRModule({"main": mod[name].with_attr("global_symbol", "main")}), target=tt)
    args = [tvm.runtime.tensor(rng.standard_normal(s).astype(d)) for s, d in shapes[name]]
    return lambda: lib["main"](*args)
