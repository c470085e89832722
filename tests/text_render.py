"""Text lines in a real font (DejaVu Sans, Debian's fonts-dejavu-core), as PP-OCR's recognizer reads them:
the calibration and held-out inputs of the calibration-method tests, and CTC greedy decoding of its output."""

from __future__ import annotations

from pathlib import Path

import numpy as np

FONTS = Path("/usr/share/fonts/truetype/dejavu")
WORDS = ("invoice", "total", "amount", "date", "street", "number", "order", "price", "station", "north", "river",
         "paper", "green", "window", "market", "express", "delivery", "account", "hotel", "coffee", "Berlin",
         "London", "Model", "Serial", "Room", "Exit", "Open", "Monday", "Friday", "April", "June", "Line")
REC_SIZE = (48, 320)  # the recognizer's input height and width (model_zoo.PPOCR_REC_SHAPE)
REC_PREPROCESS = "scale=1/255,mean=0.5,std=0.5"  # PP-OCR's own: (pixel / 255 - 0.5) / 0.5


def text_line_images(n: int, seed: int = 0, size: tuple[int, int] = REC_SIZE) -> tuple[list[np.ndarray], list[str]]:
    """n RGB uint8 images (height x width x 3) of a line of words and numbers in DejaVu Sans or Serif, dark
    ink on a light page, with the strings drawn."""
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    fonts = ["DejaVuSans.ttf", "DejaVuSerif.ttf", "DejaVuSansMono.ttf", "DejaVuSans-Bold.ttf"]
    images, strings = [], []
    h, w = size
    for _ in range(n):
        words = [str(rng.choice(WORDS)) if rng.random() < 0.7 else str(int(rng.integers(1, 99999)))
                 for _ in range(int(rng.integers(2, 4)))]
        text = " ".join(words)
        font = ImageFont.truetype(str(FONTS / fonts[int(rng.integers(len(fonts)))]), int(rng.integers(26, 34)))
        box = font.getbbox(text)
        while box[2] - box[0] > w - 8 and len(text) > 4:  # fit the width: drop the last word
            text = text.rsplit(" ", 1)[0] if " " in text else text[:-1]
            box = font.getbbox(text)
        page = int(rng.integers(200, 250))
        img = Image.new("RGB", (w, h), (page, page, page - int(rng.integers(0, 15))))
        ink = int(rng.integers(10, 70))
        x = int(rng.integers(2, max(3, w - (box[2] - box[0]) - 2)))
        y = (h - (box[3] - box[1])) // 2 - box[1] + int(rng.integers(-2, 3))
        ImageDraw.Draw(img).text((x, y), text, font=font, fill=(ink, ink, ink))
        pixels = np.asarray(img, np.float32) + rng.normal(0, 4, (h, w, 3))
        images.append(np.clip(np.round(pixels), 0, 255).astype(np.uint8))
        strings.append(text)
    return images, strings


def save_pngs(images: list[np.ndarray], directory: Path) -> Path:
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    for k, img in enumerate(images):
        Image.fromarray(img).save(directory / f"line{k:03d}.png")
    return directory


def rec_input(img: np.ndarray) -> np.ndarray:
    """One image as the recognizer's NCHW input: (pixel / 255 - 0.5) / 0.5."""
    x = (img.astype(np.float32) / 255.0 - 0.5) / 0.5
    return np.ascontiguousarray(np.transpose(x, (2, 0, 1))[None])


def ctc_greedy(probabilities: np.ndarray) -> list[int]:
    """Greedy CTC decoding of one [steps, classes] output: the arg max per step, repeats collapsed, the
    blank (class 0) dropped."""
    best = np.argmax(probabilities, axis=-1)
    out, last = [], -1
    for c in best:
        if c != last and c != 0:
            out.append(int(c))
        last = c
    return out


def character_agreement(a: list[int], b: list[int]) -> float:
    """1 - edit distance / the longer length: the share of characters two decodings agree on."""
    if not a and not b:
        return 1.0
    d = np.arange(len(b) + 1)
    for i in range(1, len(a) + 1):
        prev, d[0] = d.copy(), i
        for j in range(1, len(b) + 1):
            d[j] = min(prev[j] + 1, d[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1]))
    return 1.0 - d[len(b)] / max(len(a), len(b))
