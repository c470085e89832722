"""`--eval DIR --task T` end to end: the finished bundle against the fp32 model on held-out real inputs (text
lines rendered in DejaVu Sans by packaging/render_text_lines.py), the figures in the manifest, the build's
log and `inspect`; the OCR measure on PP-OCRv4's recognizer with its own dictionary; bad eval data and
options refused with their exit codes."""

from __future__ import annotations

import importlib.util
import json
import shutil

import numpy as np
import onnx
import pytest
from PIL import Image

from edgesdk.compression import tasks
from edgesdk.ir.calibration import load_image, parse_preprocess
from edgesdk.pipeline import BuildOptions, build, stage_dir
from edgesdk.runtime.executor import BundleModel
from edgesdk.runtime.manifest import Manifest
from tests import model_zoo
from tests.test_cli import ROOT, assert_user_facing, edgesdk

pytestmark = pytest.mark.slow  # real models built with --eval


def renderer():
    spec = importlib.util.spec_from_file_location("render_text_lines", ROOT / "packaging" / "render_text_lines.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_eval_measures_the_classifier_bundle_on_rendered_text_lines(arm_ppocr, text_calib, tuning_db, tmp_path):
    """The arm_ppocr fixture's build copied and built again with --eval: its stages are reused where the
    options agree (the compress stage and the package stage run again: --eval is among their options)."""
    lines, _ = renderer().render(8, seed=7, size=(48, 192))
    data = tmp_path / "eval"
    data.mkdir()
    for k, img in enumerate(lines + [img[::-1, ::-1] for img in lines]):  # upright (class 0), then turned (1)
        Image.fromarray(img).save(data / f"line{k:02d}.png")
    (data / "labels.txt").write_text("0\n" * 8 + "1\n" * 8)
    out = tmp_path / "out"
    shutil.copytree(arm_ppocr.out / ".build", out / ".build")
    logs: list[str] = []
    result = build(BuildOptions(model=model_zoo.ppocr_cls(), target="arm_2tpu", out=out,
                                input_shapes={"x": (1, 3, 48, 192)}, tuning_db=tuning_db / "arm_2tpu",
                                calib=text_calib, calib_samples=16, calib_preprocess=model_zoo.PPOCR_CLS_PREPROCESS,
                                calib_method="percentile", eval_data=data, task="classification"),
                   log=logs.append)
    got = Manifest.load(result.bundle).accuracy["task"]
    assert got == json.loads((stage_dir(out, "package") / "record.json").read_text())["accuracy"]["task"]

    # the figures computed here again: fp32 by onnxruntime, int8 by the bundle itself, on the same inputs
    import onnxruntime as ort

    pre = parse_preprocess(model_zoo.PPOCR_CLS_PREPROCESS, (1, 3, 48, 192))
    feeds = [load_image(p, pre) for p in sorted(data.glob("*.png"))]
    session = ort.InferenceSession(str(model_zoo.ppocr_cls()))
    fp32 = np.array([np.argmax(session.run(None, {"x": x})[0]) for x in feeds])
    twins = {p.stem: p for p in (stage_dir(out, "package") / "twin").glob("*")}
    bundle = BundleModel(result.bundle, artifacts=twins, log=lambda s: None)
    output = bundle.manifest.outputs[0].name
    int8 = np.array([np.argmax(bundle.run({"x": x})[output]) for x in feeds])
    bundle.release()
    truth = np.array([0] * 8 + [1] * 8)
    assert got["task"] == "classification" and got["against"] == "labels" and got["rows"] == got["samples"] == 16
    assert got["top1_fp32"] == pytest.approx(np.mean(fp32 == truth), abs=1e-6)
    assert got["top1_fp32"] > 0.6  # the real classifier reads real text lines: the inputs are right
    assert got["top1_int8"] == pytest.approx(np.mean(int8 == truth), abs=1e-6)
    assert got["top1_agreement"] == pytest.approx(np.mean(int8 == fp32), abs=1e-6)
    assert got["verdict"]["met"] == (got["top1_int8"] >= 0.99 * got["top1_fp32"] - 1e-12)
    assert any(line.startswith("package: task classification on 16 --eval sample(s), against labels.txt: top-1 fp32")
               for line in logs), logs
    proc = edgesdk("inspect", str(result.bundle))
    assert f"task        classification on 16 --eval sample(s): {got['summary']}" in proc.stdout, proc.stdout


def test_ocr_measure_reads_rendered_lines_with_the_recognizers_own_dictionary():
    """PP-OCRv4's recognizer in fp32 (onnxruntime) on lines rendered in DejaVu Sans: CTC decoding with the
    character list its ONNX file carries reads them, so the renderer, the decoder and the dictionary agree."""
    import onnxruntime as ort

    model = onnx.load(str(model_zoo.ppocr_rec()), load_external_data=False)
    chars = tasks.dictionary(None, {p.key: p.value for p in model.metadata_props})
    assert len(chars) + 2 == model.graph.output[0].type.tensor_type.shape.dim[2].dim_value
    images, strings = renderer().render(6, seed=3, alphabet=set(chars) | {" "})
    session = ort.InferenceSession(str(model_zoo.ppocr_rec()))
    name = session.get_outputs()[0].name
    runs = [{name: session.run(None, {"x": ((img.astype(np.float32) / 255 - 0.5) / 0.5).transpose(2, 0, 1)[None]})[0]}
            for img in images]
    got = tasks.measure_task("ocr", runs, runs, tasks.Labels("labels.txt", texts=tuple(strings)), characters=chars)
    assert got["lines"] == 6 and got["characters"] == 1.0
    assert got["characters_fp32"] >= 0.95, got["examples"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """softmax(x W), 16 inputs, 4 classes; ten held-out samples with labels."""
    root = tmp_path_factory.mktemp("eval-tiny")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 4)).astype(np.float32)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w"], ["m"]), onnx.helper.make_node("Softmax", ["m"], ["p"])], "tiny",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, (1, 16))],
        [onnx.helper.make_tensor_value_info("p", onnx.TensorProto.FLOAT, (1, 4))],
        [onnx.numpy_helper.from_array(w, "w")])
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=9),
              str(root / "tiny.onnx"))
    x = rng.standard_normal((10, 1, 16)).astype(np.float32)
    data = root / "eval"
    data.mkdir()
    np.save(data / "a.npy", x)
    labels = [int(np.argmax(s @ w)) if k % 3 else 0 for k, s in enumerate(x)]
    (data / "labels.txt").write_text("".join(f"{c}\n" for c in labels))
    return root / "tiny.onnx", data, x @ w, np.array(labels)


def test_eval_without_pruning_records_the_task_and_refuses_bad_data(tiny, tmp_path):
    model, data, logits, labels = tiny
    common = ("-t", "x86", "--low-memory", "--tuning-db", str(tmp_path / "db"))
    proc = edgesdk("build", str(model), "-o", str(tmp_path / "b"), *common, "--eval", str(data))
    assert proc.returncode == 0, proc.stderr
    got = Manifest.load(tmp_path / "b" / "bundle").accuracy["task"]
    top1 = float(np.mean(np.argmax(logits[:, 0], 1) == labels))
    assert got["task"] == "classification" and got["top1_fp32"] == pytest.approx(top1) and top1 < 1
    assert got["top1_int8"] == pytest.approx(top1)  # a float bundle
    assert "package: task classification on 10 --eval sample(s), against labels.txt" in proc.stderr

    # bad data: the same stages in a fresh directory, so that only the package stage runs, and fails
    for text, args, needle in [
            ("1\n" * 9, (), f"{data / 'labels.txt'}: 9 labels for 10 rows of output 'p'"),
            (None, ("--task", "ocr"), "output 'p' has shape [1, 4]: not per-step class scores [B, T, C]")]:
        if text is not None:
            (data / "labels.txt").write_text(text)
        out = tmp_path / f"o{len(args)}"
        shutil.copytree(tmp_path / "b" / ".build", out / ".build")
        proc = edgesdk("build", str(model), "-o", str(out), *common, "--eval", str(data), *args)
        assert_user_facing(proc, 1, needle)
        assert not (out / "bundle").exists()
        (data / "labels.txt").write_text("".join(f"{c}\n" for c in labels))


@pytest.mark.parametrize("args, needle", [
    (["--task", "ocr"], "--task, --decoder and --task-options need --eval DIR"),
    (["--eval", ".", "--task", "detection"], "--task detection needs --decoder"),
    (["--eval", ".", "--decoder", "yolov8"], "--decoder and --task-options need --task"),
    (["--eval", ".", "--task", "ocr", "--task-options", "dictionary=keys.txt"], "dictionary=keys.txt: no such file"),
])
def test_task_options_that_do_not_go_together_are_refused(tiny, tmp_path, args, needle):
    proc = edgesdk("build", str(tiny[0]), "-t", "x86", "-o", str(tmp_path / "o"), *args, cwd=tmp_path)
    assert_user_facing(proc, 2, needle)
    assert not (tmp_path / "o").exists()
