"""PyTorch models in: export and build time, and the bundle's answers against eager PyTorch.

    .venv/bin/python benchmarks/bench_pytorch.py [--models resnet18,mobilenet_v2,vit_tiny] [--targets x86,arm_2tpu]

Three real architectures from `transformers`, at their published sizes, with random weights (seed 0): ResNet-18
(basic blocks 2,2,2,2, widths 64..512), MobileNetV2 1.0 at 224, and a ViT at DeiT-Tiny's size (192 wide, 12
layers, 3 heads, patches of 16 at 224). Each (model, target) in a fresh process, as a user's script runs it:
`edgesdk.build(module, target, out, example_inputs=...)`, timed whole, and the export alone
(`torch.export` + `torch.onnx`, the same function the build calls) timed in the same process before it.

x86 builds with the schedule's own cut, TVM untuned (`cpu_backends="planned"`): the export is the question,
not which CPU backend is fastest (`x86-latency` answers that). The answers, on 16 held-out crops of scikit-image's sample photographs (ImageNet preprocessing), never the
crops calibrated on: x86 (fp32): the bundle run on this host, against eager PyTorch, each output's largest
error relative to its scale and the share of images whose top-1 class is eager's. arm_2tpu (int8, calibrated
on 32 other crops): its `--eval` on the held-out crops with eager PyTorch's top-1 class as the label, as the
build's golden path runs the bundle (Edge TPU segments on LiteRT's CPU interpreter), and the accuracy gate's
figures against fp32; beside it, what onnxruntime's own static int8 gives on the same exported model and crops,
and eager's top-1 margin (random weights leave small ones, which int8's error crosses more easily).
Random weights as a library draws them leave BatchNorm at mean 0 / variance 1 (MobileNetV2's logits were
1e-22, the same for every image): its statistics are set from 32 other crops (tests/model_zoo.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk")]
import _results  # noqa: E402  (after the path above)

WORK = ROOT / ".cache" / "bench-pytorch"
MODELS = ("resnet18", "mobilenet_v2", "vit_tiny")
TARGETS = ("x86", "arm_2tpu")
SIZE = 224


def module(name: str):
    import numpy as np
    import torch
    from transformers import (MobileNetV2Config, MobileNetV2ForImageClassification, ResNetConfig,
                              ResNetForImageClassification, ViTConfig, ViTForImageClassification)

    torch.manual_seed(0)
    if name == "resnet18":
        model = ResNetForImageClassification(ResNetConfig(embedding_size=64, hidden_sizes=[64, 128, 256, 512],
                                                          depths=[2, 2, 2, 2], layer_type="basic", num_labels=1000))
    elif name == "mobilenet_v2":
        model = MobileNetV2ForImageClassification(MobileNetV2Config(depth_multiplier=1.0, image_size=SIZE,
                                                                    num_labels=1001))
    else:
        model = ViTForImageClassification(ViTConfig(hidden_size=192, num_hidden_layers=12, num_attention_heads=3,
                                                    intermediate_size=768, image_size=SIZE, patch_size=16,
                                                    num_labels=1000))

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, pixel_values):
            return self.m(pixel_values=pixel_values).logits

    if name == "vit_tiny":  # LayerNorm: no statistics to set
        return Logits(model).eval()
    from tests import model_zoo

    return model_zoo.with_torch_bn_statistics(Logits(model), np.concatenate(crops(32, seed=3)))


def crops(n: int, seed: int):
    import numpy as np
    from PIL import Image

    from tests import model_zoo

    rng = np.random.default_rng(seed)
    photos = model_zoo.photos()
    out = []
    for k in range(n):
        p = photos[k % len(photos)]
        side = int(rng.integers(min(SIZE, min(p.shape[:2])), min(p.shape[:2]) + 1))
        y, x = int(rng.integers(0, p.shape[0] - side + 1)), int(rng.integers(0, p.shape[1] - side + 1))
        img = Image.fromarray(p[y:y + side, x:x + side]).resize((SIZE, SIZE), Image.BILINEAR)
        a = (np.asarray(img, np.float32) / 255.0 - (0.485, 0.456, 0.406)) / (0.229, 0.224, 0.225)
        out.append(a.transpose(2, 0, 1).astype(np.float32)[None])
    return out


def child(name: str, target: str) -> dict:
    """One (model, target), in this process: export alone, then the whole build, then its answers."""
    import numpy as np
    import torch

    torch.set_num_threads(2)
    import edgesdk
    from edgesdk.frontends.torch_export import export

    net = module(name)
    example = (torch.from_numpy(crops(1, seed=99)[0]),)
    work = WORK / f"{name}-{target}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    export(net, example, work / "exported.onnx", shown=name)
    export_s = time.perf_counter() - t0
    held = crops(16, seed=1)
    with torch.no_grad():
        eager = [net(torch.from_numpy(x)).numpy() for x in held]
    options = {"cpu_backends": "planned"} if target == "x86" else {}
    if target == "arm_2tpu":
        calib, heldout = work / "calib", work / "heldout"
        calib.mkdir()
        heldout.mkdir()
        for i, x in enumerate(crops(32, seed=2)):
            np.save(calib / f"{i:03d}.npy", x)
        for i, x in enumerate(held):
            np.save(heldout / f"{i:03d}.npy", x)
        (heldout / "labels.txt").write_text("".join(f"{int(e.argmax())}\n" for e in eager))  # in file-name order
        options.update(calib=calib, eval_data=heldout, task="classification", accept_accuracy_loss=True)
    t0 = time.perf_counter()
    build = edgesdk.build(net, target, work / "out", example_inputs=example, name=name, log=lambda s: None,
                          tuning_db=work / "db", **options)
    build_s = time.perf_counter() - t0
    row = {"model": name, "target": target, "export_s": round(export_s, 2), "build_s": round(build_s, 2),
           "params_m": round(sum(p.numel() for p in net.parameters()) / 1e6, 2),
           "bundle_mib": round(build.tarball.stat().st_size / 2**20, 2),
           "placement": build.stages["schedule"].get("placement", {}).get("by_device")
           if isinstance(build.stages["schedule"].get("placement"), dict) else None}
    if target == "x86":
        with edgesdk.Bundle.open(build.bundle.path) as bundle:
            (inp,) = bundle.inputs
            got = [next(iter(bundle.run({inp: x}).values())) for x in held]
        errors = [float(np.abs(g - e).max() / max(float(np.abs(e).max()), 1e-12)) for g, e in zip(got, eager)]
        row.update(max_rel_error=max(errors), top1_same=sum(int(g.argmax() == e.argmax()) for g, e in zip(got, eager)),
                   images=len(held))
    else:
        acc = build.accuracy
        task = acc.get("task") or {}
        row.update(task=task.get("summary"), top1_vs_eager=task.get("top1_int8"),
                   top1_vs_fp32=task.get("top1_agreement"), verdict=task.get("verdict"),
                   gate=acc.get("gate"), images=len(held), margin_std=_margin(eager),
                   ort_int8_top1_vs_eager=_ort_int8_top1(work / "exported.onnx", calib, held, eager))
    return row


def _margin(eager) -> float:
    """Eager PyTorch's median margin between its first and second class, in standard deviations of the logits:
    how far int8's error may move a logit before the top-1 class changes (random weights give small ones)."""
    import numpy as np

    return round(float(np.median([(np.sort(e[0])[-1] - np.sort(e[0])[-2]) / e[0].std() for e in eager])), 3)


def _ort_int8_top1(onnx_path: Path, calib: Path, held, eager) -> float:
    """What a user would get from onnxruntime's own static int8 (QDQ, weights per channel, min-max ranges) on
    the same exported model and the same calibration crops: its top-1 agreement with eager on the held-out crops."""
    import numpy as np
    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    name = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).get_inputs()[0].name

    class Crops(CalibrationDataReader):
        def __init__(self):
            self.files = iter(sorted(calib.glob("*.npy")))

        def get_next(self):
            f = next(self.files, None)
            return None if f is None else {name: np.load(f)}

    out = onnx_path.with_name("ort-int8.onnx")
    quantize_static(str(onnx_path), str(out), Crops(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = [session.run(None, {name: x})[0] for x in held]
    return round(float(np.mean([g.argmax() == e.argmax() for g, e in zip(got, eager)])), 4)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--child", nargs=2, metavar=("MODEL", "TARGET"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(*args.child), default=str))
        return 0
    rows = []
    env = {**os.environ, "TVM_NUM_THREADS": "2", "TF_CPP_MIN_LOG_LEVEL": "2"}
    for name in args.models.split(","):
        for target in args.targets.split(","):
            print(f"{name} for {target} ...", file=sys.stderr, flush=True)
            proc = subprocess.run([sys.executable, __file__, "--child", name, target], capture_output=True, text=True,
                                  env=env)
            if proc.returncode != 0:
                rows.append({"model": name, "target": target, "error": proc.stderr.strip().splitlines()[-1:]})
                print(proc.stderr[-2000:], file=sys.stderr)
                continue
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"  {rows[-1]}", file=sys.stderr)
    old = _results.load("pytorch-in")
    kept = [r for r in (old or {}).get("data", {}).get("rows", [])
            if (r["model"], r["target"]) not in {(x["model"], x["target"]) for x in rows}]
    for r in rows:
        r["commit"] = _results.commit()[:12]
    every = kept + rows
    lines = ["| model (params) | target | export s | export + build s | bundle MiB | against eager PyTorch, 16 held-out photo crops |",
             "|---|---|---|---|---|---|"]
    for r in sorted(every, key=lambda r: (MODELS.index(r["model"]) if r["model"] in MODELS else 9, r["target"])):
        if "error" in r:
            lines.append(f"| {r['model']} | {r['target']} | failed | | | {' '.join(r['error'])} |")
            continue
        if r["target"] == "x86":
            answer = (f"fp32: top-1 same {r['top1_same']}/{r['images']}, largest error "
                      f"{100 * r['max_rel_error']:.2g} % of the output's scale")
        else:
            verdict = r.get("verdict") or {}
            answer = (f"int8: top-1 same as eager {100 * (r.get('top1_vs_eager') or 0):.0f} %, as the fp32 ONNX "
                      f"{100 * (r.get('top1_vs_fp32') or 0):.0f} %; the task's goal "
                      + ("met" if verdict.get("met") else f"missed ({'; '.join(verdict.get('missed', []))}), published "
                         "with accept_accuracy_loss"))
            if "ort_int8_top1_vs_eager" in r:
                answer += (f"; onnxruntime's static int8 on the same crops: top-1 same as eager "
                           f"{100 * r['ort_int8_top1_vs_eager']:.0f} %; eager's top-1 margin: median "
                           f"{r['margin_std']:.2f} std of the logits")
        lines.append(f"| {r['model']} ({r['params_m']} M) | {r['target']} | {r['export_s']:.1f} | {r['build_s']:.1f} | "
                     f"{r['bundle_mib']:.1f} | {answer} |")
    _results.write("pytorch-in", {"rows": every}, "\n".join(lines),
                   notes=["arm_2tpu: the Edge TPU segments run on LiteRT's CPU interpreter (no Edge TPU here), int8 "
                          "numerics real; the labels are eager PyTorch's top-1 classes, so top-1 is agreement",
                          "random weights (BatchNorm statistics from 32 other photo crops) leave eager's first and "
                          "second classes a fraction of a standard deviation apart, where a trained classifier's are "
                          "several: top-1 agreement is a harsh measure here, hence onnxruntime's own int8 beside it "
                          "(QDQ, weights per channel, min-max, the same calibration crops) and top-5 in `task`"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
