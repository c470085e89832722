"""The import stage end to end: every format into the canonical graph, optimized, shapes static,
the answer unchanged (onnxruntime on the result against the original, stated tolerances), and the
record the build report and `--json` are made from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tests.model_zoo import PPOCR_CLS, ROOT, SILERO_VAD

# float graphs: the passes fold BatchNorm and constant chains, which reassociates float math;
# 1e-5 of the output's range is the bound for "the same answer"
RTOL = 1e-5


def _session(model: onnx.ModelProto | Path) -> ort.InferenceSession:
    m = onnx.load(str(model)) if isinstance(model, Path) else model
    m.ir_version = min(m.ir_version, 10)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _import(model: Path, out: Path, values: dict | None = None, **shapes):
    from edgesdk.pipeline import BuildOptions, build

    result = build(BuildOptions(model=model, target="x86", out=out, until="import",
                                input_shapes={k: tuple(v) for k, v in shapes.items()}, input_values=values or {}))
    return result.stages[0].record, out / ".build" / "1-import"


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def test_onnx_opset11_is_canonicalized_optimized_and_equal(tmp_path):
    record, stage = _import(PPOCR_CLS, tmp_path / "o", x=(1, 3, 48, 192))
    model = onnx.load(str(stage / "model.onnx"))
    assert record["format"] == "onnx" and record["converter"] is None
    assert record["opset"] == {"source": 11, "canonical": 17}
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) == 17
    # the classifier's exported graph carries BatchNormalization after each Conv: folded away
    assert record["nodes_before"].get("BatchNormalization", 0) > 0
    assert record["nodes_after"].get("BatchNormalization", 0) == 0
    assert sum(record["nodes_after"].values()) < sum(record["nodes_before"].values())
    assert any(v > 0 for v in record["rules"].values())
    # every node's outputs have static shapes
    shapes = {vi.name for vi in list(model.graph.value_info) + list(model.graph.output)}
    assert all(o in shapes for n in model.graph.node for o in n.output)

    x = np.random.default_rng(0).uniform(-1, 1, (1, 3, 48, 192)).astype(np.float32)
    (ref,) = _session(PPOCR_CLS).run(None, {"x": x})
    (got,) = _session(stage / "model.onnx").run(None, {"x": x})
    assert _rel(got, ref) < RTOL


@pytest.fixture(scope="module")
def small_keras(tmp_path_factory) -> tuple[Path, np.ndarray, np.ndarray]:
    """A Keras 3 conv net with BatchNorm (statistics set) and a GELU layer (Keras writes it with Erfc,
    which tf2onnx lacks and the import adds) saved as .keras; an input and Keras' output."""
    import tensorflow as tf

    tf.keras.utils.set_random_seed(0)
    inp = tf.keras.Input((32, 32, 3), name="image")
    x = tf.keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(inp)
    x = tf.keras.layers.BatchNormalization()(x)
    x = tf.keras.layers.ReLU(6.0)(x)
    x = tf.keras.layers.DepthwiseConv2D(3, padding="same")(x)
    x = tf.keras.layers.BatchNormalization()(x)
    x = tf.keras.layers.ReLU()(x)
    x = tf.keras.layers.GlobalAveragePooling2D()(x)
    x = tf.keras.layers.Dense(16, activation="gelu")(x)
    out = tf.keras.layers.Dense(5, name="logits")(x)
    model = tf.keras.Model(inp, out)
    for layer in model.layers:
        if isinstance(layer, tf.keras.layers.BatchNormalization):
            layer.momentum = 0.0
    model(tf.random.stateless_uniform((8, 32, 32, 3), seed=(1, 2)), training=True)
    path = tmp_path_factory.mktemp("keras") / "small.keras"
    model.save(path)
    x = np.random.default_rng(1).uniform(-1, 1, (1, 32, 32, 3)).astype(np.float32)
    return path, x, np.asarray(model(x, training=False))


def test_keras_file_imports_with_batch_fixed_and_same_answer(tmp_path, small_keras):
    path, x, ref = small_keras
    record, stage = _import(path, tmp_path / "o")
    assert record["format"] == "keras" and record["converter"].startswith("tf2onnx")
    assert (stage / "converted.onnx").exists()
    model = onnx.load(str(stage / "model.onnx"))
    (inp,) = [i for i in model.graph.input]
    assert [d.dim_value for d in inp.type.tensor_type.shape.dim] == [1, 32, 32, 3]
    assert "Erf" in {n.op_type for n in model.graph.node}
    (got,) = _session(model).run(None, {inp.name: x})
    assert _rel(got, ref) < RTOL
    io = json.loads((stage / "import.json").read_text())
    assert io["source"]["format"] == "keras"


def test_cli_reports_rules_and_op_counts(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "sdk")}
    cmd = [sys.executable, "-m", "edgesdk.cli", "build", str(PPOCR_CLS), "--target", "x86", "-o", str(tmp_path / "o"),
           "--input-shape", "x=1x3x48x192", "--until", "import"]
    text = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert text.returncode == 0, text.stderr
    assert "rules fired:" in text.stderr and "BatchNormalization" in text.stderr
    js = subprocess.run(cmd + ["--json"], capture_output=True, text=True, env=env, timeout=300)
    assert js.returncode == 0, js.stderr
    record = json.loads(js.stdout)["stages"][0]["record"]
    assert set(record) >= {"nodes_before", "nodes_after", "rules", "format", "opset"}
    assert record["nodes_after"] != record["nodes_before"]


def test_frozen_input_takes_the_if_branch_it_selects(tmp_path):
    """silero-vad's `sr` selects the 16 kHz or 8 kHz front end: frozen by --input-value, the If (and
    the Ifs nested in it) fold away, every shape becomes static, and the answer is the original's."""
    record, stage = _import(SILERO_VAD, tmp_path / "o", values={"sr": (16000,)}, input=(1, 512), state=(2, 1, 128))
    model = onnx.load(str(stage / "model.onnx"))
    assert [i.name for i in model.graph.input] == ["input", "state"]
    assert record["nodes_before"].get("If", 0) > 0 and "If" not in record["nodes_after"]
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = (0.3 * rng.standard_normal((1, 512))).astype(np.float32)
        state = rng.standard_normal((2, 1, 128)).astype(np.float32)
        ref = _session(SILERO_VAD).run(None, {"input": x, "state": state, "sr": np.array(16000, np.int64)})
        got = _session(model).run(None, {"input": x, "state": state})
        # the speech probability on its scale, 1 (near 0 here, relative to itself a float32 rounding is 4e-5):
        # import folds the LSTM's weights into initializers, which onnxruntime packs, summing in another order
        prob, state_out = zip(got, ref)
        assert np.abs(prob[0] - prob[1]).max() < RTOL
        assert _rel(*state_out) < RTOL


def test_frozen_input_errors(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "sdk")}
    base = [sys.executable, "-m", "edgesdk.cli", "build", str(SILERO_VAD), "--target", "x86", "--until", "import",
            "--input-shape", "input=1x512", "--input-shape", "state=2x1x128"]
    cases = {"nope=1": "'nope', which is not an input", "sr=16000.5": "does not fit it", "sr=1,2": "2 value(s)",
             "sr": "expected NAME=VALUE"}
    for i, (value, message) in enumerate(cases.items()):
        r = subprocess.run(base + ["-o", str(tmp_path / f"o{i}"), "--input-value", value],
                           capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 2, (value, r.stderr)
        assert message in r.stderr and "Traceback" not in r.stderr, (value, r.stderr)
    # without it, with static shapes the branch for batch > 1 inside the If is ill-typed: the error
    # names the If and points to --input-value
    r = subprocess.run(base + ["-o", str(tmp_path / "none")], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and "If_0" in r.stderr and "--input-value" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


# Declared shapes that contradict the graph: exporters write them, onnxruntime
# warns and runs the model, the import takes the shape the graph computes and names each one.

def _sequence_model(output_dims, value_info_dims=None, input_dims=(1, 5, 4)):
    """x [1, T=5, 4] -> Transpose -> [T, 1, 4] -> MatMul w [4, 3] -> logits [T, 1, 3], as a
    recognizer's head computes; the output declares `output_dims`, `t` (the transposed x) declares
    `value_info_dims` when given."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2], name="to_time_major"),
         helper.make_node("MatMul", ["t", "w"], ["logits"], name="classes")],
        "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(input_dims))],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, output_dims)],
        initializer=[numpy_helper.from_array(w, "w")],
        value_info=[helper.make_tensor_value_info("t", TensorProto.FLOAT, value_info_dims)]
        if value_info_dims is not None else [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def _import_inline(model: onnx.ModelProto, tmp_path: Path):
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    record, stage = _import(path, tmp_path / "o")
    return path, record, onnx.load(str(stage / "model.onnx"))


def test_declared_shapes_that_contradict_the_graph_are_replaced_and_named(tmp_path):
    path, record, model = _import_inline(_sequence_model([1, 5], value_info_dims=[5, 5]), tmp_path)
    assert record["outputs"] == [{"name": "logits", "shape": [5, 1, 3], "dtype": "float32"}]
    assert [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim] == [5, 1, 3]
    assert record["warnings"] == [
        f"{path}: output 'logits' is declared [1, 5] but the graph computes [5, 1, 3]: "
        "the inferred shape replaces the declared one",
        f"{path}: value_info 't' is declared [5, 5] but the graph computes [5, 1, 4]: "
        "the inferred shape replaces the declared one",
    ]
    x = np.random.default_rng(1).normal(size=(1, 5, 4)).astype(np.float32)
    (ref,) = _session(path).run(None, {"x": x})
    (got,) = _session(model).run(None, {"x": x})
    assert got.shape == ref.shape == (5, 1, 3) and _rel(got, ref) < RTOL


def test_a_wrong_dimension_of_the_right_rank_is_replaced_too(tmp_path):
    path, record, _ = _import_inline(_sequence_model([5, 1, 40]), tmp_path)
    assert record["outputs"][0]["shape"] == [5, 1, 3]
    assert record["warnings"] == [f"{path}: output 'logits' is declared [5, 1, 40] but the graph computes "
                                  "[5, 1, 3]: the inferred shape replaces the declared one"]


@pytest.mark.parametrize("output_dims, value_info_dims", [
    ([5, 1, 3], [5, 1, 4]),                    # agrees
    (["T", "batch", 3], ["T", "batch", 4]),    # symbolic: merely more general
    ([-1, 1, 3], [-1, -1, 4]),                 # -1, as Paddle writes a dynamic dimension
    (["T", 1, 3], None),                       # partly symbolic, no value_info at all
])
def test_declared_shapes_that_agree_or_are_more_general_are_not_reported(tmp_path, output_dims, value_info_dims):
    _, record, _ = _import_inline(_sequence_model(output_dims, value_info_dims), tmp_path)
    assert record["outputs"][0]["shape"] == [5, 1, 3]
    assert record["warnings"] == []


def test_an_input_shape_that_contradicts_the_graph_stays_an_error(tmp_path):
    """An input is what the user feeds: x declared [1, 5, 6] cannot meet w [4, 3]; the import does
    not guess which side is wrong, even when the output is declared wrongly as well."""
    from edgesdk.errors import UserError

    path = tmp_path / "m.onnx"
    onnx.save(_sequence_model([1, 5], input_dims=(1, 5, 6)), path)
    with pytest.raises(UserError) as e:
        _import(path, tmp_path / "o")
    assert e.value.code == "import.shape-inference" and "MatMul" in e.value.message
    assert not (tmp_path / "o" / ".build" / "1-import").exists()


def test_real_recognizer_with_a_wrongly_declared_output_imports_and_answers_as_onnxruntime(tmp_path):
    """PP-OCRv4's recognizer (CNN + SVTR sequence head) declares its output [?, ?, 6625]. A copy that
    declares it [1, 40] (the wrong rank, as the issue's CNN+LSTM model did) and a value_info entry of
    the wrong shape: the import names both, takes the computed shapes, and answers as onnxruntime
    does on the original model."""
    from onnx import TensorProto, helper

    from tests.model_zoo import PPOCR_REC, ppocr_rec

    model = onnx.load(str(ppocr_rec()))
    output = model.graph.output[0].name
    middle = model.graph.node[len(model.graph.node) // 2].output[0]
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info(output, TensorProto.FLOAT, [1, 40]))
    model.graph.value_info.append(helper.make_tensor_value_info(middle, TensorProto.FLOAT, [7, 7]))
    path = tmp_path / "rec_declared_wrong.onnx"
    onnx.save(model, path)

    record, stage = _import(path, tmp_path / "o", x=(1, 3, 48, 320))
    assert record["outputs"] == [{"name": output, "shape": [1, 40, 6625], "dtype": "float32"}]
    assert len(record["warnings"]) == 2, record["warnings"]
    assert f"output '{output}' is declared [1, 40] but the graph computes [1, 40, 6625]" in record["warnings"][0]
    assert f"value_info '{middle}' is declared [7, 7] but the graph computes [1, " in record["warnings"][1]

    x = np.random.default_rng(0).uniform(-1, 1, (1, 3, 48, 320)).astype(np.float32)
    (ref,) = _session(PPOCR_REC).run(None, {"x": x})
    (got,) = _session(stage / "model.onnx").run(None, {"x": x})
    assert got.shape == ref.shape == (1, 40, 6625)
    assert _rel(got, ref) < RTOL
