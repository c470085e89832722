"""The packed format of a pruned convolution's weights: blocked ELL, every loop length fixed at compile time.

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
- **Where each entry reads** (`ConvShape`): a convolution's geometry, and each packed entry's input row as
  an offset into the padded input flattened, in the layout the kernel reads (sparse_kernels.py).

The rest of the sparse path: sparse_kernels.py (the TIR kernels), sparse_schedules.py (their schedules),
sparse_choice.py and sparse_measured.py (sparse or dense, per convolution), sparse_pass.py (the Relax pass
that puts the kernels in a module).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 16  # input channels per block: 16 channels x 3 kernel rows x a row of pixels stay in L1


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

