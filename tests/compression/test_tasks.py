"""Task measures on small known arrays: each decoder on a hand-made head, box matching, CTC greedy decoding
and character accuracy, mask IoU, top-1/top-5, the generic per-output figures, the verdicts, labels.txt's
formats and the options' refusals."""

from __future__ import annotations

import numpy as np
import pytest

from edgesdk.compression import tasks
from edgesdk.errors import UsageError, UserError


def yolov8_head(columns: list[list[float]]) -> np.ndarray:
    """[1, 4+C, N] from one column per candidate: cx, cy, w, h, then the class scores."""
    return np.asarray(columns, np.float32).T[None]


TWO_BOXES = yolov8_head([
    [50, 50, 20, 20, 0.90, 0.10],    # class 0 at (40, 40)-(60, 60)
    [52, 50, 20, 20, 0.80, 0.05],    # the same object again, a worse score: suppressed (IoU 0.82 > 0.5)
    [150, 100, 40, 30, 0.10, 0.70],  # class 1 at (130, 85)-(170, 115)
    [10, 10, 5, 5, 0.20, 0.10],      # under the score threshold 0.25
    [51, 50, 20, 20, 0.05, 0.60],    # overlaps the first, another class: not suppressed by it
])


def test_yolov8_decoder_keeps_two_boxes_and_suppresses_the_duplicate():
    spec = tasks.parse_options("detection", "yolov8", None)
    [found] = tasks.decode({"output0": TWO_BOXES[:, :, :4]}, spec)
    assert found.boxes.tolist() == [[40, 40, 60, 60], [130, 85, 170, 115]]
    assert found.scores.tolist() == pytest.approx([0.9, 0.7]) and found.classes.tolist() == [0, 1]
    [found] = tasks.decode({"output0": TWO_BOXES}, spec)
    assert found.classes.tolist() == [0, 1, 1]  # suppression is per class
    [found] = tasks.decode({"output0": TWO_BOXES}, {**spec, "score": 0.75})
    assert found.classes.tolist() == [0]


def test_yolov5_decoder_multiplies_objectness_into_the_class_scores():
    head = np.array([[[50, 50, 20, 20, 0.9, 0.5, 1.0],     # 0.9 * 1.0 for class 1
                      [150, 100, 40, 30, 0.2, 1.0, 0.0]]], np.float32)  # 0.2: under 0.25
    [found] = tasks.decode({"o": head}, tasks.parse_options("detection", "yolov5", None))
    assert found.boxes.tolist() == [[40, 40, 60, 60]] and found.classes.tolist() == [1]
    assert found.scores.tolist() == pytest.approx([0.9])


def test_ssd_anchors_on_blazeface_strides_number_896():
    spec = tasks.parse_options("detection", "ssd", "anchors=8:16:16:16,size=128")
    anchors = tasks._anchors(spec)
    assert anchors.shape == (16 * 16 * 2 + 8 * 8 * 6, 4)
    assert anchors[0].tolist() == [0.5 / 16, 0.5 / 16, 1, 1] and anchors[2].tolist() == [1.5 / 16, 0.5 / 16, 1, 1]
    assert anchors[512].tolist() == [0.5 / 8, 0.5 / 8, 1, 1]


def test_ssd_decoder_offsets_boxes_from_their_anchors_and_applies_the_sigmoid_to_logits():
    spec = tasks.parse_options("detection", "ssd", "anchors=64,size=128")  # a 2x2 grid, 2 anchors per cell: 8
    raw = np.zeros((1, 8, 16), np.float32)
    raw[0, 3] = [12.8, -6.4, 32, 64] + [0] * 12  # anchor 3: cell (1, 0), centre (0.75, 0.25)
    logits = np.full((1, 8, 1), -5, np.float32)
    logits[0, 3] = 2.0
    [found] = tasks.decode({"regressors": raw, "classificators": logits}, {**spec, "activation": "auto"})
    assert found.classes.tolist() == [0] and found.scores.tolist() == pytest.approx([1 / (1 + np.exp(-2))])
    cx, cy, w, h = 0.75 + 0.1, 0.25 - 0.05, 0.25, 0.5
    assert found.boxes[0] == pytest.approx([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2])


def test_ssd_decoder_refuses_anchors_that_do_not_fit():
    spec = tasks.parse_options("detection", "ssd", "anchors=8:16:16:16,size=128")
    with pytest.raises(UserError, match="896 anchors for the 8 boxes of output 'b'"):
        tasks.decode({"b": np.zeros((1, 8, 4)), "s": np.zeros((1, 8, 1))}, spec)


def test_iou_of_known_boxes():
    a = np.array([[0, 0, 10, 10]])
    b = np.array([[0, 0, 10, 10], [5, 0, 15, 10], [20, 20, 30, 30], [0, 0, 0, 0]])
    assert tasks.iou(a, b)[0].tolist() == pytest.approx([1.0, 50 / 150, 0.0, 0.0])


def test_matching_counts_kept_lost_and_false_at_iou_half():
    found = tasks.Detections(np.array([[0, 0, 10, 10], [100, 100, 110, 110], [5, 0, 15, 10.0]]),
                             np.array([0.9, 0.8, 0.7]), np.array([0, 0, 1]))
    reference = np.array([[1, 0, 11, 10], [50, 50, 60, 60], [5, 0, 15, 10]])
    # the first kept (IoU 0.82); the second matches nothing; the third is of another class than box 2's
    kept, lost, false, ious = tasks.match(found, reference, np.array([0, 0, 0]), 0.5)
    assert (kept, lost, false) == (1, 2, 2) and ious == pytest.approx([90 / 110])


def test_detection_against_fp32_and_its_verdict():
    fp32 = [{"y": TWO_BOXES}]
    lost_one = TWO_BOXES.copy()
    lost_one[0, 5, 2] = lost_one[0, 5, 4] = 0.1  # int8 loses the class-1 boxes
    spec = tasks.parse_options("detection", "yolov8", None)
    same = tasks.measure_task("detection", fp32, fp32, **spec)
    assert (same["kept"], same["lost"], same["false"], same["detections_fp32"]) == (3, 0, 0, 3)
    assert same["verdict"]["met"] and same["mean_iou"] == 1.0
    worse = tasks.measure_task("detection", fp32, [{"y": lost_one}], **spec)
    assert (worse["kept"], worse["lost"], worse["false"]) == (1, 2, 0)
    assert not worse["verdict"]["met"] and worse["verdict"]["missed"] == ["kept 1 of 3 (33.33% < 95%)"]


def test_detection_against_labelled_boxes(tmp_path):
    (tmp_path / "labels.txt").write_text("# image class x1 y1 x2 y2\n0 0 40 40 60 60\n0 1 131 85 171 115\n"
                                         "0 1 300 300 310 310\n")
    labels = tasks.load_labels(tmp_path, "detection", 1)
    got = tasks.measure_task("detection", [{"y": TWO_BOXES}], [{"y": TWO_BOXES[:, :, :3]}], labels,
                             **tasks.parse_options("detection", "yolov8", None))
    assert got["against"] == "labels" and got["objects"] == 3
    assert (got["kept_fp32"], got["lost_fp32"], got["false_fp32"]) == (2, 1, 1)  # candidate 5 is a false class 1
    assert (got["kept_int8"], got["lost_int8"], got["false_int8"]) == (2, 1, 0)
    assert got["verdict"]["met"]


def test_ctc_greedy_collapses_repeats_and_drops_the_blank():
    steps = [1, 1, 0, 2, 2, 0, 2, 4, 3, 0, 4]  # a a - b b - b ' ' c - ' '
    scores = np.eye(5)[steps][None]
    assert tasks.ctc_greedy(scores, ["a", "b", "c"]) == ["abb c"]  # the last index a space; ends stripped
    assert tasks.ctc_greedy(np.eye(4)[[1, 3, 3, 0, 3]][None], ["a", "b", "c"]) == ["acc"]  # no space class


def test_character_accuracy_is_one_minus_edit_distance_over_length():
    assert tasks.edit_distance("kitten", "sitting") == 3
    assert tasks.characters(["hello world", "abc"], ["hello world", "abd"]) == pytest.approx(1 - 1 / 14)
    assert tasks.characters(["x" * 20], ["ab"]) == 0.0


def test_ocr_against_labels_and_fp32(tmp_path):
    chars = list("abcdefghij")

    def read(*texts: str) -> dict:
        t = 10  # steps, as a recognizer's fixed output
        rows = np.zeros((len(texts), t, len(chars) + 2), np.float32)
        for r, text in enumerate(texts):
            for k in range(t):  # each character then a blank: repeats stay apart
                rows[r, k, chars.index(text[k // 2]) + 1 if k % 2 == 0 and k // 2 < len(text) else 0] = 1
        return {"softmax": rows}

    (tmp_path / "labels.txt").write_text("abc#d\nhij\n")  # '#' is text, not a comment
    labels = tasks.load_labels(tmp_path, "ocr", 2)
    assert labels.texts == ("abc#d", "hij")
    got = tasks.measure_task("ocr", [read("abcd"), read("hij")], [read("abcd"), read("hia")], labels,
                             characters=chars)
    assert got["characters_fp32"] == pytest.approx(1 - 1 / 8) and got["characters_int8"] == pytest.approx(1 - 2 / 8)
    assert got["characters"] == pytest.approx(1 - 1 / 7) and got["lines_same"] == 0.5
    assert not got["verdict"]["met"] and got["verdict"]["missed"][0].startswith("characters 85.71% < 98.00%")
    assert {"label": "hij", "fp32": "hij", "int8": "hia"} in got["examples"]
    with pytest.raises(UserError, match="12 classes per step, and the dictionary 3 characters"):
        tasks.measure_task("ocr", [read("a")], [read("a")], characters=list("abc"))


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_segmentation_iou_over_the_argmax_classes(layout):
    fp32 = np.zeros((1, 3, 4, 4), np.float32)
    fp32[0, 0] = 1  # background everywhere ...
    fp32[0, 1, :2, :2] = 2  # ... but class 1 in the top-left quarter
    int8 = fp32.copy()
    int8[0, 1, 0, 2] = 2  # and one more pixel of class 1
    if layout == "NHWC":
        fp32, int8 = fp32.transpose(0, 2, 3, 1), int8.transpose(0, 2, 3, 1)
    got = tasks.measure_task("segmentation", [{"m": fp32}], [{"m": int8}])
    assert got["classes"] == 3 and got["pixels"] == 15 / 16
    assert got["iou"] == pytest.approx(np.mean([11 / 12, 4 / 5]))  # background, class 1; class 2 absent
    assert not got["verdict"]["met"]


def test_segmentation_of_one_channel_thresholds_it():
    fp32 = np.array([[[[0.9, 0.8], [0.1, 0.2]]]])
    int8 = np.array([[[[0.9, 0.4], [0.6, 0.2]]]])
    got = tasks.measure_task("segmentation", [{"m": fp32}], [{"m": int8}])
    assert got["classes"] == "foreground" and got["iou"] == pytest.approx(1 / 3) and got["pixels"] == 0.5


def test_classification_top1_top5_against_labels_and_fp32(tmp_path):
    rng = np.random.default_rng(0)
    fp32 = rng.standard_normal((6, 10)).astype(np.float32)
    int8 = fp32.copy()
    int8[0, fp32[0].argmax()] = -10  # row 0's best class falls out of int8's top-5 too
    (tmp_path / "labels.txt").write_text("".join(f"{c}\n" for c in fp32.argmax(1)))
    labels = tasks.load_labels(tmp_path, "classification", 6)
    got = tasks.measure_task("classification", [{"p": r[None]} for r in fp32], [{"p": r[None]} for r in int8], labels)
    assert got["top1_fp32"] == 1.0 and got["top1_int8"] == pytest.approx(5 / 6)
    assert got["top5_fp32"] == 1.0 and got["top5_int8"] == pytest.approx(5 / 6)
    assert got["top1_agreement"] == pytest.approx(5 / 6) and not got["verdict"]["met"]
    free = tasks.measure_task("classification", [{"p": fp32}], [{"p": fp32}])
    assert free["against"] == "fp32" and free["top1_agreement"] == 1.0 and free["verdict"]["met"]


def test_generic_cosine_and_errors_as_shares_of_the_range():
    a = np.array([0.0, 1.0, 2.0, 4.0])
    got = tasks.measure_task("generic", [{"y": a}], [{"y": a + [0, 0, 0.4, 0]}])
    f, b = got["outputs"]["y"], a + [0, 0, 0.4, 0]
    assert f["max_error"] == pytest.approx(0.1) and f["mean_error"] == pytest.approx(0.025)
    assert f["cosine"] == pytest.approx(a @ b / np.linalg.norm(a) / np.linalg.norm(b), abs=1e-6)
    assert got["verdict"]["met"]


@pytest.mark.parametrize("task, decoder, options, needle", [
    ("pose", None, None, "--task pose: expected one of classification"),
    ("detection", None, None, "--task detection needs --decoder"),
    ("ocr", "yolov8", None, "--decoder yolov8 goes with --task detection only"),
    ("detection", "rcnn", None, "--decoder rcnn: expected one of yolov8, yolov5, ssd"),
    ("detection", "yolov8", "score=high", "score=high: not a number"),
    ("detection", "yolov8", "iou=1.5", "iou=1.5: outside [0, 1]"),
    ("detection", "yolov8", "anchors=8:16", "'anchors=8:16' is not KEY=VALUE with KEY one of"),
    ("detection", "ssd", "anchors=8:16", "anchors=8:16 needs size="),
    ("detection", "ssd", "anchors=0:16,size=128", "anchors=0:16: a stride of 0"),
    ("detection", "yolov5", "max=0", "max=0: fewer than 1 detection"),
    ("ocr", None, "dictionary=missing.txt", "dictionary=missing.txt: no such file"),
    ("ocr", None, "threshold=0.5", "'threshold=0.5' is not KEY=VALUE"),
])
def test_options_that_do_not_parse_are_refused(task, decoder, options, needle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as e:
        tasks.parse_options(task, decoder, options)
    assert needle in e.value.message and e.value.hint and e.value.exit_code == 2


@pytest.mark.parametrize("task, text, needle", [
    ("classification", "1\ncat\n", "labels.txt:2: 'cat' is not an integer class"),
    ("detection", "0 1 2 3 4\n", "labels.txt:1: '0 1 2 3 4' is not INDEX CLASS X1 Y1 X2 Y2"),
    ("detection", "0 0 1 2 3 nan\n", "labels.txt:1: '0 0 1 2 3 nan' is not INDEX CLASS X1 Y1 X2 Y2"),
    ("detection", "\n\n2 0 1 1 2 2\n", "labels.txt:3: image 2, and --eval holds 2 image(s) (0 to 1)"),
])
def test_bad_labels_name_their_line(tmp_path, task, text, needle):
    (tmp_path / "labels.txt").write_text(text)
    with pytest.raises(UserError) as e:
        tasks.load_labels(tmp_path, task, 2)
    assert needle in e.value.message and e.value.hint and e.value.exit_code == 1


def test_labels_of_the_wrong_count_are_refused(tmp_path):
    (tmp_path / "labels.txt").write_text("one line\n")
    labels = tasks.load_labels(tmp_path, "ocr", 2)
    rows = {"y": np.eye(3)[[1, 0, 2]][None].repeat(2, 0)}
    with pytest.raises(UserError, match="1 lines of text for 2 lines read from output 'y'"):
        tasks.measure_task("ocr", [rows], [rows], labels, characters=["a", "b"])
    assert tasks.load_labels(tmp_path / "none", "ocr", 2) is None


def test_a_dictionary_from_the_model_metadata_or_a_file(tmp_path):
    assert tasks.dictionary(None, {"character": "a\nb\n'\n"}) == ["a", "b", "'"]
    assert tasks.dictionary(None, {}) is None
    (tmp_path / "keys.txt").write_bytes(b"x\n\xff\n")
    with pytest.raises(UserError, match=r"keys.txt:2: not UTF-8 text"):
        tasks.dictionary(tmp_path / "keys.txt")


def test_an_output_that_does_not_fit_the_task_is_named():
    with pytest.raises(UserError, match=r"output 'y' has shape \[1, 4, 10\]: not \[B, 4\+C, N\] as yolov8"):
        tasks.measure_task("detection", [{"y": np.zeros((1, 4, 10))}], [{"y": np.zeros((1, 4, 10))}],
                           **tasks.parse_options("detection", "yolov8", None))
    with pytest.raises(UserError, match="the model has no output 'logits'"):
        tasks.measure_task("classification", [{"y": np.zeros((1, 4))}], [{"y": np.zeros((1, 4))}], output="logits")
