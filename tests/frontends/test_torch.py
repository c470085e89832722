"""PyTorch in (frontends/torch_export.py, frontends/objects.py): an nn.Module built from Python, a saved
torch.export program (.pt2) built by the command line, each bundle against eager PyTorch on real
photographs; an export that cannot work is a typed error naming the module, the op and the line.

The architectures are real ones with random weights, from `transformers` (ResNet, MobileNetV2, ViT, YOLOS:
pure PyTorch, which torchvision and timm are not without a CUDA build of torch), narrowed where a test is
about the export and not the model's size, and a small network trained here on photo crops."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
import torch

import edgesdk
from edgesdk.errors import UsageError, UserError
from tests import model_zoo
from tests.numeric import assert_close

pytestmark = pytest.mark.slow  # whole builds

torch.set_num_threads(2)


def crops(n: int, size: int, *, seed: int) -> np.ndarray:
    """n RGB crops (NCHW float32, ImageNet-normalized) of scikit-image's sample photographs, resized to size."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    photos = model_zoo.photos()
    out = []
    for k in range(n):
        p = photos[k % len(photos)]
        side = int(rng.integers(size, min(p.shape[:2]) + 1))
        y, x = int(rng.integers(0, p.shape[0] - side + 1)), int(rng.integers(0, p.shape[1] - side + 1))
        img = Image.fromarray(p[y:y + side, x:x + side]).resize((size, size), Image.BILINEAR)
        a = (np.asarray(img, np.float32) / 255.0 - (0.485, 0.456, 0.406)) / (0.229, 0.224, 0.225)
        out.append(a.transpose(2, 0, 1).astype(np.float32))
    return np.stack(out)


class Logits(torch.nn.Module):
    """A transformers image model as a user exports it: pixels in, its outputs as tensors out."""

    def __init__(self, model: torch.nn.Module, *names: str) -> None:
        super().__init__()
        self.model, self.names = model, names or ("logits",)

    def forward(self, pixel_values: torch.Tensor):
        out = self.model(pixel_values=pixel_values)
        return tuple(out[n] for n in self.names) if len(self.names) > 1 else out[self.names[0]]


def _eager(module: torch.nn.Module, x: np.ndarray) -> list[np.ndarray]:
    with torch.no_grad():
        out = module.eval()(torch.from_numpy(x))
    return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]


def _built_matches_eager(module, example: np.ndarray, held_out: np.ndarray, out, **options):
    """Build `module` for x86 from Python; each held-out image through the bundle against eager PyTorch. The
    CPU runs onnxruntime alone (`low_memory`): these tests are about the export; TVM's code for ONNX models
    is tested elsewhere (and benchmarks/bench_pytorch.py builds these architectures with every backend)."""
    build = edgesdk.build(module, "x86", out, example_inputs=(torch.from_numpy(example),), low_memory=True,
                          log=lambda s: None, **options)
    with edgesdk.Bundle.open(build.bundle.path) as bundle:
        (name,) = bundle.inputs
        wants = []
        for i in range(len(held_out)):
            x = held_out[i:i + 1]
            got = list(bundle.run({name: x}).values())
            want = _eager(module, x)
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert_close(g, w)
            wants.append(want[0])
    # the answers depend on the image (a network whose activations vanish answers every image alike, and
    # agrees with anything): the first output's spread over the images is a share of its scale
    first = np.stack(wants)
    assert first.std(axis=0).max() > 1e-3 * np.abs(first).max(), "eager PyTorch gives every image the same answer"
    return build


def test_a_resnet_module_builds_and_answers_as_eager_pytorch(tmp_path):
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    # ResNet's basic blocks and stages, narrowed (ResNet-18 is depths 2,2,2,2 at widths 64..512)
    config = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                          layer_type="basic", num_labels=10)
    module = model_zoo.with_torch_bn_statistics(Logits(ResNetForImageClassification(config)), crops(16, 64, seed=10))
    build = _built_matches_eager(module, crops(1, 64, seed=0), crops(4, 64, seed=1), tmp_path / "out")
    assert build.stages["import"]["format"] == "onnx" and build.stages["import"]["opset"]["source"] == 18  # torch.onnx wrote it
    assert (tmp_path / "out" / ".build" / "source" / "logits.onnx").is_file()


def test_a_mobilenet_v2_module_builds_and_answers_as_eager_pytorch(tmp_path):
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    torch.manual_seed(1)
    config = MobileNetV2Config(depth_multiplier=0.35, image_size=96, num_labels=10)
    module = model_zoo.with_torch_bn_statistics(Logits(MobileNetV2ForImageClassification(config)),
                                                crops(16, 96, seed=11))
    _built_matches_eager(module, crops(1, 96, seed=2), crops(4, 96, seed=3), tmp_path / "out", name="mobilenet_v2")
    assert (tmp_path / "out" / ".build" / "source" / "mobilenet_v2.onnx").is_file()


def test_a_small_vision_transformer_builds_and_answers_as_eager_pytorch(tmp_path):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(2)
    config = ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                       image_size=32, patch_size=8, num_labels=10)
    module = Logits(ViTForImageClassification(config))
    _built_matches_eager(module, crops(1, 32, seed=4), crops(4, 32, seed=5), tmp_path / "out")


def test_a_swin_the_dynamo_exporter_cannot_decompose_is_traced_and_answers_as_eager_pytorch(tmp_path):
    """Swin's windowed attention: torch.onnx's dynamo exporter fails in its decompositions ("Cannot view a
    tensor with shape ... and strides ..."), a program that runs; the TorchScript exporter traces it. The
    import's model against eager PyTorch on held-out photo crops (the rest of a build is as for any ONNX)."""
    from transformers import SwinConfig, SwinForImageClassification

    torch.manual_seed(3)
    config = SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
                        num_labels=10)
    module = Logits(SwinForImageClassification(config)).eval()
    logged = []
    edgesdk.build(module, "x86", tmp_path / "out", example_inputs=(torch.from_numpy(crops(1, 32, seed=6)),),
                  until="import", log=logged.append)
    assert any("the dynamo exporter failed" in line and "aten.view" in line for line in logged), logged
    session = ort.InferenceSession(str(tmp_path / "out" / ".build" / "source" / "logits.onnx"))
    (name,) = [i.name for i in session.get_inputs()]
    held_out = crops(4, 32, seed=7)
    wants = []
    for i in range(len(held_out)):
        (got,) = session.run(None, {name: held_out[i:i + 1]})
        (want,) = _eager(module, held_out[i:i + 1])
        assert_close(got, want)
        wants.append(want)
    first = np.stack(wants)
    assert first.std(axis=0).max() > 1e-3 * np.abs(first).max(), "eager PyTorch gives every image the same answer"


def test_a_detector_builds_and_its_boxes_and_classes_answer_as_eager_pytorch(tmp_path):
    from transformers import YolosConfig, YolosForObjectDetection

    torch.manual_seed(3)
    # YOLOS: a ViT whose detection tokens each give a class and a box
    config = YolosConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                         image_size=[64, 64], patch_size=16, num_detection_tokens=10, num_labels=5)
    module = Logits(YolosForObjectDetection(config), "logits", "pred_boxes")
    _built_matches_eager(module, crops(1, 64, seed=6), crops(3, 64, seed=7), tmp_path / "out")


class Small(torch.nn.Module):
    """A small convolutional classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1))
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


@pytest.fixture(scope="module")
def trained():
    """`Small` trained to tell which of four photographs a 32x32 crop comes from; its held-out crops."""
    from PIL import Image

    rng = np.random.default_rng(0)
    photos = model_zoo.photos()[:4]

    def sample(n):
        xs, ys = [], []
        for _ in range(n):
            k = int(rng.integers(0, 4))
            p = photos[k]
            y, x = int(rng.integers(0, p.shape[0] - 64)), int(rng.integers(0, p.shape[1] - 64))
            img = Image.fromarray(p[y:y + 64, x:x + 64]).resize((32, 32), Image.BILINEAR)
            xs.append((np.asarray(img, np.float32) / 255.0 - 0.5).transpose(2, 0, 1) / 0.25)
            ys.append(k)
        return np.stack(xs).astype(np.float32), np.array(ys)

    torch.manual_seed(0)
    model = Small()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    x, y = sample(512)
    for step in range(150):
        i = rng.integers(0, len(x), 64)
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x[i])), torch.from_numpy(y[i]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    held_x, held_y = sample(64)
    model.eval()
    with torch.no_grad():
        accuracy = float((model(torch.from_numpy(held_x)).argmax(1).numpy() == held_y).mean())
    assert accuracy > 0.6, accuracy  # it learned something: the test of the bundle is worth making
    model.train()  # as a user leaves it after training: the export runs it in inference mode
    return {"model": model, "x": held_x, "y": held_y, "accuracy": accuracy}


def test_a_model_trained_here_keeps_its_answers_in_the_bundle_and_stays_in_training_mode(trained, tmp_path):
    model = trained["model"]
    build = edgesdk.build(model, "x86", tmp_path / "out", example_inputs=(torch.from_numpy(trained["x"][:1]),),
                          low_memory=True, log=lambda s: None)
    assert model.training and model.features[1].training  # given back as it was
    model.eval()
    with edgesdk.Bundle.open(build.bundle.path) as bundle:
        (name,) = bundle.inputs
        got = np.concatenate([bundle.run({name: trained["x"][i:i + 1]})[bundle.manifest.outputs[0].name]
                              for i in range(len(trained["x"]))])
    with torch.no_grad():
        want = model(torch.from_numpy(trained["x"])).numpy()
    model.train()
    assert_close(got, want)
    assert (got.argmax(1) == want.argmax(1)).all()


def test_a_saved_program_builds_from_the_command_line_its_dynamic_batch_fixed_by_input_shape(trained, tmp_path):
    model = trained["model"].eval()
    batch = torch.export.Dim("batch", max=64)  # exported for any batch: the build fixes it
    program = torch.export.export(model, (torch.from_numpy(trained["x"][:2]),), dynamic_shapes={"x": {0: batch}})
    torch.export.save(program, str(tmp_path / "small.pt2"))
    trained["model"].train()
    proc = subprocess.run([sys.executable, "-m", "edgesdk", "build", str(tmp_path / "small.pt2"), "--target", "x86",
                           "-o", str(tmp_path / "out"), "--low-memory", "--input-shape", "x=1x3x32x32"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "import: pt2 via torch 2.13.0 (torch.export, torch.onnx dynamo exporter, opset 18)" in proc.stderr
    with edgesdk.Bundle.open(tmp_path / "out" / "bundle") as bundle:
        (name,) = bundle.inputs
        x = trained["x"][:8]
        got = np.concatenate([list(bundle.run({name: x[i:i + 1]}).values())[0] for i in range(len(x))])
    with torch.no_grad():
        want = program.module()(torch.from_numpy(x)).numpy()
    assert_close(got, want)


def test_a_damaged_program_file_is_a_user_error(tmp_path):
    bad = tmp_path / "bad.pt2"
    bad.write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    proc = subprocess.run([sys.executable, "-m", "edgesdk", "build", str(bad), "--target", "x86", "-o",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "error:" in proc.stderr and "bad.pt2" in proc.stderr and "Traceback" not in proc.stderr


class DataDependent(torch.nn.Module):
    """A module whose slice depends on a tensor's values: torch.export cannot capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 4, 3)
        self.crop = Crop()

    def forward(self, x):
        return self.crop(self.stem(x))


class Crop(torch.nn.Module):
    def forward(self, x):
        keep = int((x > 0).sum())  # the number of positive values decides the shape
        return x.flatten()[:keep]


def test_an_export_that_cannot_be_captured_names_the_module_and_the_line(tmp_path):
    with pytest.raises(UserError) as e:
        edgesdk.build(DataDependent(), "x86", tmp_path / "out", example_inputs=(torch.randn(1, 3, 8, 8),))
    err = e.value
    assert err.code == "import.torch-export", err
    assert "module 'crop'" in err.message, err.message
    assert "test_torch.py" in err.message and "keep = int((x > 0).sum())" in err.message, err.message
    assert "data-dependent" in err.hint or "depends on a tensor's values" in err.hint
    assert not (tmp_path / "out" / ".build" / "source" / "datadependent.onnx").exists()


class Histogram(torch.nn.Module):
    def forward(self, x):
        return torch.histc(x, bins=4)  # torch.onnx translates histc only with a range given


class Counted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 4, 1)
        self.head = Histogram()

    def forward(self, x):
        return self.head(self.stem(x))


def test_an_op_torch_onnx_cannot_translate_names_the_module_and_the_op(tmp_path):
    with pytest.raises(UserError) as e:
        edgesdk.build(Counted(), "x86", tmp_path / "out", example_inputs=(torch.randn(1, 3, 8, 8),))
    err = e.value
    assert err.code == "import.torch-unsupported", err
    assert "module 'head'" in err.message and "aten.histc" in err.message, err.message
    assert "is not supported" in err.message and "\x1b" not in err.message, err.message
    assert "aten.histc" in err.hint and "export the model to ONNX yourself" in err.hint


def test_a_module_without_example_inputs_is_refused(tmp_path):
    with pytest.raises(UsageError) as e:
        edgesdk.build(Small(), "x86", tmp_path / "out")
    assert e.value.code == "import.torch-example-inputs" and "example_inputs" in e.value.hint
