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
from ..scheduling.plan import Plan
from .archive import savez

ACCURACY_SAMPLES = 8  # calibration samples the bundle is compared with the fp32 model on


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


def accuracy(host_model: BundleModel, reference: Callable[[], onnx.ModelProto], plan: Plan, samples: list[dict],
             reference_name: str = "the imported fp32 model") -> dict:
    """The bundle against the fp32 model (a pruned build's: the pruned one), on logits where a trailing
    softmax would hide errors. `host_model` is released once it has run the samples, before `reference()`
    reads the float model: the two are never held at once."""
    probes = {o: p for o, p in plan.probes.items()
              if any(p == t.name for s in host_model.manifest.segments for t in s.outputs)}
    names = [o.name for o in host_model.manifest.outputs if o.name not in probes] + list(probes.values())
    got = [host_model.run(f, extra_outputs=probes.values()) for f in samples]
    host_model.release()
    give_back()
    ref = ort_backend.run_many(reference(), samples, names)  # one session: each holds the weights again
    tensors = {n: compare(np.stack([g[n] for g in got]), np.stack([r[n] for r in ref])) for n in names}
    out = {"reference": f"onnxruntime on {reference_name}", "samples": len(samples), "tensors": tensors}
    if probes:
        p = next(iter(probes.values()))
        # per position along the last (class) axis: a sequence model has one decision per step
        agree = [np.mean(np.argmax(g[p], -1) == np.argmax(r[p], -1)) for g, r in zip(got, ref)]
        out["top1_agreement"] = round(float(np.mean(agree)), 4)
    return out
