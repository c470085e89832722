"""The zoo: real architectures users bring, each a file made offline and cached under `.cache/zoo/`.

Families, not one of each, so that the share that builds means something:

- `wheel`: pretrained models that ship inside PyPI wheels (`make models` fetches them, pinned by sha256):
  PP-OCR's detector, recognizer and direction classifier, Silero VAD, MediaPipe's face detector, face and
  iris landmarks and selfie segmenter (float16 TFLite), a YOLOv8n detector (Ultralytics export).
- `hf-vision`, `hf-text`: Hugging Face `transformers` architectures instantiated from their configs (no
  weights downloaded), random weights (seed 0; BatchNorm statistics from photo crops where the model has
  BatchNorm, as tests/model_zoo.py says why), exported by PyTorch's own ONNX exporter
  (`edgesdk.frontends.torch_export`, as `edgesdk.build(module, ...)` exports them).
- `keras`: `keras.applications` with `weights=None` (BatchNorm statistics from photo crops, the softmax
  head's logits scaled until fp32 is sure of most crops: `_sharpen`), as `.keras` files, which edgesdk
  imports itself.
- `tflite`: Keras models converted by TensorFlow's own converter, float, float16 weights and full int8.

torchvision and timm are not here: their PyPI wheels need a CUDA build of torch (torchvision's compiled ops
fail to load beside the CPU wheel the project installs), and timm imports torchvision.

Each model says how to feed it real inputs (`feeds`): crops of scikit-image's sample photographs for images
(in the model's own layout and normalization), rendered text lines for the OCR models, English sentences
as token ids for the text encoders, and for Silero VAD a tone-and-noise signal (no speech ships in a wheel we
fetch; named as such).
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk")]
from tests import model_zoo  # noqa: E402  (after the path above)

CACHE = Path(os.environ.get("EDGESDK_ZOO_CACHE", ROOT / ".cache" / "zoo"))
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Model:
    """One zoo model: `make()` writes (once) and returns its file; `feeds(n, seed)` gives n real samples, each
    a dict of the model's inputs by name; `args`: the build's own options for it (--input-shape where the
    file's inputs are dynamic, --input-value for a sample rate)."""

    name: str
    family: str
    make: Callable[[], Path]
    feeds: Callable[[int, int], list[dict[str, np.ndarray]]]
    args: tuple[str, ...] = ()
    task: str = ""  # what the outputs are (classification logits, boxes, a mask, embeddings)
    notes: tuple[str, ...] = field(default_factory=tuple)


# ---------------------------------------------------------------- inputs

def photo_crops(n: int, seed: int, size: int, *, layout: str = "nchw", norm: str = "imagenet") -> np.ndarray:
    """n crops of the sample photographs at size x size: `norm` imagenet ((x/255 - mean) / std), unit
    ([0, 1]), signed ([-1, 1]) or raw ([0, 255], models that normalize inside)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    photos = model_zoo.photos()
    out = []
    for k in range(n):
        p = photos[(k + seed) % len(photos)]
        side = int(rng.integers(min(size, min(p.shape[:2])), min(p.shape[:2]) + 1))
        y, x = int(rng.integers(0, p.shape[0] - side + 1)), int(rng.integers(0, p.shape[1] - side + 1))
        a = np.asarray(Image.fromarray(p[y:y + side, x:x + side]).resize((size, size), Image.BILINEAR), np.float32)
        a = {"imagenet": (a / 255.0 - IMAGENET_MEAN) / IMAGENET_STD, "unit": a / 255.0, "signed": a / 127.5 - 1.0,
             "raw": a}[norm]
        out.append(a.transpose(2, 0, 1) if layout == "nchw" else a)
    return np.stack(out).astype(np.float32)


def _images(name: str, size: int, layout: str = "nchw", norm: str = "imagenet"):
    return lambda n, seed: [{name: photo_crops(1, seed * 1000 + k, size, layout=layout, norm=norm)} for k in range(n)]


SENTENCES = (
    "the pump on line three stopped twice this morning and the operator restarted it by hand",
    "replace the filter before the pressure drops below the lower limit shown on the panel",
    "a camera at the gate reads the plates of trucks that arrive after six in the evening",
    "the model flags parts whose surface has scratches longer than two millimetres",
    "temperature in the second oven rose slowly over the shift without any alarm",
    "please check the conveyor belt for wear near the motor on the east side",
    "the inspection found three cracked welds and one missing bolt on the frame",
    "battery level of the handheld scanner is low and it should be charged tonight",
)


def _tokens(n: int, seed: int, length: int, vocab: int, *, mask: bool = True, types: bool = False):
    """English sentences as token ids of a model with `vocab` tokens: each word's id its hash (a tokenizer's
    vocabulary needs its files; the ids still carry the sentences' structure: repeated words, lengths,
    padding), between [CLS]=1 and [SEP]=2, padded with 0 to `length`."""
    out = []
    for k in range(n):
        words = SENTENCES[(seed + k) % len(SENTENCES)].split()
        ids = [1] + [3 + int.from_bytes(hashlib.sha256(w.encode()).digest()[:4], "little") % (vocab - 3)
                     for w in words][:length - 2] + [2]
        feed = {"input_ids": np.array([ids + [0] * (length - len(ids))], np.int64)}
        if mask:
            feed["attention_mask"] = np.array([[1] * len(ids) + [0] * (length - len(ids))], np.int64)
        if types:
            feed["token_type_ids"] = np.zeros((1, length), np.int64)
        out.append(feed)
    return out


# ---------------------------------------------------------------- transformers (PyTorch, exported by torch.onnx)

def _hf(name: str, build: Callable, example: Callable[[], tuple], outputs: tuple[str, ...] = ("logits",),
        *, bn_images: Callable[[], np.ndarray] | None = None, input_names: tuple[str, ...] = ("pixel_values",)
        ) -> Callable[[], Path]:
    def make() -> Path:
        path = CACHE / f"{name}.onnx"
        if path.exists():
            return path
        import torch

        from edgesdk.frontends.torch_export import export

        torch.manual_seed(0)
        inner = build()

        class Outputs(torch.nn.Module):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, *args):
                out = self.m(**dict(zip(input_names, args)))
                got = tuple(out[o] for o in outputs)
                return got if len(got) > 1 else got[0]

        module = Outputs(inner).eval()
        if bn_images is not None:
            model_zoo.with_torch_bn_statistics(module, bn_images())
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.onnx")
        export(module, tuple(torch.from_numpy(a) for a in example()), tmp, shown=name)
        _named_inputs(tmp, input_names)
        os.replace(tmp, path)
        return path
    return make


def _named_inputs(path: Path, names: tuple[str, ...]) -> None:
    """The exported graph's inputs named as the module's arguments (torch.onnx names them after `forward`'s
    own, `args_0`...), so that samples are fed by the names users know."""
    import onnx

    model = onnx.load(str(path))
    rename = {i.name: n for i, n in zip(model.graph.input, names) if i.name != n}
    if not rename:
        return
    for i in model.graph.input:
        i.name = rename.get(i.name, i.name)
    for node in model.graph.node:
        node.input[:] = [rename.get(x, x) for x in node.input]
    onnx.save(model, str(path))


def _vision(name: str, config: Callable, cls: str, size: int, outputs=("logits",), bn: bool = False) -> Model:
    def build():
        import transformers

        c = config()
        if cls.endswith("ForImageClassification") or "ForImageClassificationWith" in cls:
            c.num_labels = 1000  # ImageNet's, as the published checkpoints have (the configs' default is 2)
        return getattr(transformers, cls)(c)
    return Model(name, "hf-vision",
                 _hf(name, build, lambda: (photo_crops(1, 99, size),), outputs,
                     bn_images=(lambda: photo_crops(32, 3, size)) if bn else None),
                 _images("pixel_values", size), task="+".join(outputs))


def _text(name: str, config: Callable, cls: str, length: int = 32, types: bool = False,
          outputs=("last_hidden_state",)) -> Model:
    names = ("input_ids", "attention_mask") + (("token_type_ids",) if types else ())

    def build():
        import transformers

        return getattr(transformers, cls)(config())

    def example():
        feed = _tokens(1, 99, length, config().vocab_size, types=types)[0]
        return tuple(feed[n] for n in names)

    return Model(name, "hf-text", _hf(name, build, example, outputs, input_names=names),
                 lambda n, seed: _tokens(n, seed, length, config().vocab_size, types=types), task="+".join(outputs))


def _c(cls: str, **kw):
    def config():
        import transformers

        return getattr(transformers, cls)(**kw)
    return config


HF_VISION = [
    _vision("hf-resnet18", _c("ResNetConfig", embedding_size=64, hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2],
                              layer_type="basic"), "ResNetForImageClassification", 224, bn=True),
    _vision("hf-resnet50", _c("ResNetConfig"), "ResNetForImageClassification", 224, bn=True),
    _vision("hf-mobilenet-v1", _c("MobileNetV1Config"), "MobileNetV1ForImageClassification", 224, bn=True),
    _vision("hf-mobilenet-v2", _c("MobileNetV2Config"), "MobileNetV2ForImageClassification", 224, bn=True),
    _vision("hf-efficientnet-b0", _c("EfficientNetConfig"), "EfficientNetForImageClassification", 224, bn=True),
    _vision("hf-convnext-tiny", _c("ConvNextConfig"), "ConvNextForImageClassification", 224),
    _vision("hf-convnextv2-atto", _c("ConvNextV2Config", hidden_sizes=[40, 80, 160, 320], depths=[2, 2, 6, 2]),
            "ConvNextV2ForImageClassification", 224),
    _vision("hf-regnet-y-400mf", _c("RegNetConfig", hidden_sizes=[48, 104, 208, 440], depths=[1, 3, 6, 6],
                                     groups_width=8, layer_type="y"), "RegNetForImageClassification", 224, bn=True),
    _vision("hf-vit-tiny", _c("ViTConfig", hidden_size=192, num_hidden_layers=12, num_attention_heads=3,
                              intermediate_size=768), "ViTForImageClassification", 224),
    _vision("hf-deit-tiny", _c("DeiTConfig", hidden_size=192, num_hidden_layers=12, num_attention_heads=3,
                               intermediate_size=768), "DeiTForImageClassificationWithTeacher", 224),
    _vision("hf-swin-tiny", _c("SwinConfig"), "SwinForImageClassification", 224),
    _vision("hf-levit-128s", _c("LevitConfig"), "LevitForImageClassificationWithTeacher", 224, bn=True),
    _vision("hf-mobilevit-xs", _c("MobileViTConfig", hidden_sizes=[96, 120, 144],
                                  neck_hidden_sizes=[16, 32, 48, 64, 80, 96, 384]),
            "MobileViTForImageClassification", 256, bn=True),
    _vision("hf-mobilevitv2", _c("MobileViTV2Config", width_multiplier=0.5), "MobileViTV2ForImageClassification",
            256, bn=True),
    _vision("hf-poolformer-s12", _c("PoolFormerConfig"), "PoolFormerForImageClassification", 224),
    _vision("hf-dinov2-small", _c("Dinov2Config", hidden_size=384, num_hidden_layers=12, num_attention_heads=6,
                                  image_size=224), "Dinov2Model", 224, outputs=("pooler_output",)),
    _vision("hf-segformer-b0", _c("SegformerConfig"), "SegformerForSemanticSegmentation", 256),
    _vision("hf-yolos-tiny", _c("YolosConfig", hidden_size=192, num_hidden_layers=12, num_attention_heads=3,
                                intermediate_size=768, image_size=[256, 256]), "YolosForObjectDetection", 256,
            outputs=("logits", "pred_boxes")),
    _vision("hf-cvt-13", _c("CvtConfig"), "CvtForImageClassification", 224, bn=True),
    _vision("hf-focalnet-tiny", _c("FocalNetConfig"), "FocalNetForImageClassification", 224),
    _vision("hf-bit-50", _c("BitConfig"), "BitForImageClassification", 224),
    # transformers 5 has no EfficientFormer: SwiftFormer, its successor (efficient additive attention, BatchNorm)
    _vision("hf-swiftformer-xs", _c("SwiftFormerConfig"), "SwiftFormerForImageClassification", 224, bn=True),
    _vision("hf-glpn-depth", _c("GLPNConfig"), "GLPNForDepthEstimation", 256, outputs=("predicted_depth",)),
]

HF_TEXT = [
    _text("hf-bert-mini", _c("BertConfig", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                             intermediate_size=1024), "BertModel", types=True),
    _text("hf-distilbert", _c("DistilBertConfig"), "DistilBertModel"),
    _text("hf-albert-base", _c("AlbertConfig", hidden_size=768, num_attention_heads=12, intermediate_size=3072),
          "AlbertModel"),
    _text("hf-electra-small", _c("ElectraConfig"), "ElectraModel"),
    _text("hf-mobilebert", _c("MobileBertConfig"), "MobileBertModel"),
    _text("hf-roberta-small", _c("RobertaConfig", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                 intermediate_size=1024), "RobertaModel"),
    _text("hf-minilm-l6", _c("BertConfig", hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                             intermediate_size=1536), "BertModel", types=True),
]


# ---------------------------------------------------------------- keras.applications, and TFLite from them

def _keras(name: str, app: str, size: int, norm: str, **kw) -> Model:
    def make() -> Path:
        path = CACHE / f"{name}.keras"
        if path.exists():
            return path
        import tensorflow as tf

        tf.keras.utils.set_random_seed(0)
        model = getattr(tf.keras.applications, app)(input_shape=(size, size, 3), weights=None, **kw)
        for layer in model.layers:
            if isinstance(layer, tf.keras.layers.BatchNormalization):
                layer.momentum = 0.0
        crops = photo_crops(16, 3, size, layout="nhwc", norm=norm)
        model(crops, training=True)
        _sharpen(model, crops)
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.stem + ".tmp.keras")
        model.save(tmp)
        os.replace(tmp, path)
        return path
    return Model(name, "keras", make, _keras_feeds(make, size, norm), task="logits")


def _sharpen(model, crops: np.ndarray, sure: float = 0.9) -> None:
    """Scale the classifier head of `model` (the last layer with a kernel: the Dense or 1x1 Conv before the
    softmax) until fp32 is sure of most of `crops` (median best score at least `sure`). With random weights
    a 1000-way softmax is near uniform (best score ~0.006 on every image): fp32 decides nothing, and the
    accuracy gate has nothing to judge int8 by (it says so). Scaling the logits changes no ranking and no
    relative int8 error of the head; it makes the softmax's arg max something a reduced-precision model
    can be seen to keep or lose, as a trained classifier's is."""
    layer = next(layer for layer in reversed(model.layers) if getattr(layer, "kernel", None) is not None)
    for _ in range(24):
        if float(np.median(np.max(np.asarray(model(crops, training=False)), axis=-1))) >= sure:
            return
        layer.kernel.assign(layer.kernel * 2.0)
        if getattr(layer, "bias", None) is not None:
            layer.bias.assign(layer.bias * 2.0)
    raise RuntimeError(f"{model.name}: its head's softmax stays unsure after scaling its logits by 2^24")


def _keras_feeds(make: Callable[[], Path], size: int, norm: str):
    def feeds(n: int, seed: int):
        import json
        import zipfile

        with zipfile.ZipFile(make()) as z:  # the input layer's name, as the .keras archive holds it
            config = json.loads(z.read("config.json"))
        name = config["config"]["input_layers"][0][0] if isinstance(config["config"]["input_layers"][0], list) \
            else config["config"]["input_layers"][0]
        return [{name: photo_crops(1, seed * 1000 + k, size, layout="nhwc", norm=norm)} for k in range(n)]
    return feeds


KERAS = [
    _keras("keras-mobilenet", "MobileNet", 224, "signed"),
    _keras("keras-mobilenet-v2", "MobileNetV2", 224, "signed"),
    _keras("keras-mobilenet-v3-small", "MobileNetV3Small", 224, "raw"),
    _keras("keras-mobilenet-v3-large", "MobileNetV3Large", 224, "raw"),
    _keras("keras-efficientnet-b0", "EfficientNetB0", 224, "raw"),
    _keras("keras-efficientnet-v2-b0", "EfficientNetV2B0", 224, "raw"),
    _keras("keras-resnet50", "ResNet50", 224, "raw"),
    _keras("keras-resnet50-v2", "ResNet50V2", 224, "signed"),
    _keras("keras-densenet121", "DenseNet121", 224, "raw"),
    _keras("keras-inception-v3", "InceptionV3", 299, "signed"),
    _keras("keras-xception", "Xception", 299, "signed"),
    _keras("keras-nasnet-mobile", "NASNetMobile", 224, "signed"),
    _keras("keras-convnext-tiny", "ConvNeXtTiny", 224, "raw"),
    _keras("keras-inception-resnet-v2", "InceptionResNetV2", 299, "signed"),
    _keras("keras-densenet169", "DenseNet169", 224, "raw"),
    _keras("keras-resnet101", "ResNet101", 224, "raw"),
]


def _tflite(name: str, source: Model, size: int, norm: str, form: str) -> Model:
    """`source` (a keras zoo model) converted by TensorFlow's converter: float, float16 weights, or full int8
    (calibrated on 32 photo crops)."""
    def make() -> Path:
        path = CACHE / f"{name}.tflite"
        if path.exists():
            return path
        import tensorflow as tf

        model = tf.keras.models.load_model(source.make())
        converter = tf.lite.TFLiteConverter.from_keras_model(model)
        if form == "fp16":
            converter.optimizations = [tf.lite.Optimize.DEFAULT]
            converter.target_spec.supported_types = [tf.float16]
        elif form == "int8":
            crops = photo_crops(32, 5, size, layout="nhwc", norm=norm)
            converter.optimizations = [tf.lite.Optimize.DEFAULT]
            converter.representative_dataset = lambda: ([c[None]] for c in crops)
            converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
            converter.inference_input_type = converter.inference_output_type = tf.int8
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(converter.convert())
        os.replace(tmp, path)
        return path

    def feeds(n: int, seed: int):
        from ai_edge_litert.interpreter import Interpreter

        # by its signature's name ('input_layer'), as edgesdk names a TFLite model's inputs, not the tensor's
        # ('serving_default_input_layer:0')
        ((name, detail),) = Interpreter(model_path=str(make())).get_signature_runner().get_input_details().items()
        crops = [photo_crops(1, seed * 1000 + k, size, layout="nhwc", norm=norm) for k in range(n)]
        if detail["dtype"] == np.int8:  # a full-int8 model takes its input quantized, as its user's code gives it
            scale, zero = detail["quantization"]
            crops = [np.clip(np.round(c / scale + zero), -128, 127).astype(np.int8) for c in crops]
        return [{name: c} for c in crops]
    return Model(name, "tflite", make, feeds, task="logits")


_by_name = {m.name: m for m in KERAS}
TFLITE = [_tflite(f"tflite-mobilenet-v2-{form}", _by_name["keras-mobilenet-v2"], 224, "signed", form)
          for form in ("float", "fp16", "int8")] + \
         [_tflite(f"tflite-efficientnet-b0-{form}", _by_name["keras-efficientnet-b0"], 224, "raw", form)
          for form in ("float", "int8")] + \
         [_tflite(f"tflite-mobilenet-v3-small-{form}", _by_name["keras-mobilenet-v3-small"], 224, "raw", form)
          for form in ("float", "int8")]


# ---------------------------------------------------------------- pretrained, from wheels (make models)

def _cached(path: Path) -> Callable[[], Path]:
    def make() -> Path:
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: run `make models`")
        return path
    return make


def _text_lines(name: str, width: int, norm: str):
    def feeds(n: int, seed: int):
        lines, _ = model_zoo.rendered_text_lines(n, seed, width=width)
        x = lines.astype(np.float32) / 255.0
        x = (x - 0.5) / 0.5 if norm == "half" else (x - IMAGENET_MEAN) / IMAGENET_STD
        return [{name: x[k:k + 1].transpose(0, 3, 1, 2).astype(np.float32)} for k in range(n)]
    return feeds


def _pages(n: int, seed: int):
    pages = model_zoo.rendered_text_pages(n, seed, size=640).astype(np.float32) / 255.0
    x = (pages - IMAGENET_MEAN) / IMAGENET_STD
    return [{"x": x[k:k + 1].transpose(0, 3, 1, 2).astype(np.float32)} for k in range(n)]


def _faces(name: str, size: int, norm: str, layout: str = "nhwc"):
    def feeds(n: int, seed: int):
        from PIL import Image

        faces = model_zoo.faces()
        out = []
        for k in range(n):
            a = np.asarray(Image.fromarray(faces[(seed + k) % len(faces)]).resize((size, size)), np.float32)
            a = a / 255.0 if norm == "unit" else a / 127.5 - 1.0
            out.append({name: (a.transpose(2, 0, 1) if layout == "nchw" else a)[None].astype(np.float32)})
        return out
    return feeds


def _vad(n: int, seed: int):
    """Silero VAD's inputs: 512 samples at 16 kHz of a tone in noise (no speech ships in a wheel we fetch) and
    its state (2 x 1 x 128) zero; the sample rate is frozen at build (--input-value)."""
    rng = np.random.default_rng(seed)
    t = np.arange(512) / 16000.0
    out = []
    for k in range(n):
        x = 0.3 * np.sin(2 * np.pi * (150 + 40 * k) * t) * (k % 2) + 0.02 * rng.standard_normal(512)
        out.append({"input": x[None].astype(np.float32), "state": np.zeros((2, 1, 128), np.float32)})
    return out


WHEEL = [
    Model("ppocr-det", "wheel", _cached(model_zoo.PPOCR_DET), _pages, ("--input-shape", "x=1x3x640x640"),
          task="text probability map"),
    Model("ppocr-rec", "wheel", _cached(model_zoo.PPOCR_REC), _text_lines("x", 320, "half"),
          ("--input-shape", model_zoo.PPOCR_REC_SHAPE), task="characters (CTC)"),
    Model("ppocr-cls", "wheel", _cached(model_zoo.PPOCR_CLS), _text_lines("x", 192, "half"),
          ("--input-shape", model_zoo.PPOCR_CLS_SHAPE), task="text direction"),
    Model("silero-vad", "wheel", _cached(model_zoo.SILERO_VAD), _vad,
          ("--input-shape", "input=1x512", "--input-shape", "state=2x1x128", "--input-value", "sr=16000"),
          task="speech probability", notes=("a tone in noise, not speech",)),
    Model("blazeface", "wheel", _cached(model_zoo.BLAZEFACE), _faces("input", 128, "signed"), task="face boxes"),
    Model("face-landmark", "wheel", _cached(model_zoo.FACE_LANDMARK), _faces("input_1", 192, "unit"),
          task="468 landmarks"),
    Model("iris-landmark", "wheel", _cached(model_zoo.IRIS_LANDMARK), _faces("input_1", 64, "unit"),
          task="iris landmarks"),
    Model("selfie-segmentation", "wheel", _cached(model_zoo.SELFIE_SEGMENTATION), _faces("input_1", 256, "unit"),
          task="person mask"),
    Model("yolov8n", "wheel", _cached(model_zoo.CACHE / "320n.onnx"), _images("images", 320, norm="unit"),
          ("--input-shape", "images=1x3x320x320"), task="boxes + 18 classes"),
]

MODELS: dict[str, Model] = {m.name: m for m in WHEEL + HF_VISION + HF_TEXT + KERAS + TFLITE}
FAMILIES = ("wheel", "hf-vision", "hf-text", "keras", "tflite")
