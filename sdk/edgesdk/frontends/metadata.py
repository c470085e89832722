"""What a model file states about the range of its inputs, for synthetic calibration samples that
follow it (`ir/calibration.py`).

- ONNX: the image metadata of ONNX's metadata conventions (`metadata_props`), `Image.NominalPixelRange`:
  `NominalRange_0_255`, `Normalized_0_1`, `Normalized_1_1`, `NominalRange_16_235`. It describes the
  model's image input: those whose type denotation is IMAGE, else every 4-d float input with 1 or 3
  channels (first or last).
- TFLite: TFLite Support's metadata (the model's `TFLITE_METADATA` buffer, a `ModelMetadata` flatbuffer):
  an input's `stats` (per-channel min and max, the range itself), else its `NormalizationOptions` (per
  channel mean and std, applied to 8-bit pixels: [(0 - mean) / std, (255 - mean) / std]).

A range is `{"low": [...], "high": [...], "axis": A, "source": "..."}`: one value, or one per channel along
axis A. Metadata that cannot be read is no range, never an error: the model still builds.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import onnx

NOMINAL_RANGES = {"NominalRange_0_255": (0.0, 255.0), "Normalized_0_1": (0.0, 1.0), "Normalized_1_1": (-1.0, 1.0),
                  "NominalRange_16_235": (16.0, 235.0)}
PIXEL_RANGE_KEY = "Image.NominalPixelRange"
TFLITE_METADATA = "TFLITE_METADATA"


def input_ranges(model: onnx.ModelProto, path: Path, fmt: str, inputs: list[dict]) -> dict[str, dict]:
    """The range each of `inputs` (import.json's: name, shape, dtype) is stated to take, by name."""
    if fmt == "onnx":
        return _onnx_ranges(model, inputs)
    if fmt == "tflite":
        try:
            return _tflite_ranges(Path(path), inputs)
        except (OSError, ValueError, IndexError, struct.error, UnicodeDecodeError):
            return {}  # metadata we cannot read states nothing
    return {}


def _image_inputs(model: onnx.ModelProto, inputs: list[dict]) -> list[dict]:
    denoted = {i.name for i in model.graph.input if i.type.denotation == "IMAGE"}
    if denoted:
        return [i for i in inputs if i["name"] in denoted]
    return [i for i in inputs if i["dtype"].startswith("float") and len(i["shape"]) == 4
            and (i["shape"][1] in (1, 3) or i["shape"][3] in (1, 3))]


def _onnx_ranges(model: onnx.ModelProto, inputs: list[dict]) -> dict[str, dict]:
    stated = {p.key: p.value for p in model.metadata_props}.get(PIXEL_RANGE_KEY)
    if stated not in NOMINAL_RANGES:
        return {}
    lo, hi = NOMINAL_RANGES[stated]
    return {i["name"]: {"low": [lo], "high": [hi], "axis": None,
                        "source": f"the model's metadata ({PIXEL_RANGE_KEY} = {stated})"}
            for i in _image_inputs(model, inputs)}


# --- TFLite Support's metadata, read with flatbuffers' table accessors (no tflite_support needed) -----------


class _Table:
    """A flatbuffer table at `pos` of `buf`: field k's value, string, vector or sub-table."""

    def __init__(self, buf, pos: int):
        self.buf, self.pos = buf, pos
        vtable = pos - struct.unpack_from("<i", buf, pos)[0]
        self._vlen = struct.unpack_from("<H", buf, vtable)[0]
        self._vtable = vtable

    def _field(self, k: int) -> int:
        slot = 4 + 2 * k
        return struct.unpack_from("<H", self.buf, self._vtable + slot)[0] if slot < self._vlen else 0

    def scalar(self, k: int, fmt: str, default=0):
        off = self._field(k)
        return struct.unpack_from("<" + fmt, self.buf, self.pos + off)[0] if off else default

    def _indirect(self, k: int) -> int | None:
        off = self._field(k)
        if not off:
            return None
        at = self.pos + off
        return at + struct.unpack_from("<I", self.buf, at)[0]

    def table(self, k: int) -> "_Table | None":
        at = self._indirect(k)
        return _Table(self.buf, at) if at is not None else None

    def string(self, k: int) -> str | None:
        at = self._indirect(k)
        if at is None:
            return None
        n = struct.unpack_from("<I", self.buf, at)[0]
        return bytes(self.buf[at + 4:at + 4 + n]).decode()

    def vector(self, k: int) -> tuple[int, int]:
        """(start, length) of a vector field; (0, 0) where absent."""
        at = self._indirect(k)
        return (at + 4, struct.unpack_from("<I", self.buf, at)[0]) if at is not None else (0, 0)

    def tables(self, k: int) -> list["_Table"]:
        start, n = self.vector(k)
        return [_Table(self.buf, start + 4 * j + struct.unpack_from("<I", self.buf, start + 4 * j)[0]) for j in range(n)]

    def floats(self, k: int) -> list[float]:
        start, n = self.vector(k)
        return list(struct.unpack_from(f"<{n}f", self.buf, start)) if n else []

    def ints(self, k: int) -> list[int]:
        start, n = self.vector(k)
        return list(struct.unpack_from(f"<{n}i", self.buf, start)) if n else []


def _root(buf, at: int = 0) -> _Table:
    return _Table(buf, at + struct.unpack_from("<I", buf, at)[0])


def _tflite_ranges(path: Path, inputs: list[dict]) -> dict[str, dict]:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        model = _root(buf)
        # Model: 2 subgraphs, 4 buffers, 6 metadata; Metadata: 0 name, 1 buffer; Buffer: 0 data
        found = [m for m in model.tables(6) if m.string(0) == TFLITE_METADATA]
        if not found:
            return {}
        data_at, size = model.tables(4)[found[0].scalar(1, "I")].vector(0)
        if not size:
            return {}
        meta = bytes(buf[data_at:data_at + size])
        graph = model.tables(2)[0]
        # SubGraph: 0 tensors, 1 inputs; Tensor: 3 name
        names = [graph.tables(0)[i].string(3) for i in graph.ints(1)]
    # ModelMetadata: 3 subgraph_metadata; SubGraphMetadata: 2 input_tensor_metadata
    subgraphs = _root(meta).tables(3)
    if not subgraphs:
        return {}
    described = subgraphs[0].tables(2)
    by_name = {i["name"]: i for i in inputs}
    out = {}
    for k, tensor in enumerate(described):
        name = names[k] if k < len(names) else None
        target = by_name.get(name) or (inputs[k] if len(inputs) == len(described) else None)
        if target is None:
            continue
        stated = _tensor_range(tensor)
        if stated is not None:
            channels = target["shape"][-1] if target["shape"] else 1
            lo, hi, source = stated
            if len(lo) not in (1, channels) or len(hi) != len(lo):
                continue
            out[target["name"]] = {"low": lo, "high": hi, "axis": None if len(lo) == 1 else len(target["shape"]) - 1,
                                   "source": f"the model's TFLite metadata ({source})"}
    return out


def _tensor_range(tensor: _Table) -> tuple[list[float], list[float], str] | None:
    """TensorMetadata: 4 process_units, 5 stats. Stats: 0 max, 1 min. ProcessUnit: 0 options_type,
    1 options; NormalizationOptions (type 1): 0 mean, 1 std."""
    stats = tensor.table(5)
    if stats is not None:
        hi, lo = stats.floats(0), stats.floats(1)
        if lo and hi:
            n = max(len(lo), len(hi))
            lo, hi = (lo * n if len(lo) == 1 else lo), (hi * n if len(hi) == 1 else hi)
            if len(lo) == len(hi) and all(a < b for a, b in zip(lo, hi)):
                return lo, hi, f"stats: min {_nums(lo)}, max {_nums(hi)}"
    for unit in tensor.tables(4):
        if unit.scalar(0, "B") != 1:
            continue
        options = unit.table(1)
        mean, std = (options.floats(0), options.floats(1)) if options is not None else ([], [])
        if not mean or not std or any(s == 0 for s in std):
            continue
        n = max(len(mean), len(std))
        mean, std = (mean * n if len(mean) == 1 else mean), (std * n if len(std) == 1 else std)
        if len(mean) != len(std):
            continue
        ends = [((0.0 - m) / s, (255.0 - m) / s) for m, s in zip(mean, std)]
        return ([min(e) for e in ends], [max(e) for e in ends],
                f"normalization of 8-bit pixels: mean {_nums(mean)}, std {_nums(std)}")
    return None


def _nums(v: list[float]) -> str:
    return ":".join(f"{x:g}" for x in v)
