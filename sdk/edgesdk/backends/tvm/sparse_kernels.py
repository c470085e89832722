"""The sparse convolution kernels as TIR functions, and the kernels that keep a sparse run's layout.

`kernel` computes `y[co, h, w, n] = sum over the kept (c, i, j) of v * x[c, h*s + i*d, w*s + j*d, n]` on a
zero-padded input flattened to one buffer, each kept weight's row given as an offset into it (blocked ELL,
sparse_format.py). With a batch (n > 1), the layout is CHWN, the seed's: the batch is the vector (16 fp32
lanes fill an AVX-512 register, 8 an AVX2 one), and a row of `wb` output pixels shares each weight load.
With batch 1 the layout is CHW and the output row is the vector (W-vectorized), `rb` output rows sharing
each weight load; on x86 at unit column stride that form is `row_kernel`: full-register vectors with a
masked tail (AVX-512 mask registers, AVX2 vmaskmov) and the accumulators in registers. The channel blocks
sit outside the output channels, so the input rows of one block stay in the L1 cache across all output
channels. `conv_kernel` picks the form for the target being compiled.

A sparse run stays in CHWN between its sparse convolutions: `depthwise_kernel` computes a depthwise one
there, and `transpose` is the layout change at the run's edges, both scheduled here.

Measured on one ResNet-18 layer (64 -> 64 channels, 3x3, 56x56, batch 16, AMD EPYC znver5, 2 threads):
1:4 at 3.4 ms, onnxruntime's dense 7.9 ms; 2:4 at 6.2 ms (benchmarks/results/sparse-layers.json).
"""

from __future__ import annotations

import functools
from typing import Any

from .sparse_format import ConvShape
from .sparse_schedules import PIXELS, ROWS, RULE, register_rule, scheduled
from .tiling import largest_divisor, pixel_block, vector_registers

TASKS = 8  # batch 1: parallel tasks `row_kernel` makes at least, where the output channels divide that far
OPAQUE = 8  # TVM's OpPatternKind kOpaque
LANES_MAX = 16  # a transpose's vector: at most this many lanes


def _per_target(make):
    """`make(*args)` made once per arguments and target being compiled (`tvm.target.Target.current()`, which
    the tiling reads) in a process, and the same TIR function handed out again: TVM's IR is immutable, and the
    first call did the registering. Each kernel was TVMScript parsed anew, and the parse calls
    `inspect.stack()`, which reads the source of every frame on the stack: 0.1-0.2 s a kernel, for the same
    shapes over and over (each convolution of a repeated block, the measured and the dense candidates, the
    bundle's library and its twin)."""
    @functools.lru_cache(maxsize=256)
    def made(target: str | None, *args):
        return make(*args)

    @functools.wraps(make)
    def cached(*args):
        import tvm

        target = tvm.target.Target.current(allow_none=True)
        return made(None if target is None else str(target), *args)

    return cached


@_per_target
def kernel(shape: ConvShape, blocks: int, count: int) -> Any:
    """The TIR function `main(data, values, offsets, y)`, unscheduled: data the padded input (C, Hp, Wp, N),
    read through a flat view of the same memory, y (Co, OH, OW, N)."""
    from tvm.script import tirx as T

    register_rule()
    n, co = shape.n, shape.co
    hp, wp = shape.padded
    oh, ow = shape.out
    sh, sw = shape.stride
    size = shape.ci * hp * wp * n
    last = size - 1 - ((oh - 1) * sh * wp + (ow - 1) * sw) * n - (n - 1)  # the largest offset in bounds

    @T.prim_func(s_tir=True, private=True)
    def main(data: T.Buffer((shape.ci, hp, wp, n), "float32"), values: T.Buffer((co, blocks, count), "float32"),
             offsets: T.Buffer((co, blocks, count), "int32"), y: T.Buffer((co, oh, ow, n), "float32")):
        # opaque to FuseOps (fused, it would be another function); marked for `is_kernel`
        T.func_attr({"tirx.noalias": True, "op_pattern": OPAQUE, "edgesdk.sparse_conv": True})
        x = T.decl_buffer((size,), "float32", data=data.data)  # the same memory, flat: offsets index it
        for o, h, w, b, k, p in T.grid(co, oh, ow, n, blocks, count):
            with T.sblock("sparse_conv"):
                vo, vh, vw, vb, vk, vp = T.axis.remap("SSSSRR", [o, h, w, b, k, p])
                T.reads(values[vo, vk, vp], offsets[vo, vk, vp], data[0:shape.ci, 0:hp, 0:wp, 0:n])
                T.writes(y[vo, vh, vw, vb])
                T.sblock_attr({"schedule_rule": RULE})
                with T.init():
                    y[vo, vh, vw, vb] = T.float32(0)
                # clamped to the input: a no-op for a packed weight's offsets; MetaSchedule measures
                # candidates on random ones
                y[vo, vh, vw, vb] = y[vo, vh, vw, vb] + values[vo, vk, vp] * x[
                    T.max(T.min(offsets[vo, vk, vp], last), 0) + (vh * sh * wp + vw * sw) * n + vb]

    return main


@_per_target
def row_kernel(shape: ConvShape, blocks: int, count: int, lanes: int) -> Any:
    """Batch 1: `kernel`'s computation written scheduled, the output row cut in vectors of `lanes` (a full
    register) with a masked tail, the accumulators of `ROWS` output rows in registers across the kept weights
    of a channel block. The input is in `ConvShape.row_layout` (its columns dealt into `stride` planes, so a
    strided output row reads contiguous lanes), its offsets `ConvShape.row_offsets`.

    Why written by hand: TVM's buffer-level predication (`tirx.enable_buffer_level_predication`) vectorizes a
    predicated tail only where every access starts at the loop's own index; here the input rows sit at an
    offset, so TVM falls back to a scalar loop. And `kernel`'s row vector must divide the width (7 lanes at
    widths 7, 14 and 28, which LLVM splits 4+2+1), its accumulators stored and reloaded per kept weight.
    Measured on a 2:4-pruned 64-channel 3x3 layer (AVX-512, 2 threads): width 14 from 0.42 to 0.13 ms, width 13
    (scalar before) from 2.1 to 0.16 ms. Not a MetaSchedule task: its cost model reads no feature from
    masked stores, and a tile that does not divide cannot be sampled."""
    from tvm.script import tirx as T

    co = shape.co
    hp, _ = shape.padded
    planes, wq = shape.row_layout()
    pitch = planes * wq  # an input row, all its planes
    layout = (shape.ci, hp, planes, wq) if planes > 1 else (shape.ci, hp, wq, 1)  # stride 1: CHWN's, N = 1
    oh, ow = shape.out
    sh = shape.stride[0]
    size = shape.ci * hp * pitch
    last = size - 1 - ((oh - 1) * sh * pitch + (ow - 1))  # the largest offset in bounds, as in `kernel`
    rows = largest_divisor(oh, ROWS)
    tiles = -(-ow // lanes)  # vectors per output row, the last one masked where lanes do not divide the width
    # the output channels in parts where the tiles alone are too few to share out (7x7: one tile of 7 rows)
    parts = largest_divisor(co, -(-TASKS // (oh // rows * tiles)))
    span = co // parts
    mask, vector = f"uint1x{lanes}", f"float32x{lanes}"

    @T.prim_func(private=True)
    def main(data: T.Buffer(layout, "float32"), values: T.Buffer((co, blocks, count), "float32"),
             offsets: T.Buffer((co, blocks, count), "int32"), y: T.Buffer((co, oh, ow, 1), "float32")):
        T.func_attr({"tirx.noalias": True, "op_pattern": OPAQUE, "edgesdk.sparse_conv": True,
                     "tirx.is_scheduled": True})
        x = T.decl_buffer((size,), "float32", data=data.data)
        yf = T.decl_buffer((co * oh * ow,), "float32", data=y.data)
        # a task: `rows` output rows by one vector of columns, of `span` output channels
        for task in T.parallel(parts * (oh // rows) * tiles):
            acc = T.alloc_buffer((rows * lanes,), "float32", scope="local")
            for k, oi in T.grid(blocks, span):
                o = task // (oh // rows * tiles) * span + oi
                t = task % (oh // rows * tiles)
                for r in T.unroll(rows):
                    if k == 0:
                        acc[T.Ramp(r * lanes, 1, lanes)] = T.Broadcast(T.float32(0), lanes)
                    else:
                        acc[T.Ramp(r * lanes, 1, lanes)] = T.masked_load(
                            vector, yf, T.Ramp((o * oh + t // tiles * rows + r) * ow + t % tiles * lanes, 1, lanes),
                            T.get_active_lane_mask(mask, t % tiles * lanes, ow))
                for p in range(count):
                    for r in T.unroll(rows):
                        acc[T.Ramp(r * lanes, 1, lanes)] = acc[T.Ramp(r * lanes, 1, lanes)] + T.Broadcast(
                            values[o, k, p], lanes) * T.masked_load(
                            vector, x, T.Ramp(T.max(T.min(offsets[o, k, p], last), 0)
                                              + (t // tiles * rows + r) * sh * pitch + t % tiles * lanes, 1, lanes),
                            T.get_active_lane_mask(mask, t % tiles * lanes, ow))
                for r in T.unroll(rows):
                    T.masked_store(yf, acc[T.Ramp(r * lanes, 1, lanes)],
                                   T.Ramp((o * oh + t // tiles * rows + r) * ow + t % tiles * lanes, 1, lanes),
                                   T.get_active_lane_mask(mask, t % tiles * lanes, ow))

    return main


def conv_kernel(shape: ConvShape, blocks: int, count: int) -> Any:
    """The kernel for `shape` on the target being compiled: `row_kernel` at batch 1 on x86 where a register's
    lanes do not divide the output row or the columns are strided (masked vector loads and stores: AVX-512's
    mask registers, AVX2's vmaskmov; strided columns dealt into planes), else `kernel`, MetaSchedule's task
    (the batch's CHWN form, rows of whole vectors at stride 1, aarch64). Measured (2:4 and 1:4, 3x3, AVX-512
    and AVX2, 2 threads): at widths 7, 14 and 28 `row_kernel` took 0.35-0.6 of `kernel`'s time; at width 56
    on AVX2 (whole 8-lane vectors) it was 15 % slower, so `kernel` keeps that case."""
    lanes = row_lanes(shape)
    return row_kernel(shape, blocks, count, lanes) if lanes else kernel(shape, blocks, count)


def row_lanes(shape: ConvShape) -> int | None:
    """The vector lanes `row_kernel` computes `shape` with on the target being compiled, or None where `kernel`
    does (`conv_kernel`)."""
    import tvm

    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "llvm" or shape.n != 1 or \
            str(target.attrs.get("mtriple", "") or "").startswith("aarch64"):
        return None
    lanes = vector_registers()[0]
    return lanes if shape.out[1] % lanes or shape.stride[1] > 1 else None


def row_input(data: Any, shape: ConvShape) -> Any:
    """The Relax expression of `row_kernel`'s input from the padded input `data` (C, Hp, Wp, 1): as it is at
    stride 1, else its columns padded to a multiple of the stride and dealt into planes."""
    from tvm import relax

    s, wq = shape.row_layout()
    if s == 1:
        return data
    ci, hp, wp = shape.ci, *shape.padded
    if wq * s > wp:
        data = relax.op.nn.pad(data, [0, 0, 0, 0, 0, wq * s - wp, 0, 0])
    return relax.op.permute_dims(relax.op.reshape(data, (ci, hp, wq, s)), [0, 1, 3, 2])


@_per_target
def depthwise_kernel(shape: ConvShape) -> Any:
    """A scheduled TIR function `main(data, weight, y)`: a depthwise convolution (one channel per group) in
    CHWN, data padded (C, Hp, Wp, N), weight (C, KH, KW), y (C, OH, OW, N); the batch vectorized under a row
    of output pixels, as the sparse kernel's (`design`)."""
    import tvm
    from tvm import s_tir
    from tvm.script import tirx as T

    c, n, kh, kw = shape.ci, shape.n, shape.kh, shape.kw
    hp, wp = shape.padded
    oh, ow = shape.out
    (sh, sw), (dh, dw) = shape.stride, shape.dilation

    @T.prim_func(s_tir=True, private=True)
    def main(data: T.Buffer((c, hp, wp, n), "float32"), weight: T.Buffer((c, kh, kw), "float32"),
             y: T.Buffer((c, oh, ow, n), "float32")):
        T.func_attr({"tirx.noalias": True, "op_pattern": OPAQUE})
        for ch, h, w, b, i, j in T.grid(c, oh, ow, n, kh, kw):
            with T.sblock("depthwise_conv"):
                vc, vh, vw, vb, vi, vj = T.axis.remap("SSSSRR", [ch, h, w, b, i, j])
                with T.init():
                    y[vc, vh, vw, vb] = T.float32(0)
                y[vc, vh, vw, vb] = y[vc, vh, vw, vb] + data[vc, vh * sh + vi * dh, vw * sw + vj * dw, vb] * \
                    weight[vc, vi, vj]

    sch = s_tir.Schedule(tvm.IRModule({"main": main}))
    block = sch.get_sblock("depthwise_conv")
    ch, h, w, b, i, j = sch.get_loops(block)
    wo, wi = sch.split(w, [None, largest_divisor(ow, min(PIXELS, pixel_block(n)))])
    sch.reorder(ch, h, wo, i, j, wi, b)
    sch.parallel(sch.fuse(ch, h))
    sch.vectorize(b)
    sch.unroll(wi)
    sch.decompose_reduction(block, i)
    return scheduled(sch.mod["main"])


def transpose(shape: tuple[int, ...], axes: list[int], dtype: str = "float32") -> Any:
    """A scheduled TIR function `y = permute_dims(x, axes)` for a 4-D `x` of `shape`: the output's last axis
    innermost and vectorized, the output axis that walks the input's last axis just outside it, so that both
    sides stream through the cache (TVM's default schedule walks the input once per output channel when a
    batch moves innermost: 23 ms for ResNet-18's stem output at batch 16, against 2-3 ms this way)."""
    from tvm import s_tir, te

    x = te.placeholder(shape, dtype, name="x")
    out = [shape[a] for a in axes]
    y = te.compute(out, lambda *i: x[tuple(i[axes.index(k)] for k in range(len(shape)))], name="T_layout")
    sch = s_tir.Schedule(te.create_prim_func([x, y]))
    loops = sch.get_loops(sch.get_sblock("T_layout"))
    last, walks_input = len(out) - 1, axes.index(len(shape) - 1)
    order = [loops[k] for k in range(len(out)) if k not in (walks_input, last)]
    order += [loops[walks_input]] if walks_input != last else []
    sch.reorder(*order, loops[last])
    sch.parallel(sch.fuse(*order[:2]) if len(order) > 2 else order[0])
    sch.vectorize(_vector(sch, loops[last], out[last]))
    func = sch.mod["main"].with_attr("tirx.is_scheduled", True).with_attr("op_pattern", OPAQUE)
    return func.without_attr("global_symbol")


def _vector(sch: Any, loop: Any, extent: int) -> Any:
    """`loop`, or its inner part where it is split: at most LANES_MAX lanes (a divisor of `extent`)."""
    lanes = largest_divisor(extent, LANES_MAX)
    return loop if lanes == extent else sch.split(loop, [None, lanes])[1]
