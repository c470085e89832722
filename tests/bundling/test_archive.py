"""The bundle's tarball: the same bytes for the same files, and a model's weights stored rather than
gzipped past `archive.STORED_FROM` (gzip shrinks float bytes by a few percent at 30 MB/s)."""

from __future__ import annotations

import gzip
import shutil
import subprocess
import tarfile

import numpy as np

from edgesdk.bundling import archive


def _bundle(root, weights_bytes: int):
    bundle = root / "bundle"
    (bundle / "segments").mkdir(parents=True)
    (bundle / "manifest.json").write_text('{"a": 1}\n' * 2000)  # compresses well
    rng = np.random.default_rng(0)
    (bundle / "segments" / "s0.onnx").write_bytes(b"graph" * 1000)
    (bundle / "segments" / "s0.onnx.data").write_bytes(rng.standard_normal(weights_bytes // 4).astype(np.float32).tobytes())
    return bundle


def _members(path) -> dict[str, bytes]:
    with tarfile.open(path, "r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_weights_are_stored_and_the_tarball_reads_back_the_same_files(tmp_path, monkeypatch):
    monkeypatch.setattr(archive, "STORED_FROM", 1 << 20)
    bundle = _bundle(tmp_path, 4 << 20)
    dest = tmp_path / "bundle.tar.gz"
    archive.write_tarball(bundle, dest)
    got = _members(dest)
    assert got == {f"bundle/{p.relative_to(bundle).as_posix()}": p.read_bytes() for p in bundle.rglob("*") if p.is_file()}
    raw = dest.read_bytes()
    assert raw.count(b"\x1f\x8b\x08") >= 3  # gzip members: before the weights, the weights, after them
    weights = (bundle / "segments" / "s0.onnx.data").read_bytes()
    assert weights[1 << 20:(1 << 20) + 4096] in raw  # stored: its bytes are in the file as they are
    assert len(gzip.decompress(raw)) % tarfile.RECORDSIZE == 0  # one tar stream across the members
    if shutil.which("tar"):  # as a device's shell unpacks it
        listed = subprocess.run(["tar", "tzf", str(dest)], capture_output=True, text=True, check=True).stdout.split()
        assert "bundle/segments/s0.onnx.data" in listed
    # the same files give the same bytes
    again = tmp_path / "again.tar.gz"
    archive.write_tarball(bundle, again)
    assert again.read_bytes() == raw


def test_small_weights_are_compressed_with_the_rest(tmp_path):
    bundle = _bundle(tmp_path, 1 << 20)  # below STORED_FROM
    dest = tmp_path / "bundle.tar.gz"
    archive.write_tarball(bundle, dest)
    weights = (bundle / "segments" / "s0.onnx.data").read_bytes()
    assert weights[4096:8192] not in dest.read_bytes()
    assert _members(dest)["bundle/segments/s0.onnx.data"] == weights


def test_a_scalar_is_saved_as_a_scalar(tmp_path):
    """A model's 0-d output (a golden value, a sample): np.ascontiguousarray made it shape (1,), and the self-test
    would then compare a scalar with a vector."""
    archive.savez(tmp_path / "g.npz", {"s": np.array(2.5, np.float32), "v": np.arange(3, dtype=np.float32)})
    loaded = np.load(tmp_path / "g.npz")
    assert loaded["s"].shape == () and float(loaded["s"]) == 2.5 and loaded["v"].shape == (3,)


def test_a_scalar_moved_within_its_tolerance_stays_an_array():
    """The golden run's spread moves each tensor a later segment reads within its tolerance: a 0-d one came back
    a numpy scalar, which onnxruntime refuses ("Unable to handle object of type numpy.float32"), an internal
    error of an int8 TFLite model on rtx3090."""
    from edgesdk.bundling.golden import _moved

    for tolerance in ({"abs": 0.01}, {"lsb": 1, "scale": 0.5}):
        moved = _moved(np.array(2.0, np.float32), tolerance, np.random.default_rng(0))
        assert isinstance(moved, np.ndarray) and moved.shape == () and moved.dtype == np.float32
