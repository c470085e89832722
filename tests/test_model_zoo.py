"""The real inputs tests/model_zoo.py gives (photographs, scanned pages, faces, rendered text) and PP-OCR's
dictionary: what each returns. `make models` fetches the files; a missing one fails here, never skips."""

from __future__ import annotations

import numpy as np
import onnx

from tests import model_zoo


def _is_rgb_uint8(img: np.ndarray) -> bool:
    return img.ndim == 3 and img.shape[2] == 3 and img.dtype == np.uint8


def test_photos_are_the_sample_photographs_as_rgb_uint8():
    photos = model_zoo.photos()
    assert len(photos) == len(model_zoo.PHOTOS) == 13
    assert all(_is_rgb_uint8(p) and min(p.shape[:2]) >= 256 for p in photos)
    assert all(p.std() > 10 for p in photos)  # pictures, not flat fields
    astronaut = photos[model_zoo.PHOTOS.index("astronaut.png")]
    assert astronaut.shape == (512, 512, 3) and not np.array_equal(astronaut[..., 0], astronaut[..., 1])


def test_documents_are_two_scanned_pages_of_dark_ink_on_light_paper():
    pages = model_zoo.documents()
    assert [p.shape for p in pages] == [(191, 384, 3), (172, 448, 3)]
    for p in pages:
        assert _is_rgb_uint8(p) and (p < 100).any() and np.median(p) > 120


def test_faces_are_two_photographed_faces_then_lfw_subsets_hundred():
    faces = model_zoo.faces()
    assert len(faces) == 102 and all(_is_rgb_uint8(f) and f.shape[0] == f.shape[1] for f in faces)
    assert [f.shape[0] for f in faces[:2]] == [142, 291]  # 1.5 times each face box
    assert all(f.shape == (25, 25, 3) for f in faces[2:])
    assert all(np.array_equal(f[..., 0], f[..., 2]) for f in faces[2:])  # grey, on three channels
    assert len({f.tobytes() for f in faces}) == 102


def test_the_dictionary_and_the_blank_and_space_are_the_recognizers_classes():
    chars = model_zoo.ppocr_dictionary()
    output = onnx.load(str(model_zoo.ppocr_rec()), load_external_data=False).graph.output[0]
    assert len(chars) + 2 == output.type.tensor_type.shape.dim[-1].dim_value == 6625
    assert "" not in chars and " " not in chars
    assert set("0123456789abcxyzABCXYZ.,:-") <= set(chars)


def test_rendered_text_lines_draw_their_strings_in_dictionary_characters():
    images, strings = model_zoo.rendered_text_lines(6, seed=3)
    assert images.shape == (6, 48, 320, 3) and images.dtype == np.uint8 and len(strings) == 6
    allowed = {*model_zoo.ppocr_dictionary(), " "}
    assert all(s and s == s.strip() and set(s) <= allowed for s in strings)
    assert any(c.isdigit() for s in strings for c in s) and any(c.isalpha() for s in strings for c in s)
    for img in images:
        grey = img.mean(-1)
        assert grey.min() < 110 and np.median(grey) > 170  # dark ink, light paper
        inked = np.nonzero((grey < np.median(grey) - 60).any(0))[0]
        assert inked[0] < 20 and inked[-1] > 320 * 0.7  # the text spans the line
    again, same = model_zoo.rendered_text_lines(6, seed=3)
    other, different = model_zoo.rendered_text_lines(6, seed=4)
    assert np.array_equal(images, again) and strings == same and strings != different
    wide, _ = model_zoo.rendered_text_lines(2, seed=3, width=192)
    assert wide.shape == (2, 48, 192, 3)


def test_the_fp32_recognizer_reads_the_rendered_lines():
    """Real text in a real font: PP-OCRv4's recognizer (onnxruntime, fp32), read by `--task ocr`'s CTC decoding,
    reads at least 95 % of the characters (measured: all of them on these 8 lines)."""
    import onnxruntime as ort

    from edgesdk.compression import tasks

    images, strings = model_zoo.rendered_text_lines(8, seed=5)
    sess = ort.InferenceSession(str(model_zoo.ppocr_rec()), providers=["CPUExecutionProvider"])
    x = ((images.astype(np.float32) / 255 - 0.5) / 0.5).transpose(0, 3, 1, 2)
    scores = np.concatenate([sess.run(None, {"x": xi[None]})[0] for xi in x])
    read = tasks.ctc_greedy(scores, model_zoo.ppocr_dictionary())
    assert tasks.characters(read, strings) >= 0.95, list(zip(read, strings))


def test_rendered_text_pages_are_lines_of_ink_on_a_light_page():
    pages = model_zoo.rendered_text_pages(2, seed=1, size=320)
    assert pages.shape == (2, 320, 320, 3) and pages.dtype == np.uint8
    for page in pages:
        grey = page.mean(-1)
        rows = (grey < np.median(grey) - 60).any(1)
        assert np.median(grey) > 170 and 0.05 < rows.mean() < 0.9  # some rows inked, not all
    assert np.array_equal(pages, model_zoo.rendered_text_pages(2, seed=1, size=320))
    assert not np.array_equal(pages, model_zoo.rendered_text_pages(2, seed=2, size=320))
