"""The bundle's golden self-test and its accuracy, both from running the bundle's own plan on the
build host: the very same TFLite files, and for CPU/GPU segments built for another machine (aarch64,
CUDA) the x86-64 twins compiled from the same segments and tuning records."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx

from ..backends import onnxruntime as ort_backend
from ..errors import UserError
from ..ir.memory import give_back
from ..ir.numeric import compare
from ..runtime import manifest as mf
from ..runtime.executor import BundleModel
from ..runtime.inputs import InputError, check_feeds
from .archive import savez

ACCURACY_SAMPLES = 16  # held-out samples the bundle is compared with the fp32 model on, at most


def write_golden(bundle: Path, manifest: mf.Manifest, host_model: BundleModel, samples: list[dict]) -> None:
    """golden/inputs.npz (the first sample), outputs.npz and boundaries.npz: every tensor crossing a
    segment boundary too, so the self-test checks each segment on its own golden inputs and a device
    whose int8 kernels round differently is judged segment by segment."""
    golden_in = samples[0]
    crossing = sorted({t.name for seg in manifest.segments for t in (*seg.inputs, *seg.outputs)}
                      - set(golden_in) - {t.name for t in manifest.outputs})
    for k, sample in enumerate(samples):  # a --calib sample the bundle would refuse (an id beyond its table)
        try:
            check_feeds(manifest.inputs, sample)
        except InputError as e:
            raise UserError("package.bad-sample", f"calibration sample {k + 1} is not a valid input: {e}",
                            "give --calib samples the deployed model accepts; " + e.hint) from None
    golden_all = host_model.run(golden_in, extra_outputs=crossing)
    (bundle / "golden").mkdir()
    savez(bundle / "golden" / "inputs.npz", golden_in)
    savez(bundle / "golden" / "outputs.npz", {t.name: golden_all[t.name] for t in manifest.outputs})
    savez(bundle / "golden" / "boundaries.npz", {n: golden_all[n] for n in crossing})


def accuracy(host_model: BundleModel, reference: Callable[[], onnx.ModelProto], samples: list[dict],
             reference_name: str = "the imported fp32 model", *, held_out: bool = True) -> dict:
    """The bundle against the fp32 model (a pruned build's: the pruned one) on `samples` (the held-out
    ones, `held_out`): per output (`tensors`: cosine, max abs error, as before) and per part of an output
    as its meaning cuts it (`parts`: compression/accuracy.py, after the output's own sigmoid or softmax).
    `host_model` is released once it has run the samples, before `reference()` reads the float model:
    the two are never held at once."""
    from ..compression import accuracy as measures

    names = [o.name for o in host_model.manifest.outputs]
    got = [host_model.run(f) for f in samples]
    host_model.release()
    give_back()
    model = reference()
    ref = ort_backend.run_many(model, samples, names)  # one session: each holds the weights again
    tensors = {n: compare(np.stack([g[n] for g in got]), np.stack([r[n] for r in ref])) for n in names}
    parts = measures.views(model)
    return {"reference": f"onnxruntime on {reference_name}", "samples": len(samples), "held_out": held_out,
            "tensors": tensors, "parts": measures.measure(ref, got, {n: parts[n] for n in names if n in parts})}
