"""Which format a model path is in, and the cheap container checks that need no converter.

The checks here are the sure ones: a file that fails them cannot be the format it claims, so it
is refused without starting a converter process. A file that passes may still be damaged inside;
the converter finds that.
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

from ..errors import UsageError, UserError

FORMATS = ("onnx", "savedmodel", "keras", "h5", "tflite", "pt2")

SUFFIXES = {".onnx": "onnx", ".keras": "keras", ".h5": "h5", ".hdf5": "h5", ".tflite": "tflite", ".pt2": "pt2"}
DESCRIPTIONS = {
    "onnx": "an ONNX model",
    "savedmodel": "a TensorFlow SavedModel",
    "keras": "a Keras 3 .keras archive",
    "h5": "a Keras HDF5 (.h5) model",
    "tflite": "a TFLite flatbuffer",
    "pt2": "a PyTorch torch.export program (.pt2)",
}
READABLE = ("ONNX (.onnx), TensorFlow SavedModel (a directory holding saved_model.pb), "
            "Keras (.keras, .h5), TFLite (.tflite) and PyTorch torch.export programs (.pt2, torch.export.save)")

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
TFLITE_IDENTIFIER = b"TFL3"  # flatbuffer file identifier, bytes 4..8
ZIP_MAGIC = b"PK\x03\x04"


def detect(path: Path) -> str:
    """The format of `path`: a SavedModel directory, else by suffix, else by magic bytes."""
    path = Path(path)
    if not path.exists():
        raise UsageError("import.no-such-file", f"{path} does not exist", "check the model path")
    if path.is_dir():
        if (path / "saved_model.pb").is_file() or (path / "saved_model.pbtxt").is_file():
            return "savedmodel"
        raise UsageError("import.unknown-format", f"{path} is a directory without saved_model.pb",
                         f"edgesdk reads {READABLE}")
    if path.name in ("saved_model.pb", "saved_model.pbtxt"):
        return "savedmodel"
    if path.suffix.lower() in SUFFIXES:
        return SUFFIXES[path.suffix.lower()]
    with open(path, "rb") as f:
        head = f.read(16)
    if head[4:8] == TFLITE_IDENTIFIER:
        return "tflite"
    if head[:8] == HDF5_SIGNATURE:
        return "h5"
    if head[:4] == ZIP_MAGIC:
        return "keras"
    hint = f"edgesdk reads {READABLE}"
    if path.suffix.lower() == ".pb":
        hint += "; a frozen GraphDef is not read: export a SavedModel (tf.saved_model.save) instead"
    raise UsageError("import.unknown-format", f"{path}: cannot tell the model format (suffix '{path.suffix}')", hint)


def check_container(path: Path, fmt: str) -> None:
    """Refuse a file whose container is not `fmt` (signature, zip directory, HDF5 end-of-file
    address): such files never reach a converter."""
    problem = CONTAINER_CHECKS[fmt](Path(path))
    if problem:
        raise UserError("import.bad-file", f"{path} is not {DESCRIPTIONS[fmt]}: {problem}",
                        "the file may be truncated or damaged; export the model again")


def _onnx(path: Path) -> str | None:
    return "the file is empty" if path.stat().st_size == 0 else None


def _savedmodel(path: Path) -> str | None:
    pb = path / "saved_model.pb"
    if pb.is_file() and pb.stat().st_size == 0:
        return "saved_model.pb is empty"
    return None


def _keras(path: Path) -> str | None:
    try:
        with zipfile.ZipFile(path) as z:
            names = set(z.namelist())
            if "config.json" not in names:
                return "the archive holds no config.json"
            bad = z.testzip()  # CRC of every member: catches flipped bytes anywhere
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as e:
        return f"not a readable zip archive ({str(e)[:80] or type(e).__name__})"
    except Exception as e:  # zlib errors and the like from damaged members
        return f"a member of the archive is damaged ({type(e).__name__}: {str(e)[:80]})"
    return f"member '{bad}' fails its CRC check" if bad else None


def _h5(path: Path) -> str | None:
    size = path.stat().st_size
    with open(path, "rb") as f:
        # The signature sits at 0 or, after a user block, at 512, 1024, 2048, ...
        offset = 0
        while True:
            f.seek(offset)
            if f.read(8) == HDF5_SIGNATURE:
                break
            offset = 512 if offset == 0 else offset * 2
            if offset >= size:
                return "no HDF5 signature"
        head = f.read(96)
    eof = _hdf5_end_of_file(head)
    if eof is not None and offset + eof > size:
        return f"truncated: the HDF5 superblock says {offset + eof} bytes, the file has {size}"
    return None


def _hdf5_end_of_file(head: bytes) -> int | None:
    """The end-of-file address from an HDF5 superblock (the bytes after the signature), or None.

    Superblock v0/v1: version, 3 version bytes, reserved, sizeof offsets, sizeof lengths, reserved,
    2x2 bytes of B-tree K, 4 bytes of flags, (v1: 4 more bytes), then base, free-space, EOF addresses.
    v2/v3: version, sizeof offsets, sizeof lengths, flags, then base, extension, EOF addresses."""
    if len(head) < 4:
        return None
    version = head[0]
    if version in (0, 1):
        size_of_offsets, start = head[5], 16 + (4 if version == 1 else 0)
        index = 2
    elif version in (2, 3):
        size_of_offsets, start, index = head[1], 4, 2
    else:
        return None
    fmt = {4: "<I", 8: "<Q"}.get(size_of_offsets)
    at = start + index * size_of_offsets
    if fmt is None or len(head) < at + size_of_offsets:
        return None
    (eof,) = struct.unpack_from(fmt, head, at)
    return None if eof == (1 << (8 * size_of_offsets)) - 1 else eof  # all ones: "undefined address"


def _tflite(path: Path) -> str | None:
    with open(path, "rb") as f:
        head = f.read(8)
    size = path.stat().st_size
    if len(head) < 8 or head[4:8] != TFLITE_IDENTIFIER:
        return "no 'TFL3' identifier at byte 4"
    (root,) = struct.unpack_from("<I", head, 0)
    if root + 4 > size:
        return f"truncated: the root table sits at byte {root}, the file has {size} bytes"
    return None


def _pt2(path: Path) -> str | None:
    """torch.export.save writes a zip archive (PyTorch's PT2 archive); torch reads what is inside."""
    try:
        with zipfile.ZipFile(path) as z:
            if not z.namelist():
                return "the archive is empty"
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as e:
        return f"not a readable zip archive ({str(e)[:80] or type(e).__name__})"
    return None


CONTAINER_CHECKS = {"onnx": _onnx, "savedmodel": _savedmodel, "keras": _keras, "h5": _h5, "tflite": _tflite,
                    "pt2": _pt2}
