"""Real models for the tests, made offline and cached under `.cache/models/`.

- MobileNetV2 from `tf.keras.applications` with `weights=None` (random weights, fixed seed),
  exported to ONNX with tf2onnx, as a Keras user would.
- The PP-OCR text-direction classifier, a real pretrained model that the `rapidocr-onnxruntime`
  wheel carries; `make models` fetches it with `pip download --no-deps` (no network here).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("EDGESDK_MODEL_CACHE", ROOT / ".cache" / "models"))

PPOCR_CLS = CACHE / "ch_ppocr_mobile_v2.0_cls_infer.onnx"
PPOCR_CLS_SHAPE = "x=1x3x48x192"
PPOCR_REC = CACHE / "ch_PP-OCRv4_rec_infer.onnx"
PPOCR_REC_SHAPE = "x=1x3x48x320"
# silero-vad 6.2.3: `sr` (8000 or 16000) selects one of two If branches with different front ends
SILERO_VAD = CACHE / "silero_vad.onnx"
# nudenet 3.4.2's detector: a YOLOv8n (Ultralytics 8.2.46 export, input images 1x3xHxW, output [1, 4 + 18, anchors])
YOLOV8N = CACHE / "320n.onnx"
YOLOV8N_SHA256 = "c15d8273adad2d0a92f014cc69ab2d6c311a06777a55545f2c4eb46f51911f0f"


def ppocr_cls() -> Path:
    if not PPOCR_CLS.exists():
        raise FileNotFoundError(f"{PPOCR_CLS} is missing: run `make models` first")
    return PPOCR_CLS


def ppocr_rec() -> Path:
    """PP-OCRv4's text recognizer (SVTR: convolutions, attention, layer norms)."""
    if not PPOCR_REC.exists():
        raise FileNotFoundError(f"{PPOCR_REC} is missing: run `make models` first")
    return PPOCR_REC


def yolov8n() -> Path:
    """A real YOLOv8n detector with trained weights (its classes: nudity and faces, a content filter's),
    exported by Ultralytics with dynamic height and width: the anchor-grid head of every YOLOv8 export."""
    if not YOLOV8N.exists():
        raise FileNotFoundError(f"{YOLOV8N} is missing: run `make models` first")
    import hashlib

    digest = hashlib.sha256(YOLOV8N.read_bytes()).hexdigest()
    if digest != YOLOV8N_SHA256:
        raise ValueError(f"{YOLOV8N} has sha256 {digest}, not nudenet 3.4.2's {YOLOV8N_SHA256}: run `make models`")
    return YOLOV8N


def mobilenet_v2(size: int = 224, alpha: float = 1.0) -> Path:
    """MobileNetV2 (weights=None, seed 0, BatchNorm statistics set) as ONNX, NHWC input 1x{size}x{size}x3."""
    path = CACHE / f"mobilenet_v2_{size}_{alpha}_bnstats.onnx"
    if path.exists():
        return path
    import tensorflow as tf

    tf.keras.utils.set_random_seed(0)
    model = tf.keras.applications.MobileNetV2(
        input_shape=(size, size, 3), alpha=alpha, weights=None, classifier_activation=None
    )
    return _with_bn_statistics_as_onnx(model, size, 1, path)


def _with_bn_statistics_as_onnx(model, size: int, batch: int, path: Path) -> Path:
    """`model` (Keras, random weights) with its BatchNorm statistics set, exported to ONNX at `path` with a
    fixed NHWC input {batch}x{size}x{size}x3. weights=None leaves every BatchNorm at mean 0 / variance 1, so
    activations shrink layer by layer to ~1e-10, which int8 cannot represent; one training-mode pass with
    momentum 0 sets the statistics a trained network would have on such inputs, the weights stay random."""
    import tensorflow as tf
    import tf2onnx

    for layer in model.layers:
        if isinstance(layer, tf.keras.layers.BatchNormalization):
            layer.momentum = 0.0
    model(tf.random.stateless_uniform((16, size, size, 3), seed=(1, 2), minval=-1, maxval=1), training=True)
    spec = (tf.TensorSpec((batch, size, size, 3), tf.float32, name="input"),)
    proto, _ = tf2onnx.convert.from_keras(model, input_signature=spec, opset=13)
    proto.ir_version = min(proto.ir_version, 10)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(proto.SerializeToString())
    tmp.rename(path)
    return path


def with_torch_bn_statistics(module, images: np.ndarray):
    """`module` (PyTorch, random weights) with its BatchNorm statistics those of `images` (NCHW float32), in
    eval mode. As with Keras above: a library's initialization leaves every BatchNorm at mean 0 / variance 1,
    and transformers' MobileNetV2 draws its convolutions' weights at a deviation of 0.02, so its logits are
    some 1e-22 and the same for every image; one training-mode pass with cumulative statistics (momentum
    None) sets those a trained network would have on such inputs, the weights stay random."""
    import torch

    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for m in norms:
        m.reset_parameters()  # statistics, and scale 1 / shift 0 as PyTorch makes them (transformers draws
        m.momentum = None     # EfficientNet's scales at a deviation of 0.02: 1e-28 logits even with statistics)
    module.train()
    with torch.no_grad():
        module(torch.from_numpy(images))
    return module.eval()


def resnet18(size: int = 224, batch: int = 1, classes: int = 1000) -> Path:
    """ResNet-18 (He et al.: 7x7 stem, max pool, four stages of two basic blocks, 64-512 channels) built
    in Keras, random weights (seed 0, BatchNorm statistics set as for MobileNetV2), as ONNX with a fixed
    NHWC input {batch}x{size}x{size}x3. Keras has no ResNet-18 among its applications."""
    path = CACHE / f"resnet18_{size}_b{batch}_{classes}.onnx"
    if path.exists():
        return path
    import tensorflow as tf

    layers = tf.keras.layers
    tf.keras.utils.set_random_seed(0)

    def bn_relu(x, relu=True):
        x = layers.BatchNormalization()(x)
        return layers.ReLU()(x) if relu else x

    def block(x, filters, stride):
        y = bn_relu(layers.Conv2D(filters, 3, stride, padding="same", use_bias=False)(x))
        y = bn_relu(layers.Conv2D(filters, 3, 1, padding="same", use_bias=False)(y), relu=False)
        if stride != 1 or x.shape[-1] != filters:
            x = bn_relu(layers.Conv2D(filters, 1, stride, use_bias=False)(x), relu=False)
        return layers.ReLU()(layers.Add()([x, y]))

    inputs = tf.keras.Input((size, size, 3))
    x = bn_relu(layers.Conv2D(64, 7, 2, padding="same", use_bias=False)(inputs))
    x = layers.MaxPooling2D(3, 2, padding="same")(x)
    for filters, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        x = block(block(x, filters, stride), filters, 1)
    x = layers.Dense(classes)(layers.GlobalAveragePooling2D()(x))
    return _with_bn_statistics_as_onnx(tf.keras.Model(inputs, x, name="resnet18"), size, batch, path)


DENSENET121 = (6, 12, 24, 16)


def captioner(frames: int = 2, size: int = 32, units: int = 32, steps: int = 4, words: int = 100,
              blocks: tuple[int, ...] = DENSENET121) -> Path:
    """The DenseNet-LSTM video captioner edgesdk was designed around, at sizes a CI run can afford:
    `frames` frames of size x size x 3 -> a DenseNet per frame (no top, average pool; DenseNet121's
    dense blocks of 6, 12, 24 and 16 layers unless `blocks` says otherwise) -> LSTM(units) encoder ->
    LSTM(units) decoder over `steps` steps -> Dense over `words`. The architecture is the benchmark's
    (benchmarks/bench_schedule.py builds 8 x 224 x 224, DenseNet121, LSTM(512), 16 steps, 10,000 words);
    random weights, seed 0, BatchNorm statistics set as for MobileNetV2. A .keras file: the build imports
    it through tf2onnx, whose LSTM Loops import unrolls."""
    depth = "" if blocks == DENSENET121 else "_densenet" + "-".join(map(str, blocks))
    path = CACHE / f"captioner_{frames}x{size}_{units}_{steps}_{words}{depth}.keras"
    if path.exists():
        return path
    import tensorflow as tf

    layers = tf.keras.layers
    tf.keras.utils.set_random_seed(0)
    if blocks == DENSENET121:
        cnn = tf.keras.applications.DenseNet121(include_top=False, weights=None, pooling="avg", input_shape=(size, size, 3))
    else:
        cnn = _dense_net(blocks, size)
    for layer in cnn.layers:
        if isinstance(layer, tf.keras.layers.BatchNormalization):
            layer.momentum = 0.0
    cnn(tf.random.stateless_uniform((16, size, size, 3), seed=(1, 2), minval=-1, maxval=1), training=True)
    clip = tf.keras.Input((frames, size, size, 3), batch_size=1, name="frames")
    features = layers.TimeDistributed(cnn)(clip)
    _, h, c = layers.LSTM(units, return_state=True)(features)
    decoded = layers.LSTM(units, return_sequences=True)(layers.RepeatVector(steps)(h), initial_state=[h, c])
    model = tf.keras.Model(clip, layers.Dense(words)(decoded))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.keras")
    model.save(tmp)
    tmp.rename(path)
    return path


def _dense_net(blocks: tuple[int, ...], size: int):
    """keras.applications' DenseNet (growth rate 32, compression 0.5, no top, average pool) with dense
    blocks of `blocks` layers: DenseNet121's layers and order, fewer of them."""
    import tensorflow as tf

    layers = tf.keras.layers

    def norm_relu(x):
        return layers.Activation("relu")(layers.BatchNormalization(epsilon=1.001e-5)(x))

    image = tf.keras.Input((size, size, 3))
    x = layers.Conv2D(64, 7, strides=2, use_bias=False)(layers.ZeroPadding2D(3)(image))
    x = layers.MaxPooling2D(3, strides=2)(layers.ZeroPadding2D(1)(norm_relu(x)))
    for i, layers_in_block in enumerate(blocks):
        for _ in range(layers_in_block):
            y = layers.Conv2D(4 * 32, 1, use_bias=False)(norm_relu(x))
            y = layers.Conv2D(32, 3, padding="same", use_bias=False)(norm_relu(y))
            x = layers.Concatenate()([x, y])
        if i < len(blocks) - 1:  # a transition halves the channels and the size
            x = layers.Conv2D(x.shape[-1] // 2, 1, use_bias=False)(norm_relu(x))
            x = layers.AveragePooling2D(2, strides=2)(x)
    return tf.keras.Model(image, layers.GlobalAveragePooling2D()(norm_relu(x)))


def keras_encoder(tokens: int = 16, width: int = 32, heads: int = 2) -> Path:
    """One post-norm Keras transformer encoder layer (MultiHeadAttention, LayerNormalization, a Dense
    with exact GELU), `tokens` x `width`, random weights (seed 0) with nonzero biases, gammas and betas:
    what tf2onnx makes of Keras's layer norm and GELU (benchmarks/bench_cpu.py's encoder at CI size)."""
    path = CACHE / f"keras_encoder_{tokens}x{width}_{heads}.keras"
    if path.exists():
        return path
    import numpy as np
    import tensorflow as tf

    layers = tf.keras.layers
    tf.keras.utils.set_random_seed(0)
    x = inp = tf.keras.Input((tokens, width), batch_size=1)
    x = layers.LayerNormalization(epsilon=1e-6)(x + layers.MultiHeadAttention(heads, width // heads)(x, x))
    f = layers.Dense(2 * width, activation="gelu")(x)
    model = tf.keras.Model(inp, layers.LayerNormalization(epsilon=1e-3)(x + layers.Dense(width)(f)))
    rng = np.random.default_rng(0)
    for w in model.weights:  # Keras initializes biases and betas to 0 and gammas to 1, which the import folds away
        w.assign(rng.normal(0.1, 0.3 if len(w.shape) == 1 else 0.2, w.shape).astype("float32"))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.keras")
    model.save(tmp)
    tmp.rename(path)
    return path


def frame_cnn(frames: int = 4, size: int = 32) -> Path:
    """One small CNN applied to every frame of a clip, as tf2onnx exports a Keras TimeDistributed CNN (the
    captioner's shape): per frame a Slice of the 5-D clip (rank 5 with 4 dimensions above 1:
    the Edge TPU refuses it, so it stays on the CPU between the frames), a Squeeze, then the same two
    convolutions (one set of weights, He-initialized, seed 0) and a global average pool; the frames'
    features concatenated into a Gemm over 10 classes. Written as ONNX: the Keras export's topological
    order puts every Slice first, which hides the per-frame structure this model is for."""
    path = CACHE / f"frame_cnn_{frames}x{size}.onnx"
    if path.exists():
        return path
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    he = lambda *s: (rng.standard_normal(s) * np.sqrt(2 / np.prod(s[1:]))).astype(np.float32)  # noqa: E731
    inits = [numpy_helper.from_array(a, n) for n, a in (
        ("w1", he(16, 3, 3, 3)), ("b1", rng.normal(0, 0.1, 16).astype(np.float32)),
        ("w2", he(32, 16, 3, 3)), ("b2", rng.normal(0, 0.1, 32).astype(np.float32)),
        ("fc", he(10, 32 * frames).T.copy()), ("fc_b", np.zeros(10, np.float32)),
        ("axis1", np.array([1], np.int64)))]
    nodes, features = [], []
    for f in range(frames):
        inits += [numpy_helper.from_array(np.array([f], np.int64), f"start{f}"),
                  numpy_helper.from_array(np.array([f + 1], np.int64), f"end{f}")]
        nodes += [helper.make_node("Slice", ["clip", f"start{f}", f"end{f}", "axis1"], [f"f{f}/frame"]),
                  helper.make_node("Squeeze", [f"f{f}/frame", "axis1"], [f"f{f}/image"]),
                  helper.make_node("Conv", [f"f{f}/image", "w1", "b1"], [f"f{f}/c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
                  helper.make_node("Relu", [f"f{f}/c1"], [f"f{f}/r1"]),
                  helper.make_node("Conv", [f"f{f}/r1", "w2", "b2"], [f"f{f}/c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
                  helper.make_node("Relu", [f"f{f}/c2"], [f"f{f}/r2"]),
                  helper.make_node("GlobalAveragePool", [f"f{f}/r2"], [f"f{f}/pool"]),
                  helper.make_node("Flatten", [f"f{f}/pool"], [f"f{f}/features"])]
        features.append(f"f{f}/features")
    nodes += [helper.make_node("Concat", features, ["features"], axis=1),
              helper.make_node("Gemm", ["features", "fc", "fc_b"], ["logits"])]
    g = helper.make_graph(nodes, "frame_cnn",
                          [helper.make_tensor_value_info("clip", TensorProto.FLOAT, [1, frames, 3, size, size])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.onnx")
    onnx.save(model, str(tmp))
    tmp.rename(path)
    return path


if __name__ == "__main__":
    print(mobilenet_v2())
    print(mobilenet_v2(96, 0.35))


# A 5x7 bitmap font for digits: enough to draw text lines the PP-OCR classifier has seen the like of.
_GLYPHS = {
    "0": ["01110", "10001", "10011", "10101", "11001", "10001", "01110"],
    "1": ["00100", "01100", "00100", "00100", "00100", "00100", "01110"],
    "2": ["01110", "10001", "00001", "00010", "00100", "01000", "11111"],
    "3": ["11110", "00001", "00001", "01110", "00001", "00001", "11110"],
    "4": ["00010", "00110", "01010", "10010", "11111", "00010", "00010"],
    "5": ["11111", "10000", "11110", "00001", "00001", "10001", "01110"],
    "6": ["00110", "01000", "10000", "11110", "10001", "10001", "01110"],
    "7": ["11111", "00001", "00010", "00100", "01000", "01000", "01000"],
    "8": ["01110", "10001", "10001", "01110", "10001", "10001", "01110"],
    "9": ["01110", "10001", "10001", "01111", "00001", "00010", "01100"],
}


PPOCR_CLS_PREPROCESS = "scale=1/255,mean=0.5,std=0.5"  # PP-OCR's own: (pixel / 255 - 0.5) / 0.5


def text_lines(n: int, seed: int = 0, *, flipped: bool = False) -> "np.ndarray":
    """n images of a line of dark digits on a light background, preprocessed as PP-OCR's classifier
    expects: NCHW 1x3x48x192, (pixel / 255 - 0.5) / 0.5. `flipped` rotates them by 180 degrees."""
    import numpy as np

    pixels = text_line_pixels(n, seed, flipped=flipped).astype(np.float32)
    return np.repeat(((pixels / 255.0 - 0.5) / 0.5)[:, None, None], 3, axis=2)


def text_line_pixels(n: int, seed: int = 0, *, flipped: bool = False) -> "np.ndarray":
    """n grey 48x192 uint8 images of a line of dark digits on a light background."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = np.empty((n, 48, 192), np.uint8)
    for k in range(n):
        img = np.full((48, 192), rng.uniform(200, 250), np.float32)
        scale = int(rng.integers(4, 6))
        x = int(rng.integers(2, 12))
        y = int(rng.integers(2, 48 - 7 * scale - 1))
        ink = rng.uniform(10, 80)
        while x + 5 * scale < 190:
            glyph = np.array([[c == "1" for c in row] for row in _GLYPHS[str(rng.integers(0, 10))]])
            block = np.kron(glyph, np.ones((scale, scale), bool))
            img[y:y + block.shape[0], x:x + block.shape[1]][block] = ink
            x += 6 * scale
        img += rng.normal(0, 6, img.shape)
        if flipped:
            img = img[::-1, ::-1]
        out[k] = np.round(np.clip(img, 0, 255))
    return out


# Real inputs. scikit-image 0.25.2's sample data (`make models` fetches it from the wheel; the package is
# never installed): photographs, two scanned text pages, and lfw_subset.npy, 25x25 grey crops of Labeled
# Faces in the Wild (the first 100 faces, then 100 non-faces).
PHOTOS = ("astronaut.png", "coffee.png", "chelsea.png", "camera.png", "rocket.jpg", "motorcycle_left.png",
          "coins.png", "moon.png", "hubble_deep_field.jpg", "ihc.png", "gravel.png", "brick.png", "grass.png")
DOCUMENTS = ("page.png", "text.png")
LFW_SUBSET = CACHE / "lfw_subset.npy"
# the two photographs that show a face at a usable size, each with its face box (x0, y0, x1, y1) in pixels,
# found by BlazeFace (fp32) on the whole picture: scikit-image's astronaut and matplotlib's Grace Hopper
_FACE_BOXES = {"astronaut.png": (179, 82, 274, 177), "grace_hopper.jpg": (173, 146, 367, 340)}
# DejaVu Sans, Debian's fonts-dejavu-core (`make system` installs it)
FONT = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")
# MediaPipe 0.10.18's models (TFLite, float16 weights)
BLAZEFACE = CACHE / "face_detection_short_range.tflite"
FACE_LANDMARK = CACHE / "face_landmark.tflite"  # 192x192 RGB in [0, 1]; 468 landmarks and a face flag; PReLU
IRIS_LANDMARK = CACHE / "iris_landmark.tflite"
SELFIE_SEGMENTATION = CACHE / "selfie_segmentation.tflite"
PPOCR_DET = CACHE / "ch_PP-OCRv4_det_infer.onnx"
# English words and numbers as printed matter has them: the lines `rendered_text_lines` draws
_WORDS = ("the of and to in is for on that with by from at this are be as or an it was not we can all your has "
          "total price order invoice date number page item amount paid due account name address street city "
          "phone email model serial version battery power input output voltage current speed weight height "
          "width length open close start stop enter exit north south east west monday friday january july "
          "receipt customer service station platform ticket gate seat flight train coffee water bread milk "
          "Edge Board Coral Camera Sensor Device Report Table Figure Section Chapter Note Warning Error").split()


def _cache_file(path: Path) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `make models` first")
    return path


def _rgb(path: Path) -> "np.ndarray":
    import numpy as np
    from PIL import Image

    with Image.open(_cache_file(path)) as img:
        return np.asarray(img.convert("RGB"))


def photos() -> "list[np.ndarray]":
    """scikit-image's sample photographs (PHOTOS), RGB uint8 HxWx3 (the grey ones repeated on 3 channels)."""
    return [_rgb(CACHE / name) for name in PHOTOS]


def documents() -> "list[np.ndarray]":
    """scikit-image's two scanned pages of printed text (page.png, text.png), RGB uint8 HxWx3."""
    return [_rgb(CACHE / name) for name in DOCUMENTS]


def faces() -> "list[np.ndarray]":
    """Real face crops, RGB uint8 HxWx3, square: first the two photographs' faces (the face box enlarged
    1.5 times about its centre, as MediaPipe crops a face for its landmark model; 143 and 291 pixels),
    then lfw_subset's 100 faces (25x25, grey repeated on 3 channels)."""
    import matplotlib
    import numpy as np

    out = []
    for name, (x0, y0, x1, y1) in _FACE_BOXES.items():
        path = Path(matplotlib.get_data_path()) / "sample_data" / name if name == "grace_hopper.jpg" else CACHE / name
        image = _rgb(path)
        cx, cy, half = (x0 + x1) / 2, (y0 + y1) / 2, 0.75 * max(x1 - x0, y1 - y0)
        top, left = int(round(cy - half)), int(round(cx - half))
        side = int(round(2 * half))
        out.append(np.ascontiguousarray(image[top:top + side, left:left + side]))
    lfw = np.load(_cache_file(LFW_SUBSET))[:100]
    out += [np.repeat(np.round(f * 255).astype(np.uint8)[..., None], 3, axis=2) for f in lfw]
    return out


def ppocr_dictionary() -> list[str]:
    """PP-OCRv4's dictionary, the 6,623 characters its ONNX file's `character` metadata lists, as `--task ocr`
    reads it (compression.tasks.dictionary): the recognizer's classes are the CTC blank, these, then the
    space."""
    import onnx

    from edgesdk.compression import tasks

    model = onnx.load(str(ppocr_rec()), load_external_data=False)
    return tasks.dictionary(metadata={p.key: p.value for p in model.metadata_props})


def rendered_text_lines(n: int, seed: int = 0, *, width: int = 320, height: int = 48) -> "tuple[np.ndarray, list[str]]":
    """n lines of real text (English words and numbers, every character in PP-OCR's dictionary) drawn in
    DejaVu Sans, dark ink on a light background, as a text detector's crop gives them to PP-OCR's
    recognizer: RGB uint8 images [n, height, width, 3] (the recognizer's input height is 48) and the
    strings drawn, one per image, the text spanning the width. Words, ink, paper, margins and a little
    noise vary with `seed`."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    images, strings = np.empty((n, height, width, 3), np.uint8), []
    for k in range(n):
        font = ImageFont.truetype(str(_cache_file(FONT)), int(rng.integers(int(height * 0.55), int(height * 0.7))))
        x0 = int(rng.integers(2, 10))
        words: list[str] = []
        while True:
            word = (str(int(rng.integers(0, 10 ** int(rng.integers(1, 5))))) if rng.random() < 0.25
                    else _WORDS[int(rng.integers(len(_WORDS)))])
            candidate = " ".join([*words, word])
            if x0 + font.getlength(candidate) > width - 4:
                break
            words.append(word)
        text = " ".join(words) or _WORDS[0]
        # as a detector's crop gives a line: the text spans the image's width, up to 80 % of its height
        while font.size < 0.8 * height and x0 + font.font_variant(size=font.size + 1).getlength(text) <= width - 4:
            font = font.font_variant(size=font.size + 1)
        paper, ink = rng.uniform(190, 250, 3), rng.uniform(0, 70, 3)
        img = Image.new("RGB", (width, height), tuple(int(v) for v in paper))
        top, bottom = font.getbbox(text)[1], font.getbbox(text)[3]
        y = int(rng.integers(0, max(1, height - bottom + top))) - top
        ImageDraw.Draw(img).text((x0, y), text, font=font, fill=tuple(int(v) for v in ink))
        pixels = np.asarray(img, np.float32) + rng.normal(0, 4, (height, width, 3))
        images[k] = np.round(np.clip(pixels, 0, 255))
        strings.append(text)
    return images, strings


def rendered_text_pages(n: int, seed: int = 0, *, size: int = 640) -> "np.ndarray":
    """n pages of real text for a text detector: RGB uint8 [n, size, size, 3], 6-14 lines of
    `rendered_text_lines` (various sizes) laid out at random left margins down a light page."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = np.empty((n, size, size, 3), np.uint8)
    for k in range(n):
        page = np.full((size, size, 3), rng.uniform(200, 250, 3), np.float32)
        y = int(rng.integers(5, 40))
        for line in range(int(rng.integers(6, 15))):
            h = int(rng.integers(24, 56))
            w = int(rng.integers(size // 3, size - 20))
            if y + h > size:
                break
            (img,), _ = rendered_text_lines(1, seed=seed * 1000 + k * 20 + line, width=w * 48 // h, height=48)
            grey = np.asarray(Image.fromarray(img).resize((w, h), Image.Resampling.BILINEAR), np.float32).mean(-1)
            x = int(rng.integers(0, size - w + 1))
            # only the line's ink is drawn, each pixel as much as it is darker than the line's own paper
            paper = np.median(grey)
            alpha = np.clip((paper - grey) / max(paper - grey.min(), 1.0), 0, 1)[..., None]
            region = page[y:y + h, x:x + w]
            page[y:y + h, x:x + w] = region * (1 - alpha) + rng.uniform(0, 70, 3) * alpha
            y += h + int(rng.integers(4, 30))
        out[k] = np.round(np.clip(page, 0, 255))
    return out
