"""Calibration data: `--calib DIR` of .npy / .npz files or images, or seeded synthetic samples.

Images (.png, .jpg, .jpeg, .bmp) feed a model with one image input, preprocessed as stated by
`--calib-preprocess` (or the target's `calibration.preprocess`), a comma-separated list of
KEY=VALUE: `color=RGB` (or BGR, GRAY), `scale=1/255`, `mean=M` and `std=S` (one value, or one per channel joined by ':'),
`layout=NCHW` (or NHWC; default: guessed from where the input's 1 or 3 channels are). An image is
resized (bilinear) to the input's height and width, and each pixel becomes
`(pixel * scale - mean) / std`, in the model's layout, batch 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ..errors import UserError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")
PREPROCESS_KEYS = ("color", "scale", "mean", "std", "layout")


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


def load_image(path: Path, pre: Preprocess, dtype: str = "float32") -> np.ndarray:
    """One image file as a batch-1 model input, preprocessed as `pre` states."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img = img.convert("L" if pre.color == "GRAY" else "RGB")
            if img.size != (pre.size[1], pre.size[0]):
                img = img.resize((pre.size[1], pre.size[0]), Image.Resampling.BILINEAR)
            pixels = np.asarray(img, np.float32)
    except (UnidentifiedImageError, OSError) as e:
        raise UserError("compress.calib-unreadable", f"{path}: not a readable image ({e})",
                        "give PNG, JPEG or BMP files") from None
    pixels = pixels[..., None] if pixels.ndim == 2 else pixels
    if pre.color == "BGR":
        pixels = pixels[..., ::-1]
    x = (pixels * pre.scale - np.asarray(pre.mean, np.float32)) / np.asarray(pre.std, np.float32)
    x = np.transpose(x, (2, 0, 1)) if pre.layout == "NCHW" else x
    return np.ascontiguousarray(x[None]).astype(dtype)


def load_calibration(options, inputs: list[dict], *, flag: str = "--calib"
                     ) -> tuple[list[dict[str, np.ndarray]], dict]:
    """Calibration feeds keyed by input name, each shaped exactly like the model's input. `flag`: the option
    that named the directory, as the errors say it."""
    n = options.calib_samples
    if options.calib is None:
        rng = np.random.default_rng(options.seed)
        feeds = [{i["name"]: rng.uniform(-1, 1, i["shape"]).astype(i["dtype"]) for i in inputs} for _ in range(n)]
        return feeds, {"synthetic": True, "samples": n, "distribution": "uniform(-1, 1)", "seed": options.seed}
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
        try:
            data = np.load(f)
        except Exception as e:
            raise UserError("compress.calib-unreadable", f"{f}: not a numpy file ({numpy_load_error(e)})",
                            "write samples with numpy.save / numpy.savez") from None
        arrays = {inputs[0]["name"]: data} if f.suffix == ".npy" else dict(data)
        if f.suffix == ".npy" and len(inputs) > 1:
            raise UserError("compress.calib-multi-input", f"{f}: a .npy file holds one array, the model has "
                            f"{len(inputs)} inputs", "use .npz files with one array per input name")
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
            stacks[i["name"]] = a.astype(i["dtype"])
        count = min(len(a) for a in stacks.values())
        feeds += [{k: v[j] for k, v in stacks.items()} for j in range(count)]
    feeds = feeds[:n]
    return feeds, {"synthetic": False, "samples": len(feeds), "source": str(root), "files": len(files)}


LABELS = "labels.txt"  # in an --eval directory: one integer class per output row, in sample order


def load_labelled(root: Path, inputs: list[dict], preprocess: str | None
                  ) -> tuple[list[dict[str, np.ndarray]], np.ndarray, dict]:
    """`--eval DIR`: every sample in DIR, read as `--calib` reads its samples (files in name order, a stack's
    samples in order), and LABELS: one integer class per line (blank lines and `#` comments skipped), one for
    each row of the model's first output over all samples (a batch-16 model: 16 per sample)."""
    options = SimpleNamespace(calib=root, calib_samples=10 ** 9, calib_preprocess=preprocess, seed=0)
    samples, info = load_calibration(options, inputs, flag="--eval")
    path = Path(root) / LABELS
    if not path.is_file():
        raise UserError("compress.eval-labels-missing", f"--eval {root}: no {LABELS}",
                        f"write one integer class per line to {path}, one per sample (per batch row), in the order "
                        "of the sample files' names")
    labels = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            labels.append(int(text))
        except ValueError:
            raise UserError("compress.eval-label", f"{path}:{number}: '{text}' is not an integer class",
                            "one integer class per line") from None
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
