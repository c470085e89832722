"""Int8 conversions kept for the next plan of the same output directory (`OUT/.build/int8/`).

The accuracy remedy plans again with a few nodes kept on the CPU (pipeline.build); the segments those
nodes were not in come back unchanged, under other ids where a segment before them split, and converting
them again took most of each round (a face-landmark model: 3 of its 8 conversions, ~4 s each). A
conversion is kept under a digest of everything it reads: the segment's graph and weights (not its id:
the id names only its files), its tensor names, each calibration sample's arrays, the quantization
options, the backend and the SDK's code. A later compress run of this directory with the same digest
copies its files under the segment's own id instead of converting; the entries no run used since are
removed at the end of each run, so the directory holds one plan's conversions at most. A kept conversion whose
files changed since is converted again, as a changed stage cache entry is.

`--from compress` (or an earlier stage) converts again whatever it finds here: it asks for the work done
anew."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import onnx

from ...ir import model as irm
from ...ir.digest import file_sha256, tree_sha256

DIR = "int8"
PLACEHOLDER = "@"  # a kept file's name and the record's paths have the segment's id replaced by this


class Kept:
    """The kept conversions of one build directory, for one compress run."""

    def __init__(self, build_dir: Path, sdk: str, enabled: bool = True):
        self.root, self.sdk, self.enabled = Path(build_dir) / DIR, sdk, enabled
        self.used: set[str] = set()

    def quantized(self, seg, job, model_file: Path, quantize: Callable[[], dict], log: Callable[[str], None]) -> dict:
        """`quantize()`'s record of `seg` (its files written to `job.out_dir`), or the record and files of
        a conversion with the same digest, kept by an earlier run and copied under `seg.id`."""
        if not self.enabled:
            return quantize()
        key = self._digest(seg, job, model_file)
        self.used.add(key)
        kept = self.root / key
        if self._intact(kept):
            entry = self._restore(kept, seg.id, Path(job.out_dir))
            log(f"compress: {seg.id}: {len(seg.nodes)} nodes: int8 as an earlier plan of this build converted the "
                f"same graph on the same calibration samples (kept in {DIR}/ of the build directory)")
            return entry
        before = set(os.listdir(job.out_dir))
        entry = json.loads(json.dumps(quantize()))  # as a kept one reads back: JSON's types
        written = sorted(n for n in set(os.listdir(job.out_dir)) - before if n.startswith(f"{seg.id}."))
        self._keep(kept, seg.id, Path(job.out_dir), written, entry)
        return entry

    def forget_unused(self) -> None:
        """Remove what this run did not use: a later plan shares most with this one."""
        if not self.enabled or not self.root.is_dir():
            return
        for entry in self.root.iterdir():
            if entry.name not in self.used:
                shutil.rmtree(entry, ignore_errors=True)

    def _digest(self, seg, job, model_file: Path) -> str:
        h = hashlib.sha256()
        options = {"sdk": self.sdk, "backend": seg.backend, "inputs": list(seg.inputs), "outputs": list(seg.outputs),
                   "method": job.method, "percentile": job.percentile, "alternatives": job.alternatives,
                   "activations": dict(job.activations), "model_inputs": list(job.model_inputs),
                   "grids": {k: job.grids[k] for k in sorted(job.grids)}, "target": job.target,
                   "keep_float": job.keep_float}
        h.update(json.dumps(options, sort_keys=True, default=str).encode())
        data = model_file.with_name(model_file.name + ".data")
        # each node names the device it runs on (the remedy's next plan may deal the same segment to the other
        # Edge TPU), and a weights file is named after the segment's id: neither is read by a conversion
        graph = model_file.read_bytes().replace(_entry(irm.DEVICE_KEY, seg.device), _entry(irm.DEVICE_KEY, PLACEHOLDER))
        if data.exists():
            graph = graph.replace(data.name.encode(), PLACEHOLDER.encode())
            h.update(file_sha256(data).encode())
        h.update(hashlib.sha256(graph).digest())
        for sample in job.samples:
            for name in sorted(sample):
                a = np.ascontiguousarray(sample[name])
                h.update(f"{name}:{a.dtype.str}:{a.shape}".encode())
                h.update(a.data)
        return h.hexdigest()

    def _keep(self, kept: Path, seg_id: str, segments: Path, written: list[str], entry: dict) -> None:
        tmp = kept.with_name(f".{kept.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "files").mkdir(parents=True)
        renames = {}
        for name in written:
            general = PLACEHOLDER + name[len(seg_id):]
            shutil.copyfile(segments / name, tmp / "files" / general)
            renames[f"{segments.name}/{name}"] = f"{segments.name}/{general}"
        (tmp / "record.json").write_text(json.dumps(_renamed(entry, renames)))
        (tmp / "digest").write_text(tree_sha256(tmp / "files"))
        shutil.rmtree(kept, ignore_errors=True)
        tmp.rename(kept)

    @staticmethod
    def _intact(kept: Path) -> bool:
        """Whether `kept` holds a whole conversion whose files are still the bytes kept (as the stage cache,
        a changed entry is converted again, never trusted)."""
        try:
            return (kept / "record.json").is_file() and (kept / "digest").read_text() == tree_sha256(kept / "files")
        except OSError:
            return False

    def _restore(self, kept: Path, seg_id: str, segments: Path) -> dict:
        renames = {}
        for f in sorted((kept / "files").iterdir()):
            own = seg_id + f.name[len(PLACEHOLDER):]
            shutil.copyfile(f, segments / own)
            renames[f"{segments.name}/{f.name}"] = f"{segments.name}/{own}"
        return _renamed(json.loads((kept / "record.json").read_text()), renames)


def _entry(key: str, value: str) -> bytes:
    """A node's metadata entry `key: value` as the model file holds it."""
    return onnx.StringStringEntryProto(key=key, value=value).SerializeToString()


def _renamed(value, renames: dict[str, str]):
    """`value` (a JSON record) with every string that is a key of `renames` replaced by its value."""
    if isinstance(value, str):
        return renames.get(value, value)
    if isinstance(value, dict):
        return {k: _renamed(v, renames) for k, v in value.items()}
    if isinstance(value, list):
        return [_renamed(v, renames) for v in value]
    return value
