"""Damaged files of every format: `load` returns a model or raises UserError, nothing else, and
never crashes the calling process (TensorFlow's native crashes stay in the converter child).

Each TensorFlow-format example costs a converter process (~3 s, mostly importing TensorFlow, twice that
while the suite's other process runs) unless the parent's container checks refuse it first, so those
formats get few examples here; ONNX is read in-process and gets many. `make fuzz` (benchmarks/fuzz.py)
sends over 10,000 hostile inputs through every loader.
"""

from __future__ import annotations

import shutil
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from edgesdk import frontends
from edgesdk.errors import UserError

TF_EXAMPLES = 3
ONNX_EXAMPLES = 40

# A truncation point, or a few (offset, xor) byte edits; offsets are taken modulo the file size.
damage = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, 1 << 20)),
    st.tuples(st.just("mutate"), st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 255)),
                                          min_size=1, max_size=6, unique_by=lambda edit: edit[0])),
)


def _damaged(data: bytes, how) -> bytes:
    kind, arg = how
    if kind == "truncate":
        return data[: arg % len(data)]
    out = bytearray(data)
    for offset, xor in arg:  # xor with a non-zero byte: every edit changes the file
        out[offset % len(out)] ^= xor
    return bytes(out)


def _load_damaged(source: Path, how, member: str | None = None) -> str:
    """Copy `source`, damage it (or, for a directory or a .keras zip, its `member`), load it."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / source.name
        if source.is_dir():
            shutil.copytree(source, path)
            (path / member).write_bytes(_damaged((source / member).read_bytes(), how))
        elif member is not None:  # rewrite the zip so its CRCs hold: the damage reaches Keras itself
            with zipfile.ZipFile(source) as src, zipfile.ZipFile(path, "w") as dst:
                for item in src.infolist():
                    data = src.read(item)
                    dst.writestr(item, _damaged(data, how) if item.filename == member else data)
        else:
            path.write_bytes(_damaged(source.read_bytes(), how))
        try:
            frontends.load(path, Path(tmp) / "work")
            return "ok"
        except UserError as e:  # anything else fails the test
            assert e.message and str(path) in e.message, e.message
            return e.code


def _onnx_file(directory: Path) -> Path:
    """Conv, an If with a Relu branch and a Neg branch, an initializer: enough structure for
    damage to land in node lists, attributes, subgraphs and tensors."""
    rng = np.random.default_rng(0)
    branch_out = helper.make_tensor_value_info("b", TensorProto.FLOAT, [1, 4, 6, 6])
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["h"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("If", ["c"], ["y"], name="cond",
                         then_branch=helper.make_graph([helper.make_node("Relu", ["h"], ["b"])], "t", [], [branch_out]),
                         else_branch=helper.make_graph([helper.make_node("Neg", ["h"], ["b"])], "e", [], [branch_out])),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6]),
         helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])],
        initializer=[numpy_helper.from_array(rng.normal(size=(4, 3, 3, 3)).astype(np.float32), "w")])
    path = directory / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory) -> Path:
    return _onnx_file(tmp_path_factory.mktemp("fuzz-onnx"))


def _fuzz_settings(examples: int):
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@_fuzz_settings(ONNX_EXAMPLES)
@given(how=damage)
def test_damaged_onnx(onnx_file, how):
    _load_damaged(onnx_file, how)


@pytest.mark.slow
@_fuzz_settings(TF_EXAMPLES)
@given(how=damage)
def test_damaged_keras(conv_net_files, how):
    _load_damaged(conv_net_files["keras"], how)


@pytest.mark.slow
@_fuzz_settings(TF_EXAMPLES // 2)
@given(how=damage, member=st.sampled_from(["config.json", "model.weights.h5"]))
def test_damaged_keras_member(conv_net_files, how, member):
    """Damage inside the archive, with valid CRCs: the zip check passes and Keras reads it."""
    _load_damaged(conv_net_files["keras"], how, member=member)


@pytest.mark.slow
@_fuzz_settings(TF_EXAMPLES)
@given(how=damage)
def test_damaged_h5(conv_net_files, how):
    _load_damaged(conv_net_files["h5"], how)


@pytest.mark.slow
@_fuzz_settings(TF_EXAMPLES)
@given(how=damage)
def test_damaged_tflite(conv_net_files, how):
    _load_damaged(conv_net_files["int8-per-channel"], how)


@pytest.mark.slow
@_fuzz_settings(TF_EXAMPLES)
@given(how=damage)
def test_damaged_savedmodel(conv_net_files, how):
    _load_damaged(conv_net_files["savedmodel"], how, member="saved_model.pb")
