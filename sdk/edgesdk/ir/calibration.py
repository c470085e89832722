"""Calibration data: `--calib DIR` of .npy / .npz files, or seeded synthetic samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import UserError


def load_calibration(options, inputs: list[dict]) -> tuple[list[dict[str, np.ndarray]], dict]:
    """Calibration feeds keyed by input name, each shaped exactly like the model's input."""
    n = options.calib_samples
    if options.calib is None:
        rng = np.random.default_rng(options.seed)
        feeds = [{i["name"]: rng.uniform(-1, 1, i["shape"]).astype(i["dtype"]) for i in inputs} for _ in range(n)]
        return feeds, {"synthetic": True, "samples": n, "distribution": "uniform(-1, 1)", "seed": options.seed}
    root = Path(options.calib)
    if not root.is_dir():
        raise UserError("compress.calib-not-found", f"--calib {root}: not a directory",
                        "give a directory of .npy files (one per sample) or .npz files (one array per input)")
    files = sorted(p for p in root.iterdir() if p.suffix in (".npy", ".npz"))
    if not files:
        raise UserError("compress.calib-empty", f"--calib {root}: no .npy or .npz files",
                        "save calibration samples with numpy.save, shaped like the model input")
    feeds: list[dict[str, np.ndarray]] = []
    for f in files:
        try:
            data = np.load(f)
        except Exception as e:
            raise UserError("compress.calib-unreadable", f"{f}: not a numpy file ({e})",
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
