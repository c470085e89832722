"""Input checks before any segment runs (runtime/inputs.py): an index outside its table, NaN/inf, and
dtypes the model does not take.

The bundle is a tiny embedding model built for x86 through the real pipeline (about 10 s): int64 `ids`
[1, 8] -> Gather on a [100, 16] table -> ReduceMean over the tokens -> + float `x` [1, 16] -> MatMul ->
`y` [1, 4]. Its outputs are compared with onnxruntime on the original model; the dtype policy is also
checked on its own, on TensorSpecs, without a bundle.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk.runtime import BundleModel
from edgesdk.runtime.inputs import FeedCheck, InputError, check_feeds
from edgesdk.runtime.manifest import TensorSpec
from tests.test_cli import assert_user_facing, edgesdk

ROWS = 100
OUT_OF_RANGE = [ROWS, 10**6, 2**40, -ROWS - 1]


def _embedding_model(path: Path) -> Path:
    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.normal(size=(ROWS, 16)).astype(np.float32), "table")
    w = numpy_helper.from_array(rng.normal(size=(16, 4)).astype(np.float32), "w")
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], name="embedding"),
             helper.make_node("ReduceMean", ["e"], ["m"], axes=[1], keepdims=0),
             helper.make_node("Add", ["m", "x"], ["s"]),
             helper.make_node("MatMul", ["s", "w"], ["y"])]
    g = helper.make_graph(nodes, "embed", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 8]),
                                           helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [table, w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    onnx.save(m, str(path))
    return path


SLOW_FIXTURES = ("embedding",)  # a build measuring its CPU backends: the tests that need it are slow


@pytest.fixture(scope="module")
def embedding(tmp_path_factory, tuning_db):
    from tests.conftest import _build

    d = tmp_path_factory.mktemp("embedding")
    model = _embedding_model(d / "embed.onnx")
    return model, _build(d / "out", model, "x86", tuning_db=tuning_db).bundle


@pytest.fixture()
def model(embedding):
    """The bundle, each runner recording its calls in `model.calls`."""
    m = BundleModel(embedding[1], log=lambda s: None)
    m.calls = []
    for seg, runner in m.runners:
        def recorded(feeds, *args, _run=runner.run, _id=seg.id, **kwargs):
            m.calls.append(_id)
            return _run(feeds, *args, **kwargs)
        runner.run = recorded
    yield m
    m.close()


def _ids(*values: int) -> np.ndarray:
    ids = np.zeros((1, 8), np.int64)
    ids[0, 3:3 + len(values)] = values
    return ids


X = np.linspace(-1, 1, 16, dtype=np.float32)[None]


def test_manifest_records_the_range_of_the_index_input(embedding):
    raw = {t["name"]: t for t in json.loads((embedding[1] / "manifest.json").read_text())["inputs"]}
    assert raw["ids"]["valid_range"] == [-ROWS, ROWS - 1]
    assert raw["x"].get("valid_range") is None
    specs = {t.name: t for t in BundleModel(embedding[1], log=lambda s: None).inputs}
    assert specs["ids"].valid_range == (-ROWS, ROWS - 1) and specs["x"].valid_range is None


@pytest.mark.parametrize("value", OUT_OF_RANGE)
def test_out_of_range_ids_are_refused_before_any_segment(model, value):
    with pytest.raises(InputError) as e:
        model.run({"ids": _ids(value, value), "x": X})
    assert str(e.value) == (f"input 'ids' is an index into a table, valid range [-{ROWS}, {ROWS - 1}]: {value} at "
                            f"position (0, 3) is outside it, and so is 1 more of the 8 values")
    with pytest.raises(InputError):
        list(model.stream([{"ids": _ids(value), "x": X}]))
    assert model.calls == []


@pytest.mark.parametrize("value", OUT_OF_RANGE)
def test_cli_refuses_out_of_range_ids(embedding, tmp_path, value):
    np.save(tmp_path / "ids.npy", _ids(value))
    np.save(tmp_path / "x.npy", X)
    proc = edgesdk("run", str(embedding[1]), "-i", f"ids={tmp_path / 'ids.npy'}", "-i", f"x={tmp_path / 'x.npy'}")
    assert_user_facing(proc, 1, "input 'ids'", str(value), "position (0, 3)", f"[-{ROWS}, {ROWS - 1}]")
    assert proc.stdout == ""


@pytest.mark.parametrize("ids", [np.arange(8) * 13 - 4, -np.arange(1, 9) * 12, [-ROWS, ROWS - 1, -1, 0, 5, -50, 50, 7]],
                         ids=["mixed", "negative", "edges"])
def test_ids_in_range_match_onnxruntime(model, embedding, ids):
    """ONNX counts a negative index from the end of the table; TVM's importer does the same (it adds
    N before its take), so the runtime passes negative ids on unchanged."""
    feeds = {"ids": np.asarray(ids, np.int64)[None], "x": X}
    got = model.run(feeds)["y"]
    ref = ort.InferenceSession(str(embedding[0])).run(["y"], feeds)[0]
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    assert model.calls


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_refused_unless_allowed(model, embedding, bad):
    x = X.copy()
    x[0, 5] = bad
    with pytest.raises(InputError, match=rf"input 'x' holds NaN or inf.*: {bad!r} at position \(0, 5\)"):
        model.run({"ids": _ids(), "x": x})
    assert model.calls == []
    got = model.run({"ids": _ids(), "x": x}, allow_nonfinite=True)["y"]
    ref = ort.InferenceSession(str(embedding[0])).run(["y"], {"ids": _ids(), "x": x})[0]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    assert list(model.stream([{"ids": _ids(), "x": x}], allow_nonfinite=True))


def test_cli_allow_nonfinite(embedding, tmp_path):
    x = X.copy()
    x[0, 1] = np.nan
    np.save(tmp_path / "ids.npy", _ids())
    np.save(tmp_path / "x.npy", x)
    args = ["run", str(embedding[1]), "-i", f"ids={tmp_path / 'ids.npy'}", "-i", f"x={tmp_path / 'x.npy'}"]
    assert_user_facing(edgesdk(*args), 1, "input 'x' holds NaN or inf", "--allow-nonfinite")
    proc = edgesdk(*args, "--allow-nonfinite")
    assert proc.returncode == 0 and "y: shape [1, 4] float32" in proc.stdout, proc.stderr


def _files(root: Path) -> dict[str, str]:
    """Every entry under `root` and what it is (a link: where it leads)."""
    return {str(p.relative_to(root)): os.readlink(p) if p.is_symlink() else "dir" if p.is_dir() else "file"
            for p in root.rglob("*")}


@pytest.mark.parametrize("given, make, why", [
    ("y.out", None, "does not end in .npz or .npy"),  # numpy.savez wrote y.out.npz
    ("existing", lambda p: p.mkdir(), "is a directory"),  # numpy.savez wrote existing.npz beside it
    ("null.npz", lambda p: p.symlink_to("/dev/null"), "is a character device, not a regular file"),
    ("fifo.npz", lambda p: os.mkfifo(p), "is a FIFO, not a regular file"),  # opening it to write waited for ever
    ("missing/y.npz", None, "its directory {tmp}/missing does not exist"),  # an internal error (exit 3)
], ids=["suffix", "directory", "device", "fifo", "missing-directory"])
def test_run_output_is_written_exactly_where_asked_or_refused(embedding, tmp_path, given, make, why):
    """`run -o` writes the path given or refuses it before the model runs (exit 2), writing nothing."""
    np.save(tmp_path / "ids.npy", _ids())
    np.save(tmp_path / "x.npy", X)
    if make:
        make(tmp_path / given)
    before = _files(tmp_path)
    proc = edgesdk("run", str(embedding[1]), "-i", f"ids={tmp_path / 'ids.npy'}", "-i", f"x={tmp_path / 'x.npy'}",
                   "-o", str(tmp_path / given))
    assert_user_facing(proc, 2, f"error: --output {tmp_path / given}: {why.format(tmp=tmp_path)}",
                       "hint: give a file name ending in .npz (every output, by name) or .npy (the one output)")
    assert _files(tmp_path) == before


def test_run_output_holds_what_its_suffix_says_and_nothing_else_is_written(embedding, tmp_path):
    np.save(tmp_path / "ids.npy", _ids())
    np.save(tmp_path / "x.npy", X)
    args = ["run", str(embedding[1]), "-i", f"ids={tmp_path / 'ids.npy'}", "-i", f"x={tmp_path / 'x.npy'}", "-o"]
    assert edgesdk(*args, str(tmp_path / "y.npz")).returncode == 0
    assert edgesdk(*args, str(tmp_path / "y.NPY")).returncode == 0
    assert set(_files(tmp_path)) == {"ids.npy", "x.npy", "y.npz", "y.NPY"}  # no temporary left
    with np.load(tmp_path / "y.npz") as z:
        assert list(z) == ["y"] and z["y"].shape == (1, 4)
    np.testing.assert_array_equal(np.load(tmp_path / "y.NPY"), np.load(tmp_path / "y.npz")["y"])


def test_run_output_npy_is_refused_for_a_model_of_several_outputs(embedding, tmp_path):
    """A .npy file holds one array: for two outputs numpy.savez wrote `y.npy.npz`; now refused, before the
    model runs. The second output is a copy's manifest edit (the refusal reads the manifest alone)."""
    import shutil

    bundle = tmp_path / "bundle"
    shutil.copytree(embedding[1], bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    for outputs in (manifest["outputs"], manifest["segments"][-1]["outputs"]):
        outputs.append({**outputs[0], "name": "y2"})
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    np.save(tmp_path / "ids.npy", _ids())
    np.save(tmp_path / "x.npy", X)
    before = _files(tmp_path)
    proc = edgesdk("run", str(bundle), "-i", f"ids={tmp_path / 'ids.npy'}", "-i", f"x={tmp_path / 'x.npy'}",
                   "-o", str(tmp_path / "y.npy"))
    assert_user_facing(proc, 2, f"error: --output {tmp_path / 'y.npy'}: a .npy file holds one array, and the model "
                       "has 2 outputs", "hint: give a .npz file name: it holds every output by name")
    assert _files(tmp_path) == before


def test_a_run_output_the_file_system_refuses_leaves_nothing(embedding, tmp_path):
    """A write that fails midway (here past RLIMIT_FSIZE, as a full disk would) is a user error, and neither
    the output nor its temporary is left."""
    import resource
    import subprocess
    import sys

    from tests.model_zoo import ROOT

    np.save(tmp_path / "ids.npy", _ids())
    np.save(tmp_path / "x.npy", X)
    args = ["run", str(embedding[1]), "-i", f"ids={tmp_path / 'ids.npy'}", "-i", f"x={tmp_path / 'x.npy'}",
            "-o", str(tmp_path / "y.npz")]
    proc = subprocess.run([sys.executable, "-m", "edgesdk.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "sdk")}, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100)))
    assert_user_facing(proc, 1, f"error: --output {tmp_path / 'y.npz'}: cannot be written (File too large)",
                       "nothing was written")
    assert set(_files(tmp_path)) == {"ids.npy", "x.npy"}


def test_a_segment_onnxruntime_cannot_load_is_a_manifest_error(embedding, tmp_path):
    """A manifest naming onnxruntime for an artifact that is no ONNX model (a hand-edited manifest; the
    fuzzer's) was onnxruntime's InvalidProtobuf, an internal error of `edgesdk run`."""
    import shutil

    from edgesdk.runtime.manifest import ManifestError

    bundle = tmp_path / "bundle"
    shutil.copytree(embedding[1], bundle)
    (bundle / "segments" / "junk.onnx").write_bytes(b"not a model")
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["segments"][0].update(backend="onnxruntime", artifact="segments/junk.onnx")
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=r"segment s0: segments/junk.onnx is not a model onnxruntime loads "
                                            r"\(\[ONNXRuntimeError\] : 7 : INVALID_PROTOBUF"):
        BundleModel(bundle, log=lambda s: None)


def test_device_run_writes_exactly_the_output_named(embedding, tmp_path):
    """`python -B -m runtime run IN OUT` (numpy.savez appended .npz to OUT) writes OUT.npz or refuses."""
    import subprocess
    import sys

    np.savez(tmp_path / "in.npz", ids=_ids(), x=X)

    def device_run(out: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-B", "-m", "runtime", "run", str(tmp_path / "in.npz"), out],
                              capture_output=True, text=True, cwd=tmp_path, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(embedding[1])})

    for out, why in (("y.out", "does not end in .npz"), ("missing/y.npz", "its directory missing does not exist")):
        proc = device_run(out)
        assert proc.returncode == 2 and proc.stderr == f"error: {out}: {why}\n", proc.stderr
        assert set(_files(tmp_path)) == {"in.npz"}
    proc = device_run("y.npz")
    assert proc.returncode == 0, proc.stderr
    assert set(_files(tmp_path)) == {"in.npz", "y.npz"} and list(np.load(tmp_path / "y.npz")) == ["y"]
    # IN a FIFO (np.load waited for a writer for ever) or a damaged archive: refused, named, nothing written
    os.mkfifo(tmp_path / "fifo.npz")
    (tmp_path / "bad.npz").write_bytes(b"PK\x03\x04" + b"\0" * 40)
    for name, why in (("fifo.npz", "not a regular file (a FIFO)"), ("bad.npz", "")):
        proc = subprocess.run([sys.executable, "-B", "-m", "runtime", "run", str(tmp_path / name), "z.npz"],
                              capture_output=True, text=True, cwd=tmp_path, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(embedding[1])})
        assert proc.returncode == 1 and proc.stderr.startswith(f"error: {tmp_path / name}: {why}"), proc.stderr
        assert "Traceback" not in proc.stderr and not (tmp_path / "z.npz").exists()



def test_device_run_allow_nonfinite(embedding, tmp_path):
    """The device's `run` refuses NaN as `BundleModel.run` does, and runs it with --allow-nonfinite (what
    `edgesdk run --allow-nonfinite` passes on to an aarch64 bundle's runtime under qemu)."""
    import subprocess
    import sys

    x = X.copy()
    x[0, 5] = np.nan
    np.savez(tmp_path / "in.npz", ids=_ids(), x=x)

    def device_run(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-B", "-m", "runtime", "run", "in.npz", "y.npz", *flags],
                              capture_output=True, text=True, cwd=tmp_path, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(embedding[1])})

    proc = device_run()
    assert proc.returncode == 1 and "error: input 'x' holds NaN or inf" in proc.stderr, proc.stderr
    assert not (tmp_path / "y.npz").exists()
    proc = device_run("--allow-nonfinite")
    assert proc.returncode == 0, proc.stderr
    assert np.isnan(np.load(tmp_path / "y.npz")["y"]).any()

# (input, value given, verdict): a refusal's words, or the note of the cast done
BUNDLE_VERDICTS = [
    ("x", X.astype(np.float16), "note: cast to float32 (exact)"),
    ("x", X.astype(np.float64), "note: narrowed to float32"),
    ("x", np.arange(16, dtype=np.int64)[None], "note: cast to float32 (every value exact)"),
    ("x", np.arange(16, dtype=np.uint8)[None], "note: cast to float32 (exact)"),
    ("x", X > 0, "refused: bool values are not cast to float"),
    ("x", X.astype(np.complex64), "refused: complex values are not cast to float"),
    ("ids", _ids(5, 7).astype(np.float32), "refused: float values are not cast to integers"),
    ("ids", _ids(5, 7).astype(np.int32), "note: cast to int64 (exact)"),
    ("ids", _ids(5, 7).astype(np.uint8), "note: cast to int64 (exact)"),
    ("ids", _ids(1) > 0, "refused: bool values are not cast to integer"),
]


@pytest.mark.parametrize("name,value,verdict", BUNDLE_VERDICTS, ids=[f"{n}-{v.dtype}" for n, v, _ in BUNDLE_VERDICTS])
def test_dtype_verdicts_on_the_bundle(model, embedding, name, value, verdict):
    feeds = {"ids": _ids(5, 7), "x": X, name: value}
    kind, _, words = verdict.partition(": ")
    head = f"input '{name}' is {value.dtype}, the model takes {'int64' if name == 'ids' else 'float32'}: "
    if kind == "refused":
        with pytest.raises(InputError) as e:
            model.run(feeds)
        assert str(e.value).startswith(head + words)
        assert model.calls == []
        return
    got = model.run(feeds)["y"]
    model.run(feeds)
    noted = [n for n in model.notes if n.startswith(head)]
    assert len(noted) == 1 and words in noted[0]  # once per input, however often it runs
    exact = {"ids": np.asarray(feeds["ids"], np.int64), "x": np.asarray(feeds["x"], np.float32)}
    ref = ort.InferenceSession(str(embedding[0])).run(["y"], exact)[0]
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


# --- the dtype policy on its own -------------------------------------------------------------------

SPECS = (TensorSpec("x", (2, 3), "float32"), TensorSpec("n", (2, 3), "int32"))


def _check(name: str, value, **kw):
    feeds = {"x": np.zeros((2, 3), np.float32), "n": np.zeros((2, 3), np.int32), name: np.asarray(value)}
    checked, notes = check_feeds(SPECS, feeds, **kw)
    return checked[name], notes


def test_same_dtype_is_passed_without_a_note():
    x = np.ones((2, 3), np.float32)
    got, notes = _check("x", x)
    assert got is x and notes == []


def test_narrowing_int_cast_needs_every_value_to_fit():
    got, notes = _check("n", np.arange(6, dtype=np.int64).reshape(2, 3))
    assert got.dtype == np.int32
    assert notes == ["input 'n' is int64, the model takes int32: cast to int32 (every value fits)"]
    with pytest.raises(InputError, match=r"input 'n' is int64, the model takes int32: .*fits \[-2147483648, "
                                         r"2147483647\]: 2147483648 at position \(1, 0\) is outside it"):
        _check("n", np.array([[1, 2, 3], [2**31, 5, -2**40]]))


def test_float64_narrowing_and_nonfinite():
    with pytest.raises(InputError, match=r"float32's range.*: 1e\+39 at position \(0, 1\)"):
        _check("x", np.array([[0, 1e39, 0], [0, 0, 0]]), allow_nonfinite=True)
    nan = np.array([[0, np.nan, 0], [0, 0, 0]])
    with pytest.raises(InputError, match="holds NaN or inf"):
        _check("x", nan)
    got, notes = _check("x", nan, allow_nonfinite=True)
    assert got.dtype == np.float32 and np.isnan(got[0, 1]) and "narrowed to float32" in notes[0]


def test_integer_to_float_only_when_exact():
    with pytest.raises(InputError, match=r"exactly representable \(\|v\| <= 16777216\): 16777217 at position \(0, 0\)"):
        _check("x", np.array([[2**24 + 1, 0, 0], [0, 0, 0]]))


@pytest.mark.parametrize("value,words", [
    (np.full((2, 3), "7"), "string or object values are not cast to float"),
    (np.zeros((2, 3), object), "string or object values are not cast to float"),
    (np.zeros((2, 3), np.complex128), "complex values are not cast to float"),
])
def test_meaningless_casts_are_refused(value, words):
    with pytest.raises(InputError, match=words):
        _check("x", value)


def test_names_and_shapes_stay_plain_value_errors():
    with pytest.raises(ValueError, match=r"missing \['n'\]") as e:
        check_feeds(SPECS, {"x": np.zeros((2, 3), np.float32)})
    assert not isinstance(e.value, InputError)
    with pytest.raises(ValueError, match=r"input 'x' has shape \(3, 2\), the model takes \(2, 3\)"):
        _check("x", np.zeros((3, 2), np.float32))


def test_range_check_on_a_spec():
    spec = (TensorSpec("ids", (4,), "int64", valid_range=(-3, 2)),)
    assert check_feeds(spec, {"ids": np.array([-3, -1, 0, 2])})[1] == []
    with pytest.raises(InputError, match=r"valid range \[-3, 2\]: 3 at position \(2,\) is outside it \(the only one"):
        check_feeds(spec, {"ids": np.array([-3, -1, 3, 2])})


def test_one_check_serves_every_inference():
    """A bundle builds its check once and runs it on each inference's feeds: a good feed after a refused
    one passes, a refused one after good ones is refused, and lists are taken as arrays as before."""
    check = FeedCheck(SPECS)
    good = {"x": np.zeros((2, 3), np.float32), "n": np.zeros((2, 3), np.int32)}
    assert check(good)[0]["x"] is good["x"]
    inf = {**good, "x": np.array([[0, 0, 0], [0, 0, np.inf]], np.float32)}
    with pytest.raises(InputError, match=r"holds NaN or inf.*inf at position \(1, 2\)"):
        check(inf)
    checked, notes = check({"x": [[1, 2, 3], [4, 5, 6]], "n": good["n"]})
    assert checked["x"].dtype == np.float32 and checked["x"][1, 2] == 6 and "cast to float32" in notes[0]
    assert check(inf, allow_nonfinite=True)[0]["x"][1, 2] == np.inf
    with pytest.raises(ValueError, match=r"unexpected \['y'\]"):
        check({**good, "y": good["x"]})


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_all_finite_sees_every_nan_and_infinity_wherever_it_is(dtype):
    """The finite test by a sum of squares (one BLAS dot, whose vector kernels handle a tail apart): a NaN, +inf or
    -inf at every position of arrays of 1 to 70 values is seen; huge finite values, whose squares overflow, pass."""
    from edgesdk.runtime.inputs import all_finite

    rng = np.random.default_rng(0)
    for n in range(1, 71):
        x = rng.standard_normal(n).astype(dtype)
        assert all_finite(x) and all_finite(x.reshape(1, n)[:, ::-1])
        for i in range(n):
            for bad in (np.nan, np.inf, -np.inf):
                y = x.copy()
                y[i] = bad
                assert not all_finite(y), (n, i, bad)
    huge = np.full(64, np.finfo(dtype).max / 2, dtype)  # its squares overflow: the elementwise test decides
    assert all_finite(huge) and not all_finite(np.append(huge, np.inf).astype(dtype))
    assert all_finite(np.zeros((0, 3), dtype))
