"""Render lines of real text with a real font: calibration and held-out images for a text recognizer.

    python packaging/render_text_lines.py --model MODEL.onnx --out DIR [--calib 32] [--eval 24] [--seed 0]

writes DIR/calib/lineNNN.png (calibration images) and DIR/eval/lineNNN.png with DIR/eval/labels.txt (the
held-out images and their strings, one line each, in file-name order: what `edgesdk build --eval DIR --task
ocr` reads). The two sets are drawn from different seeds, and no held-out line shows a calibration line's text.

Each line is one to four English words, numbers and punctuation, drawn only from characters in the
recognizer's dictionary (PP-OCR's character list, which its ONNX file carries as the `character`
metadata), in DejaVu Sans (Debian's fonts-dejavu-core) at 24-32 px, dark ink on a light background, on a
canvas of the model's input size (48x320 for PP-OCRv4's recognizer): the build preprocesses the PNGs as
PP-OCR does, (pixel / 255 - 0.5) / 0.5, without resizing them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

FONT = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")
SIZE = (48, 320)  # height, width: PP-OCRv4's recognizer input as the demo builds it
WORDS = (
    "the of and to in is for on with as by at from this that be are was it or an not can all your one has "
    "more will new about time order total price date invoice number page item amount paid due account name "
    "address street city phone email office room floor door open closed exit entrance warning danger caution "
    "stop slow left right north south east west station platform train bus ticket gate arrival departure "
    "delayed cancelled coffee tea milk sugar bread water fresh daily special menu lunch dinner breakfast "
    "store market bank hotel hospital school library museum park garden river bridge road avenue square "
    "monday tuesday wednesday thursday friday saturday sunday january march april june july august october "
    "december model serial version battery power voltage current input output level speed weight length "
    "width height temperature pressure system control unit sensor camera light sound signal green red blue "
    "black white yellow orange small large medium quick brown fox jumps over lazy dog hello world welcome "
    "thank you please help information service customer support parking only private public free sale"
).split()


def dictionary(model: Path) -> set[str]:
    """The characters a PP-OCR recognizer reads: its ONNX file's `character` metadata, one per line."""
    import onnx

    proto = onnx.load(str(model), load_external_data=False)
    text = next((p.value for p in proto.metadata_props if p.key == "character"), None)
    if text is None:
        sys.exit(f"render_text_lines: {model} carries no 'character' metadata: not a PP-OCR recognizer export")
    return set(text.splitlines()) | {" "}


def _phrase(rng: np.random.Generator) -> str:
    words = []
    for _ in range(int(rng.integers(1, 5))):
        kind = rng.random()
        if kind < 0.15:
            words.append(str(int(rng.integers(0, 10000))))
        elif kind < 0.22:
            words.append(f"{rng.integers(0, 1000)}.{rng.integers(0, 100):02d}")
        elif kind < 0.27:
            words.append(f"{rng.integers(1, 13):02d}/{rng.integers(1, 29):02d}")
        else:
            w = str(rng.choice(WORDS))
            style = rng.random()
            words.append(w.upper() if style < 0.1 else w.capitalize() if style < 0.4 else w)
    text = " ".join(words)
    if rng.random() < 0.3:
        text += str(rng.choice([".", ",", ":", "!", "?", ";"]))
    return text


def render(n: int, seed: int, font: Path = FONT, size: tuple[int, int] = SIZE,
           alphabet: set[str] | None = None,
           exclude: frozenset[str] = frozenset()) -> tuple[list[np.ndarray], list[str]]:
    """n RGB uint8 images of `size` (height, width), each a line of text, and the strings they show.
    Words that would not fit the width are left off; every character is in `alphabet` where given; no
    string is one of `exclude`."""
    from PIL import Image, ImageDraw, ImageFont

    if not font.is_file():
        sys.exit(f"render_text_lines: no font at {font}: install Debian's fonts-dejavu-core (make system)")
    rng = np.random.default_rng(seed)
    height, width = size
    images, strings = [], []
    while len(images) < n:
        text = _phrase(rng)
        if alphabet is not None and not set(text) <= alphabet:
            continue
        face = ImageFont.truetype(str(font), int(rng.integers(24, 33)))
        x = int(rng.integers(3, 13))
        while face.getlength(text) + x > width - 4 and " " in text:
            text = text.rsplit(" ", 1)[0]
        if face.getlength(text) + x > width - 4 or text in exclude:
            continue
        background = int(rng.integers(205, 256))
        ink = int(rng.integers(0, 70))
        img = Image.new("L", (width, height), background)
        _, top, _, bottom = face.getbbox(text)
        y = (height - (bottom - top)) // 2 - top + int(rng.integers(-3, 4))  # centred, give or take 3 px
        ImageDraw.Draw(img).text((x, y), text, fill=ink, font=face)
        pixels = np.asarray(img, np.float32) + rng.normal(0, 4, (height, width))
        grey = np.clip(np.round(pixels), 0, 255).astype(np.uint8)
        images.append(np.repeat(grey[..., None], 3, axis=2))
        strings.append(text)
    return images, strings


def write(out: Path, images: list[np.ndarray], strings: list[str] | None) -> None:
    from PIL import Image

    out.mkdir(parents=True, exist_ok=True)
    for k, img in enumerate(images):
        Image.fromarray(img).save(out / f"line{k:03d}.png")
    if strings is not None:
        (out / "labels.txt").write_text("".join(s + "\n" for s in strings), encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="the recognizer (its dictionary decides the characters)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--calib", type=int, default=32, help="calibration lines")
    p.add_argument("--eval", type=int, default=24, help="held-out lines, with their strings in labels.txt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--font", type=Path, default=FONT)
    a = p.parse_args(argv)
    alphabet = dictionary(a.model)
    calib, seen = render(a.calib, a.seed, a.font, alphabet=alphabet)
    held, strings = render(a.eval, a.seed + 1, a.font, alphabet=alphabet, exclude=frozenset(seen))
    write(a.out / "calib", calib, None)
    write(a.out / "eval", held, strings)
    print(f"render_text_lines: {len(calib)} calibration lines in {a.out / 'calib'}, {len(held)} held-out lines "
          f"with their strings in {a.out / 'eval'}")


if __name__ == "__main__":
    main()
