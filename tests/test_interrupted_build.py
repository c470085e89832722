"""A build stopped from outside: Ctrl-C exits 130 with a message and leaves no bundle; a SIGKILL while
the bundle is being put in place never leaves a bundle/ and a bundle.tar.gz of different builds.
Tiny two-node models, so each build takes seconds."""

from __future__ import annotations

import gzip
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.model_zoo import ROOT


def tiny_model(path: Path, seed: int) -> Path:
    w = numpy_helper.from_array(np.random.default_rng(seed).standard_normal((16, 4)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                          f"tiny{seed}", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    onnx.save(m, str(path))
    return path


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "sdk")}


def _default_sigint() -> None:
    # a child started from a shell without job control inherits SIGINT ignored; a user's terminal
    # delivers it, so restore the default and Python installs its KeyboardInterrupt handler
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_a_build_exits_130_and_leaves_no_bundle(tmp_path):
    model = tiny_model(tmp_path / "a.onnx", 0)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "edgesdk.cli", "build", str(model), "-t", "x86", "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            preexec_fn=_default_sigint)
    lines = []
    for line in proc.stderr:  # wait until the package stage compiles, then press Ctrl-C
        lines.append(line)
        if "package ..." in line:
            proc.send_signal(signal.SIGINT)
            break
    lines += proc.stderr.readlines()
    proc.wait(timeout=300)
    stderr = "".join(lines)
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "error: interrupted"
    assert "Traceback" not in stderr
    assert not (out / "bundle").exists() and not (out / "bundle.tar.gz").exists()
    assert not list((out / ".build").glob(".*.tmp"))  # the interrupted stage's temporary directory is gone


KILLER = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from edgesdk.pipeline import BuildOptions, build

    point = sys.argv[3]
    rename, unlink = Path.rename, Path.unlink

    def killing_rename(self, target):
        result = rename(self, target)
        if point == "after-bundle-rename" and Path(target).name == "bundle":
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    def killing_unlink(self, missing_ok=False):
        result = unlink(self, missing_ok=missing_ok)
        if point == "after-tarball-removal" and self.name == "bundle.tar.gz":
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    Path.rename, Path.unlink = killing_rename, killing_unlink
    build(BuildOptions(model=Path(sys.argv[1]), target="x86", out=Path(sys.argv[2])))
""")


def _manifest_in_tarball(path: Path) -> dict:
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(path.read_bytes()))) as tar:
        return json.load(tar.extractfile("bundle/manifest.json"))


@pytest.mark.parametrize("point", ["after-tarball-removal", "after-bundle-rename"])
def test_a_killed_build_never_pairs_a_bundle_with_another_builds_tarball(tmp_path, point):
    from edgesdk.pipeline import BuildOptions, build

    out = tmp_path / "out"
    build(BuildOptions(model=tiny_model(tmp_path / "a.onnx", 0), target="x86", out=out))
    first = json.loads((out / "bundle" / "manifest.json").read_text())["model"]["sha256"]
    second_model = tiny_model(tmp_path / "b.onnx", 1)
    proc = subprocess.run([sys.executable, "-c", KILLER, str(second_model), str(out), point], env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    bundle = out / "bundle" / "manifest.json"
    tar = out / "bundle.tar.gz"
    if bundle.exists() and tar.exists():
        assert json.loads(bundle.read_text()) == _manifest_in_tarball(tar)
    shas = {json.loads(bundle.read_text())["model"]["sha256"]} if bundle.exists() else set()
    assert shas <= {first, onnx_sha(second_model)}
    if point == "after-bundle-rename":  # the new bundle is in place, the previous tarball is gone
        assert shas == {onnx_sha(second_model)} and not tar.exists()


def onnx_sha(path: Path) -> str:
    from edgesdk.ir.digest import file_sha256

    return file_sha256(path)
