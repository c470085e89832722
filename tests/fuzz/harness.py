"""Fuzzing every loader with generated hostile inputs: ONNX, TFLite, Keras and SavedModel
models (the import stage), target YAML, manifest JSON, bundle archives, the `.npy` inputs of
`edgesdk run`, and the `--calib` / `--eval` directories of samples and labels.

The contract is the CLI's: a loader accepts its input, or refuses it with a typed error (`EdgeSDKError`;
on the runtime side `ManifestError` and `UnpackError`), which `edgesdk` prints as `error:` and `hint:`
with exit 1 or 2. Anything else is a finding: another exception (exit 3, "internal error"), a crash of
the process, a hang, a file left on disk, the input or a seed changed by reading it.

A run (`Session`):
1. seeds: small valid files of every format, made once under the session's directory: ONNX models (the
   tests' tiny and If models, random nets of the passes' grammar, one of shape arithmetic and control
   flow), a Keras model as .keras, .h5, SavedModel and TFLite (TensorFlow, in a child), an x86 bundle
   of a two-input model (its directory, archive, signed archive and inputs; the x86 build, in a child),
   the shipped targets, calibration samples (.npy, .npz, PNG) and labels.
2. cases: case i of loader L comes from `random.Random(f"{seed}/{L}/{i}")` alone, so (seed, L, i) names
   one input for good: a seed damaged byte-wise (flips, truncations, insertions, splices with other
   seeds) or structurally (an ONNX model's protobuf fields, YAML and JSON values, tar members, npy
   headers, .npz members, image headers), or a file that is not a regular one (a FIFO, a link to a
   device). The generators run in this process and write the input before the worker sees it, so an
   input that kills the worker is still on disk.
3. a worker process runs each case (`python -m tests.fuzz.harness worker`) with its own TMPDIR,
   working directory and memory limit: a crash, a hang or a memory bomb costs one worker (started
   again), and a file left behind is seen right after the case that left it.

What each loader runs (`Worker`): the model formats `edgesdk build MODEL --until import`; a target
`load_target`, its digest and devices, and for one case in four a build through `schedule` for it; a
manifest `Manifest.from_json`, and where accepted `edgesdk inspect` and `edgesdk run` on a bundle that
holds it; an archive the device's `signed_manifest` and `edgesdk verify --no-selftest`, with the device's
key for half the cases; an .npy file `edgesdk run BUNDLE --input NAME=FILE`; a calibration directory
`load_calibration` (`--calib`), or for half the cases `load_labelled` (`--eval`, with labels.txt). The CLI runs in the worker's
process, its output encoded as a terminal's would be; exit 3 is a finding, with the traceback of a run
with --debug.

The TensorFlow formats are converted in a child process that costs ~3 s, so their cases are mostly ones
the parent must refuse before converting (container checks); one case in DEEP_EVERY is made to pass
those checks and reach the converter.
"""

from __future__ import annotations

import collections
import copy
import contextlib
import functools
import gzip
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
LOADERS = ("onnx", "tflite", "keras", "savedmodel", "target", "manifest", "bundle", "npy", "calib")
TF_LOADERS = ("tflite", "keras", "savedmodel")
DEEP_EVERY = 15  # one TensorFlow-format case in DEEP_EVERY is made to reach the converter child
# Seconds a case may take before it counts as a hang: the converter's own limit is 900 s
TIMEOUT_S = {"tflite": 240, "keras": 240, "savedmodel": 240}
DEFAULT_TIMEOUT_S = 60
WORKER_MEMORY = 6 << 30  # address space of the worker (and the converters it starts): a bomb fails there
# Names our own hostile inputs try to plant outside the case directory: never expected anywhere
ESCAPE = "fz_escape"


# Findings in code this suite's fixes could not touch, reported with the fix they need and awaiting
# it: (loader, text in the finding's summary, where the fix belongs). `make test`'s short run counts a
# finding that matches as known (it fails nothing there, and is shown); the full run (`make fuzz`)
# fails on it like on any other. Delete an entry once its fix is in.
KNOWN: list[tuple[str, str, str]] = []


# --- outcomes ----------------------------------------------------------------------------------

@dataclass
class Finding:
    loader: str
    seed: int
    index: int
    kind: str      # exception | exit-3 | crash | hang | leftover | changed
    summary: str   # one line
    detail: str    # the traceback, the worker's log, or what was left
    mutation: str  # how the input was made
    saved: Path | None = None  # the input, kept under the caller's findings directory

    def as_json(self) -> dict:
        return {"loader": self.loader, "seed": self.seed, "index": self.index, "kind": self.kind,
                "summary": self.summary, "mutation": self.mutation, "saved": str(self.saved) if self.saved else None,
                "known": self.known}

    @property
    def known(self) -> str | None:
        """Where the fix belongs, for a finding on the KNOWN list."""
        return next((fix for loader, text, fix in KNOWN if loader == self.loader and text in self.summary), None)


@dataclass
class Counts:
    """What one loader did with its cases: accepted, refused with a typed error (by code), findings."""
    loader: str
    inputs: int = 0
    accepted: int = 0
    refused: int = 0
    findings: list[Finding] = field(default_factory=list)
    codes: collections.Counter = field(default_factory=collections.Counter)
    converter_runs: int = 0
    seconds: float = 0.0

    @property
    def new_findings(self) -> list[Finding]:
        return [f for f in self.findings if not f.known]

    def as_json(self) -> dict:
        return {"inputs": self.inputs, "accepted": self.accepted, "refused": self.refused,
                "findings": len(self.findings), "known_findings": len(self.findings) - len(self.new_findings),
                "converter_runs": self.converter_runs,
                "seconds": round(self.seconds, 1), "refused_by_code": dict(self.codes.most_common()),
                "finding_list": [f.as_json() for f in self.findings]}


# --- seeds -------------------------------------------------------------------------------------

class Seeds:
    """The valid files every case starts from, under `root` (made by `make_seeds`)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.onnx = sorted((self.root / "onnx").glob("*.onnx"))
        self.tflite = sorted((self.root / "tflite").glob("*.tflite"))
        self.keras = sorted((self.root / "keras").glob("*.keras")) + sorted((self.root / "keras").glob("*.h5"))
        self.savedmodel = sorted(p for p in (self.root / "savedmodel").iterdir() if p.is_dir())
        self.targets = sorted((self.root / "targets").glob("*.yaml"))
        self.bundle = self.root / "bundle"
        self.archives = [self.root / "bundle.tar.gz", self.root / "signed.tar.gz"]
        self.public_key = self.root / "keys" / "fuzz.pub"
        self.npy = {name: self.root / "npy" / f"{name}.npy" for name in BUNDLE_INPUTS}
        self.calib = {p.suffix: p for p in sorted((self.root / "calib").iterdir())}

    @functools.cached_property
    def splices(self) -> list[bytes]:
        """Bytes of a file of each format, to splice into another."""
        files = [*self.onnx[:2], *self.tflite[:1], *self.keras, *self.targets[:1], self.bundle / "manifest.json",
                 self.npy["x"], self.archives[0]]
        return [f.read_bytes()[:200_000] for f in files]

    @functools.cached_property
    def manifest(self) -> dict:
        return json.loads((self.bundle / "manifest.json").read_text())

    @functools.cached_property
    def members(self) -> dict[str, list[tuple[tarfile.TarInfo, bytes | None]]]:
        """Each seed archive's members with their data, in archive order."""
        out = {}
        for archive in self.archives:
            with tarfile.open(archive) as tar:
                out[archive.name] = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]
        return out


# the bundle's model: y = relu(x @ w) + sum(table[ids]); `ids` indexes a table, so it has a valid range
BUNDLE_INPUTS = {"x": ((1, 16), "float32"), "ids": ((1, 3), "int64")}


def make_seeds(root: Path, log: Path) -> Seeds:
    """Every seed under `root`; TensorFlow's and the x86 build's in child processes, both at once."""
    root.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        children = [subprocess.Popen([sys.executable, "-m", "tests.fuzz.harness", "seeds", part, str(root)],
                                     cwd=ROOT, env=_child_env(root / f"tmp-{part}"), stdout=out, stderr=out,
                                     stdin=subprocess.DEVNULL)
                    for part in ("tensorflow", "bundle")]
        try:
            _onnx_seeds(root / "onnx")
            (root / "targets").mkdir()
            for t in sorted((ROOT / "targets").glob("*.yaml")):
                shutil.copyfile(t, root / "targets" / t.name)
            _npy_seeds(root / "npy")
            _calib_seeds(root / "calib")
        finally:
            codes = [c.wait() for c in children]
    if any(codes):
        raise RuntimeError(f"making the seeds failed (exit {codes}); see {log}:\n{_tail(log, 3000)}")
    for part in ("tensorflow", "bundle"):
        shutil.rmtree(root / f"tmp-{part}", ignore_errors=True)
    return Seeds(root)


def _child_env(tmp: Path) -> dict[str, str]:
    tmp.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join([str(ROOT), str(ROOT / "sdk"), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, "TMPDIR": str(tmp), "TF_CPP_MIN_LOG_LEVEL": "2",
            "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}


def _onnx_seeds(out: Path) -> None:
    import numpy as np
    import onnx

    from tests.frontends.test_fuzz import _onnx_file
    from tests.passes.harness import model as checked_model
    from tests.passes.test_property import STEPS, RandomNet
    from tests.test_interrupted_build import tiny_model

    out.mkdir(parents=True)
    tiny_model(out / "tiny.onnx", 0)
    _onnx_file(out).rename(out / "branches.onnx")
    for k in range(3):  # nets of the passes' grammar: BN, chains, transposes, reshapes for the rules to fire on
        rng = np.random.default_rng(k)
        net = RandomNet(rng, 3, 4)
        for step in rng.choice(STEPS, size=6):
            getattr(net, str(step))()
        if net.cur == "x":
            net.relu()
        outputs = [o for o in net.outputs if o != net.cur] + [net.cur]
        onnx.save(checked_model(net.nodes, {"x": [1, 3, 4, 5]}, outputs, net.inits), out / f"net{k}.onnx")
    onnx.save(_shapes_model(), out / "shapes.onnx")


def _shapes_model():
    """Shape arithmetic (Shape, Gather, Concat into Reshape), a Loop of constant trip count, Resize,
    Pad, Slice, Transpose, Softmax and an embedding lookup: what constant folding, the loop unroller
    and shape inference work on."""
    import numpy as np
    from onnx import TensorProto as T
    from onnx import helper, numpy_helper

    def const(name, value, dtype):
        return numpy_helper.from_array(np.asarray(value, dtype), name)

    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Add", ["v_in", "one"], ["v_out"])],
        "body", [helper.make_tensor_value_info("i", T.INT64, []), helper.make_tensor_value_info("cond_in", T.BOOL, []),
                 helper.make_tensor_value_info("v_in", T.FLOAT, [1, 192])],
        [helper.make_tensor_value_info("cond_out", T.BOOL, []), helper.make_tensor_value_info("v_out", T.FLOAT, [1, 192])])
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["n"], axis=0),
        helper.make_node("Concat", ["n", "minus_one"], ["flat_shape"], axis=0),
        helper.make_node("Reshape", ["x", "flat_shape"], ["flat"]),
        helper.make_node("Loop", ["trip", "true", "flat"], ["looped"], body=body),
        helper.make_node("Softmax", ["looped"], ["probs"], axis=-1),
        helper.make_node("Resize", ["x", "", "scales"], ["big"], mode="nearest"),
        helper.make_node("Pad", ["big", "pads"], ["padded"]),
        helper.make_node("Slice", ["padded", "starts", "ends", "axes"], ["cut"]),
        helper.make_node("Transpose", ["cut"], ["nhwc"], perm=[0, 2, 3, 1]),
        helper.make_node("Gather", ["table", "ids"], ["embedded"], axis=0),
    ]
    inits = [const("zero", [0], np.int64), const("minus_one", [-1], np.int64), const("trip", 3, np.int64),
             const("true", True, np.bool_), const("one", 1.0, np.float32), const("scales", [1, 1, 2, 2], np.float32),
             const("pads", [0, 0, 1, 1, 0, 0, 1, 1], np.int64), const("starts", [1, 1], np.int64),
             const("ends", [17, 17], np.int64), const("axes", [2, 3], np.int64),
             const("table", np.arange(40).reshape(10, 4), np.float32)]
    graph = helper.make_graph(nodes, "shapes",
                              [helper.make_tensor_value_info("x", T.FLOAT, [1, 3, 8, 8]),
                               helper.make_tensor_value_info("ids", T.INT64, [2])],
                              [helper.make_tensor_value_info("probs", T.FLOAT, [1, 192]),
                               helper.make_tensor_value_info("nhwc", T.FLOAT, [1, 16, 16, 3]),
                               helper.make_tensor_value_info("embedded", T.FLOAT, [2, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def _bundle_model(path: Path) -> Path:
    import numpy as np
    import onnx
    from onnx import TensorProto as T
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((16, 4)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((10, 4)).astype(np.float32), "table"),
             numpy_helper.from_array(np.array([1], np.int64), "axes")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gather", ["table", "ids"], ["g"]),
             helper.make_node("ReduceSum", ["g", "axes"], ["s"], keepdims=0), helper.make_node("Add", ["r", "s"], ["y"])]
    graph = helper.make_graph(nodes, "fuzz", [helper.make_tensor_value_info("x", T.FLOAT, [1, 16]),
                                              helper.make_tensor_value_info("ids", T.INT64, [1, 3])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [1, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, path)
    return path


def _npy_seeds(out: Path) -> None:
    import numpy as np

    out.mkdir(parents=True)
    np.save(out / "x.npy", np.random.default_rng(0).uniform(-1, 1, BUNDLE_INPUTS["x"][0]).astype(np.float32))
    np.save(out / "ids.npy", np.array([[0, 3, 9]], np.int64))


def _calib_seeds(out: Path) -> None:
    """One calibration sample of CALIB_INPUT as .npy, .npz and PNG."""
    import numpy as np
    from PIL import Image

    out.mkdir(parents=True)
    x = np.random.default_rng(0).uniform(-1, 1, CALIB_INPUT["shape"]).astype(np.float32)
    np.save(out / "s.npy", x)
    np.savez(out / "s.npz", x=x)
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(out / "s.png")


def _tensorflow_seeds(root: Path) -> None:
    """A Dense model as .keras, .h5, SavedModel and TFLite, and the tests' conv net as TFLite."""
    import keras
    import tensorflow as tf

    from tests.frontends import tf_models

    keras.utils.set_random_seed(0)
    x = keras.Input((8,), name="x")
    dense = keras.Model(x, keras.layers.Dense(4, activation="relu", name="y")(x))
    for d in ("keras", "savedmodel", "tflite"):
        (root / d).mkdir(parents=True, exist_ok=True)
    dense.save(root / "keras" / "dense.keras")
    dense.save(root / "keras" / "dense.h5")
    dense.export(str(root / "savedmodel" / "dense"), verbose=False)
    for name, model in (("dense", dense), ("conv", tf_models.conv_net())):
        (root / "tflite" / f"{name}.tflite").write_bytes(tf.lite.TFLiteConverter.from_keras_model(model).convert())


def _bundle_seeds(root: Path) -> None:
    """The two-input model built for x86 (the schedule's cut, TVM): its bundle directory and archive,
    and the archive signed (bundle_version 7) by a key made here."""
    from edgesdk.bundling.signing import generate_keys, load_private_key, stamp
    from edgesdk.pipeline import BuildOptions, build

    result = build(BuildOptions(model=_bundle_model(root / "two_inputs.onnx"), target="x86", out=root / "build",
                                cpu_backends=("planned",)))
    shutil.copytree(result.bundle, root / "bundle")
    shutil.copyfile(result.out / "bundle.tar.gz", root / "bundle.tar.gz")
    private, _, _ = generate_keys(root / "keys", "fuzz")
    shutil.copytree(result.bundle, root / "signed")
    stamp(root / "signed", version=7, key=load_private_key(private), tarball=root / "signed.tar.gz")
    for d in ("signed", "build"):
        shutil.rmtree(root / d)


# --- byte-level damage, for every format -------------------------------------------------------

INTERESTING = [b"\x00", b"\xff", b"\x7f", b"\x80", b"\x00\x00\x00\x00", b"\xff\xff\xff\xff", b"\xff\xff\xff\x7f",
               b"\x00\x00\x00\x80", b"\xff" * 8, b"\x00\x00\x00\x00\x00\x00\xf0\x7f"]


def damage(rng: random.Random, data: bytes, others: list[bytes], start: int = 0) -> tuple[bytes, str]:
    """`data` with one kind of damage at or after byte `start`: a few flipped bytes, a truncation, bytes
    inserted or deleted, an interesting value written, a chunk repeated, or another file spliced in."""
    n = len(data)
    if n <= start:
        return data + rng.randbytes(rng.randint(1, 16)), "appended bytes"
    kind = rng.choice(["flip", "flip", "truncate", "insert", "delete", "interesting", "repeat", "splice"])
    at = rng.randrange(start, n)
    if kind == "flip":
        out = bytearray(data)
        k = rng.choice([1, 1, 2, 4, 16])
        for _ in range(k):
            out[rng.randrange(start, n)] ^= rng.randint(1, 255)
        return bytes(out), f"{k} byte(s) flipped"
    if kind == "truncate":
        return data[:at], f"truncated at {at} of {n}"
    if kind == "insert":
        chunk = rng.randbytes(rng.choice([1, 4, 64, 1024]))
        return data[:at] + chunk + data[at:], f"{len(chunk)} random bytes inserted at {at}"
    if kind == "delete":
        end = min(n, at + rng.choice([1, 4, 64, 4096]))
        return data[:at] + data[end:], f"bytes {at}..{end} deleted"
    if kind == "interesting":
        value = rng.choice(INTERESTING)
        return data[:at] + value + data[at + len(value):], f"{value.hex()} written at {at}"
    if kind == "repeat":
        end = min(n, at + rng.choice([8, 256, 4096]))
        where = rng.randrange(start, n + 1)
        return data[:where] + data[at:end] * rng.choice([1, 2, 16]) + data[where:], f"bytes {at}..{end} repeated at {where}"
    other = rng.choice(others)
    cut = rng.randrange(len(other) + 1)
    return data[:at] + other[cut:], f"another file spliced in at {at}"


def _walk(node, path=()):
    """Every (path, value) in a JSON/YAML document, the root first."""
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, path + (i,))


def _set(doc, path, value):
    """`doc` (a copy) with the value at `path` replaced, or removed when `value` is _DELETE."""
    if not path:
        return value
    doc = copy.deepcopy(doc)
    node = doc
    for k in path[:-1]:
        node = node[k]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


_DELETE = object()


def _shown(path) -> str:
    return ".".join(str(p) for p in path) or "(root)"


def _tree_mutation(rng: random.Random, doc, values: list, keys: list[str]) -> tuple[object, str]:
    """A JSON/YAML document with one value replaced by one from `values`, one key removed, one unknown
    key added, or a list emptied, shuffled or repeated."""
    paths = list(_walk(doc))
    path, node = rng.choice(paths)
    how = rng.choice(["replace", "replace", "replace", "delete", "add-key", "list", "string", "rename-key"])
    if how == "string":  # a string (there are many) replaced by a hostile one
        strings = [p for p, v in paths if isinstance(v, str)]
        if strings:
            path, value = rng.choice(strings), rng.choice(HOSTILE_STRINGS)
            return _set(doc, path, value), f"{_shown(path)} = {_short(value)}"
    if how == "rename-key":
        mappings = [(p, v) for p, v in paths if isinstance(v, dict) and v]
        if mappings:
            path, node = rng.choice(mappings)
            old, new = rng.choice(sorted(node, key=str)), rng.choice(HOSTILE_STRINGS)
            renamed = {(new if k == old else k): v for k, v in node.items()}
            return _set(doc, path, renamed), f"key {_shown(path + (old,))} renamed {_short(new)}"
    if how == "delete" and path:
        return _set(doc, path, _DELETE), f"{_shown(path)} removed"
    if how == "add-key" and isinstance(node, dict):
        key = rng.choice(keys)
        return _set(doc, path, {**node, key: _pick(rng, values)}), f"key {key!r} added at {_shown(path)}"
    if how == "list" and isinstance(node, list) and node:
        what = rng.choice(["empty", "shuffle", "repeat", "duplicate"])
        items = {"empty": [], "shuffle": rng.sample(node, len(node)), "repeat": node * rng.choice([2, 40]),
                 "duplicate": node + node[:1]}[what]
        return _set(doc, path, items), f"list {_shown(path)}: {what}"
    value = _pick(rng, values)
    return _set(doc, path, value), f"{_shown(path)} = {_short(value)}"


def _pick(rng: random.Random, values: list):
    """One of `values`; a function among them makes its value (a nested list) from `rng`."""
    value = rng.choice(values)
    return value(rng) if callable(value) else value


HOSTILE_STRINGS = ["", " ", "\x00", "\ud800", "a\udcffb", "x" * 70_000, "../x", "/abs", "a//b", "名前", "\u202e",
                   "%s%n", "line\nbreak", "segments/s0.so", "cpu"]


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} chars)"


def _nested(depth: int, leaf=1):
    for _ in range(depth):
        leaf = [leaf]
    return leaf


# --- ONNX ----------------------------------------------------------------------------------------

DIMS = [0, -1, -7, 1, 3, 2**31 - 1, 2**31, 2**40, 2**62, 2**63 - 1, -(2**63)]
ELEM_TYPES = list(range(0, 27)) + [99, -1, 2**31 - 1]
OPS = ["Abs", "Add", "ArgMax", "AveragePool", "BatchNormalization", "BitShift", "Cast", "Clip", "Col2Im", "Concat",
       "Constant", "ConstantOfShape", "Conv", "ConvInteger", "ConvTranspose", "CumSum", "DFT", "DepthToSpace",
       "DequantizeLinear", "Div", "Dropout", "Einsum", "Equal", "Erf", "Expand", "Flatten", "GRU", "Gather",
       "GatherElements", "GatherND", "Gemm", "GlobalAveragePool", "Identity", "If", "LSTM", "LayerNormalization",
       "Loop", "MatMul", "MatMulInteger", "MaxPool", "Mul", "NonMaxSuppression", "NonZero", "OneHot", "Pad", "Pow",
       "QLinearConv", "QuantizeLinear", "RandomNormal", "Range", "ReduceMean", "ReduceSum", "Relu", "Reshape",
       "Resize", "RoiAlign", "STFT", "Scan", "ScatterND", "SequenceConstruct", "Shape", "Sigmoid", "Size", "Slice",
       "Softmax", "Split", "SplitToSequence", "Squeeze", "StringNormalizer", "Tile", "TopK", "Transpose",
       "Unsqueeze", "Upsample", "Where", "", "Foo", "relu"]
DOMAINS = ["", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training", "com.microsoft", "fz.custom"]
ATTR_NAMES = ["axis", "axes", "perm", "kernel_shape", "pads", "strides", "dilations", "group", "to", "mode",
              "keepdims", "alpha", "epsilon", "auto_pad", "transA", "value", "value_int", "value_ints", "shape",
              "split", "direction", "hidden_size", "coordinate_transformation_mode", "fz_unknown"]
ATTR_VALUES = [0, -1, 1, 2**31, 2**40, 2**63 - 1, -(2**63), 1.5, float("nan"), float("inf"), -0.0, "", "bogus",
               b"\xff\xfe", [0], [-1, -1], [2**40, 1], [0, 0, 0, 0], [1] * 1000, [1.5, float("nan")], ["a", "b"],
               "x" * 100_000]
EXTERNAL_LOCATIONS = ["w.bin", "../w.bin", "/etc/hostname", "", "sub/../w.bin", "nonexistent.bin", "link.bin",
                      "dir.bin", ".", "w.bin\\..\\x", "w" * 300]
EXTERNAL_NUMBERS = ["0", "1", "-1", "abc", str(2**63), str(2**64), "1e3", " 5", "4096"]


def _graphs(graph):
    yield graph
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("g"):
                yield from _graphs(a.g)
            for g in a.graphs:
                yield from _graphs(g)


def _any_node(rng, model):
    nodes = [n for g in _graphs(model.graph) for n in g.node]
    return rng.choice(nodes) if nodes else model.graph.node.add(op_type="Relu", input=["x"], output=["fz_relu"])


def _tag(rng) -> str:
    return f"fz{rng.randrange(10**6)}_"


def _const(name, value, dtype):
    import numpy as np
    from onnx import helper, numpy_helper

    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, dtype), name + "v"))


def _float_value(model) -> str:
    """A float tensor the graph computes or takes (for new nodes to read)."""
    for vi in model.graph.input:
        if vi.type.tensor_type.elem_type == 1:
            return vi.name
    return model.graph.node[0].output[0] if model.graph.node and model.graph.node[0].output else "x"


def _add_output(model, name, elem_type) -> None:
    from onnx import helper

    model.graph.output.append(helper.make_tensor_value_info(name, elem_type, None))


def onnx_dims(rng, model, case, seeds) -> str:
    g = model.graph
    vi = rng.choice([*g.input, *g.output, *g.value_info])
    shape = vi.type.tensor_type.shape
    how = rng.choice(["value", "value", "param", "clear", "no-shape", "rank", "scalar"])
    if how in ("value", "param", "clear") and not shape.dim:
        how = "rank"
    if how == "value":
        d, v = rng.choice(shape.dim), rng.choice(DIMS)
        d.Clear()
        d.dim_value = v
        return f"{vi.name}: a dimension = {v}"
    if how == "param":
        d, p = rng.choice(shape.dim), rng.choice(["N", "", "batch size", "x" * 1000, "-1", "1", "\u202e"])
        d.Clear()
        d.dim_param = p
        return f"{vi.name}: a dimension = {_short(p)}"
    if how == "clear":
        rng.choice(shape.dim).Clear()
        return f"{vi.name}: a dimension unknown"
    if how == "no-shape":
        vi.type.tensor_type.ClearField("shape")
        return f"{vi.name}: no shape"
    if how == "scalar":
        del shape.dim[:]
        return f"{vi.name}: rank 0"
    k = rng.choice([1, 5, 40, 300])
    for _ in range(k):
        shape.dim.add().dim_value = rng.choice([1, 1, 1, 2])
    return f"{vi.name}: {k} more dimensions"


def onnx_types(rng, model, case, seeds) -> str:
    g = model.graph
    how = rng.choice(["elem", "elem", "init", "sequence", "map", "optional", "sparse", "none"])
    if how == "init" and g.initializer:
        t, v = rng.choice(g.initializer), rng.choice(ELEM_TYPES)
        t.data_type = v
        return f"initializer {t.name}: data_type {v}"
    vi = rng.choice([*g.input, *g.output, *g.value_info])
    elem = copy.deepcopy(vi.type)
    if how in ("elem", "init"):
        v = rng.choice(ELEM_TYPES)
        vi.type.tensor_type.elem_type = v
        return f"{vi.name}: elem_type {v}"
    vi.type.Clear()
    if how == "sequence":
        vi.type.sequence_type.elem_type.CopyFrom(elem)
    elif how == "map":
        vi.type.map_type.key_type = 7
        vi.type.map_type.value_type.CopyFrom(elem)
    elif how == "optional":
        vi.type.optional_type.elem_type.CopyFrom(elem)
    elif how == "sparse":
        vi.type.sparse_tensor_type.elem_type = 1
        vi.type.sparse_tensor_type.shape.dim.add().dim_value = 4
    return f"{vi.name}: a {how} type"


def onnx_initializer(rng, model, case, seeds) -> str:
    from onnx import TensorProto

    g = model.graph
    if not g.initializer:
        t = g.initializer.add(name="fz_w", data_type=TensorProto.FLOAT, dims=[2], raw_data=bytes(8))
    t = rng.choice(g.initializer)
    how = rng.choice(["dims", "dims", "raw-short", "raw-long", "typed-data", "string", "external", "external",
                      "segment", "rename"])
    if how == "dims":
        dims = rng.choice([[2**40], [1 << 20, 1 << 20], [-3, 4], [0], [*t.dims, 7], [], [2**62, 2**62]])
        del t.dims[:]
        t.dims.extend(dims)
        return f"initializer {t.name}: dims {dims}"
    if how == "raw-short":
        t.raw_data = t.raw_data[: len(t.raw_data) // 2]
        return f"initializer {t.name}: half its data"
    if how == "raw-long":
        t.raw_data = t.raw_data + rng.randbytes(13)
        return f"initializer {t.name}: 13 bytes too many"
    if how == "typed-data":
        t.ClearField("raw_data")
        t.float_data.extend([1.0, float("nan")] * rng.choice([1, 3]))
        return f"initializer {t.name}: float_data of the wrong count"
    if how == "string":
        t.data_type = TensorProto.STRING
        return f"initializer {t.name}: STRING holding raw bytes"
    if how == "segment":
        t.segment.begin, t.segment.end = 5, 2**40
        return f"initializer {t.name}: a segment"
    if how == "rename":
        other = rng.choice([*g.initializer, *g.input])
        t.name = other.name
        return f"initializer {t.name}: renamed to {other.name}"
    for f in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
        t.ClearField(f)
    t.data_location = TensorProto.EXTERNAL
    del t.external_data[:]
    (case / "w.bin").write_bytes(rng.randbytes(rng.choice([0, 3, 64, 4096])))
    location = rng.choice(EXTERNAL_LOCATIONS)
    if location == "link.bin":
        os.symlink(seeds.npy["x"], case / "link.bin")
    elif location == "dir.bin":
        (case / "dir.bin").mkdir()
    entries = {"location": location}
    for key in ("offset", "length", "checksum", "fz_unknown"):
        if rng.random() < 0.4:
            entries[key] = rng.choice(EXTERNAL_NUMBERS)
    for k, v in entries.items():
        t.external_data.add(key=k, value=v)
    return f"initializer {t.name}: external data {_short(entries)}"


def onnx_op(rng, model, case, seeds) -> str:
    node = _any_node(rng, model)
    node.op_type = rng.choice(OPS)
    if rng.random() < 0.25:
        node.domain = rng.choice(DOMAINS)
    return f"node {node.name or node.output[:1]}: op {node.domain}::{node.op_type}"


def onnx_wiring(rng, model, case, seeds) -> str:
    g = rng.choice(list(_graphs(model.graph)))
    if not g.node:
        return "wiring: an empty graph"
    i = rng.randrange(len(g.node))
    node = g.node[i]
    how = rng.choice(["unknown-input", "self-loop", "cycle", "duplicate-output", "no-inputs", "many-inputs",
                      "empty-name", "reorder", "delete", "duplicate", "output-is-input"])
    if how == "unknown-input" and node.input:
        node.input[rng.randrange(len(node.input))] = "fz_nowhere"
    elif how == "self-loop" and node.output:
        node.input.append(node.output[0])
    elif how == "cycle" and i + 1 < len(g.node) and g.node[i + 1].output and node.input:
        node.input[0] = g.node[i + 1].output[0]
    elif how == "duplicate-output" and node.output:
        node.output[0] = rng.choice(g.node).output[0] if rng.choice(g.node).output else "x"
    elif how == "no-inputs":
        del node.input[:]
    elif how == "many-inputs":
        node.input.extend([node.input[0] if node.input else "x"] * rng.choice([10, 3000]))
    elif how == "empty-name":
        (node.input if rng.random() < 0.5 else node.output).append("")
    elif how == "reorder":
        nodes = list(g.node)
        rng.shuffle(nodes)
        del g.node[:]
        g.node.extend(nodes)
    elif how == "delete":
        del g.node[i]
    elif how == "duplicate":
        g.node.append(copy.deepcopy(node))
    elif how == "output-is-input" and node.output and model.graph.input:
        node.output[0] = model.graph.input[0].name
    return f"node {i} of graph {g.name!r}: {how}"


def onnx_attribute(rng, model, case, seeds) -> str:
    from onnx import AttributeProto, helper

    node = _any_node(rng, model)
    how = rng.choice(["set", "set", "set", "remove", "retype", "graph", "ref", "duplicate"])
    if how in ("remove", "retype", "ref", "duplicate") and not node.attribute:
        how = "set"
    if how == "set":
        names = [a.name for a in node.attribute]
        name = rng.choice(names) if names and rng.random() < 0.7 else rng.choice(ATTR_NAMES)
        value = rng.choice(ATTR_VALUES)
        for k in reversed(range(len(node.attribute))):
            if node.attribute[k].name == name:
                del node.attribute[k]
        node.attribute.append(helper.make_attribute(name, value))
        return f"node {node.op_type}: {name} = {_short(value)}"
    k = rng.randrange(len(node.attribute)) if node.attribute else 0
    if how == "remove":
        name = node.attribute[k].name
        del node.attribute[k]
        return f"node {node.op_type}: attribute {name} removed"
    if how == "retype":
        node.attribute[k].type = rng.randrange(0, 15)
        return f"node {node.op_type}: attribute {node.attribute[k].name} of type {node.attribute[k].type}"
    if how == "ref":
        node.attribute[k].ref_attr_name = "fz_ref"
        return f"node {node.op_type}: attribute {node.attribute[k].name} refers to a function attribute"
    if how == "duplicate":
        node.attribute.append(copy.deepcopy(node.attribute[k]))
        return f"node {node.op_type}: attribute {node.attribute[k].name} twice"
    body = helper.make_graph([helper.make_node("Identity", ["fz_nowhere"], ["fz_b"])], "fz_body", [],
                             [helper.make_tensor_value_info("fz_b", 1, None)])
    name = rng.choice(["then_branch", "else_branch", "body", "fz_graph"])
    node.attribute.append(helper.make_attribute(name, body))
    if rng.random() < 0.5:
        node.attribute[-1].type = AttributeProto.GRAPHS
    return f"node {node.op_type}: graph attribute {name}"


def onnx_opset(rng, model, case, seeds) -> str:
    from onnx import helper

    how = rng.choice(["version", "version", "drop", "duplicate", "domain", "ir"])
    if how == "version":
        v = rng.choice([0, 1, 6, 9, 10, 11, 12, 13, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 99, 2**31 - 1, -1, 2**63 - 1])
        for o in model.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = v
        return f"opset {v}"
    if how == "drop":
        del model.opset_import[:]
        return "no opset_import"
    if how == "duplicate":
        v = rng.choice([11, 13, 21])
        model.opset_import.append(helper.make_opsetid(rng.choice(["", "ai.onnx"]), v))
        return f"the standard opset twice (also {v})"
    if how == "domain":
        d = rng.choice(DOMAINS)
        model.opset_import.append(helper.make_opsetid(d, rng.choice([1, 3, 99])))
        return f"opset_import of domain {d!r} added"
    v = rng.choice([0, 1, 2, 3, 4, 7, 8, 9, 10, 11, 12, 13, 99, 2**40, -1])
    model.ir_version = v
    return f"ir_version {v}"


def onnx_graph_io(rng, model, case, seeds) -> str:
    from onnx import helper

    g = model.graph
    how = rng.choice(["no-outputs", "no-inputs", "output-initializer", "output-input", "output-unproduced",
                      "duplicate-input", "input-shadows-initializer", "no-nodes", "many-outputs"])
    if how == "no-outputs":
        del g.output[:]
    elif how == "no-inputs":
        del g.input[:]
    elif how == "output-initializer" and g.initializer:
        t = g.initializer[0]
        g.output.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    elif how == "output-input" and g.input:
        g.output.append(copy.deepcopy(g.input[0]))
    elif how == "output-unproduced":
        g.output.append(helper.make_tensor_value_info("fz_nowhere", 1, [1]))
    elif how == "duplicate-input" and g.input:
        g.input.append(copy.deepcopy(g.input[0]))
    elif how == "input-shadows-initializer" and g.initializer:
        g.input.append(helper.make_tensor_value_info(g.initializer[0].name, 1, [rng.choice([1, 7]), 3]))
    elif how == "no-nodes":
        del g.node[:]
    elif how == "many-outputs":
        for n in list(g.node):
            g.output.extend(helper.make_empty_tensor_value_info(o) for o in n.output)
    return f"graph: {how}"


def onnx_nesting(rng, model, case, seeds) -> str:
    """An output computed inside If branches nested `depth` deep (each level an If in a then branch),
    or as deep as protobuf nests messages (100, 3 per level)."""
    from onnx import TensorProto as T
    from onnx import helper

    tag = _tag(rng)
    value = f"{tag}v"
    trivial = helper.make_graph([helper.make_node("Identity", [value], [f"{tag}e"])], f"{tag}else", [],
                                [helper.make_tensor_value_info(f"{tag}e", T.FLOAT, None)])

    def nested(depth):
        graph = helper.make_graph([helper.make_node("Identity", [value], [f"{tag}o0"])], f"{tag}l0", [],
                                  [helper.make_tensor_value_info(f"{tag}o0", T.FLOAT, None)])
        for k in range(1, depth):
            node = helper.make_node("If", [f"{tag}c"], [f"{tag}o{k}"], then_branch=graph, else_branch=trivial)
            graph = helper.make_graph([node], f"{tag}l{k}", [], [helper.make_tensor_value_info(f"{tag}o{k}", T.FLOAT, None)])
        return helper.make_node("If", [f"{tag}c"], [f"{tag}out"], then_branch=graph, else_branch=trivial)

    depth = rng.choice([2, 8, 24, 31, 32, 40])
    while True:
        try:
            model.graph.node.append(nested(depth))
            break
        except Exception:  # too deep for protobuf
            depth -= 1
    model.graph.node.extend([_const(f"{tag}c", True, "bool"), _const(value, [1.0], "float32")])
    _add_output(model, f"{tag}out", T.FLOAT)
    return f"If nested {depth} deep"


def onnx_function(rng, model, case, seeds) -> str:
    """A model-local function: calling itself, two calling each other, an empty one, one calling what
    is not defined, one named like a standard op, or called a thousand times."""
    from onnx import helper

    how = rng.choice(["recursive", "mutual", "empty", "undefined-call", "standard-name", "many-calls"])
    domain = "" if how == "standard-name" else "fz.local"
    name = "Relu" if how == "standard-name" else "F"
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("fz.local", 1)]
    call = {"recursive": ("F", "fz.local"), "mutual": ("G", "fz.local"), "undefined-call": ("H", "fz.local")}
    if how in call:
        body = [helper.make_node(call[how][0], ["a"], ["b"], domain=call[how][1])]
    elif how == "empty":
        body = []
    else:
        body = [helper.make_node("Neg", ["a"], ["t"]), helper.make_node("Neg", ["t"], ["b"])]
    model.functions.append(helper.make_function(domain, name, ["a"], ["b"], body, opsets))
    if how == "mutual":
        model.functions.append(helper.make_function("fz.local", "G", ["a"], ["b"],
                                                     [helper.make_node("F", ["a"], ["b"], domain="fz.local")], opsets))
    model.opset_import.append(helper.make_opsetid("fz.local", 1))
    tag, x = _tag(rng), _float_value(model)
    calls = 1000 if how == "many-calls" else 1
    prev = x
    for k in range(calls):
        model.graph.node.append(helper.make_node(name, [prev], [f"{tag}{k}"], domain=domain))
        prev = f"{tag}{k}"
    _add_output(model, prev, 1)
    return f"local function: {how}"


BOMBS = ("ConstantOfShape", "Range", "Expand", "Tile", "Reshape", "Gather", "Div", "Loop", "Resize", "Pad", "Slice",
         "OneHot", "Cast", "Concat", "TopK", "Einsum", "Squeeze", "MatMul", "BitShift", "Split", "ScatterND", "chain")


def _bomb(kind: str, rng, tag: str) -> tuple[list, int]:
    """A small graph whose constant result would be enormous, or that no evaluator can compute: its
    nodes and the element type of its output `tag + "o"`."""
    from onnx import TensorProto as T
    from onnx import helper

    def c(name, value, dtype):
        return _const(tag + name, value, dtype)

    def n(op, inputs, outputs=("o",), **attrs):
        return helper.make_node(op, [tag + i for i in inputs], [tag + o for o in outputs], **attrs)

    big, pick = rng.choice([2**20, 2**31, 2**40]), rng.choice
    if kind == "ConstantOfShape":
        return [c("s", [big, big], "int64"), n("ConstantOfShape", ["s"])], T.FLOAT
    if kind == "Range":
        return [c("a", 0, "int64"), c("b", min(big * big, 2**62), "int64"), c("d", pick([1, 0, -1]), "int64"),
                n("Range", ["a", "b", "d"])], T.INT64
    if kind == "Expand":
        return [c("v", [1.0], "float32"), c("s", [big, 1 << 16], "int64"), n("Expand", ["v", "s"])], T.FLOAT
    if kind == "Tile":
        return [c("v", [[1.0]], "float32"), c("r", [big, big], "int64"), n("Tile", ["v", "r"])], T.FLOAT
    if kind == "Reshape":
        shape = pick([[-1, -1], [0, 7], [2**40], [-2], [4, -1], [0]])
        return [c("v", list(range(6)), "float32"), c("s", shape, "int64"), n("Reshape", ["v", "s"])], T.FLOAT
    if kind == "Gather":
        return [c("v", [1.0, 2.0, 3.0], "float32"), c("i", [pick([10, -4, 2**62])], "int64"),
                n("Gather", ["v", "i"])], T.FLOAT
    if kind == "Div":
        return [c("a", [1], "int64"), c("b", [0], "int64"), n(pick(["Div", "Mod"]), ["a", "b"])], T.INT64
    if kind == "Loop":
        body = helper.make_graph(
            [n("Identity", ["ci"], ["co"]), n("Add", ["vi", "one"], ["vo"])], tag + "body",
            [helper.make_tensor_value_info(tag + "i", T.INT64, []), helper.make_tensor_value_info(tag + "ci", T.BOOL, []),
             helper.make_tensor_value_info(tag + "vi", T.FLOAT, [1])],
            [helper.make_tensor_value_info(tag + "co", T.BOOL, []), helper.make_tensor_value_info(tag + "vo", T.FLOAT, [1])])
        return [c("m", pick([2**40, -1, 0, 10**5, 17]), "int64"), c("t", True, "bool"), c("one", [1.0], "float32"),
                c("v0", [0.0], "float32"), n("Loop", ["m", "t", "v0"], body=body)], T.FLOAT
    if kind == "Resize":
        scales = pick([[1, 1, 1e6, 1e6], [1, 1, 0, 0], [1, 1, float("nan"), 2], [1, 1, -2, 2]])
        return [c("v", [[[[1.0, 2.0], [3.0, 4.0]]]], "float32"), c("roi", [], "float32"), c("sc", scales, "float32"),
                n("Resize", ["v", "roi", "sc"])], T.FLOAT
    if kind == "Pad":
        return [c("v", [1.0, 2.0], "float32"), c("p", pick([[0, big], [-5, -5], [2**62, 2**62]]), "int64"),
                n("Pad", ["v", "p"])], T.FLOAT
    if kind == "Slice":
        return [c("v", list(range(10)), "float32"), c("s", [2**62], "int64"), c("e", [-(2**62)], "int64"),
                c("a", [pick([0, 5, -9])], "int64"), c("st", [pick([-(2**62), 0, 2**62])], "int64"),
                n("Slice", ["v", "s", "e", "a", "st"])], T.FLOAT
    if kind == "OneHot":
        return [c("i", [0], "int64"), c("d", [pick([big, -1, 0])], "int64"), c("vals", [0.0, 1.0], "float32"),
                n("OneHot", ["i", "d", "vals"])], T.FLOAT
    if kind == "Cast":
        return [c("v", [1.5, float("nan")], "float32"), n("Cast", ["v"], to=pick([T.STRING, T.BOOL, 0, 99]))], T.STRING
    if kind == "Concat":
        return [c("a", [[1.0]], "float32"), c("b", [1.0, 2.0, 3.0], "float32"),
                n("Concat", ["a", "b"], axis=pick([0, 5, -9]))], T.FLOAT
    if kind == "TopK":
        return [c("v", [1.0, 2.0], "float32"), c("k", [pick([big, -1, 0])], "int64"),
                n("TopK", ["v", "k"], ("o", "idx"))], T.FLOAT
    if kind == "Einsum":
        equation = pick(["ij,->z", "", "...", "ii", "i" * 60 + "->", "ij->jji"])
        return [c("a", [[1.0, 2.0], [3.0, 4.0]], "float32"), n("Einsum", ["a"], equation=equation)], T.FLOAT
    if kind == "Squeeze":
        return [c("v", [[1.0]], "float32"), c("a", [pick([5, -9, 0])], "int64"), n("Squeeze", ["v", "a"])], T.FLOAT
    if kind == "MatMul":
        return [c("a", [[1.0] * 3] * 2, "float32"), c("b", [[1.0] * 5] * 4, "float32"), n("MatMul", ["a", "b"])], T.FLOAT
    if kind == "BitShift":
        return [c("a", [1], "uint64"), c("b", [pick([64, 2**40, 2**63])], "uint64"),
                n("BitShift", ["a", "b"], direction="LEFT")], T.UINT64
    if kind == "Split":
        return [c("v", list(range(6)), "float32"), c("s", pick([[4, 4], [-1, 7], [0, 6]]), "int64"),
                n("Split", ["v", "s"], ("o", "o2"), axis=0)], T.FLOAT
    if kind == "ScatterND":
        return [c("d", [1.0, 2.0, 3.0, 4.0], "float32"), c("i", [[pick([10, -9, 2**40])]], "int64"),
                c("u", [5.0], "float32"), n("ScatterND", ["d", "i", "u"])], T.FLOAT
    # a chain of 5000 nodes: what walks the graph recursively overflows the stack
    return [c("n0", [1.0], "float32")] + [n("Neg", [f"n{k}"], [f"n{k + 1}" if k < 4999 else "o"])
                                          for k in range(5000)], T.FLOAT


def onnx_bomb(rng, model, case, seeds) -> str:
    tag, kind = _tag(rng), rng.choice(BOMBS)
    nodes, elem_type = _bomb(kind, rng, tag)
    model.graph.node.extend(nodes)
    _add_output(model, tag + "o", elem_type)
    return f"a {kind} whose result is enormous or undefined"


def onnx_strings(rng, model, case, seeds) -> str:
    from onnx import helper

    big = rng.choice(["x" * 10**6, "\u202e" * 1000, "a\x00b", "../../" * 100, "名前" * 1000, " ", "/"])
    how = rng.choice(["node-name", "doc", "metadata", "many-metadata", "producer", "graph-name", "value-name"])
    g = model.graph
    if how == "node-name":
        _any_node(rng, model).name = big
    elif how == "doc":
        g.doc_string = big
    elif how == "metadata":
        model.metadata_props.add(key=big[:1000], value=big)
    elif how == "many-metadata":
        for k in range(100_000):
            model.metadata_props.add(key=f"k{k}", value="v")
    elif how == "producer":
        model.producer_name = big
    elif how == "graph-name":
        g.name = big
    else:  # a graph input renamed, with every use of it
        if not g.input:
            return "strings: no input to rename"
        old, new = g.input[0].name, big[:4096] or " "
        for graph in _graphs(g):
            for n in graph.node:
                n.input[:] = [new if v == old else v for v in n.input]
        g.input[0].name = new
        return f"input {old!r} renamed to {_short(new)}"
    return f"strings: {how} = {_short(big)}"


def onnx_sparse(rng, model, case, seeds) -> str:
    import numpy as np
    from onnx import helper, numpy_helper

    tag = _tag(rng)
    sp = model.graph.sparse_initializer.add()
    sp.values.CopyFrom(numpy_helper.from_array(np.ones(3, np.float32), tag + "sp"))
    indices = rng.choice([[0, 1, 2], [5, 1, 99], [-1, 0, 1], [2**40, 0, 1], [1, 1, 1]])
    sp.indices.CopyFrom(numpy_helper.from_array(np.array(indices, np.int64), ""))
    dims = rng.choice([[4], [2**40], [-1], [2, 2], []])
    sp.dims.extend(dims)
    model.graph.node.append(helper.make_node("Neg", [tag + "sp"], [tag + "o"]))
    _add_output(model, tag + "o", 1)
    return f"sparse initializer: indices {indices}, dims {dims}"


def onnx_graft(rng, model, case, seeds) -> str:
    import onnx

    other = onnx.load_model_from_string(rng.choice(seeds.onnx).read_bytes())
    if rng.random() < 0.5 and other.graph.node:
        model.graph.node.append(rng.choice(other.graph.node))
        return f"a node of {other.graph.name!r} grafted in"
    model.graph.node.extend(other.graph.node)
    model.graph.initializer.extend(other.graph.initializer)
    return f"every node of {other.graph.name!r} grafted in"


ONNX_MUTATIONS: dict[str, Callable] = {
    "dims": onnx_dims, "types": onnx_types, "initializer": onnx_initializer, "op": onnx_op, "wiring": onnx_wiring,
    "attribute": onnx_attribute, "opset": onnx_opset, "graph-io": onnx_graph_io, "nesting": onnx_nesting,
    "function": onnx_function, "bomb": onnx_bomb, "strings": onnx_strings, "sparse": onnx_sparse, "graft": onnx_graft,
}


def gen_onnx(rng, seeds, case, deep):
    import onnx

    source = rng.choice(seeds.onnx)
    name = rng.choice(["model.onnx"] * 18 + ["model", "model.ONNX"])
    if rng.random() < 0.2:
        data, how = damage(rng, source.read_bytes(), seeds.splices)
    else:
        model = onnx.load_model_from_string(source.read_bytes())
        kinds = [rng.choice(sorted(ONNX_MUTATIONS)) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
        how = "; ".join(ONNX_MUTATIONS[k](rng, model, case, seeds) for k in kinds)
        data = model.SerializeToString()
    path = case / name
    path.write_bytes(data)
    return path, f"{source.name}: {how}", {}


# --- TFLite, Keras, SavedModel ---------------------------------------------------------------------

def gen_tflite(rng, seeds, case, deep):
    source = rng.choice(seeds.tflite)
    data = source.read_bytes()
    name = "model" if rng.random() < 0.1 else "model.tflite"  # without a suffix: found by its identifier
    if deep:  # the identifier and a root offset inside the file: the converter reads it
        if rng.random() < 0.2:
            data = struct.pack("<I", rng.randrange(8, len(data) - 4)) + data[4:]
            how = "root offset moved inside the file"
        else:
            (root,) = struct.unpack_from("<I", data)
            data, how = damage(rng, data, seeds.splices, start=8)
            if len(data) < root + 4:
                data += bytes(root + 4 - len(data))
    else:
        how = rng.choice(["identifier", "root-offset", "tiny", "empty", "other-format", "directory"])
        if how == "identifier":
            data = data[:4] + rng.choice([b"TFL2", b"tfl3", b"\0\0\0\0", rng.randbytes(4)]) + data[8:]
        elif how == "root-offset":
            data = struct.pack("<I", rng.choice([len(data), len(data) - 3, 2**32 - 1, 2**31])) + data[4:]
        elif how == "tiny":
            data = data[:rng.randrange(8)]
        elif how == "empty":
            data = b""
        elif how == "other-format":
            data = rng.choice(seeds.splices)
        else:
            (case / "model.tflite").mkdir()
            return case / "model.tflite", f"{source.name}: a directory named model.tflite", {}
    path = case / name
    path.write_bytes(data)
    return path, f"{source.name}: {how}", {}


def _zip_rewrite(source: Path, dest: Path, change: Callable[[str, bytes], bytes | None],
                 extra: dict[str, bytes] | None = None) -> None:
    """`source` rewritten member by member (valid CRCs: the damage reaches Keras itself); `change`
    returns a member's new bytes, or None to drop it; `extra` members are added."""
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            data = change(item.filename, src.read(item))
            if data is not None:
                dst.writestr(item.filename, data)
        for name, data in (extra or {}).items():
            dst.writestr(name, data)


KERAS_VALUES = [None, -1, 0, 2**40, 1e308, float("nan"), "", "Lambda", "fz.Unknown", "os", "builtins.eval",
                [], {}, [None, 8], [None, -1], [None, 2**40], {"class_name": "Lambda", "config": {}},
                lambda rng: _nested(rng.choice([100, 200]))]


def _patch_zip_headers(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    """Every local header (field at `offset`) and central directory entry (at `offset` + 2) of `data`
    with that field set to `value`: a change no CRC covers."""
    out = bytearray(data)
    for magic, at in ((b"PK\x03\x04", offset), (b"PK\x01\x02", offset + 2)):
        i = out.find(magic)
        while i >= 0:
            struct.pack_into(fmt, out, i + at, value)
            i = out.find(magic, i + 4)
    return bytes(out)


def gen_keras(rng, seeds, case, deep):
    source = rng.choice(seeds.keras)
    path = case / source.name
    if source.suffix == ".h5":
        return _h5_case(rng, seeds, source, path, deep)
    if deep:
        how = rng.choice(["config", "config", "weights", "metadata", "duplicate-config", "bomb", "member-names", "comment"])
        if how in ("config", "duplicate-config"):
            with zipfile.ZipFile(source) as z:
                doc, what = _tree_mutation(rng, json.loads(z.read("config.json")), KERAS_VALUES,
                                           ["fz_unknown", "module", "registered_name", "build_config"])
            text = json.dumps(doc).encode()
            if how == "config":
                _zip_rewrite(source, path, lambda n, d: text if n == "config.json" else d)
            else:
                _zip_rewrite(source, path, lambda n, d: d, {"config.json": text})
            how = f"{how}: {what}"
        elif how in ("weights", "metadata"):
            member = "model.weights.h5" if how == "weights" else "metadata.json"
            damaged = {}

            def change(name, data):
                if name == member:
                    data, damaged["how"] = damage(rng, data, seeds.splices)
                return data
            _zip_rewrite(source, path, change)
            how = f"{member}: {damaged.get('how', 'absent')}"
        elif how == "bomb":
            _zip_rewrite(source, path, lambda n, d: d, {"assets/zeros.bin": bytes(64 << 20)})
        elif how == "member-names":
            _zip_rewrite(source, path, lambda n, d: d, {f"../../{ESCAPE}": b"x", f"/tmp/{ESCAPE}": b"x"})
        else:
            with zipfile.ZipFile(source) as src, zipfile.ZipFile(path, "w") as dst:
                dst.comment = rng.randbytes(65535)
                for item in src.infolist():
                    dst.writestr(item, src.read(item))
        return path, f"{source.name}: {how}", {}
    how = rng.choice(["bytes", "bytes", "no-config", "method", "encrypted", "not-zip", "truncate"])
    data = source.read_bytes()
    if how == "bytes":
        data, how = damage(rng, data, seeds.splices)
    elif how == "no-config":
        _zip_rewrite(source, path, lambda n, d: None if n == "config.json" else d)
        return path, f"{source.name}: no config.json", {}
    elif how == "method":
        data = _patch_zip_headers(data, 8, "<H", rng.choice([1, 6, 12, 14, 93, 99, 0xFFFF]))
    elif how == "encrypted":
        data = _patch_zip_headers(data, 6, "<H", 1)
    elif how == "not-zip":
        data = rng.choice(seeds.splices)
    else:
        data = data[:rng.randrange(len(data))]
    path.write_bytes(data)
    return path, f"{source.name}: {how}", {}


def _h5_case(rng, seeds, source, path, deep):
    data = source.read_bytes()
    if deep:
        how = rng.choice(["bytes", "bytes", "userblock"])
        if how == "userblock":  # the signature found at 512, the addresses still relative to 0
            data = bytes(512) + data
        else:
            data, how = damage(rng, data, seeds.splices, start=96)
    else:
        how = rng.choice(["truncate", "signature", "end-of-file", "prefix", "not-h5", "empty"])
        if how == "truncate":
            data = data[:rng.randrange(100, len(data))]
        elif how == "signature":
            out = bytearray(data)
            out[rng.randrange(8)] ^= rng.randint(1, 255)
            data = bytes(out)
        elif how == "end-of-file":  # superblock v0: the end-of-file address at bytes 40..48
            data = data[:40] + struct.pack("<Q", rng.choice([len(data) + 1, 2**40, 2**63])) + data[48:]
        elif how == "prefix":
            data = rng.randbytes(rng.choice([1, 100, 511])) + data
        elif how == "not-h5":
            data = rng.choice(seeds.splices)
        else:
            data = b""
    path.write_bytes(data)
    return path, f"{source.name}: {how}", {}


def gen_savedmodel(rng, seeds, case, deep):
    source = rng.choice(seeds.savedmodel)
    model = case / "model"
    shutil.copytree(source, model)
    pb = model / "saved_model.pb"
    path = model
    if deep:
        how = rng.choice(["pb", "pb", "pb", "variables", "no-variables", "fingerprint", "pbtxt", "junk"])
        if how == "pb":
            data, how = damage(rng, pb.read_bytes(), seeds.splices)
            pb.write_bytes(data)
            how = f"saved_model.pb: {how}"
        elif how == "variables":
            victim = rng.choice(sorted((model / "variables").iterdir()))
            data, what = damage(rng, victim.read_bytes(), seeds.splices)
            victim.write_bytes(data)
            how = f"{victim.name}: {what}"
        elif how == "no-variables":
            shutil.rmtree(model / "variables")
        elif how == "fingerprint":
            fp = model / "fingerprint.pb"
            fp.write_bytes(damage(rng, fp.read_bytes(), seeds.splices)[0] if fp.exists() else b"\xff")
        elif how == "pbtxt":
            pb.unlink()
            (model / "saved_model.pbtxt").write_bytes(rng.choice([b"", b"meta_graphs {", rng.randbytes(300)]))
        else:
            for k in range(3):
                (model / f"junk{k}").write_bytes(rng.randbytes(100))
            (model / "variables" / "variables.data-00001-of-00002").write_bytes(rng.randbytes(64))
    else:
        how = rng.choice(["empty-pb", "no-pb", "pb-directory", "the-pb-file", "missing"])
        if how == "empty-pb":
            pb.write_bytes(b"")
        elif how == "no-pb":
            pb.unlink()
        elif how == "pb-directory":
            pb.unlink()
            pb.mkdir()
        elif how == "the-pb-file":  # the user names saved_model.pb itself; it is empty
            pb.write_bytes(b"")
            path = pb
        else:
            path = model / "nope"
    return path, f"{source.name}: {how}", {}


# --- target YAML ---------------------------------------------------------------------------------

YAML_VALUES = [None, True, False, 0, -1, 1, 2**63, 10**400, 1e308, float("inf"), float("nan"), -0.0, "", "x" * 5000,
               "x" * 201, [], {}, [1, 2], {"a": 1}, "haswell", "native", "sm_86", "usb:0", "\u202e", "cpu", "edgetpu",
               "gpu", "llvm", "cuda", "aarch64-linux-gnu", "x86_64-linux-gnu", 1e-300, 4096, 1025, 17, 1.0000001,
               {"value": 1.0, "unit": "us", "source": "fuzz"}, {"value": float("nan"), "unit": "us", "source": "fz"},
               lambda rng: _nested(rng.choice([20, 33, 200]))]
YAML_KEYS = ["fz_unknown", "kind", "name", "count", "physical", "codegen", "mcpu", "mattr", "backends", "precision",
             "cache_bandwidth", "cache_capacity", "step_dispatch", "parallel_efficiency", "legalize", "host"]


def _yaml_text(rng, text: str) -> tuple[str, str]:
    """YAML-specific hostility, written as text: aliases, tags, nesting, numbers, encodings."""
    lines = text.splitlines()
    at = rng.randrange(len(lines) + 1)
    how = rng.choice(["alias-bomb", "recursive-alias", "deep", "tag", "merge", "duplicate-key", "huge-int",
                      "numbers", "documents", "control", "tabs", "crlf", "long-line", "many-values", "complex-key",
                      "empty", "scalar", "list", "indent"])
    if how == "alias-bomb":
        levels = rng.choice([3, 6, 9, 12])
        bomb = ["fz_lol0: &l0 [lol]"] + [f"fz_lol{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels)]
        return "\n".join(bomb + lines), f"an alias bomb of {levels} levels"
    if how == "recursive-alias":
        return text.replace("cores:", "cores: &loop [*loop]\n    fz_cores:", 1), "an alias inside the node it names"
    if how == "deep":
        depth = rng.choice([30, 33, 100, 5000])
        kind = rng.choice(["[", "{a: "])
        close = "]" if kind == "[" else "}"
        return text + f"\nfz_deep: {kind * depth}1{close * depth}\n", f"{kind}-nesting {depth} deep"
    if how == "tag":
        tag = rng.choice(["!!python/object/apply:os.system ['true']", "!!binary aGVsbG8=", "!!timestamp 2020-01-01",
                          "!!set {a, b}", "!!omap [a: 1]", "!!float nan", "!fz tagged", "!!str", "!!int 0x1F",
                          "!!python/name:os.system", "!!bool maybe", "!!float abc", "!!timestamp 2020-13-45",
                          "!!timestamp x", "!!int 0x", "!!int 0b2"])
        return re_sub_first(text, r"cores: \d+", f"cores: {tag}"), f"tag {tag}"
    if how == "merge":
        return text.replace("devices:", "fz_base: &base {cores: 2}\ndevices:", 1).replace(
            "kind: cpu", "kind: cpu\n    <<: *base", 1), "a merge key"
    if how == "duplicate-key":
        key = rng.choice(["name", "devices", "cores", "kind"])
        for i, line in enumerate(lines):
            if line.strip().startswith(key + ":"):
                lines.insert(i + 1, line)
                break
        return "\n".join(lines), f"key {key} twice"
    if how == "huge-int":
        digits = rng.choice([19, 400, 4301, 5000])
        return re_sub_first(text, r"cores: \d+", "cores: " + "9" * digits), f"an integer of {digits} digits"
    if how == "numbers":
        number = rng.choice(["1e309", ".nan", "-.inf", "0x7fffffff", "0o777", "1_000", "0b101", "+.5", "1:20",
                             "yes", "off", "~", "1e-400", "0.0", "-0"])
        return re.sub(r"value: [0-9.]+", f"value: {number}", text, count=1), f"a figure written {number}"
    if how == "documents":
        return text + "\n---\n" + text, "two documents"
    if how == "control":
        char = rng.choice(["\x00", "\x07", "\x1b", "\ufeff", "\ud7ff", "\u2028", "\x85"])
        return text[:at * 10] + char + text[at * 10:], f"character {ord(char):#x}"
    if how == "tabs":
        return text.replace("    ", "\t", rng.choice([1, 5])), "tabs for indentation"
    if how == "crlf":
        return text.replace("\n", "\r\n"), "CRLF line ends"
    if how == "long-line":
        return text.replace("description:", "description: " + "x" * rng.choice([10**5, 10**6 + 1]), 1), "a long line"
    if how == "many-values":
        return text + "\nfz_many: [" + ", ".join(["0"] * rng.choice([9000, 20_000])) + "]\n", "many values"
    if how == "complex-key":
        return text + "\n? [a, b]\n: 1\n", "a sequence as a key"
    if how == "empty":
        return rng.choice(["", "# only a comment\n", "\n\n", "---\n", "...\n"]), "no document"
    if how == "scalar":
        return rng.choice(["x86", "42", "null", "'quoted'"]), "a scalar document"
    if how == "list":
        return "- " + "\n- ".join(lines[:5]), "a list document"
    lines.insert(at, " " * rng.choice([1, 3, 7]) + rng.choice(["fz: 1", "- x", ": y", "]"]))
    return "\n".join(lines), f"a badly indented line at {at}"


def re_sub_first(text: str, pattern: str, replacement: str) -> str:
    return re.sub(pattern, lambda m: replacement, text, count=1)


def gen_target(rng, seeds, case, deep):
    import yaml

    source = rng.choice(seeds.targets)
    text = source.read_text()
    kind = rng.choice(["bytes", "tree", "tree", "tree", "text", "text"])
    data: bytes
    if kind == "bytes":
        data, how = damage(rng, text.encode(), seeds.splices)
    elif kind == "tree":
        doc, how = _tree_mutation(rng, yaml.safe_load(text), YAML_VALUES, YAML_KEYS)
        data = yaml.safe_dump(doc, sort_keys=False, allow_unicode=rng.random() < 0.5).encode("utf-8", "surrogatepass")
    else:
        out, how = _yaml_text(rng, text)
        data = out.encode("utf-8", "surrogatepass")
    path = case / rng.choice(["target.yaml"] * 9 + ["target.yml"])
    path.write_bytes(data)
    return path, f"{source.name}: {how}", {"deep": deep}


# --- manifests -----------------------------------------------------------------------------------

MANIFEST_VALUES = [None, True, False, 0, -1, 1, 2**31, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, 10**30, 1.5, -0.0, 1e308,
                   float("nan"), float("inf"), -float("inf"), "", "x", "x" * 70_000, "\ud800", "a\udcffb", "\x00",
                   "../../etc/passwd", "/abs", "a/../b", "a//b", "segments/s0.so", "segments", "manifest.json", "cpu",
                   "gpu:0", "edgetpu:99999", "tvm", "tflite", "onnxruntime", "float32", "int8", "bool", "0", "99.0.0",
                   "0.0.1", "x86_64", "aarch64", [], [1], ["x"], [[]], [0, 1, 1], [3, 2], {}, {"a": 1},
                   {"sha256": "0" * 64, "size": 1},
                   {"name": "x", "shape": [1], "dtype": "float32"}, {"name": "y", "shape": [1, 4], "dtype": "float32"},
                   {"scale": 0.0, "zero_point": 0}, lambda rng: _nested(rng.choice([50, 200]))]
MANIFEST_KEYS = ["fz_unknown", "valid_range", "quant", "perm", "fallback_artifact", "replicas", "parallel_steps",
                 "signing", "bundle_version", "key", "threads", "replica", "files", "provenance", "__proto__"]


def _manifest_text(rng, seeds) -> tuple[bytes, str]:
    """JSON-level hostility: encodings, duplicate keys, literals json.loads takes, deep nesting, size."""
    text = (seeds.bundle / "manifest.json").read_text()
    how = rng.choice(["bom", "utf16", "latin1", "duplicate-key", "nan", "big-int", "deep", "huge", "top-level",
                      "trailing", "empty", "control"])
    if how == "bom":
        return b"\xef\xbb\xbf" + text.encode(), how
    if how == "utf16":
        return text.encode(rng.choice(["utf-16", "utf-16-le", "utf-32"])), how
    if how == "latin1":
        return text.replace('"x86"', '"x86\u00e9"').encode("latin-1"), how
    if how == "duplicate-key":
        return text.replace('"arch": "x86_64"', '"arch": "x86_64", "arch": "aarch64"', 1).encode(), how
    if how == "nan":
        literal = rng.choice(["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1E+999"])
        return re_sub_first(text, r'"predicted_ms": [0-9.e-]+', f'"predicted_ms": {literal}').encode(), f"{how} {literal}"
    if how == "big-int":
        digits = rng.choice([20, 4300, 4301, 100_000])
        return text.replace('"bundle_version": 0', '"bundle_version": ' + "9" * digits, 1).encode(), f"an int of {digits} digits"
    if how == "deep":
        depth = rng.choice([500, 990, 1000, 5000, 200_000])
        return text.replace('"calibration": {}', '"calibration": {"x": ' + "[" * depth + "]" * depth + "}", 1).encode(), \
            f"nesting {depth} deep"
    if how == "huge":
        return text.replace('"warnings": []', '"warnings": ["' + "x" * (16 << 20) + '"]', 1).encode(), "over 16 MiB"
    if how == "top-level":
        return rng.choice([b"[]", b"null", b"1", b'"manifest"', b"{}", b"[{}]"]), how
    if how == "trailing":
        return text.encode() + rng.choice([b"{}", b"\x00", b"]"]), how
    if how == "empty":
        return rng.choice([b"", b" ", b"\n"]), how
    return text.replace('"x86_64"', '"x86\\u0000_64"', 1).encode(), how


def gen_manifest(rng, seeds, case, deep):
    kind = rng.choice(["tree", "tree", "tree", "tree", "bytes", "text"])
    if kind == "tree":
        doc, how = seeds.manifest, ""
        for _ in range(rng.choice([1, 1, 2, 3])):
            doc, step = _tree_mutation(rng, doc, MANIFEST_VALUES, MANIFEST_KEYS)
            how += ("; " if how else "") + step
        data = json.dumps(doc, indent=rng.choice([None, 2])).encode()
    elif kind == "bytes":
        data, how = damage(rng, (seeds.bundle / "manifest.json").read_bytes(), seeds.splices)
    else:
        data, how = _manifest_text(rng, seeds)
    path = case / "manifest.json"
    path.write_bytes(data)
    return path, how, {}


# --- bundle archives -----------------------------------------------------------------------------

def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]], fmt: int = tarfile.GNU_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, encoding="utf-8", errors="surrogateescape") as tar:
        for info, data in members:
            info = copy.copy(info)
            if data is not None and info.type in (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE):
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _info(name: str, type_=tarfile.REGTYPE, **fields) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = type_
    info.mode = 0o644
    for k, v in fields.items():
        setattr(info, k, v)
    return info


def _restamped(members, manifest: dict) -> bytes:
    """`manifest` listing the archive's files (not itself or the signature) with their true sizes and hashes."""
    files = {}
    for info, data in members:
        rel = info.name.removeprefix("bundle/")
        if data is not None and rel not in ("manifest.json", "manifest.sig"):
            files[rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    return json.dumps({**manifest, "files": files}, indent=2, sort_keys=True).encode()


def _member_case(rng, seeds, members) -> tuple[bytes, str]:
    """The archive's members with one hostile change, as an uncompressed tar."""
    files = [k for k, (m, d) in enumerate(members) if d is not None]
    k = rng.choice(files)
    name = members[k][0].name
    fmt = tarfile.GNU_FORMAT
    how = rng.choice(["symlink", "hardlink", "device", "fifo", "contiguous", "dotdot", "absolute", "dot-slash",
                      "empty-part", "backslash", "duplicate", "file-dir-clash", "huge-size", "long-name", "non-utf8",
                      "pax", "sparse", "unlisted", "size-differs", "no-manifest", "manifest-dir", "manifest",
                      "manifest", "manifest", "signature", "bomb", "empty", "shuffle", "flat", "mixed-prefix", "modes"])
    out = list(members)
    if how in ("symlink", "hardlink"):
        link = rng.choice(["/etc/passwd", "../../..", "bundle/manifest.json", "manifest.json", "/"])
        out[k] = (_info(name, tarfile.SYMTYPE if how == "symlink" else tarfile.LNKTYPE, linkname=link), None)
        how += f" {name} -> {link}"
    elif how in ("device", "fifo"):
        type_ = rng.choice([tarfile.CHRTYPE, tarfile.BLKTYPE]) if how == "device" else tarfile.FIFOTYPE
        out.append((_info(rng.choice([name, f"bundle/{ESCAPE}"]), type_, devmajor=1, devminor=3), None))
    elif how == "contiguous":
        out[k] = (_info(name, tarfile.CONTTYPE), members[k][1])
    elif how in ("dotdot", "absolute", "backslash"):
        bad = {"dotdot": rng.choice([f"bundle/../{ESCAPE}", f"../{ESCAPE}", f"bundle/segments/../../../{ESCAPE}"]),
               "absolute": f"/tmp/{ESCAPE}", "backslash": f"bundle\\..\\..\\{ESCAPE}"}[how]
        out.append((_info(bad), b"x"))
        how += f" {bad}"
    elif how == "dot-slash":
        out = [(_info("./" + m.name, m.type), d) for m, d in members]
    elif how == "empty-part":
        out[k] = (_info(rng.choice([name.replace("/", "//", 1), name.replace("/", "/./", 1), name + "/"])), members[k][1])
    elif how == "duplicate":
        out.append(members[k])
    elif how == "file-dir-clash":
        out.append(rng.choice([(_info("bundle/segments"), b"x"), (_info(name + "/inner"), b"x"),
                               (_info(name, tarfile.DIRTYPE), None)]))
    elif how == "huge-size":  # a header that declares more data than follows, alone or after the members
        info = _info(rng.choice([name, "bundle/huge.bin"]), size=rng.choice([2**33, 2**40, 8**11 - 1]))
        head = _tar(members)[:-1024] if rng.random() < 0.5 else b""
        return head + info.tobuf(tarfile.GNU_FORMAT) + bytes(rng.choice([0, 512, 4096])) + bytes(1024), how
    elif how == "long-name":
        length = rng.choice([101, 256, 300, 1025, 5000])
        out.append((_info("bundle/" + "a" * length), b"x"))
        how += f" of {length} characters"
    elif how == "non-utf8":
        out.append((_info("bundle/\udcff\udcfe" + rng.choice(["", "/x", ".so"])), b"x"))
    elif how == "pax":
        fmt = tarfile.PAX_FORMAT
        key, value = rng.choice([("path", f"../{ESCAPE}"), ("size", "-1"), ("size", "abc"), ("size", str(2**40)),
                                 ("mtime", "nan"), ("mtime", "1e400"), ("uid", "-1"), ("linkpath", "/etc/passwd"),
                                 ("GNU.sparse.map", "0,1,x"), ("GNU.sparse.size", "99"), ("hdrcharset", "BINARY"),
                                 ("path", "bundle/\x00x"), ("fz", "x" * 10000)])
        info = copy.copy(members[k][0])
        info.pax_headers = {key: value}
        out[k] = (info, members[k][1])
        how += f" {key}={_short(value)}"
    elif how == "sparse":
        out[k] = (_info(name, tarfile.GNUTYPE_SPARSE), members[k][1])
    elif how == "unlisted":
        out.append((_info("bundle/segments/fz_extra.so"), rng.randbytes(64)))
    elif how == "size-differs":
        out[k] = (members[k][0], members[k][1] + b"\0")
    elif how == "no-manifest":
        out = [(m, d) for m, d in members if not m.name.endswith("manifest.json")]
    elif how == "manifest-dir":
        out = [(_info(m.name, tarfile.DIRTYPE), None) if m.name.endswith("manifest.json") else (m, d) for m, d in members]
    elif how == "manifest":  # a mutated manifest, its files restamped half the time so that unpacking goes on
        doc, what = _tree_mutation(rng, seeds.manifest, MANIFEST_VALUES, MANIFEST_KEYS)
        text = _restamped(members, doc) if rng.random() < 0.5 and isinstance(doc, dict) else json.dumps(doc).encode()
        out = [(m, text if m.name.endswith("manifest.json") else d) for m, d in members]
        how += f": {what}"
    elif how == "signature":
        sig = rng.choice([b"", rng.randbytes(64), rng.randbytes(63), rng.randbytes(5000), bytes(64)])
        out = [(m, d) for m, d in members if not m.name.endswith("manifest.sig")] + [(_info("bundle/manifest.sig"), sig)]
        how += f" of {len(sig)} bytes"
    elif how == "bomb":  # 64 MiB of zeros: 64 KiB compressed, listed (and restamped) or not
        bomb = [(_info("bundle/segments/zeros.bin"), bytes(64 << 20))]
        out = members + bomb
        if rng.random() < 0.5:
            text = _restamped(out, seeds.manifest)
            out = [(m, text if m.name.endswith("manifest.json") else d) for m, d in out]
            how += ", listed"
    elif how == "empty":
        out = rng.choice([[], [(_info("bundle", tarfile.DIRTYPE), None)], [(_info("bundle/x"), b"")]])
    elif how == "shuffle":
        out = rng.sample(members, len(members))
    elif how == "flat":
        out = [(_info(m.name.removeprefix("bundle/").removeprefix("bundle"), m.type), d) for m, d in members
               if m.name != "bundle"]
    elif how == "mixed-prefix":
        out[k] = (_info(name.removeprefix("bundle/")), members[k][1])
    else:
        mode, mtime = rng.choice([0, 0o7777, 0o4755]), rng.choice([-1, 2**33])
        out = [(_info(m.name, m.type, mode=mode, uid=2**21 - 1, mtime=mtime), d) for m, d in members]
    return _tar(out, fmt), how


def _compress(rng, raw: bytes) -> tuple[bytes, str]:
    how = rng.choice(["gz"] * 12 + ["none", "bz2", "xz", "gz-twice", "trailing"])
    if how == "none":
        return raw, "uncompressed"
    if how == "bz2":
        import bz2
        return bz2.compress(raw), "bzip2"
    if how == "xz":
        import lzma
        return lzma.compress(raw), "xz"
    data = gzip.compress(raw, mtime=0)
    if how == "gz-twice":
        return data + gzip.compress(b"\0" * 1024, mtime=0), "two gzip members"
    if how == "trailing":
        return data + rng.randbytes(rng.choice([1, 8, 100])), "bytes after the gzip stream"
    return data, ""


def gen_bundle(rng, seeds, case, deep):
    source = rng.choice(seeds.archives)
    keys = rng.random() < 0.5  # judged with the device's key, or (verify without one) by its hashes
    kind = rng.choice(["gz-bytes", "tar-bytes", "members", "members", "members", "members", "other"])
    if kind == "gz-bytes":
        data, how = damage(rng, source.read_bytes(), seeds.splices)
    elif kind == "tar-bytes":
        raw = gzip.decompress(source.read_bytes())
        raw, how = damage(rng, raw, seeds.splices)
        data, packed = _compress(rng, raw)
        how += f" ({packed or 'gzip'})"
    elif kind == "members":
        raw, how = _member_case(rng, seeds, seeds.members[source.name])
        data, packed = _compress(rng, raw)
        how += f" ({packed})" if packed else ""
    else:
        how = rng.choice(["not-gzip", "zip", "gz-of-nothing", "empty", "directory"])
        data = {"not-gzip": b"\x1f\x8b" + rng.randbytes(2000), "zip": (seeds.keras[0]).read_bytes(),
                "gz-of-nothing": gzip.compress(b"", mtime=0), "empty": b"", "directory": b""}[how]
        if how == "directory":
            (case / "bundle.tar.gz").mkdir()
            return case / "bundle.tar.gz", f"{source.name}: a directory without manifest.json", {"keys": keys}
    path = case / "bundle.tar.gz"
    path.write_bytes(data)
    return path, f"{source.name}: {how}" + (" (with the device's key)" if keys else ""), {"keys": keys}


# --- .npy inputs of `edgesdk run` ---------------------------------------------------------------------

NPY_DTYPES = ["<f2", "<f4", "<f8", ">f4", ">f8", "|i1", "|u1", "<i2", "<i4", "<i8", ">i8", "<u8", "|b1", "<c8", "<U5",
              "|S5", "|V4", "<M8[s]", "<m8[s]", "<f16"]


def _npy_header(descr, fortran, shape, version=(1, 0), extra: str = "") -> bytes:
    text = "{'descr': %s, 'fortran_order': %s, 'shape': %s, %s}" % (descr, fortran, shape, extra)
    head = text.encode("latin-1", "replace")
    size = 4 if version[0] >= 2 else 2
    pad = (-(6 + 2 + size + len(head) + 1)) % 64
    head = head + b" " * pad + b"\n"
    return b"\x93NUMPY" + bytes(version) + len(head).to_bytes(size, "little") + head


class _Opener:
    """A pickle that, if ever loaded, creates `marker` (np.load must never unpickle: allow_pickle is off)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _hostile_array(rng, name: str):
    import numpy as np

    shape, dtype = BUNDLE_INPUTS[name]
    wrong_shape = rng.random() < 0.2
    if wrong_shape:
        shape = rng.choice([(), (0,), (16,), (16, 1), (1, 16, 1), (2, 16), (1, 3), (0, 16), (1, 1, 1, 1)])
    dtype = rng.choice(NPY_DTYPES) if rng.random() < 0.5 else dtype
    dt = np.dtype(dtype)
    if dt.kind in "fc":
        special = rng.choice([np.nan, np.inf, -np.inf, 3.5e38, 1e300, -0.0, 5e-324, 65504.0, 70000.0, 1.0])
        values = np.random.default_rng(rng.getrandbits(32)).uniform(-1, 1, shape)
        if values.size:
            values.flat[rng.randrange(values.size)] = special
        how = f"{dtype} {shape} holding {special}"
    elif dt.kind in "iu":
        special = rng.choice([-11, -10, 9, 10, 2**24 + 1, 2**31, 2**62, -(2**63), 2**64 - 1, 0])
        values = np.zeros(shape, np.float64).astype(object)
        if values.size:
            values.flat[rng.randrange(values.size)] = special
        how = f"{dtype} {shape} holding {special}"
    else:
        values = np.zeros(shape)
        how = f"{dtype} {shape}"
    try:
        with np.errstate(all="ignore"):
            array = np.asarray(values).astype(dt)
    except (OverflowError, ValueError, TypeError):
        array = np.zeros(shape, dt)
    if rng.random() < 0.2 and array.ndim >= 2:
        array = np.asfortranarray(array)
        how += ", fortran order"
    return array, how


def gen_npy(rng, seeds, case, deep):
    import numpy as np

    name = rng.choice(sorted(BUNDLE_INPUTS))
    path = case / f"{name}.npy"
    kind = rng.choice(["array", "array", "array", "header", "header", "bytes", "other"])
    if kind == "array":
        array, how = _hostile_array(rng, name)
        np.save(path, array)
    elif kind == "header":
        shape, dtype = BUNDLE_INPUTS[name]
        data = np.zeros(shape, dtype).tobytes()
        descr, fortran, shape_text, version, extra = repr(dtype), "False", repr(shape), (1, 0), ""
        what = rng.choice(["descr", "fortran", "shape", "version", "extra", "length", "magic", "short-data",
                           "object", "pickle", "literal"])
        if what == "descr":
            descr = rng.choice(["'zz'", "'<f4'", "'|O'", "[('a', '<f4')]", "('<f4', (16,))", "'<f4' + 1", "None",
                                "'<U2147483647'", "'V1000000000'", "{'names': ['a'], 'formats': ['<f4']}", "'>f999'"])
        elif what == "fortran":
            fortran = rng.choice(["True", "'yes'", "None", "1"])
        elif what == "shape":
            shape_text = rng.choice(["(2**62,)", "(-1, 16)", "(1.5,)", "'abc'", "(1, 16, " + "1, " * 100 + ")",
                                     "(9223372036854775807, 2)", "(0, 2**62)", "()", "[1, 16]", "(1, -16)"])
        elif what == "version":
            version = rng.choice([(2, 0), (3, 0), (9, 9), (0, 0), (1, 9)])
        elif what == "extra":
            extra = rng.choice(["'fz': 1", "'descr': '<i8'", "'shape': ()"])
        elif what == "object":
            descr, data = "'|O'", b"\x80\x03" + bytes(64)
        elif what == "pickle":  # an object array whose pickle would create a file if it were ever loaded
            import pickle
            descr, shape_text = "'|O'", "(1,)"
            data = pickle.dumps(np.array([_Opener(str(case / "unpickled"))], dtype=object), protocol=3)
        elif what == "literal":
            descr = rng.choice(["__import__('os').getcwd()", "'<f4'}; x = {", "(lambda: 1)()"])
        head = _npy_header(descr, fortran, shape_text, version, extra)
        if what == "length":
            head = head[:8] + rng.choice([b"\xff\xff", b"\x00\x00", b"\x10\x00"]) + head[10:]
        elif what == "magic":
            head = rng.choice([b"\x93NUMPZ", b"NUMPY\x93", b"\x00" * 6]) + head[6:]
        elif what == "short-data":
            data = data[:rng.randrange(len(data))]
        path.write_bytes(head + data)
        how = f"header: {what}"
    elif kind == "bytes":
        data, how = damage(rng, seeds.npy[name].read_bytes(), seeds.splices)
        path.write_bytes(data)
    else:
        how = rng.choice(["npz", "text", "empty", "directory", "missing", "pickle-file", "npy-of-npz"])
        if how == "npz":
            np.savez(path.with_suffix(".npz"), x=np.zeros(BUNDLE_INPUTS[name][0], BUNDLE_INPUTS[name][1]))
            path = path.with_suffix(".npz")
        elif how == "text":
            path.write_text("1 2 3\n")
        elif how == "empty":
            path.write_bytes(b"")
        elif how == "directory":
            path.mkdir()
        elif how == "pickle-file":
            import pickle
            path.write_bytes(pickle.dumps(_Opener(str(case / "unpickled"))))
        elif how == "npy-of-npz":
            np.savez(case / "inner.npz", x=np.zeros(1))
            path.write_bytes((case / "inner.npz").read_bytes())
            (case / "inner.npz").unlink()
    # the other input is valid; the given form varies: NAME=FILE, FILE alone (two inputs: a usage error)
    inputs = {n: str(seeds.npy[n]) for n in BUNDLE_INPUTS}
    inputs[name] = str(path)
    specs = [f"{n}={p}" for n, p in inputs.items()]
    form = rng.random()
    if form < 0.05:
        specs = [str(path)]
    elif form < 0.1:
        specs.append(f"fz_unknown={path}")
    elif form < 0.15:
        specs = specs[:1]
    return path, f"input {name}: {how}", {"inputs": specs, "archive": rng.random() < 0.1}


# --- --calib and --eval directories ---------------------------------------------------------------------

CALIB_INPUT = {"name": "x", "shape": [1, 3, 8, 8], "dtype": "float32"}
PNG_SIZES = [(0, 0), (1, 1), (8, 8), (65535, 1), (20000, 20000), (10000, 10000), (2**31 - 1, 2**31 - 1), (2**32 - 1, 2)]
LABELS = [b"0\n", b"1\n2\n", b"\xff\xfe1\n", b"1\x00\n", b"cat\n", b"99999999999999999999\n", b"-9223372036854775809\n",
          b"9" * 5000 + b"\n", b"# only a comment\n", b"", b"1_000\n", "\u0663\n".encode(), b"1e3\n", b" -3 \n" * 1000]


def _png(width: int, height: int, data: bytes = b"\0" * 64) -> bytes:
    """A PNG declaring `width` x `height` RGB pixels, whatever its data holds."""
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(data)) + chunk(b"IEND", b""))


def _npz_case(rng, seeds, path: Path) -> str:
    """An .npz whose member for the input is damaged, mislabelled or declares more than it holds."""
    what = rng.choice(["bytes", "header", "name", "method", "sizes", "compressed", "extra"])
    shape, dtype = tuple(CALIB_INPUT["shape"]), CALIB_INPUT["dtype"]
    if what == "bytes":
        data, how = damage(rng, seeds.calib[".npz"].read_bytes(), seeds.splices)
        path.write_bytes(data)
        return f"npz: {how}"
    if what == "sizes":  # the local header's or the central directory's sizes of the member changed
        data = bytearray(seeds.calib[".npz"].read_bytes())
        at = rng.choice([18, 22, data.rfind(b"PK\x01\x02") + 20, data.rfind(b"PK\x01\x02") + 24])
        data[at:at + 4] = struct.pack("<I", rng.choice([0, 1, 2**31, 2**32 - 1]))
        path.write_bytes(bytes(data))
        return f"npz: a size field at {at} changed"
    if what == "method":  # a compression method zipfile does not know, or the encrypted flag
        data = bytearray(seeds.calib[".npz"].read_bytes())
        at, value = rng.choice([(8, struct.pack("<H", 99)), (6, struct.pack("<H", 1))])
        data[at:at + 2] = value
        central = data.rfind(b"PK\x01\x02")
        data[central + at + 2:central + at + 4] = value
        path.write_bytes(bytes(data))
        return f"npz: header field at {at} set to {value.hex()}"
    member, body = "x.npy", None
    if what == "header":
        shape_text = rng.choice(["(2**40, 3, 8, 8)", "(1, 3, 8, 8)", "(-1, 3, 8, 8)", "(0, 3, 8, 8)", "(9223372036854775807,)"])
        body = _npy_header(repr(dtype), "False", shape_text) + bytes(rng.choice([0, 16, 768]))
    elif what == "name":
        member = rng.choice(["x", "X.npy", "../x.npy", "/x.npy", "x.npy/", "x.npy\x00"])
    body = body if body is not None else seeds.calib[".npy"].read_bytes()
    method = zipfile.ZIP_DEFLATED if what == "compressed" else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", method) as z:
        if what == "compressed":  # a member declaring much more than the file it comes in
            with z.open("x.npy", "w", force_zip64=True) as m:
                m.write(_npy_header(repr(dtype), "False", repr((rng.choice([64, 2**20]),) + shape[1:])))
                for _ in range(rng.choice([1, 64])):
                    m.write(bytes(1 << 20))
            return "npz: a compressed member of zeros"
        z.writestr(member, body)
        if what == "extra":
            with warnings.catch_warnings():  # a second member of the same name is the point
                warnings.simplefilter("ignore")
                z.writestr(rng.choice(["x.npy", "y.npy", "x"]), rng.randbytes(64))
    return f"npz: member {member!r}, {what}"


def _calib_file(rng, seeds, case: Path, family: str, k: int) -> str:
    """One sample file of the directory `case`, of `family` ("numpy" or "image"); what it is."""
    import numpy as np

    kind = rng.choice(["seed", "bytes", "bytes", "structure", "structure", "special"])
    suffix = rng.choice([".npy", ".npz", ".NPY"]) if family == "numpy" else rng.choice([".png", ".jpg", ".PNG"])
    path = case / f"s{k}{suffix}"
    if kind == "special":
        what = rng.choice(["fifo", "zero", "directory", "dangling", "loop", "empty", "link"])
        if what == "fifo":
            os.mkfifo(path)
        elif what == "zero":
            path.symlink_to("/dev/zero")
        elif what == "directory":
            path.mkdir()
        elif what == "dangling":
            path.symlink_to(case / "nowhere")
        elif what == "loop":
            path.symlink_to(path)
        elif what == "empty":
            path.write_bytes(b"")
        else:  # a link to a valid sample
            path.symlink_to(seeds.calib[".png" if family == "image" else ".npy"])
        return f"{path.name}: {what}"
    if kind == "seed":
        source = seeds.calib[".png"] if family == "image" else seeds.calib[path.suffix.lower()]
        shutil.copyfile(source, path)
        return f"{path.name}: the seed"
    if kind == "bytes":
        source = seeds.calib[".png"] if family == "image" else seeds.calib[".npz" if "z" in path.suffix.lower() else ".npy"]
        data, how = damage(rng, source.read_bytes(), seeds.splices)
        path.write_bytes(data)
        return f"{path.name}: {how}"
    if family == "image":
        width, height = rng.choice(PNG_SIZES)
        path.write_bytes(_png(width, height, rng.choice([b"\0" * 64, b"", rng.randbytes(256)])))
        return f"{path.name}: a PNG declaring {width}x{height}"
    if path.suffix.lower() == ".npz":
        return f"{path.name}: {_npz_case(rng, seeds, path)}"
    if rng.random() < 0.5:
        shape = rng.choice([(1, 3, 8, 8), (4, 1, 3, 8, 8), (2, 3, 8, 8), (3, 8, 8), (), (0, 3, 8, 8), (1, 8, 8, 3)])
        dtype = rng.choice(NPY_DTYPES)
        try:
            array = np.zeros(shape, np.dtype(dtype))
        except (TypeError, ValueError):
            array = np.zeros(shape)
        np.save(path, array)
        return f"{path.name}: {dtype} {shape}"
    shape_text = rng.choice(["(2**40, 3, 8, 8)", "(1, 3, 8, 2**40)", "(-1, 3, 8, 8)", "(1, 3, 8, 8)", "(4, 1, 3, 8, 8)"])
    descr = rng.choice(["'<f4'", "'|O'", "'<U5'", "'>f8'", "[('a', '<f4')]"])
    data = bytes(rng.choice([0, 32, 768, 3072]))
    path.write_bytes(_npy_header(descr, "False", shape_text, rng.choice([(1, 0), (2, 0), (3, 0)])) + data)
    return f"{path.name}: header {descr} {shape_text}, {len(data)} bytes of data"


def gen_calib(rng, seeds, case, deep):
    """A `--calib` directory of one to three samples of one family (numpy files or images), each a seed,
    damaged or not a regular file; for half the cases an `--eval` directory, with a labels.txt that may
    be hostile too (or a FIFO)."""
    family = rng.choice(["numpy", "numpy", "image"])
    how = [_calib_file(rng, seeds, case, family, k) for k in range(rng.choice([1, 1, 2, 3]))]
    # a preprocessing that does not fit is refused before any image is read: one case in ten
    options = {"eval": rng.random() < 0.5,
               "preprocess": rng.choice([None] * 6 + ["scale=1/255", "layout=NHWC", "mean=0.5:0.5", "color=GRAY"])}
    if options["eval"]:
        if rng.random() < 0.05:
            os.mkfifo(case / "labels.txt")
            how.append("labels.txt: fifo")
        elif rng.random() < 0.9:
            labels = rng.choice(LABELS)
            (case / "labels.txt").write_bytes(labels)
            how.append(f"labels.txt: {_short(labels)}")
    return case, "; ".join(how), options


GENERATORS: dict[str, Callable] = {
    "onnx": gen_onnx, "tflite": gen_tflite, "keras": gen_keras, "savedmodel": gen_savedmodel, "target": gen_target,
    "manifest": gen_manifest, "bundle": gen_bundle, "npy": gen_npy, "calib": gen_calib,
}


# --- the worker: one case at a time, in its own process ------------------------------------------

class _Found(Exception):
    """A finding the worker noticed without an exception of the loader's (an exit 3, a leftover)."""

    def __init__(self, kind: str, summary: str, detail: str = ""):
        super().__init__(summary)
        self.kind, self.summary, self.detail = kind, summary, detail


class Worker:
    """What runs in the worker process: the loaders, and the checks around every case."""

    def __init__(self, seeds: Seeds, tmp: Path):
        from edgesdk.frontends import conversion

        self.seeds, self.tmp = seeds, tmp
        self.converter_runs = 0
        run_child = conversion._run_child

        def counted(*args, **kwargs):  # how many cases reached the converter child
            self.converter_runs += 1
            return run_child(*args, **kwargs)
        conversion._run_child = counted
        # onnxruntime's telemetry SDK writes its session file, TMPDIR/.ses, when onnxruntime is first imported
        # in a process (whoever imports it): imported before any case, that file is no case's leftover
        import onnxruntime  # noqa: F401

        (tmp / ".ses").unlink(missing_ok=True)
        self.loaders = {"onnx": self.model, "tflite": self.model, "keras": self.model, "savedmodel": self.model,
                        "target": self.target, "manifest": self.manifest, "bundle": self.bundle, "npy": self.npy,
                        "calib": self.calib}
        self.seed_state = _state(seeds.root)

    def case(self, request: dict) -> dict:
        loader, path, case = request["loader"], Path(request["input"]), Path(request["case"])
        before = _state(case)
        runs = self.converter_runs
        try:
            code = self.loaders[loader](path, case, request["options"])
            reply = {"outcome": "accepted" if code is None else "refused", "code": code}
        except _Found as f:
            reply = {"outcome": "finding", "kind": f.kind, "summary": f.summary, "detail": f.detail}
        except BaseException as e:  # noqa: BLE001 - that is what a finding is
            reply = {"outcome": "finding", "kind": "exception", "summary": f"{type(e).__name__}: {str(e)[:300]}",
                     "detail": traceback.format_exc()}
        left = self._left_behind(case, before)
        if left and reply["outcome"] != "finding":
            reply = {"outcome": "finding", "kind": "leftover", "summary": left.splitlines()[0], "detail": left}
        reply["converter_runs"] = self.converter_runs - runs
        return reply

    def _left_behind(self, case: Path, before: dict) -> str:
        """What the case left (in TMPDIR, the working directory, its case directory) or changed (its
        input, a seed): one line each. TMPDIR and the working directory are emptied again."""
        lines = []
        for where in (self.tmp, Path.cwd()):
            for p in sorted(where.iterdir()):
                lines.append(f"left in {where}: {p.name}")
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
        after = _state(case)
        lines += [f"left in the case directory: {p}" for p in sorted(set(after) - set(before))]
        lines += [f"changed: {p}" for p in sorted(set(before) & set(after)) if before[p] != after[p]]
        lines += [f"removed: {p}" for p in sorted(set(before) - set(after))]
        seeds = _state(self.seeds.root)
        if seeds != self.seed_state:
            lines += [f"a seed changed: {p}" for p in sorted({*seeds, *self.seed_state})
                      if seeds.get(p) != self.seed_state.get(p)]
            self.seed_state = seeds
        return "\n".join(lines)

    # each loader returns None (accepted) or the code of the typed error that refused the input

    def model(self, path: Path, case: Path, options: dict) -> str | None:
        """`edgesdk build MODEL --until import`: read (or convert), canonical graph, optimizations."""
        from edgesdk.errors import EdgeSDKError
        from edgesdk.pipeline import BuildOptions, build

        out = case / "out"
        try:
            build(BuildOptions(model=path, target="x86", out=out, until="import"))
        except EdgeSDKError as e:
            if out.exists():
                raise _Found("leftover", f"a refused build ({e.code}) left {out}") from None
            return e.code
        shutil.rmtree(out)
        return None

    def target(self, path: Path, case: Path, options: dict) -> str | None:
        """`load_target`; an accepted target is used: its digest, its devices, and for one case in four a
        build of the tiny seed model through `schedule` for it."""
        from edgesdk.config import load_target
        from edgesdk.errors import EdgeSDKError
        from edgesdk.pipeline import BuildOptions, build

        try:
            target, _ = load_target(path)
        except EdgeSDKError as e:
            return e.code
        target.digest()
        target.device_map()
        if options.get("deep"):
            out = case / "out"
            try:
                build(BuildOptions(model=self.seeds.root / "onnx" / "tiny.onnx", target=str(path), out=out,
                                   until="schedule", cpu_backends=("planned",)))
            except EdgeSDKError as e:
                shutil.rmtree(out, ignore_errors=True)
                return f"schedule: {e.code}"
            shutil.rmtree(out)
        return None

    def manifest(self, path: Path, case: Path, options: dict) -> str | None:
        """`Manifest.from_json`; an accepted manifest goes into a copy of the seed bundle, which
        `edgesdk inspect` and `edgesdk run` must then report on with exit 0, 1 or 2."""
        from edgesdk.runtime.manifest import Manifest, ManifestError

        try:
            Manifest.from_json(path.read_bytes())
        except ManifestError:
            return "ManifestError"
        bundle = case / "bundle"
        shutil.copytree(self.seeds.bundle, bundle)
        shutil.copyfile(path, bundle / "manifest.json")
        try:
            _cli(["inspect", str(bundle)])
            _cli(["run", str(bundle), *self._inputs()])
        finally:
            shutil.rmtree(bundle)
        return None

    def bundle(self, path: Path, case: Path, options: dict) -> str | None:
        """The device's read of the archive's manifest and signature (`signed_manifest`), then `edgesdk
        verify --no-selftest` (with the device's key for half the cases): unpacked, every file hashed."""
        from edgesdk.errors import EdgeSDKError
        from edgesdk.runtime.trust import load_public_key
        from edgesdk.runtime.unpack import UnpackError, signed_manifest
        from edgesdk.verify import verify

        try:
            signed_manifest(path)
        except UnpackError:
            pass
        keys = [load_public_key(self.seeds.public_key)] if options.get("keys") else None
        try:
            verify(path, run_selftest=False, keys=keys)
        except EdgeSDKError as e:
            return e.code
        return None

    def npy(self, path: Path, case: Path, options: dict) -> str | None:
        """`edgesdk run BUNDLE --input NAME=FILE.npy ...` (the bundle directory, or for one case in ten
        its archive)."""
        bundle = self.seeds.archives[0] if options.get("archive") else self.seeds.bundle
        code = _cli(["run", str(bundle), *(a for spec in options["inputs"] for a in ("--input", spec))])
        return None if code == 0 else f"exit {code}"

    def calib(self, path: Path, case: Path, options: dict) -> str | None:
        """`--calib DIR` as legalize, compress and package read it (`load_calibration`), or for half the
        cases `--eval DIR` (`load_labelled`: its samples, then labels.txt)."""
        from types import SimpleNamespace

        from edgesdk.errors import EdgeSDKError
        from edgesdk.ir.calibration import load_calibration, load_labelled

        try:
            if options["eval"]:
                load_labelled(path, [CALIB_INPUT], options["preprocess"])
            else:
                load_calibration(SimpleNamespace(calib=path, calib_samples=32, seed=0,
                                                 calib_preprocess=options["preprocess"]), [CALIB_INPUT])
        except EdgeSDKError as e:
            return e.code
        return None

    def _inputs(self) -> list[str]:
        return [a for name, p in self.seeds.npy.items() for a in ("--input", f"{name}={p}")]


def _cli(argv: list[str]) -> int:
    """`edgesdk ARGV` in this process, its output kept; exit 0, 1 or 2, else a finding (run again with
    --debug for the traceback)."""
    from edgesdk.cli import main

    # as a terminal's streams encode: stdout strictly (an unencodable character raises), stderr with escapes
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace", write_through=True)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    if code in (0, 1, 2):
        return code
    detail = err.buffer.getvalue().decode()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            main(["--debug", *argv])
    except BaseException:  # noqa: BLE001 - the traceback of the internal error
        detail += "\n" + traceback.format_exc()
    first = next((line for line in detail.splitlines() if line.startswith("error:")), f"exit {code}")
    raise _Found(f"exit-{code}", f"edgesdk {argv[0]}: exit {code}: {first[:300]}", detail)


def _state(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under `root` with its size and modification time (a link: its target's length)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns)
    return out


def worker_main(fd: int, seeds_root: str, tmp: str) -> None:
    import faulthandler
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))
    faulthandler.enable()  # a native crash writes the Python stack to the log the parent reads
    tempfile.tempdir = tmp
    worker = Worker(Seeds(Path(seeds_root)), Path(tmp))
    with socket.socket(fileno=fd) as sock, sock.makefile("rwb") as stream:
        for line in stream:
            request = json.loads(line)
            print(f"--- case {request['loader']} {request['index']}", file=sys.stderr, flush=True)
            faulthandler.dump_traceback_later(request["timeout"] - 5, exit=False)
            reply = worker.case(request)
            faulthandler.cancel_dump_traceback_later()
            stream.write(json.dumps(reply).encode() + b"\n")
            stream.flush()


# --- the runner ------------------------------------------------------------------------------------

class Session:
    """One fuzz run: a directory holding the seeds, the cases and the worker's TMPDIR and working
    directory; the worker; findings saved under `findings`. `close()` removes the directory and
    returns what the run left in the system's temporary directory (names our loaders or inputs use)."""

    def __init__(self, findings: Path, base: Path | None = None):
        self.findings = Path(findings)
        self.system_tmp = Path(tempfile.gettempdir())
        self.tmp_before = _ours(self.system_tmp)
        self.dir = Path(tempfile.mkdtemp(prefix="edgesdk-fuzz-", dir=base))
        self.log = self.dir / "worker.log"
        self.tmp, self.cwd = self.dir / "tmp", self.dir / "cwd"
        self.tmp.mkdir()
        self.cwd.mkdir()
        t0 = time.perf_counter()
        try:
            self.seeds = make_seeds(self.dir / "seeds", self.log)
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self.seeds_seconds = time.perf_counter() - t0
        self._process: subprocess.Popen | None = None
        self._stream = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, loader: str, count: int, seed: int, *, start: int = 0) -> Counts:
        """Cases start..start+count-1 of `loader` under `seed`."""
        counts = Counts(loader)
        t0 = time.perf_counter()
        for index in range(start, start + count):
            self._case(loader, seed, index, counts)
        counts.seconds = time.perf_counter() - t0
        return counts

    def _case(self, loader: str, seed: int, index: int, counts: Counts) -> None:
        rng = random.Random(f"{seed}/{loader}/{index}")
        case = self.dir / "cases" / f"{loader}-{index}"
        case.mkdir(parents=True)
        # a TensorFlow-format case reaches the converter one in DEEP_EVERY; a target is built one in four
        deep = index % (DEEP_EVERY if loader in TF_LOADERS else 4 if loader == "target" else 1) == 0
        path, mutation, options = GENERATORS[loader](rng, self.seeds, case, deep)
        timeout = TIMEOUT_S.get(loader, DEFAULT_TIMEOUT_S)
        request = {"loader": loader, "index": index, "input": str(path), "case": str(case), "options": options,
                   "timeout": timeout}
        reply = self._ask(request, timeout)
        counts.inputs += 1
        counts.converter_runs += reply.get("converter_runs", 0)
        if reply["outcome"] == "accepted":
            counts.accepted += 1
        elif reply["outcome"] == "refused":
            counts.refused += 1
            counts.codes[reply["code"]] += 1
        else:
            finding = Finding(loader, seed, index, reply["kind"], reply["summary"], reply["detail"], mutation)
            finding.saved = self._save(finding, case)
            counts.findings.append(finding)
        shutil.rmtree(case, ignore_errors=True)

    def _ask(self, request: dict, timeout: float) -> dict:
        """The worker's reply; a dead worker (crash) or one that does not answer in time (hang) is a
        finding, and a fresh worker takes the next case."""
        if self._process is None:
            self._start()
        log_at = self.log.stat().st_size
        self._socket.settimeout(timeout)
        try:
            self._stream.write(json.dumps(request).encode() + b"\n")
            self._stream.flush()
            line = self._stream.readline()
        except (TimeoutError, socket.timeout):
            self._stop()
            return {"outcome": "finding", "kind": "hang", "summary": f"no answer in {timeout} s",
                    "detail": _tail(self.log, 8000, log_at)}
        except OSError:
            line = b""
        if not line:
            code = self._process.wait()
            self._stop()
            how = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
            return {"outcome": "finding", "kind": "crash", "summary": f"the worker died ({how})",
                    "detail": _tail(self.log, 8000, log_at)}
        return json.loads(line)

    def _start(self) -> None:
        parent, child = socket.socketpair()
        with open(self.log, "ab") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "tests.fuzz.harness", "worker", str(child.fileno()), str(self.seeds.root),
                 str(self.tmp)], pass_fds=[child.fileno()], cwd=self.cwd, env=_child_env(self.tmp),
                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        child.close()
        self._socket = parent
        self._stream = parent.makefile("rwb")

    def _stop(self) -> None:
        """Kill the worker and the converter children it started (each leads its own session)."""
        if self._process is None:
            return
        for pid in _children(self._process.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self._process.kill()
        self._process.wait()
        self._stream.close()
        self._socket.close()
        self._process = self._stream = None

    def _save(self, finding: Finding, case: Path) -> Path:
        dest = self.findings / f"{finding.loader}-{finding.seed}-{finding.index}"
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(case, dest / "input", symlinks=True, ignore_dangling_symlinks=True, ignore=_special_files)
        (dest / "finding.txt").write_text(
            f"loader: {finding.loader}\nseed: {finding.seed}\nindex: {finding.index}\nkind: {finding.kind}\n"
            f"input: {finding.mutation}\nsummary: {finding.summary}\n\n{finding.detail}\n")
        return dest

    def close(self) -> list[str]:
        """Stop the worker, remove the session's directory; what was left in the system's temporary
        directory since the session began."""
        if self._process is not None:
            self._stream.close()  # EOF: the worker's loop ends
            self._socket.close()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        shutil.rmtree(self.dir, ignore_errors=True)
        left = _ours(self.system_tmp) - self.tmp_before
        if left:  # another job's build may hold one for a moment: only what stays counts
            time.sleep(2)
            left &= _ours(self.system_tmp)
        return sorted(str(path) for path in left)


def _special_files(folder: str, names: list[str]) -> list[str]:
    """What copying a case leaves out: a FIFO, a socket or a device (a link is copied as a link)."""
    special = []
    for name in names:
        mode = os.lstat(os.path.join(folder, name)).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            special.append(name)
    return special


def _ours(tmp: Path) -> set[Path]:
    """Entries of the temporary directory that edgesdk's loaders or our inputs would make, and an
    escaped archive entry in the system's /tmp (where an absolute entry would land; the edgesdk-
    folders there belong to whatever else runs on the host)."""
    ours = {p for p in tmp.iterdir()
            if p.name.startswith(("edgesdk-", ESCAPE)) and not p.name.startswith("edgesdk-fuzz-")}
    system = Path("/tmp")
    if system.is_dir() and system.resolve() != tmp.resolve():
        ours |= {p for p in system.iterdir() if p.name.startswith(ESCAPE)}
    return ours


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(stat.parent.name))
    return out


def _tail(path: Path, chars: int, start: int = 0) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read()
    except OSError:
        return ""
    return data[-chars:].decode(errors="replace")


def run(loader: str, count: int, seed: int, findings: Path, *, session: Session | None = None) -> Counts:
    """`count` cases of `loader` under `seed`, findings (and their inputs) saved under `findings`; a
    session of its own unless one is given (seeds are made once per session)."""
    if session is not None:
        return session.run(loader, count, seed)
    with Session(findings) as own:
        return own.run(loader, count, seed)


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker_main(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    elif sys.argv[1] == "seeds":
        part, root = sys.argv[2], Path(sys.argv[3])
        {"tensorflow": _tensorflow_seeds, "bundle": _bundle_seeds}[part](root)
