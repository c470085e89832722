"""Sparse convolutions on the CPU: a pruned 2-D convolution's weights packed with fixed loop lengths and
computed by a TIR kernel that reads only the kept weights.

TVM 0.27 has no sparse operators left (they went with Relay), MetaSchedule's post-processing refuses
loops of data-dependent length, and a vectorized indirect load compiles one lane at a time (no gather).
So the format fixes every loop length at compile time and the sparse index selects input *rows* while
the vector lanes stay contiguous:

- **Blocked ELL** (`BlockedEll`, `pack`): the input channels are cut in blocks of `block`; for each
  output channel and block, the kept weights (value, and the row they read: input channel, kernel row,
  kernel column) are listed, padded to the largest count of any (output channel, block) with zero
  weights that read a valid row. N:M pruning along input channels and column combining fill every
  list exactly when the block is a multiple of M or of the group; unstructured (magnitude) pruning pays
  the padding. `decode` gives the pruned dense weights back, exactly.
- **The kernel** (`kernel`) computes `y[co, h, w, n] = sum over the kept (c, i, j) of
  v * x[c, h*s + i*d, w*s + j*d, n]` on a zero-padded input flattened to one buffer, each kept weight's
  row given as an offset into it. With a batch (n > 1), the layout is CHWN, the seed's: the batch is
  the vector (16 fp32 lanes fill an AVX-512 register, 8 an AVX2 one), and a row of `wb` output pixels
  shares each weight load. With batch 1 the layout is CHW and the output row is the vector
  (W-vectorized), `rb` output rows sharing each weight load; on x86 at unit column stride that form is
  `row_kernel`: full-register vectors with a masked tail (AVX-512 mask registers, AVX2 vmaskmov) and the
  accumulators in registers. The channel blocks sit outside the output
  channels, so the input rows of one block stay in the L1 cache across all output channels.
- **In a module** (`SparseConvs`): every `relax.nn.conv2d` (NCHW/OIHW, one group) whose weight is a
  constant with at least `MIN_SPARSITY` zeros becomes layout edges (to CHWN and padded, and back) around
  a `call_tir` of its kernel, scheduled here (`schedule`); what is left to fuse fuses as before.

Measured on one ResNet-18 layer (64 -> 64 channels, 3x3, 56x56, batch 16, AMD EPYC znver5, 2 threads):
1:4 at 3.4 ms, onnxruntime's dense 7.9 ms; 2:4 at 6.2 ms (benchmarks/results/sparse-layers.json).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...runtime.files import write_whole

MIN_SPARSITY = 0.5  # a constant convolution weight with at least this share of zeros gets the sparse kernel
BLOCK = 16  # input channels per block: 16 channels x 3 kernel rows x a row of pixels stay in L1
PIXELS = 14  # batch > 1: output pixels of a row sharing each weight load (at most; a divisor of the width)
ROWS = 7  # batch 1: output rows sharing each weight load (at most; a divisor of the height)
TASKS = 8  # batch 1: parallel tasks `row_kernel` makes at least, where the output channels divide that far
OPAQUE = 8  # TVM's OpPatternKind kOpaque
LANES_MAX = 16  # a transpose's vector: at most this many lanes
LANES = 8  # batch 1: the vector along the output row (at most; a divisor of the width)


@dataclass(frozen=True)
class BlockedEll:
    """A pruned convolution weight (Co, Ci, KH, KW), packed: `values[o, b, p]` multiplies input row
    `rows[o, b, p]` (flat index into (Ci, KH, KW)) for output channel o; b runs over blocks of `block`
    input channels, p over a fixed count (padding entries have value 0 and read a valid row)."""

    values: np.ndarray  # (Co, NB, P) float32
    rows: np.ndarray  # (Co, NB, P) int32
    shape: tuple[int, int, int, int]
    block: int

    @property
    def kept(self) -> int:
        return int(np.count_nonzero(self.values))

    @property
    def padding(self) -> float:
        """The share of the packed entries that are padding (zero weights computed anyway)."""
        return 1.0 - self.kept / max(1, self.values.size)


def pack(weight: np.ndarray, block: int = BLOCK) -> BlockedEll:
    """`weight` (Co, Ci, KH, KW), its zeros pruned, in blocked ELL. Within a list the rows run in kernel
    position order, then channel, so neighbouring entries read neighbouring input rows."""
    co, ci, kh, kw = weight.shape
    blocks = -(-ci // block)
    lists = []
    for o in range(co):
        for b in range(blocks):
            part = weight[o, b * block:(b + 1) * block].transpose(1, 2, 0)  # (KH, KW, channels of the block)
            at = np.flatnonzero(part)
            i, rest = np.divmod(at, kw * part.shape[2])
            j, c = np.divmod(rest, part.shape[2])
            c = c + b * block
            lists.append(((c * kh + i) * kw + j, weight[o, c, i, j]))
    count = max(1, max(len(r) for r, _ in lists))
    rows = np.zeros((co, blocks, count), np.int32)
    values = np.zeros((co, blocks, count), np.float32)
    for n, (r, v) in enumerate(lists):
        o, b = divmod(n, blocks)
        rows[o, b, :len(r)] = r
        rows[o, b, len(r):] = r[-1] if len(r) else b * block * kh * kw  # a row of this block, weight 0
        values[o, b, :len(v)] = v
    return BlockedEll(values, rows, (co, ci, kh, kw), block)


def decode(ell: BlockedEll) -> np.ndarray:
    """The dense weight `ell` was packed from (padding adds zeros: exact)."""
    co, ci, kh, kw = ell.shape
    dense = np.zeros((co, ci * kh * kw), np.float32)
    for o in range(co):
        np.add.at(dense[o], ell.rows[o].reshape(-1), ell.values[o].reshape(-1))
    return dense.reshape(ell.shape)


@dataclass(frozen=True)
class ConvShape:
    """One convolution as the kernel computes it: input (N, Ci, H, W) padded by `pads` (top, left,
    bottom, right), weight (Co, Ci, KH, KW), `stride` and `dilation` (both axes alike)."""

    n: int
    ci: int
    h: int
    w: int
    co: int
    kh: int
    kw: int
    pads: tuple[int, int, int, int]
    stride: tuple[int, int] = (1, 1)
    dilation: tuple[int, int] = (1, 1)

    @property
    def padded(self) -> tuple[int, int]:
        return self.h + self.pads[0] + self.pads[2], self.w + self.pads[1] + self.pads[3]

    @property
    def out(self) -> tuple[int, int]:
        hp, wp = self.padded
        return ((hp - (self.kh - 1) * self.dilation[0] - 1) // self.stride[0] + 1,
                (wp - (self.kw - 1) * self.dilation[1] - 1) // self.stride[1] + 1)

    def row_layout(self) -> tuple[int, int]:
        """`row_kernel`'s input layout at column stride s: the padded input's columns dealt into s planes,
        (C, Hp, s, Wq), Wq = ceil(Wp / s), so that a strided row of the output reads one plane contiguously;
        (s, Wq). At stride 1 that is (1, Wp): the padded input as it is."""
        s = self.stride[1]
        return s, -(-self.padded[1] // s)

    def row_offsets(self, ell: BlockedEll) -> np.ndarray:
        """Each packed entry's input as an offset into `row_layout`'s input flattened: channel c, kernel row
        i and column j read plane (j * dilation) % s at column (j * dilation) // s."""
        hp, _ = self.padded
        s, wq = self.row_layout()
        c, rest = np.divmod(ell.rows.astype(np.int64), self.kh * self.kw)
        i, j = np.divmod(rest, self.kw)
        col = j * self.dilation[1]
        offsets = ((c * hp + i * self.dilation[0]) * s + col % s) * wq + col // s
        assert offsets.max(initial=0) < 2 ** 31, "input too large for int32 offsets"
        return offsets.astype(np.int32)

    def offsets(self, ell: BlockedEll) -> np.ndarray:
        """Each packed entry's input row as an offset into the padded input flattened (C, H, W, N)."""
        hp, wp = self.padded
        c, rest = np.divmod(ell.rows.astype(np.int64), self.kh * self.kw)
        i, j = np.divmod(rest, self.kw)
        offsets = ((c * hp + i * self.dilation[0]) * wp + j * self.dilation[1]) * self.n
        assert offsets.max(initial=0) < 2 ** 31, "input too large for int32 offsets"
        return offsets.astype(np.int32)


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

    from .schedules import largest_divisor

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


RULE = "edgesdk.sparse_conv"  # the kernel block's `schedule_rule`: MetaSchedule's design space is `design`


def design(sch: Any, block: Any) -> Any:
    """The kernel's schedule in `sch`, its tile sizes sampled (MetaSchedule's search mutates them; unmutated,
    the decisions are the default schedule's): parallel over output rows (and pixel tiles), the channel blocks
    outside the output channels, then the kept weights; with a batch, the batch vectorized under a row of
    pixels; at batch 1, the output row vectorized under a few output rows. Returns `sch`."""
    from .schedules import largest_divisor

    o, h, w, b, k, p = sch.get_loops(block)
    oh, ow, n = (int(sch.get(loop).extent) for loop in (h, w, b))
    if n > 1:
        pixels = largest_divisor(ow, min(PIXELS, pixel_block(n)))
        wo, wi = sch.split(w, sch.sample_perfect_tile(w, n=2, max_innermost_factor=PIXELS,
                                                      decision=[ow // pixels, pixels]))
        sch.reorder(h, wo, k, o, p, wi, b)
        sch.parallel(sch.fuse(h, wo))
        sch.vectorize(b)
        sch.unroll(wi)
    else:
        rows, lanes = largest_divisor(oh, ROWS), largest_divisor(ow, LANES)
        ho, hi = sch.split(h, sch.sample_perfect_tile(h, n=2, max_innermost_factor=ROWS, decision=[oh // rows, rows]))
        wo, wi = sch.split(w, sch.sample_perfect_tile(w, n=2, max_innermost_factor=LANES,
                                                      decision=[ow // lanes, lanes]))
        sch.reorder(ho, wo, k, o, p, hi, b, wi)
        sch.parallel(sch.fuse(ho, wo))
        sch.vectorize(wi)
        sch.unroll(hi)
    sch.decompose_reduction(block, k)
    return sch


def vector_registers() -> tuple[int, int]:
    """fp32 lanes per vector register and the number of vector registers of the target being compiled
    (`tvm.target.Target.current()`): AVX-512 16 and 32, AVX2 8 and 16, aarch64 NEON 4 and 32."""
    import tvm
    from tvm.target import codegen

    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "llvm":
        return 8, 16
    triple = str(target.attrs.get("mtriple", "") or "")
    if triple.startswith("aarch64"):
        return 4, 32
    features = set(codegen.llvm_get_cpu_features(target))
    return (16, 32) if "avx512f" in features else (8, 16)


def pixel_block(n: int) -> int:
    """With a batch of `n` as the vector: the most output pixels whose accumulators (n / lanes registers each)
    fit the target's vector registers beside the broadcast weight and a load (AVX-512, n 16: 14; AVX2: 6; an
    AVX2 block of 14 spilled and ran 1.5x slower)."""
    lanes, registers = vector_registers()
    return max(1, (registers - 4) // max(1, -(-n // lanes)))


def register_rule() -> None:
    """Make `design` the design space MetaSchedule's ApplyCustomRule finds for blocks annotated RULE (it looks
    the rule up per target key: "cpu" for x86 and aarch64)."""
    import tvm

    tvm.register_global_func(f"s_tir.meta_schedule.cpu.{RULE}", lambda sch, block: [design(sch, block)],
                             override=True)


def schedule(func: Any) -> Any:
    """`func` (from `kernel`) with the default schedule (`design`'s decisions unsampled)."""
    import tvm
    from tvm import s_tir

    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    design(sch, sch.get_sblock("sparse_conv"))
    return scheduled(sch.mod["main"])


def scheduled(func: Any) -> Any:
    """`func` marked scheduled (compilation schedules nothing more in it)."""
    return func.with_attr("tirx.is_scheduled", True)


def is_kernel(func: Any) -> bool:
    """Whether `func` is an unscheduled sparse kernel (a task MetaSchedule may tune)."""
    return (func.attrs is not None and func.attrs.get("edgesdk.sparse_conv", False)
            and not func.attrs.get("tirx.is_scheduled", False))


def schedule_rest(mod: Any) -> Any:
    """Every sparse kernel in `mod` the tuning database did not schedule, with the default schedule."""
    for gvar, func in list(mod.functions_items()):
        if is_kernel(func):
            mod[gvar] = schedule(func)
    return mod


# of the kernels and their schedules: measured choices made with another are measured again (3: `row_kernel`;
# 4: strided rows on it too; 5: its output channels split into parallel parts where the tiles are few;
# 6: the kernel timed as compiled, its pixel block sized for the target's registers, not AVX2's by default)
REVISION = 6
TIMING_RUNS = 7  # a kernel's time: the median of this many runs after one warm-up


def by_policy(shape: ConvShape, weight: np.ndarray) -> dict:
    """The choice where this host cannot run the target's code: the sparse kernel, untimed."""
    return {"kernel": "sparse", "why": f"policy: at least {MIN_SPARSITY:.0%} zeros (not timed: this host cannot "
                                       "run the target's code)"}


def weight_digest(weight: np.ndarray) -> str:
    return hashlib.sha256(str(weight.shape).encode() + np.ascontiguousarray(weight, np.float32).tobytes()).hexdigest()


def forced(kernels: dict[str, str], otherwise: Callable[[ConvShape, np.ndarray], dict]) -> Callable:
    """A choice that takes the kernel `kernels` forces on a weight (by `weight_digest`: `edgesdk build
    --sparse-kernels sparse|dense`), else asks `otherwise`."""
    def choose(shape: ConvShape, weight: np.ndarray) -> dict:
        kernel = kernels.get(weight_digest(weight))
        if kernel is None:
            return otherwise(shape, weight)
        return {"kernel": kernel, "why": f"forced: --sparse-kernels {kernel}"}

    return choose


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
        from .targets import host_cpu

        ell = pack(weight)
        key = hashlib.sha256(json.dumps([dataclasses.asdict(shape), ell.values.shape, self.target, host_cpu(),
                                         REVISION], sort_keys=True, default=str).encode()).hexdigest()
        times = self.cached(key, lambda: {"sparse_ms": _median_ms(sparse_runner(shape, ell, self.target, self.database)),
                                          "dense_ms": _median_ms(dense_runner(shape, self.target, self.database))})
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


def _median_ms(run: Any) -> float:
    run()
    times = []
    for _ in range(TIMING_RUNS):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 4)


def sparse_runner(shape: ConvShape, ell: BlockedEll, target: dict, database: Path | None = None) -> Any:
    """A function that runs the sparse kernel of `shape` and `ell` once, on random inputs: with the
    database's record where it holds one (as compilation schedules it), else the default schedule."""
    import tvm

    from .database import _apply_database, _open_database

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
    from onnx import helper, numpy_helper
    from tvm import relax

    from . import compile as tc
    from .database import _apply_database, _open_database
    from .schedules import _cpu_default_schedules

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((shape.co, shape.ci, shape.kh, shape.kw)).astype(np.float32)  # dense: no recursion
    top, left, bottom, right = shape.pads
    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[top, left, bottom, right], strides=list(shape.stride),
                            dilations=list(shape.dilation))
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("x", 1, [shape.n, shape.ci, shape.h,
                                                                                      shape.w])],
                              [helper.make_tensor_value_info("y", 1, None)], [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    resolved, tt = tc._resolve_target(target)
    mod = tc._lower(tc._import(tc._rewritten(model, tt)[0]), tt)
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


DEPTHWISE_MIN_BATCH = 4  # a depthwise convolution inside a CHWN run gets its own CHWN kernel from this batch on


def depthwise_kernel(shape: ConvShape) -> Any:
    """A scheduled TIR function `main(data, weight, y)`: a depthwise convolution (one channel per group) in
    CHWN, data padded (C, Hp, Wp, N), weight (C, KH, KW), y (C, OH, OW, N); the batch vectorized under a row
    of output pixels, as the sparse kernel's (`design`)."""
    import tvm
    from tvm import s_tir
    from tvm.script import tirx as T

    from .schedules import largest_divisor

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
    from .schedules import largest_divisor

    lanes = largest_divisor(extent, LANES_MAX)
    return loop if lanes == extent else sch.split(loop, [None, lanes])[1]


def SparseConvs(channels_last: bool, choose: Callable[[ConvShape, np.ndarray], dict] = by_policy,  # noqa: N802
                min_sparsity: float = MIN_SPARSITY, prepare: Any = None) -> Any:
    """Give each sparse constant-weight `relax.nn.conv2d` (one group, float32, static shapes) its sparse
    kernel, in CHWN with the layout changes only at the edges of sparse runs: TVM's ConvertLayout first
    makes every convolution CHWN (the elementwise operators, pooling and residual additions between them
    follow), then each sparse one becomes its kernel (a zero pad and a `call_tir`) and each dense one goes
    back to its own layout between two transposes (NHWC where `channels_last`, else NCHW), which TVM's
    ConvertLayout and `_CancelTransposePairs` treat as before. A convolution with a sparse weight keeps the
    dense kernel where `choose` (`by_policy`, or `Measured`: timed on this host) says so; a module where no
    convolution gets the sparse kernel is returned as it is. The pass's `choices` list gets, per run, each
    such convolution's choice (its shape, kernel, times and why). `prepare`, a pass, runs first on a module
    that gets a sparse kernel (compile.py: Clip as Relax ops, which ConvertLayout moves along)."""
    import tvm
    from tvm import relax

    conv2d = tvm.ir.Op.get("relax.nn.conv2d")
    choices: list[list[dict]] = []

    def sparse_weight(call) -> np.ndarray | None:
        if call.op != conv2d:
            return None
        weight = call.args[1]
        if not isinstance(weight, tvm.ir.expr.Constant) or int(call.attrs.groups) != 1:
            return None
        dims = getattr(call.args[0].ty, "shape", None)
        if str(call.args[0].ty.dtype) != "float32" or dims is None or \
                not all(isinstance(d, tvm.tirx.IntImm) for d in dims.values):
            return None
        w = weight.value.numpy()
        if call.attrs.kernel_layout != "OIHW" or w.dtype != np.float32:
            return None
        return w if np.count_nonzero(w) <= (1.0 - min_sparsity) * w.size else None

    def conv_shape(call, w: np.ndarray) -> ConvShape:
        dims = [int(d) for d in call.args[0].ty.shape.values]
        n, ci, h, wd = dims if call.attrs.data_layout == "NCHW" else (dims[3], dims[0], dims[1], dims[2])
        return ConvShape(n, ci, h, wd, w.shape[0], w.shape[2], w.shape[3], tuple(int(v) for v in call.attrs.padding),
                         tuple(int(v) for v in call.attrs.strides), tuple(int(v) for v in call.attrs.dilation))

    def identity(shape: ConvShape, w: np.ndarray) -> str:
        return hashlib.sha256(repr(dataclasses.astuple(shape)).encode() + w.tobytes()).hexdigest()

    decided: dict[str, dict] = {}

    @relax.expr_functor.visitor
    class Finder(relax.PyExprVisitor):
        """Each sparse convolution's kernel chosen, in graph order."""

        def visit_call_(self, call):
            super().visit_call_(call)
            w = sparse_weight(call)
            if w is None or call.attrs.data_layout != "NCHW":
                return
            shape = conv_shape(call, w)
            key = identity(shape, w)
            if key not in decided:
                decided[key] = {"shape": dataclasses.asdict(shape), "zeros": round(1 - np.count_nonzero(w) / w.size, 4),
                                **choose(shape, w)}

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        replaced = 0

        def visit_call_(self, call):
            call = super().visit_call_(call)
            if call.op != conv2d or call.attrs.data_layout != "CHWN":
                return call
            w = sparse_weight(call)
            if w is None or decided[identity(conv_shape(call, w), w)]["kernel"] != "sparse":
                return self._dense(call)
            self.replaced += 1
            return self._sparse(call, w)

        def _sparse(self, call, w):
            attrs = call.attrs
            ci, h, wd, n = (int(d) for d in call.args[0].ty.shape.values)
            pads = tuple(int(v) for v in attrs.padding)
            shape = ConvShape(n, ci, h, wd, w.shape[0], w.shape[2], w.shape[3], pads,
                              tuple(int(v) for v in attrs.strides), tuple(int(v) for v in attrs.dilation))
            ell = pack(w)
            gvar = self.builder_.add_func(conv_kernel(shape, ell.values.shape[1], ell.values.shape[2]),
                                          "sparse_conv2d")
            data = call.args[0]
            top, left, bottom, right = pads
            if any(pads):
                data = relax.op.nn.pad(data, [0, 0, top, bottom, left, right, 0, 0])
            offsets = shape.offsets(ell)
            if row_lanes(shape):
                data, offsets = row_input(data, shape), shape.row_offsets(ell)
            oh, ow = shape.out
            return relax.call_tir(gvar, [data, relax.const(ell.values), relax.const(offsets)],
                                  relax.TensorType((shape.co, oh, ow, n), "float32"))

        def _dense(self, call):
            data, weight = call.args
            attrs = call.attrs
            depthwise = self._depthwise(call)
            if depthwise is not None:
                return depthwise
            layout, kernel_layout, axes = ("NHWC", "HWIO", [3, 1, 2, 0]) if channels_last else \
                ("NCHW", "OIHW", [3, 0, 1, 2])
            if channels_last and isinstance(weight, tvm.ir.expr.Constant):
                weight = relax.const(weight.value.numpy().transpose(2, 3, 1, 0))
            else:
                layout, kernel_layout, axes = "NCHW", "OIHW", [3, 0, 1, 2]
            back = [axes.index(k) for k in range(4)]
            out = relax.op.nn.conv2d(relax.op.permute_dims(data, axes), weight, strides=attrs.strides,
                                     padding=attrs.padding, dilation=attrs.dilation, groups=attrs.groups,
                                     data_layout=layout, kernel_layout=kernel_layout, out_layout=layout,
                                     out_dtype=attrs.out_dtype)
            return relax.op.permute_dims(out, back)

        def _depthwise(self, call):
            """A depthwise convolution (one channel per group) with a batch, computed in CHWN where it is (a
            kernel of its own), so that a MobileNet's depthwise layers do not leave a sparse run."""
            data, weight = call.args
            dims = [int(d) for d in data.ty.shape.values]
            groups = int(call.attrs.groups)
            if not isinstance(weight, tvm.ir.expr.Constant) or groups == 1 or dims[3] < DEPTHWISE_MIN_BATCH:
                return None
            w = weight.value.numpy()
            if w.dtype != np.float32 or groups != dims[0] or w.shape[:2] != (groups, 1):
                return None
            ci, h, wd, n = dims
            pads = tuple(int(v) for v in call.attrs.padding)
            shape = ConvShape(n, ci, h, wd, ci, w.shape[2], w.shape[3], pads,
                              tuple(int(v) for v in call.attrs.strides), tuple(int(v) for v in call.attrs.dilation))
            top, left, bottom, right = pads
            if any(pads):
                data = relax.op.nn.pad(data, [0, 0, top, bottom, left, right, 0, 0])
            gvar = self.builder_.add_func(depthwise_kernel(shape), "depthwise_chwn")
            oh, ow = shape.out
            return relax.call_tir(gvar, [data, relax.const(w[:, 0])], relax.TensorType((ci, oh, ow, n), "float32"))

    permute_dims = tvm.ir.Op.get("relax.permute_dims")

    @relax.expr_functor.mutator
    class Layouts(relax.PyExprMutator):
        """Each 4-D float32 transpose into or out of CHWN as `transpose`'s kernel."""

        def visit_call_(self, call):
            call = super().visit_call_(call)
            if call.op != permute_dims or call.attrs.axes is None:
                return call
            ty = call.args[0].ty
            dims = getattr(ty, "shape", None)
            if str(ty.dtype) != "float32" or dims is None or len(dims.values) != 4 or \
                    not all(isinstance(d, tvm.tirx.IntImm) for d in dims.values):
                return call
            axes = [int(a) for a in call.attrs.axes]
            shape = tuple(int(d) for d in dims.values)
            gvar = self.builder_.add_func(transpose(shape, axes), "layout_transpose")
            return relax.call_tir(gvar, [call.args[0]], relax.TensorType([shape[a] for a in axes], "float32"))

    @tvm.transform.module_pass(opt_level=0, name="SparseConvs")
    def transform(mod: Any, _ctx: Any) -> Any:
        decided.clear()
        finder = Finder()
        for func in mod.functions.values():
            if isinstance(func, relax.Function):
                finder.visit_expr(func)
        choices.append(list(decided.values()))
        if not any(c["kernel"] == "sparse" for c in decided.values()):
            return mod
        if prepare is not None:
            mod = prepare(mod)
        mod = relax.transform.ConvertLayout({"relax.nn.conv2d": ["CHWN", "OIHW"]})(mod)
        rewriter = Rewriter(mod)
        for gvar, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        mod = rewriter.builder_.get()
        layouts = Layouts(mod)
        for gvar, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                layouts.builder_.update_func(gvar, layouts.visit_expr(func))
        return relax.transform.DeadCodeElimination()(layouts.builder_.get())

    transform.choices = choices
    return transform
