"""OpenVINO runner, for a CPU span where the tune stage measured OpenVINO fastest: the segment's IR
compiled by OpenVINO's CPU plugin for the CPU it runs on, in the precision the IR names
(`edgesdk.inference_precision` in its runtime information; float32 where it names none). OpenVINO's own
default on a CPU with AVX512_BF16 or AMX is bfloat16, which is never taken implicitly."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

from ..manifest import ManifestError, Segment

# where an IR's runtime information names the precision to compute in (written by backends/openvino.py)
PRECISION_KEY = ("edgesdk", "inference_precision")


class OvRunner:
    def __init__(self, bundle: Path, segment: Segment, threads: int = 0, *, alone: bool = False):
        import openvino as ov

        core = ov.Core()
        try:
            model = core.read_model(str(bundle / segment.artifact))
        except Exception as e:  # OpenVINO's own exception types: the artifact is not a model it reads
            said = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise ManifestError(f"segment {segment.id}: {segment.artifact} is not a model OpenVINO reads ({said})") from None
        precision = model.get_rt_info(list(PRECISION_KEY)).astype(str) if model.has_rt_info(list(PRECISION_KEY)) else "f32"
        # one stream, latency first: a bundle runs one inference at a time per segment. Threads are pinned to
        # cores only where the segment is the bundle's only work on the CPU, as onnxruntime's spin there.
        config = {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1",
                  "ENABLE_CPU_PINNING": bool(alone)}
        if threads:
            config["INFERENCE_NUM_THREADS"] = int(threads)
        self.compiled = core.compile_model(model, "CPU", config)
        self._model, self._config = model, config
        names = {n for port in self.compiled.inputs for n in port.get_names()}
        takes = sorted(t.name for t in segment.inputs)
        missing = [t for t in takes if t not in names]
        self.outputs = {}
        for t in segment.outputs:
            try:
                self.outputs[t.name] = (self.compiled.output(t.name), np.dtype(t.dtype))
            except RuntimeError:
                missing.append(t.name)
        if missing or len(self.compiled.inputs) != len(takes):
            raise ManifestError(f"segment {segment.id}: its model takes {sorted(names)}; the manifest lists "
                                f"{takes} and {sorted(t.name for t in segment.outputs)} (missing: {missing})")
        self._inputs = [(t.name, self.compiled.input(t.name)) for t in segment.inputs]
        self._tensor = ov.Tensor
        self.precision = precision
        self.note = ""
        self._request = self.compiled.create_infer_request()
        self._lock = threading.Lock()

    def float32_outputs(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """The segment's outputs on `feeds` computed in float32, where it computes in a reduced precision (None
        where it computes in float32): how far its own are from them sizes its self-test's tolerance."""
        if self.precision == "f32":
            return None
        import openvino as ov

        compiled = ov.Core().compile_model(self._model, "CPU", {**self._config, "INFERENCE_PRECISION_HINT": "f32"})
        got = compiled.create_infer_request().infer(feeds, share_outputs=False)
        return {name: np.asarray(got[compiled.output(name)]).astype(dtype) for name, (_, dtype) in self.outputs.items()}

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # each input handed over as a tensor on the caller's memory and each output copied out of the request's:
        # OpenVINO's own infer(dict) dispatches every value through its Python converters and wraps the
        # results, about 50 us a call more on a 0.7 ms model
        request = self._request
        with self._lock:
            for name, port in self._inputs:
                request.set_tensor(port, self._tensor(np.ascontiguousarray(feeds[name]), shared_memory=True))
            request.infer()
            out = {}
            for name, (port, dtype) in self.outputs.items():
                value = np.array(request.get_tensor(port).data)
                # OpenVINO's CPU plugin may hand an int64 output back as int32: the manifest's dtype is the contract
                out[name] = value if value.dtype == dtype else value.astype(dtype)
            return out


def open_runner(bundle: Path, segment: Segment, physical_device: str | None, *, alone: bool = False) -> OvRunner:
    """A segment's threads where its parallel step sets them, else the bundle's CPU threads
    (EDGESDK_NUM_THREADS, as onnxruntime's and LiteRT's)."""
    threads = segment.threads or int(os.environ.get("EDGESDK_NUM_THREADS") or 0)
    return OvRunner(bundle, segment, threads, alone=alone)
