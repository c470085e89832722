"""Calibration data: `--calib DIR` of .npy / .npz files or images, or seeded synthetic samples.

Images (.png, .jpg, .jpeg, .bmp) feed a model with one image input, preprocessed as stated by
`--calib-preprocess` (or the target's `calibration.preprocess`), a comma-separated list of
KEY=VALUE: `color=RGB` (or BGR, GRAY), `scale=1/255`, `mean=M` and `std=S` (one value, or one per channel joined by ':'),
`layout=NCHW` (or NHWC; default: guessed from where the input's 1 or 3 channels are). An image is
resized (bilinear) to the input's height and width, and each pixel becomes
`(pixel * scale - mean) / std`, in the model's layout, batch 1.

Every file is read as a regular file of a bounded size (`open_regular_file`): a FIFO, a device or a
socket named like a sample is refused, never waited on or read without end. What a file declares is
checked before anything is allocated for it: an image's width and height (a small PNG may declare
20000 x 20000 pixels), an array's shape against the bytes the file holds.
"""

from __future__ import annotations

import math
import os
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import BinaryIO

import numpy as np

from ..errors import EdgeSDKError, UsageError, UserError
from ..runtime.files import NotRegularFile, open_regular

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")
PREPROCESS_KEYS = ("color", "scale", "mean", "std", "layout")
# What one sample file may hold: its size on disk, and the arrays read from it for the model's inputs
# (a stack of many samples is one file; an .npz member's declared size counts before it is read)
MAX_SAMPLE_BYTES = 4 << 30
# An image's declared width x height: Pillow's own bound for a decode without its warning (89.5 MP,
# 8K video is 33 MP). A calibration image is resized to the model input's size anyway.
MAX_IMAGE_PIXELS = 89_478_485
MAX_LABELS_BYTES = 64 << 20  # labels.txt: one short line per sample
SAMPLE_HINT = "write samples with numpy.save / numpy.savez"


@dataclass(frozen=True)
class Preprocess:
    size: tuple[int, int]
    color: str
    scale: float
    mean: tuple[float, ...]
    std: tuple[float, ...]
    layout: str

    def describe(self) -> str:
        nums = lambda v: ":".join(f"{x:g}" for x in v)  # noqa: E731
        return (f"color={self.color},scale={self.scale:g},"
                f"mean={nums(self.mean)},std={nums(self.std)},layout={self.layout}")


def parse_preprocess(spec: str | None, input_shape: list[int] | tuple[int, ...]) -> Preprocess:
    """The preprocessing `spec` states, completed from the model input's shape."""
    shape = tuple(input_shape)
    fields: dict[str, str] = {}
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in PREPROCESS_KEYS:
            raise UserError("compress.preprocess-syntax", f"--calib-preprocess: '{item.strip()}' is not KEY=VALUE "
                            f"with KEY one of {', '.join(PREPROCESS_KEYS)}",
                            "for example: scale=1/255,mean=0.485:0.456:0.406,std=0.229:0.224:0.225,layout=NCHW")
        fields[key] = value.strip()
    if len(shape) != 4:
        raise UserError("compress.calib-images-rank", f"image calibration needs a 4-d image input, the model's is {shape}",
                        "give .npy samples instead")
    layout = fields.get("layout", "").upper() or ("NCHW" if shape[1] in (1, 3) and shape[3] not in (1, 3) else "NHWC")
    if layout not in ("NCHW", "NHWC"):
        raise UserError("compress.preprocess-layout", f"--calib-preprocess layout={layout}: expected NCHW or NHWC",
                        "NCHW: channels before height and width (PyTorch, Paddle); NHWC: after (TensorFlow)")
    channels, hw = (shape[1], shape[2:]) if layout == "NCHW" else (shape[3], shape[1:3])
    color = fields.get("color", "GRAY" if channels == 1 else "RGB").upper()
    if color not in ("RGB", "BGR", "GRAY") or (color == "GRAY") != (channels == 1):
        raise UserError("compress.preprocess-color", f"--calib-preprocess color={color} does not fit the input's "
                        f"{channels} channel(s) ({layout})", "RGB or BGR for 3 channels, GRAY for 1")
    try:
        num, _, den = fields.get("scale", "1/255").partition("/")
        scale = float(num) / float(den or 1)
        mean = tuple(float(x) for x in fields.get("mean", "0").split(":"))
        std = tuple(float(x) for x in fields.get("std", "1").split(":"))
    except (ValueError, ZeroDivisionError):
        raise UserError("compress.preprocess-value", f"--calib-preprocess {spec}: a value is not a number",
                        "scale=1/255 or 0.0039, mean and std one number or one per channel joined by ':'") from None
    for name, v in (("mean", mean), ("std", std)):
        if len(v) not in (1, channels):
            raise UserError("compress.preprocess-channels", f"--calib-preprocess {name} has {len(v)} values, the input "
                            f"has {channels} channel(s)", "give one value, or one per channel joined by ':'")
    if any(s == 0 for s in std):
        raise UserError("compress.preprocess-value", "--calib-preprocess std has a zero", "std divides every pixel")
    return Preprocess((int(hw[0]), int(hw[1])), color, scale, mean, std, layout)


def open_regular_file(path: Path, limit: int, code: str, hint: str, error: type[EdgeSDKError] = UserError
                      ) -> BinaryIO:
    """`path` open for reading, if it is a regular file of at most `limit` bytes; else `error` naming it
    (runtime/files.open_regular: a FIFO, a device (/dev/zero reads without end) or a socket is refused
    without blocking). A symbolic link counts as the file it leads to: a directory of links into a
    dataset is a common way to choose samples, reading through a link writes nothing, and what is read
    is checked all the same."""
    try:
        return open_regular(path, limit)
    except NotRegularFile as e:
        raise error(code, f"{path}: {e}", hint) from None
    except OSError as e:
        raise error(code, f"{path}: cannot be read ({e.strerror or e})", hint) from None


def utf8_text(data: bytes, path: Path, code: str, hint: str, error: type[EdgeSDKError] = UserError) -> str:
    """`data` (the file `path`'s bytes) as text; `error` naming the line of the first byte that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise error(code, f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x})", hint) from None


def load_image(path: Path, pre: Preprocess, dtype: str = "float32") -> np.ndarray:
    """One image file as a batch-1 model input, preprocessed as `pre` states. An image declaring more
    than MAX_IMAGE_PIXELS is refused from its header, before a pixel is decoded."""
    from PIL import Image, UnidentifiedImageError

    with open_regular_file(path, MAX_SAMPLE_BYTES, "compress.calib-unreadable", "give PNG, JPEG or BMP files") as f:
        try:
            # Pillow warns above its bound and refuses twice that, both before decoding
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                with Image.open(f) as img:
                    if img.size[0] * img.size[1] > MAX_IMAGE_PIXELS:
                        raise _too_large(path, img.size)
                    img = img.convert("L" if pre.color == "GRAY" else "RGB")
                    if img.size != (pre.size[1], pre.size[0]):
                        img = img.resize((pre.size[1], pre.size[0]), Image.Resampling.BILINEAR)
                    pixels = np.asarray(img, np.float32)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise _too_large(path, _declared_size(f), str(e)) from None
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as e:
            why = "Pillow identifies no image format in it" if isinstance(e, UnidentifiedImageError) else e
            raise UserError("compress.calib-unreadable", f"{path}: not a readable image ({why})",
                            "give PNG, JPEG or BMP files") from None
    pixels = pixels[..., None] if pixels.ndim == 2 else pixels
    if pre.color == "BGR":
        pixels = pixels[..., ::-1]
    x = (pixels * pre.scale - np.asarray(pre.mean, np.float32)) / np.asarray(pre.std, np.float32)
    x = np.transpose(x, (2, 0, 1)) if pre.layout == "NCHW" else x
    return np.ascontiguousarray(x[None]).astype(dtype)


def _too_large(path: Path, size: tuple[int, int] | None, said: str = "") -> UserError:
    declared = f"{size[0]}x{size[1]} pixels ({size[0] * size[1]:,})" if size else f"too many pixels ({said})"
    return UserError("compress.calib-image-too-large", f"{path}: the image declares {declared}, more than the "
                     f"{MAX_IMAGE_PIXELS:,} a calibration image may have: refused before decoding it",
                     "resize calibration images to about the model input's size; a small file declaring this many "
                     "pixels may be a decompression bomb")


def _declared_size(f: BinaryIO) -> tuple[int, int] | None:
    """The width and height in an image's header (Pillow's refusal of a decompression bomb leaves them
    out): its format's reader opens the header alone, decoding nothing."""
    from PIL import Image

    f.seek(0)
    prefix = f.read(16)
    for fmt in ("PNG", "JPEG", "BMP", *Image.OPEN):
        factory, accept = Image.OPEN.get(fmt, (None, None))
        try:
            if factory is not None and (accept is None or accept(prefix) is True):
                f.seek(0)
                return factory(f).size
        except Exception:  # noqa: BLE001 - not this format: the next one
            continue
    return None


DEFAULT_RANGE = (-1.0, 1.0)  # what a float input whose range nothing states is drawn from
REAL_DATA_HINT = ("give real inputs with --calib DIR: images (with --calib-preprocess saying how pixels become "
                  "inputs) or .npy/.npz samples shaped like the model's inputs")


@dataclass(frozen=True)
class InputRange:
    """The values synthetic samples of one input are drawn from, uniformly: [low, high], one pair for the
    whole input or one per channel along `axis`, and where that range comes from."""

    low: tuple[float, ...]
    high: tuple[float, ...]
    axis: int | None
    source: str

    def describe(self) -> str:
        nums = lambda v: ":".join(f"{x:.4g}" for x in v)  # noqa: E731
        return f"uniform({nums(self.low)}, {nums(self.high)})" + (" per channel" if self.axis is not None else "")

    def record(self) -> dict:
        return {"low": list(self.low), "high": list(self.high), **({"axis": self.axis} if self.axis is not None else {}),
                "source": self.source}


def check_input_ranges(options, inputs: list[dict]) -> None:
    """Refuse an `--input-range` naming no input of the model, or giving an integer input no integer."""
    names = [i["name"] for i in inputs]
    for name, (lo, hi) in (getattr(options, "input_ranges", None) or {}).items():
        if name not in names:
            raise UsageError("compress.input-range-unknown", f"--input-range names '{name}', which is not an input "
                             "of the model", f"the model's inputs: {', '.join(names)}")
        dtype = np.dtype(next(i["dtype"] for i in inputs if i["name"] == name))
        if (np.issubdtype(dtype, np.integer) or dtype == np.bool_) and np.ceil(lo) > np.floor(hi):
            raise UsageError("compress.input-range-empty", f"--input-range {name}={lo:g},{hi:g}: input '{name}' is "
                             f"{dtype}, and no integer lies in [{lo:g}, {hi:g}]",
                             f"give an integer input a range holding integers, e.g. --input-range {name}=0,100")


def check_output_activations(options, imported: dict) -> None:
    """Refuse an `--output-activation` naming no output of the model (`imported`: import.json)."""
    names = [o["name"] for o in imported["outputs"]]
    for name in getattr(options, "output_activations", None) or {}:
        if name not in names:
            raise UsageError("build.output-activation-unknown", f"--output-activation names '{name}', which is not "
                             "an output of the model", f"the model's outputs: {', '.join(names)}")


def input_ranges(options, inputs: list[dict]) -> dict[str, InputRange | None]:
    """Each input's range for synthetic samples, from the first that states one: `--input-range`, the range
    `--calib-preprocess` gives 8-bit pixels (an image input: 4-d float, 1 or 3 channels), the model's own
    (import.json's `range`: its metadata, or the table an index input indexes), an 8-bit integer type's
    range; None where none does (a float input is then drawn from DEFAULT_RANGE, an integer one as before:
    that range cast to its type)."""
    given = dict(getattr(options, "input_ranges", None) or {})
    spec = getattr(options, "calib_preprocess", None)
    out: dict[str, InputRange | None] = {}
    for i in inputs:
        name, dtype, shape = i["name"], np.dtype(i["dtype"]), list(i["shape"])
        stated = i.get("range")
        if name in given:
            lo, hi = given[name]
            out[name] = InputRange((float(lo),), (float(hi),), None, "--input-range")
        elif spec and _is_image(i):
            pre = parse_preprocess(spec, shape)
            ends = [((0.0 * pre.scale - m) / s, (255.0 * pre.scale - m) / s)
                    for m, s in zip(_per_channel(pre.mean, shape, pre), _per_channel(pre.std, shape, pre))]
            lo, hi = tuple(min(e) for e in ends), tuple(max(e) for e in ends)
            same = len(set(lo)) == 1 and len(set(hi)) == 1
            out[name] = InputRange(lo[:1] if same else lo, hi[:1] if same else hi,
                                   None if same else (1 if pre.layout == "NCHW" else 3),
                                   f"--calib-preprocess {pre.describe()} on 8-bit pixels (0..255)")
        elif stated:
            out[name] = InputRange(tuple(map(float, stated["low"])), tuple(map(float, stated["high"])),
                                   stated.get("axis"), stated["source"])
        elif dtype in (np.uint8, np.int8):
            info = np.iinfo(dtype)
            out[name] = InputRange((float(info.min),), (float(info.max),), None, f"its type ({dtype})")
        else:
            out[name] = None
    return out


def _is_image(i: dict) -> bool:
    shape = i["shape"]
    return np.dtype(i["dtype"]).kind == "f" and len(shape) == 4 and (shape[1] in (1, 3) or shape[3] in (1, 3))


def _per_channel(values: tuple[float, ...], shape: list[int], pre: Preprocess) -> tuple[float, ...]:
    channels = shape[1] if pre.layout == "NCHW" else shape[3]
    return values * channels if len(values) == 1 else values


def synthetic(options, inputs: list[dict]) -> tuple[list[dict[str, np.ndarray]], dict]:
    """`options.calib_samples` seeded samples, each input uniform over its range (`input_ranges`), and the
    record of it: each input's range and source, and that accuracy on real inputs is unknown."""
    rng = np.random.default_rng(options.seed)
    ranges = input_ranges(options, inputs)
    feeds = [{i["name"]: _draw(rng, i, ranges[i["name"]], k) for i in inputs} for k in range(options.calib_samples)]
    unknown = [name for name, r in ranges.items() if r is None]
    distribution = ("uniform(-1, 1)" if len(unknown) == len(ranges) else
                    "; ".join(f"{i['name']}: " + (r.describe() + (" in blocks from the whole image to one pixel"
                                                                   if _is_image(i) else "") if r else "uniform(-1, 1)")
                              for i, r in zip(inputs, ranges.values())))
    return feeds, {"synthetic": True, "samples": len(feeds), "distribution": distribution, "seed": options.seed,
                   "inputs": {name: r.record() if r else {"low": [DEFAULT_RANGE[0]], "high": [DEFAULT_RANGE[1]],
                                                           "source": "none known: the default"}
                              for name, r in ranges.items()},
                   "accuracy_on_real_data": "unknown", "hint": REAL_DATA_HINT}


def _draw(rng: np.random.Generator, i: dict, r: InputRange | None, k: int) -> np.ndarray:
    """Sample `k` of input `i`: uniform over its range `r`. An image input (4-d float, 1 or 3 channels)
    is drawn at one of several spatial scales, by sample (`_image_scale`): a photograph's neighbouring
    pixels are alike, so a filter that averages them (a first layer's colour filters) spans the whole
    range on it, where on pixels drawn apart it stays near the middle (the mean of n uniforms)."""
    dtype, shape = np.dtype(i["dtype"]), tuple(i["shape"])
    if r is None:  # as every build drew before ranges were known: the same samples, bit for bit
        return rng.uniform(*DEFAULT_RANGE, shape).astype(dtype)
    lo, hi = np.asarray(r.low, np.float64), np.asarray(r.high, np.float64)
    if r.axis is not None:
        where = [1] * len(shape)
        where[r.axis] = -1
        lo, hi = lo.reshape(where), hi.reshape(where)
    u = _image_uniform(rng, shape, k) if _is_image(i) else rng.uniform(0.0, 1.0, shape)
    if np.issubdtype(dtype, np.integer) or dtype == np.bool_:
        lo, hi = np.ceil(lo), np.floor(hi)
        return np.minimum(lo + np.floor(u * (hi - lo + 1)), hi).astype(dtype)
    return (lo + (hi - lo) * u).astype(dtype)


def _image_uniform(rng: np.random.Generator, shape: tuple[int, ...], k: int) -> np.ndarray:
    """Uniform [0, 1) values of an image input's shape in square blocks of one value per channel: sample k's
    block side is the image's longer side / 2^(k mod levels), from one flat colour (k = 0) down to single
    pixels. Layout as `parse_preprocess` guesses it (channels first where they are 1 or 3 there)."""
    nchw = shape[1] in (1, 3) and shape[3] not in (1, 3)
    n, c, h, w = (shape[0], shape[1], shape[2], shape[3]) if nchw else (shape[0], shape[3], shape[1], shape[2])
    levels = int(np.ceil(np.log2(max(h, w)))) + 1
    side = max(1, max(h, w) >> (k % levels))
    grid = rng.uniform(0.0, 1.0, (n, c, -(-h // side), -(-w // side)))
    u = np.repeat(np.repeat(grid, side, axis=2), side, axis=3)[:, :, :h, :w]
    return u if nchw else np.transpose(u, (0, 2, 3, 1))


def synthetic_warnings(info: dict, samples: int, used_for: str, precision: str = "int8") -> list[str]:
    """What a build calibrated on synthetic samples says (`info`: `synthetic`'s record): the accuracy of its
    reduced `precision` on real inputs is unknown, and each input whose range nothing stated."""
    inputs = info.get("inputs", {})
    drawn = ", ".join(f"{name}: {InputRange(tuple(r['low']), tuple(r['high']), r.get('axis'), r['source']).describe()}"
                      f" from {r['source']}" for name, r in inputs.items())
    lines = [f"no --calib data: {used_for} on {samples} synthetic samples ({drawn}): {precision} accuracy on real inputs "
             f"is unknown; {REAL_DATA_HINT}"]
    for name, r in inputs.items():
        if r["source"].startswith("none known"):
            lines.append(f"input '{name}': nothing states its range (--input-range, --calib-preprocess, the model's "
                         "metadata), so its synthetic samples are uniform in [-1, 1], which may be far from what it "
                         f"really takes (images are often in [0, 1] or 0..255): give --input-range {name}=LOW,HIGH")
    return lines


def load_calibration(options, inputs: list[dict], *, flag: str = "--calib"
                     ) -> tuple[list[dict[str, np.ndarray]], dict]:
    """Calibration feeds keyed by input name, each shaped exactly like the model's input. `flag`: the option
    that named the directory, as the errors say it."""
    n = options.calib_samples
    check_input_ranges(options, inputs)
    if options.calib is None:
        return synthetic(options, inputs)
    root = Path(options.calib)
    if not root.is_dir():
        raise UserError("compress.calib-not-found", f"{flag} {root}: not a directory",
                        "give a directory of images, .npy files (one per sample) or .npz files (one array per input)")
    files = sorted(p for p in root.iterdir() if p.suffix.lower() in (".npy", ".npz", *IMAGE_SUFFIXES))
    if not files:
        raise UserError("compress.calib-empty", f"{flag} {root}: no images, .npy or .npz files",
                        "save calibration samples with numpy.save, shaped like the model input, or give images")
    images = [f for f in files if f.suffix.lower() in IMAGE_SUFFIXES]
    if images:
        if len(images) != len(files) or len(inputs) != 1:
            raise UserError("compress.calib-mixed", f"{flag} {root}: images calibrate a model with one image input "
                            f"and only alone (the model has {len(inputs)} input(s); the directory has "
                            f"{len(images)} image(s) among {len(files)} files)", "give either images or numpy files")
        pre = parse_preprocess(getattr(options, "calib_preprocess", None), inputs[0]["shape"])
        feeds = [{inputs[0]["name"]: load_image(f, pre, inputs[0]["dtype"])} for f in images[:n]]
        return feeds, {"synthetic": False, "samples": len(feeds), "source": str(root), "files": len(files),
                       "images": True, "preprocess": pre.describe(),
                       "formula": "(pixel * scale - mean) / std, resized (bilinear) to the input's size"}
    feeds: list[dict[str, np.ndarray]] = []
    for f in files:
        arrays = read_samples(f, [i["name"] for i in inputs])
        stacks = {}
        for i in inputs:
            if i["name"] not in arrays:
                raise UserError("compress.calib-missing-input", f"{f}: no array for input '{i['name']}'",
                                f"the model's inputs: {', '.join(x['name'] for x in inputs)}")
            a = np.asarray(arrays[i["name"]])
            shape = tuple(i["shape"])
            if a.shape == shape:
                a = a[None]
            elif shape and shape[0] == 1 and a.ndim == len(shape) and a.shape[1:] == shape[1:]:
                a = a[:, None]  # N samples stacked along the batch axis of a batch-1 model
            elif a.shape[1:] != shape:
                raise UserError("compress.calib-shape", f"{f}: array for '{i['name']}' has shape {a.shape}, "
                                f"expected {shape} or a stack of N samples",
                                "preprocess calibration samples exactly as the model's input")
            try:
                stacks[i["name"]] = a.astype(i["dtype"])
            except (ValueError, TypeError):
                raise UserError("compress.calib-dtype", f"{f}: array for '{i['name']}' is {a.dtype}, which does "
                                f"not convert to the input's {i['dtype']}", "give numbers, as the model's input "
                                "takes them") from None
        count = min(len(a) for a in stacks.values())
        feeds += [{k: v[j] for k, v in stacks.items()} for j in range(count)]
    feeds = feeds[:n]
    return feeds, {"synthetic": False, "samples": len(feeds), "source": str(root), "files": len(files)}


def read_samples(path: Path, names: list[str]) -> dict[str, np.ndarray]:
    """One sample file's arrays for the inputs `names`: a .npy file's array (for the one input), or an
    .npz file's members named like them. Each array's header is read first, and an array declaring more
    bytes than the file (or its .npz member) holds is refused before anything is allocated for it."""
    with open_regular_file(path, MAX_SAMPLE_BYTES, "compress.calib-unreadable", SAMPLE_HINT) as f:
        size = os.fstat(f.fileno()).st_size
        start = f.read(6)
        f.seek(0)
        try:
            if start == b"\x93NUMPY":
                if len(names) > 1:
                    raise UserError("compress.calib-multi-input", f"{path}: a .npy file holds one array, the model "
                                    f"has {len(names)} inputs", "use .npz files with one array per input name")
                _check_declared(path, f, size, names[0], "the file")
                f.seek(0)
                return {names[0]: np.load(f)}
            if zipfile.is_zipfile(f):
                return _read_npz(path, f, names)
            f.seek(0)
            np.load(f)  # neither: numpy says why (it never loads a pickle)
            raise ValueError("neither an .npy nor an .npz file")
        except EdgeSDKError:
            raise
        except Exception as e:
            raise UserError("compress.calib-unreadable", f"{path}: not a numpy file ({numpy_load_error(e)})",
                            SAMPLE_HINT) from None


def _read_npz(path: Path, f: BinaryIO, names: list[str]) -> dict[str, np.ndarray]:
    """The members of an .npz archive named like the inputs, each checked as `read_samples` says; those of
    other names are not read. A damaged member (its CRC, its compressed stream) is refused naming it."""
    arrays = {}
    with zipfile.ZipFile(f) as z:
        members = {name: z.getinfo(f"{name}.npy") for name in names if f"{name}.npy" in z.namelist()}
        total = sum(m.file_size for m in members.values())
        if total > MAX_SAMPLE_BYTES:
            raise UserError("compress.calib-too-large", f"{path}: its arrays for the model's inputs declare "
                            f"{total:,} bytes, more than the {MAX_SAMPLE_BYTES:,} read from one sample file",
                            "split the samples into several files")
        for name, member in members.items():
            try:
                with z.open(member) as m:
                    _check_declared(path, m, member.file_size, name, f"member '{member.filename}'")
                with z.open(member) as m:
                    arrays[name] = np.lib.format.read_array(m, allow_pickle=False)
            except EdgeSDKError:
                raise
            except Exception as e:
                raise UserError("compress.calib-unreadable", f"{path}: member '{member.filename}' cannot be read "
                                f"({numpy_load_error(e)})", SAMPLE_HINT) from None
    return arrays


def _check_declared(path: Path, f: BinaryIO, size: int, name: str, where: str) -> None:
    """Refuse an .npy header (read from `f`) declaring more data than the `size` bytes it comes in hold.
    A version numpy does not write is left to numpy.load to refuse."""
    fmt = np.lib.format
    version = fmt.read_magic(f)
    if version not in ((1, 0), (2, 0), (3, 0)):
        return
    shape, _, dtype = (fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0)(f)
    declared = math.prod(shape) * dtype.itemsize
    held = size - f.tell()
    if declared > held:
        raise UserError("compress.calib-truncated", f"{path}: the array for '{name}' declares shape {shape} of "
                        f"{dtype} ({declared:,} bytes), and {where} holds {max(held, 0):,} bytes of data",
                        f"the file is truncated or damaged; {SAMPLE_HINT}")


LABELS = "labels.txt"  # in an --eval directory: one integer class per output row, in sample order


def load_labelled(root: Path, inputs: list[dict], preprocess: str | None
                  ) -> tuple[list[dict[str, np.ndarray]], np.ndarray, dict]:
    """`--eval DIR`: every sample in DIR, read as `--calib` reads its samples (files in name order, a stack's
    samples in order), and LABELS: one integer class per line (blank lines and `#` comments skipped), one for
    each row of the model's first output over all samples (a batch-16 model: 16 per sample)."""
    options = SimpleNamespace(calib=root, calib_samples=10 ** 9, calib_preprocess=preprocess, seed=0)
    samples, info = load_calibration(options, inputs, flag="--eval")
    path = Path(root) / LABELS
    if not os.path.lexists(path):
        raise UserError("compress.eval-labels-missing", f"--eval {root}: no {LABELS}",
                        f"write one integer class per line to {path}, one per sample (per batch row), in the order "
                        "of the sample files' names")
    with open_regular_file(path, MAX_LABELS_BYTES, "compress.eval-label", "one integer class per line") as f:
        text = utf8_text(f.read(), path, "compress.eval-label", "save labels.txt as UTF-8 text: one integer class per line")
    labels = []
    int64 = np.iinfo(np.int64)
    for number, line in enumerate(text.splitlines(), 1):
        value = line.split("#", 1)[0].strip()
        if not value:
            continue
        shown = value if len(value) <= 40 else value[:40] + "..."
        try:
            labels.append(int(value))
        except ValueError:
            raise UserError("compress.eval-label", f"{path}:{number}: '{shown}' is not an integer class",
                            "one integer class per line") from None
        if not int64.min <= labels[-1] <= int64.max:
            raise UserError("compress.eval-label", f"{path}:{number}: {shown} is outside int64",
                            "one integer class per line: the index of the model output's class")
    return samples, np.asarray(labels, dtype=np.int64), {**info, "labels": len(labels), "source": str(root)}


def numpy_load_error(e: Exception) -> str:
    """Why numpy.load refused a file, for a message: numpy's own advice for pickled data (load it with
    allow_pickle) is advice edgesdk never takes, since unpickling runs the file's code."""
    said = str(e)
    if "Object arrays cannot be loaded" in said:
        return "it holds pickled Python objects, which edgesdk does not load: unpickling can run code"
    if "contains pickled (object) data" in said:  # numpy's guess for any file without its magic bytes
        return "no numpy header: not a .npy or .npz file (and a pickle is never loaded)"
    return said.splitlines()[0][:200] if said else type(e).__name__
