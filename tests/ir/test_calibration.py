"""--calib DIR: the accepted layouts of samples, images with their stated preprocessing, and clear
errors for the rest."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

from edgesdk.errors import UserError
from edgesdk.ir.calibration import load_calibration, parse_preprocess

INPUTS = [{"name": "x", "shape": [1, 3, 4, 4], "dtype": "float32"}]


def _opts(calib, n=100, seed=0, preprocess=None):
    return SimpleNamespace(calib=calib, calib_samples=n, seed=seed, calib_preprocess=preprocess)


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
    with pytest.raises(UserError, match="no images, .npy or .npz files"):
        load_calibration(_opts(empty), INPUTS)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    np.save(pickled / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(UserError) as e:  # never loaded, and numpy's advice to allow pickles is not passed on
        load_calibration(_opts(pickled), INPUTS)
    assert e.value.message.endswith("obj.npy: not a numpy file (it holds pickled Python objects, which edgesdk does "
                                    "not load: unpickling can run code)") and "allow_pickle" not in str(e.value)


def test_npz_for_several_inputs(tmp_path):
    inputs = INPUTS + [{"name": "m", "shape": [1, 4], "dtype": "float32"}]
    np.savez(tmp_path / "s.npz", x=np.zeros((1, 3, 4, 4)), m=np.ones((1, 4)))
    feeds, _ = load_calibration(_opts(tmp_path), inputs)
    assert set(feeds[0]) == {"x", "m"}
    np.savez(tmp_path / "t.npz", x=np.zeros((1, 3, 4, 4)))
    with pytest.raises(UserError, match="t.npz: no array for input 'm'"):
        load_calibration(_opts(tmp_path), inputs)


# --- images ----------------------------------------------------------------------------------------


def _save_png(path, pixels: np.ndarray) -> None:
    from PIL import Image

    Image.fromarray(pixels).save(path)


def test_images_become_inputs_as_the_preprocessing_states(tmp_path):
    """Three RGB PNGs for an NCHW input, preprocessed as PP-OCR's models are: the loader's arrays
    equal the formula computed here with numpy from the same pixels (float32 rounding: 1e-6)."""
    rng = np.random.default_rng(3)
    pixels = [rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(3)]
    for k, p in enumerate(pixels):
        _save_png(tmp_path / f"{k}.png", p)
    inputs = [{"name": "x", "shape": [1, 3, 48, 64], "dtype": "float32"}]
    feeds, info = load_calibration(_opts(tmp_path, preprocess="scale=1/255,mean=0.5,std=0.5"), inputs)
    assert len(feeds) == 3 and info["images"] is True
    assert info["preprocess"] == "color=RGB,scale=0.00392157,mean=0.5,std=0.5,layout=NCHW"
    for f, p in zip(feeds, pixels):
        want = ((p.astype(np.float64) / 255 - 0.5) / 0.5).transpose(2, 0, 1)[None]
        assert f["x"].shape == (1, 3, 48, 64) and f["x"].dtype == np.float32
        np.testing.assert_allclose(f["x"], want, atol=1e-6)


def test_bgr_per_channel_mean_std_nhwc_and_resize(tmp_path):
    pixel = np.array([10, 128, 250], np.uint8)
    _save_png(tmp_path / "a.png", np.tile(pixel, (20, 30, 1)))  # a flat image: resizing keeps it flat
    inputs = [{"name": "img", "shape": [1, 8, 12, 3], "dtype": "float32"}]
    spec = "color=BGR,scale=1,mean=100:110:120,std=2:4:8"
    feeds, info = load_calibration(_opts(tmp_path, preprocess=spec), inputs)
    assert info["preprocess"].endswith("layout=NHWC")
    want = (pixel[::-1].astype(np.float64) - [100, 110, 120]) / [2, 4, 8]
    assert feeds[0]["img"].shape == (1, 8, 12, 3)
    np.testing.assert_allclose(feeds[0]["img"], np.broadcast_to(want, (1, 8, 12, 3)), atol=1e-5)


def test_grayscale_input_takes_images_as_gray(tmp_path):
    _save_png(tmp_path / "a.png", np.full((4, 4, 3), 51, np.uint8))
    feeds, _ = load_calibration(_opts(tmp_path), [{"name": "g", "shape": [1, 1, 4, 4], "dtype": "float32"}])
    np.testing.assert_allclose(feeds[0]["g"], np.full((1, 1, 4, 4), 0.2), atol=1e-6)  # 51 / 255


@pytest.mark.parametrize("spec, code, words", [
    ("scale=1/255,gamma=2", "compress.preprocess-syntax", "gamma=2"),
    ("mean=0.5:0.5", "compress.preprocess-channels", "mean has 2 values"),
    ("layout=NWHC", "compress.preprocess-layout", "layout=NWHC"),
    ("color=GRAY", "compress.preprocess-color", "3 channel(s)"),
    ("std=0", "compress.preprocess-value", "zero"),
    ("scale=1/x", "compress.preprocess-value", "not a number"),
])
def test_bad_preprocessing_is_named(spec, code, words):
    with pytest.raises(UserError) as err:
        parse_preprocess(spec, (1, 3, 48, 64))
    assert err.value.code == code and words in err.value.message


def test_images_and_numpy_do_not_mix_and_bad_images_are_named(tmp_path):
    _save_png(tmp_path / "a.png", np.zeros((4, 4, 3), np.uint8))
    np.save(tmp_path / "b.npy", np.zeros((1, 3, 4, 4)))
    with pytest.raises(UserError) as err:
        load_calibration(_opts(tmp_path), INPUTS)
    assert err.value.code == "compress.calib-mixed"
    (tmp_path / "b.npy").unlink()
    (tmp_path / "c.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(UserError, match="c.jpg: not a readable image"):
        load_calibration(_opts(tmp_path), INPUTS)


# --- hostile files ---------------------------------------------------------------------------------
# Each refusal comes from the file's type, size or header, before a sample is decoded or allocated.


def _png_header(width: int, height: int) -> bytes:
    """A PNG of a few bytes declaring `width` x `height` RGB pixels (a decompression bomb's header)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def _npy_header(shape, descr="<f4") -> bytes:
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


@pytest.mark.parametrize("name, make, kind", [
    ("a.png", lambda p: os.mkfifo(p), "a FIFO"),  # opening it for reading would wait for a writer
    ("a.npy", lambda p: os.mkfifo(p), "a FIFO"),
    ("a.npy", lambda p: os.symlink("/dev/zero", p), "a character device"),  # reads without end
    ("a.npz", lambda p: p.mkdir(), "a directory"),
])
def test_a_sample_that_is_not_a_regular_file_is_refused_unread(tmp_path, name, make, kind):
    make(tmp_path / name)
    with pytest.raises(UserError) as e:
        load_calibration(_opts(tmp_path), INPUTS)
    assert e.value.code == "compress.calib-unreadable"
    assert e.value.message == f"{tmp_path / name}: not a regular file ({kind})" and e.value.hint


def test_a_link_to_a_regular_sample_is_read_as_the_file(tmp_path):
    """A directory of links into a dataset: each link counts as the file it leads to."""
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "s.npy", np.ones((1, 3, 4, 4)))
    calib = tmp_path / "calib"
    calib.mkdir()
    (calib / "s.npy").symlink_to(data / "s.npy")
    feeds, _ = load_calibration(_opts(calib), INPUTS)
    assert len(feeds) == 1 and float(feeds[0]["x"].sum()) == 48.0


@pytest.mark.parametrize("width, height", [(20000, 20000), (10000, 10000)])  # past Pillow's error, its warning
def test_an_image_declaring_too_many_pixels_is_refused_from_its_header(tmp_path, width, height):
    (tmp_path / "bomb.png").write_bytes(_png_header(width, height))
    with pytest.raises(UserError) as e:
        load_calibration(_opts(tmp_path), INPUTS)
    assert e.value.code == "compress.calib-image-too-large"
    assert e.value.message.startswith(f"{tmp_path / 'bomb.png'}: the image declares {width}x{height} pixels "
                                      f"({width * height:,}), more than the 89,478,485")
    assert "decompression bomb" in e.value.hint


def test_an_array_declaring_more_than_its_file_holds_is_refused_before_allocating(tmp_path):
    """2^40 x 48 float32 (211 TB) declared by a header of 128 bytes, in an .npy and as an .npz member."""
    import zipfile

    shape = (2**40, 3, 4, 4)
    (tmp_path / "a.npy").write_bytes(_npy_header(shape) + bytes(192))
    with pytest.raises(UserError) as e:
        load_calibration(_opts(tmp_path), INPUTS)
    assert e.value.code == "compress.calib-truncated"
    assert e.value.message == (f"{tmp_path / 'a.npy'}: the array for 'x' declares shape {shape} of float32 "
                               f"(211,106,232,532,992 bytes), and the file holds 192 bytes of data")
    (tmp_path / "a.npy").unlink()
    with zipfile.ZipFile(tmp_path / "b.npz", "w") as z:
        z.writestr("x.npy", _npy_header(shape) + bytes(192))
    with pytest.raises(UserError) as e:
        load_calibration(_opts(tmp_path), INPUTS)
    assert e.value.code == "compress.calib-truncated" and "and member 'x.npy' holds 192 bytes" in e.value.message


def test_npz_members_past_the_bound_or_damaged_are_refused(tmp_path, monkeypatch):
    from edgesdk.ir import calibration

    # a compressed member declares its size unpacked: 40 zero samples, 7,808 bytes in a file of a few hundred
    np.savez_compressed(tmp_path / "z.npz", x=np.zeros((40, 3, 4, 4), np.float32))
    assert (tmp_path / "z.npz").stat().st_size < 2000
    monkeypatch.setattr(calibration, "MAX_SAMPLE_BYTES", 2000)
    with pytest.raises(UserError) as e:
        load_calibration(_opts(tmp_path), INPUTS)
    assert e.value.code == "compress.calib-too-large"
    assert e.value.message == (f"{tmp_path / 'z.npz'}: its arrays for the model's inputs declare 7,808 bytes, more "
                               "than the 2,000 read from one sample file")
    monkeypatch.undo()
    (tmp_path / "z.npz").unlink()
    np.savez(tmp_path / "s.npz", x=np.ones((4, 3, 4, 4), np.float32))
    data = bytearray((tmp_path / "s.npz").read_bytes())
    at = data.index(np.ones(1, np.float32).tobytes())
    data[at + 3] ^= 0x01  # one value of x changed: the member's CRC no longer matches
    (tmp_path / "s.npz").write_bytes(bytes(data))
    with pytest.raises(UserError) as e:
        load_calibration(_opts(tmp_path), INPUTS)
    assert e.value.message == f"{tmp_path / 's.npz'}: member 'x.npy' cannot be read (Bad CRC-32 for file 'x.npy')"


def test_a_file_that_is_not_numpy_is_named_as_numpy_refuses_it(tmp_path):
    (tmp_path / "x.npy").write_bytes(b"garbage")
    with pytest.raises(UserError) as e:
        load_calibration(_opts(tmp_path), INPUTS)
    assert e.value.message == (f"{tmp_path / 'x.npy'}: not a numpy file (no numpy header: not a .npy or .npz file "
                               "(and a pickle is never loaded))")


def test_an_array_of_strings_is_a_user_error(tmp_path):
    np.save(tmp_path / "s.npy", np.full((1, 3, 4, 4), "a"))
    with pytest.raises(UserError, match="s.npy: array for 'x' is <U1, which does not convert to the input's float32"):
        load_calibration(_opts(tmp_path), INPUTS)


@pytest.mark.parametrize("labels, message", [
    (b"1\n2\n\xff\n", "labels.txt:3: not UTF-8 text (byte 0xff)"),
    (b"1\n99999999999999999999\n", "labels.txt:2: 99999999999999999999 is outside int64"),
    (b"-9223372036854775809\n", "labels.txt:1: -9223372036854775809 is outside int64"),
    (None, "labels.txt: not a regular file (a FIFO)"),
])
def test_labels_that_are_not_utf8_int64_or_a_file_name_their_line(tmp_path, labels, message):
    from edgesdk.ir.calibration import load_labelled

    np.save(tmp_path / "s.npy", np.zeros((1, 3, 4, 4)))
    if labels is None:
        os.mkfifo(tmp_path / "labels.txt")
    else:
        (tmp_path / "labels.txt").write_bytes(labels)
    with pytest.raises(UserError) as e:
        load_labelled(tmp_path, INPUTS, None)
    assert e.value.code == "compress.eval-label"
    assert e.value.message == f"{tmp_path}/{message}" and e.value.hint


# --- synthetic samples: each input's range, and where it comes from -------------------------------------

def _ranged(ranges=None, preprocess=None, n=8):
    return SimpleNamespace(calib=None, calib_samples=n, seed=0, calib_preprocess=preprocess, input_ranges=ranges or {})


def test_synthetic_samples_without_a_known_range_are_what_they_were():
    """Nothing states the range: uniform in [-1, 1], the very samples builds drew before (same seed, same
    order), and the record says so and that accuracy on real inputs is unknown."""
    samples, info = load_calibration(_ranged(), INPUTS)
    rng = np.random.default_rng(0)
    assert all(np.array_equal(s["x"], rng.uniform(-1, 1, (1, 3, 4, 4)).astype(np.float32)) for s in samples)
    assert info["distribution"] == "uniform(-1, 1)" and info["inputs"]["x"]["source"].startswith("none known")
    assert info["accuracy_on_real_data"] == "unknown" and "--calib DIR" in info["hint"]


def test_input_range_then_preprocess_then_the_models_own_then_the_type():
    """--input-range wins; else the range --calib-preprocess gives 8-bit pixels (per channel); else the
    range import.json carries (the model's metadata, an index input's table); else an 8-bit type's."""
    image = {"name": "x", "shape": [1, 3, 16, 16], "dtype": "float32",
             "range": {"low": [-1.0], "high": [1.0], "axis": None, "source": "the model's metadata (...)"}}
    ids = {"name": "ids", "shape": [1, 12], "dtype": "int64",
           "range": {"low": [0], "high": [99], "axis": None, "source": "the table it indexes (Gather 'emb' ...)"}}
    pixels = {"name": "p", "shape": [1, 8], "dtype": "uint8"}
    inputs = [image, ids, pixels]
    samples, info = load_calibration(_ranged({"x": (0.0, 1.0)}), inputs)
    xs, idss, ps = (np.stack([s[k] for s in samples]) for k in ("x", "ids", "p"))
    assert 0 <= xs.min() < 0.05 and 0.95 < xs.max() <= 1 and info["inputs"]["x"]["source"] == "--input-range"
    assert idss.dtype == np.int64 and idss.min() >= 0 and idss.max() <= 99 and len(np.unique(idss)) > 50
    assert ps.dtype == np.uint8 and ps.max() > 200 and info["inputs"]["p"]["source"] == "its type (uint8)"
    samples, info = load_calibration(_ranged(preprocess="scale=1/255,mean=0.485:0.456:0.406,std=0.229:0.224:0.225"),
                                     inputs)
    xs = np.stack([s["x"] for s in samples])
    low = (0 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
    high = (1 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
    assert np.allclose(xs.min(axis=(0, 1, 3, 4)), low, atol=0.05) and np.allclose(xs.max(axis=(0, 1, 3, 4)), high, atol=0.05)
    assert info["inputs"]["x"]["axis"] == 1 and info["inputs"]["x"]["source"].startswith("--calib-preprocess")
    samples, info = load_calibration(_ranged(), inputs)
    assert info["inputs"]["x"]["source"] == "the model's metadata (...)"
    assert -1 <= min(s["x"].min() for s in samples) and max(s["x"].max() for s in samples) <= 1


def test_image_samples_span_scales_from_one_colour_to_single_pixels():
    """An image input's samples are drawn in blocks, sample k's side the image's / 2^k (cycling): a
    filter that averages neighbours sees the whole range (a flat colour), and one that differences
    them sees pixel noise."""
    samples, _ = load_calibration(_ranged({"x": (0.0, 1.0)}, n=6), [{"name": "x", "shape": [1, 3, 16, 16],
                                                                     "dtype": "float32"}])
    distinct = [len(np.unique(s["x"][0, 0])) for s in samples]
    assert distinct == [1, 4, 16, 64, 256, 1], distinct


@pytest.mark.parametrize("ranges, code, words", [
    ({"image": (0.0, 1.0)}, "compress.input-range-unknown", "--input-range names 'image', which is not an input"),
    ({"ids": (0.2, 0.8)}, "compress.input-range-empty", "input 'ids' is int64, and no integer lies in [0.2, 0.8]"),
])
def test_an_input_range_for_no_input_or_with_no_integer_is_refused(ranges, code, words):
    from edgesdk.errors import UsageError

    with pytest.raises(UsageError) as e:
        load_calibration(_ranged(ranges), INPUTS + [{"name": "ids", "shape": [1, 4], "dtype": "int64"}])
    assert e.value.code == code and words in e.value.message and e.value.hint
