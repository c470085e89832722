"""`--eval DIR`: the finished bundle against the fp32 model on held-out samples, by the task's own measure.

The bundle runs its own plan on the build host (the TFLite files it ships; x86-64 twins of code built for
another CPU), the imported fp32 model runs in onnxruntime, both on every sample of DIR (read as `--calib`
reads its samples); `compression/tasks.py` decodes and compares the outputs. The two models are never
held at once. The figures and their verdict go into the manifest's `accuracy.task`; what to do about a
missed goal is the accuracy gate's decision, not this module's.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from ..backends import onnxruntime as ort_backend
from ..compression import tasks
from ..errors import UserError
from ..ir import model as irm
from ..ir.calibration import LABELS, load_calibration
from ..ir.memory import give_back
from ..runtime.executor import BundleModel
from ..runtime.inputs import InputError

MAX_EVAL_SAMPLES = 100_000  # every sample of DIR, up to this many


def task_of(options) -> str:
    """The task `--eval` measures: `--task`, else classification where DIR has labels.txt, else generic."""
    if options.task:
        return options.task
    return "classification" if (Path(options.eval_data) / LABELS).exists() else "generic"


def eval_inputs(options, imported: Path, warn: Callable[[str], None] = lambda s: None) -> dict:
    """What `--eval` measures with: the task, its options (`spec`, with an OCR model's dictionary), the
    samples of `options.eval_data` (read as `--calib` reads its samples) and their labels (or None)."""
    root = Path(options.eval_data)
    task = task_of(options)
    spec = tasks.parse_options(task, options.decoder, options.task_options)
    io = json.loads((imported / "import.json").read_text())
    reading = dataclasses.replace(options, calib=root, calib_samples=MAX_EVAL_SAMPLES)
    samples, info = load_calibration(reading, io["inputs"], flag="--eval")
    if options.calib is not None and Path(options.calib).resolve() == root.resolve():
        warn(f"--eval {root} is the --calib directory: the task figures are measured on the calibration samples, "
             "not on held-out ones")
    first = io["inputs"][0]["name"] if io["inputs"] else None
    images = len(samples) * (int(samples[0][first].shape[0]) if first and samples[0][first].ndim else 1)
    labels = tasks.load_labels(root, task, images)
    if task == "ocr":
        model = irm.read(imported / "model.onnx")
        spec["characters"] = tasks.dictionary(spec.get("dictionary"), {p.key: p.value for p in model.metadata_props})
    return {"root": root, "task": task, "spec": spec, "samples": samples, "labels": labels, "info": info,
            "names": [o["name"] for o in io["outputs"]]}


def evaluate(bundle: Path, twins: dict[str, Path], imported: Path, options, log: Callable[[str], None],
             warn: Callable[[str], None]) -> dict:
    """The task's figures and verdict (`tasks.measure_task`) of the bundle in `bundle` against the fp32 model
    in `imported`, on the samples of `options.eval_data`, with where they came from."""
    given = eval_inputs(options, imported, warn)
    root, task, spec, samples, labels, info, names = (given[k] for k in ("root", "task", "spec", "samples", "labels",
                                                                      "info", "names"))

    log(f"package: --eval: running the bundle and the fp32 model on {len(samples)} sample(s) of {root} ({task})")
    host = BundleModel(bundle, artifacts=twins, log=log)
    got = []
    for k, sample in enumerate(samples):
        try:
            out = host.run(sample)
        except InputError as e:
            raise UserError("eval.bad-sample", f"--eval {root}: sample {k + 1} is not a valid input: {e}",
                            "give --eval samples the deployed model accepts; " + e.hint) from None
        got.append({n: out[n] for n in names})
    host.release()
    give_back()
    model = irm.read(imported / "model.onnx")
    ref = ort_backend.run_many(model, samples, names)
    del model
    result = tasks.measure_task(task, ref, got, labels, **spec)
    text = tasks.summary(result)
    result = {**result, "samples": len(samples), "source": str(root), "labels": labels.source if labels else None,
              "reference": "onnxruntime on the imported fp32 model", "summary": text,
              **({"preprocess": info["preprocess"]} if "preprocess" in info else {})}
    log(f"package: task {task} on {len(samples)} --eval sample(s), against "
        + (f"{Path(labels.source).name}" if labels else "the fp32 model's own results") + f": {text}")
    return result
