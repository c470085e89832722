"""detect() and the container checks the parent process makes before any converter runs."""

from __future__ import annotations

import shutil
import struct
import zipfile

import h5py
import numpy as np
import pytest

from edgesdk.errors import UsageError, UserError
from edgesdk.frontends import FORMATS, detect, formats


@pytest.fixture
def files(tmp_path):
    """One minimal file per container (no TensorFlow needed): what detect() and the checks see."""
    paths = {}
    paths["onnx"] = tmp_path / "m.onnx"
    paths["onnx"].write_bytes(b"\x08\x08\x12\x07tf2onnx")
    paths["keras"] = tmp_path / "m.keras"
    with zipfile.ZipFile(paths["keras"], "w", zipfile.ZIP_STORED) as z:  # as Keras writes it
        z.writestr("config.json", '{"class_name": "Functional"}' * 20)
        z.writestr("metadata.json", "{}")
    paths["h5"] = tmp_path / "m.h5"
    with h5py.File(paths["h5"], "w") as f:
        f.create_dataset("w", data=np.arange(4096, dtype=np.float32))
    paths["tflite"] = tmp_path / "m.tflite"
    paths["tflite"].write_bytes(struct.pack("<I", 16) + b"TFL3" + bytes(64))
    paths["savedmodel"] = tmp_path / "saved"
    paths["savedmodel"].mkdir()
    (paths["savedmodel"] / "saved_model.pb").write_bytes(b"\x08\x01")
    paths["pt2"] = tmp_path / "m.pt2"
    with zipfile.ZipFile(paths["pt2"], "w", zipfile.ZIP_STORED) as z:  # as torch.export.save writes it
        z.writestr("m/archive_format", "pt2")
        z.writestr("m/models/model.json", "{}" * 20)
    return paths


def test_detect_by_suffix_and_directory(files):
    assert {fmt: detect(files[fmt]) for fmt in FORMATS} == {fmt: fmt for fmt in FORMATS}
    assert detect(files["savedmodel"] / "saved_model.pb") == "savedmodel"
    hdf5 = files["h5"].with_suffix(".hdf5")
    shutil.copy(files["h5"], hdf5)
    assert detect(hdf5) == "h5"


@pytest.mark.parametrize("fmt", ["tflite", "h5", "keras"])
def test_detect_by_magic_bytes_when_the_suffix_says_nothing(files, fmt, tmp_path):
    renamed = tmp_path / "model.bin"
    shutil.copy(files[fmt], renamed)
    assert detect(renamed) == fmt


def test_unknown_suffix_names_the_file_and_the_formats(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"\x80\x02torch pickle")
    with pytest.raises(UsageError) as e:
        detect(path)
    assert e.value.code == "import.unknown-format"
    assert str(path) in e.value.message and "'.pt'" in e.value.message
    for name in ("ONNX", "SavedModel", "Keras", "TFLite", ".tflite", ".h5"):
        assert name in e.value.hint


def test_frozen_graph_pb_gets_its_own_hint(tmp_path):
    path = tmp_path / "frozen.pb"
    path.write_bytes(b"\x0a\x05graph")
    with pytest.raises(UsageError) as e:
        detect(path)
    assert "frozen GraphDef" in e.value.hint


def test_directory_without_saved_model_pb(tmp_path):
    (tmp_path / "variables").mkdir()
    with pytest.raises(UsageError) as e:
        detect(tmp_path)
    assert e.value.code == "import.unknown-format" and "without saved_model.pb" in e.value.message


def test_missing_path(tmp_path):
    with pytest.raises(UsageError) as e:
        detect(tmp_path / "nope.onnx")
    assert e.value.code == "import.no-such-file"


def test_valid_containers_pass(files):
    for fmt in FORMATS:
        formats.check_container(files[fmt], fmt)  # must not raise


@pytest.mark.parametrize("damage, fmt, says", [
    ("truncate", "h5", "truncated: the HDF5 superblock says"),
    ("signature", "h5", "no HDF5 signature"),
    ("flip-member", "keras", "member 'config.json' fails its CRC check"),
    ("truncate", "keras", "not a readable zip archive"),
    ("signature", "tflite", "no 'TFL3' identifier"),
    ("root", "tflite", "truncated: the root table sits at byte"),
    ("empty", "onnx", "the file is empty"),
    ("empty", "savedmodel", "saved_model.pb is empty"),
    ("truncate", "pt2", "not a readable zip archive"),
    ("empty", "pt2", "not a readable zip archive"),
])
def test_damaged_containers_are_refused_without_a_converter(files, damage, fmt, says):
    path = files[fmt]
    target = path / "saved_model.pb" if fmt == "savedmodel" else path
    data = bytearray(target.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "signature":
        data[1] ^= 0xFF
        data[5] ^= 0xFF
    elif damage == "flip-member":
        at = data.index(b"Functional") + 3  # inside the stored member
        data[at] ^= 0x55
    elif damage == "root":
        data[0:4] = struct.pack("<I", len(data) + 100)
    elif damage == "empty":
        data = bytearray()
    target.write_bytes(bytes(data))
    with pytest.raises(UserError) as e:
        formats.check_container(path, fmt)
    assert e.value.code == "import.bad-file"
    assert str(path) in e.value.message and says in e.value.message, e.value.message


def test_hdf5_end_of_file_address_matches_the_file(files):
    """The truncation check reads the superblock's end-of-file address: it must equal the size
    h5py wrote (else every valid .h5 would be refused, or no truncated one caught)."""
    data = files["h5"].read_bytes()
    assert formats._hdf5_end_of_file(data[8:104]) == len(data)
