"""Real models for the tests, made offline and cached under `.cache/models/`.

- MobileNetV2 from `tf.keras.applications` with `weights=None` (random weights, fixed seed),
  exported to ONNX with tf2onnx, as a Keras user would.
- The PP-OCR text-direction classifier, a real pretrained model that the `rapidocr-onnxruntime`
  wheel carries; `make models` fetches it with `pip download --no-deps` (no network here).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("EDGESDK_MODEL_CACHE", ROOT / ".cache" / "models"))

PPOCR_CLS = CACHE / "ch_ppocr_mobile_v2.0_cls_infer.onnx"
PPOCR_CLS_SHAPE = "x=1x3x48x192"


def ppocr_cls() -> Path:
    if not PPOCR_CLS.exists():
        raise FileNotFoundError(f"{PPOCR_CLS} is missing: run `make models` first")
    return PPOCR_CLS


def mobilenet_v2(size: int = 224, alpha: float = 1.0) -> Path:
    """MobileNetV2 (weights=None, seed 0) as ONNX, NHWC input of 1x{size}x{size}x3."""
    path = CACHE / f"mobilenet_v2_{size}_{alpha}.onnx"
    if path.exists():
        return path
    import tensorflow as tf
    import tf2onnx

    tf.keras.utils.set_random_seed(0)
    model = tf.keras.applications.MobileNetV2(
        input_shape=(size, size, 3), alpha=alpha, weights=None, classifier_activation=None
    )
    spec = (tf.TensorSpec((1, size, size, 3), tf.float32, name="input"),)
    proto, _ = tf2onnx.convert.from_keras(model, input_signature=spec, opset=13)
    proto.ir_version = min(proto.ir_version, 10)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(proto.SerializeToString())
    tmp.rename(path)
    return path


if __name__ == "__main__":
    print(mobilenet_v2())
    print(mobilenet_v2(96, 0.35))
