"""--calib DIR: the accepted layouts of samples, and clear errors for the rest."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from edgesdk.errors import UserError
from edgesdk.ir.calibration import load_calibration

INPUTS = [{"name": "x", "shape": [1, 3, 4, 4], "dtype": "float32"}]


def _opts(calib, n=100, seed=0):
    return SimpleNamespace(calib=calib, calib_samples=n, seed=seed)


def test_synthetic_is_seeded_and_said(tmp_path):
    a, info = load_calibration(_opts(None, 4), INPUTS)
    b, _ = load_calibration(_opts(None, 4), INPUTS)
    assert info["synthetic"] is True and len(a) == 4
    assert all(np.array_equal(p["x"], q["x"]) for p, q in zip(a, b))


def test_single_stacked_and_batch_stacked_samples(tmp_path):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "a.npy", rng.normal(size=(1, 3, 4, 4)))
    np.save(tmp_path / "b.npy", rng.normal(size=(5, 1, 3, 4, 4)))  # N samples along a new axis
    np.save(tmp_path / "c.npy", rng.normal(size=(2, 3, 4, 4)))  # N samples along the batch axis
    feeds, info = load_calibration(_opts(tmp_path), INPUTS)
    assert len(feeds) == 8 and info["synthetic"] is False and info["files"] == 3
    assert all(f["x"].shape == (1, 3, 4, 4) and f["x"].dtype == np.float32 for f in feeds)
    assert len(load_calibration(_opts(tmp_path, n=3), INPUTS)[0]) == 3


def test_errors_name_the_file_and_what_is_expected(tmp_path):
    np.save(tmp_path / "bad.npy", np.zeros((3, 4, 4)))
    with pytest.raises(UserError, match=r"bad.npy: array for 'x' has shape \(3, 4, 4\)"):
        load_calibration(_opts(tmp_path), INPUTS)
    with pytest.raises(UserError, match="not a directory"):
        load_calibration(_opts(tmp_path / "nope"), INPUTS)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no .npy or .npz files"):
        load_calibration(_opts(empty), INPUTS)


def test_npz_for_several_inputs(tmp_path):
    inputs = INPUTS + [{"name": "m", "shape": [1, 4], "dtype": "float32"}]
    np.savez(tmp_path / "s.npz", x=np.zeros((1, 3, 4, 4)), m=np.ones((1, 4)))
    feeds, _ = load_calibration(_opts(tmp_path), inputs)
    assert set(feeds[0]) == {"x", "m"}
    np.savez(tmp_path / "t.npz", x=np.zeros((1, 3, 4, 4)))
    with pytest.raises(UserError, match="t.npz: no array for input 'm'"):
        load_calibration(_opts(tmp_path), inputs)
