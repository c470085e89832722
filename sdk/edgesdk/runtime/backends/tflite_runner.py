"""TFLite runner for Edge TPU segments: the Edge TPU delegate when it is there, else the CPU; and for
the fp32 CPU segments of the `litert` backend, on LiteRT's CPU kernels (XNNPACK).

A segment compiled for the Edge TPU (`artifact` is the `_edgetpu.tflite`) runs through
`libedgetpu.so.1`, opened with `{"device": "usb:0"}` exactly as Coral's own library does, one
interpreter per TPU. When the delegate cannot be loaded (no libedgetpu, TPU unplugged) or the
segment was never compiled, the uncompiled int8 model (`fallback_artifact`) runs on the CPU
interpreter with the same int8 numerics, and `note` says so.

An Edge TPU that stops answering while the bundle runs (unplugged, reset: the delegate's invoke
raises) is not fatal: that call and every later one run the uncompiled int8 model on the CPU, the
runner says so once on stderr and in `note`, and a stream loses and reorders no frame, since the call
that failed is run again on the CPU before it returns.

The interpreter is LiteRT (`ai_edge_litert`); `tflite_runtime` is the fallback for hosts
that only have it (it needs numpy < 2).
"""

from __future__ import annotations

import copy
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..manifest import ManifestError, Segment, TensorSpec


# ops that move int8 values without changing them
_RESHAPING = ("RESHAPE", "SQUEEZE", "TRANSPOSE")
# int8 activations whose output moves by many steps when their input moves by one (docs/bundle.md)
_ACTIVATIONS = ("LOGISTIC", "TANH", "SOFTMAX")


def _interpreter_module() -> Any:
    try:
        from ai_edge_litert import interpreter
    except ImportError:
        from tflite_runtime import interpreter  # type: ignore[no-redef]
    return interpreter


def _num_threads() -> int | None:
    value = os.environ.get("EDGESDK_NUM_THREADS")
    return int(value) if value else None


@dataclass
class _Interpreter:
    """An open interpreter and what the runner reads of it, shared by the views of a shared artifact
    (`for_segment`), so that a switch to the CPU is seen by all of them."""

    interpreter: Any
    runner: Any
    inputs: dict
    outputs: dict
    fallback: Path | None  # what the CPU runs if the accelerator stops answering; None: nothing else
    lock: threading.Lock = field(default_factory=threading.Lock)


def _load(model: Path, delegates: list[Any], segment: Segment, fallback: Path | None) -> _Interpreter:
    interpreter = _interpreter_module().Interpreter(model_path=str(model), experimental_delegates=delegates or None,
                                                    num_threads=_num_threads())
    runner = interpreter.get_signature_runner()
    opened = _Interpreter(interpreter, runner, runner.get_input_details(), runner.get_output_details(), fallback)
    for specs, details, what in ((segment.inputs, opened.inputs, "input"), (segment.outputs, opened.outputs, "output")):
        keys = sorted(spec.key for spec in specs)
        if keys != sorted(details):
            raise ManifestError(f"segment {segment.id}: its model's {what}s are {sorted(details)}; the manifest "
                                f"lists {keys}")
    return opened


class TfliteRunner:
    """One interpreter, run through its signature runner; `run` is safe to call from threads."""

    def __init__(self, model: Path, segment: Segment, delegates: list[Any], note: str,
                 fallback: Path | None = None):
        self.note = note
        self.segment = segment
        self._shared = _load(model, delegates, segment, fallback)

    def for_segment(self, segment: Segment) -> "TfliteRunner":
        """This runner's interpreter for another segment that ships the same artifact on the same device (a
        shared segment: its own tensor names, the same signature keys); calls of the two take turns."""
        keys = sorted(spec.key for spec in (*segment.inputs, *segment.outputs))
        if keys != sorted(spec.key for spec in (*self.segment.inputs, *self.segment.outputs)):
            raise ManifestError(f"segment {segment.id} shares {segment.artifact} with segment {self.segment.id} "
                                f"but lists other tensors ({keys})")
        view = copy.copy(self)
        view.segment, view.note = segment, ""
        return view

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """ONNX-named, ONNX-layout float inputs → ONNX-named, ONNX-layout float32 outputs."""
        shared = self._shared
        with shared.lock:
            try:
                raw = shared.runner(**self._args(feeds))
            except (RuntimeError, ValueError) as e:
                if shared.fallback is None:
                    raise
                self._to_cpu(e)  # and this call again, on the CPU: no frame is lost
                raw = shared.runner(**self._args(feeds))
            return {spec.name: self._decode(spec, raw[spec.key]) for spec in self.segment.outputs}

    @property
    def on_accelerator(self) -> bool:
        """Whether the segment runs on its accelerator (the Edge TPU's delegate), not on the CPU."""
        return self._shared.fallback is not None

    def output_arithmetic(self, spec: TensorSpec) -> dict | None:
        """How this model computed output `spec`, for the self-test's tolerance: `scale`, the int8 step of
        the tensor it was rounded to (its own, or the int8 tensor a DEQUANTIZE at the end reads), and where
        an int8 LOGISTIC, TANH or SOFTMAX made that tensor (through reshapes), `activation` (the op),
        `input_scale` (its input's step) and, where that input is an output of the segment too, `input`
        (its name). None for a float result, or where LiteRT does not list its ops."""
        interpreter = self._shared.interpreter
        try:
            ops = [op for op in interpreter._get_ops_details() if op["op_name"] != "DELEGATE"]
            tensors = {t["index"]: t for t in interpreter.get_tensor_details()}
        except (AttributeError, ValueError):
            return None
        producer = {t: op for op in ops for t in op["outputs"]}
        index = self._shared.outputs[spec.key]["index"]
        op = producer.get(index)
        if op is not None and op["op_name"] == "DEQUANTIZE":
            index = op["inputs"][0]
            op = producer.get(index)
        tensor = tensors[index]
        if np.dtype(tensor["dtype"]).kind not in "iu" or not tensor["quantization"][0]:
            return None
        out = {"scale": float(tensor["quantization"][0])}
        while op is not None and op["op_name"] in _RESHAPING:
            op = producer.get(op["inputs"][0])
        if op is not None and op["op_name"] in _ACTIVATIONS:
            before = op["inputs"][0]
            out.update(activation=op["op_name"], input_scale=float(tensors[before]["quantization"][0]))
            given = [t.name for t in self.segment.outputs if self._shared.outputs[t.key]["index"] == before]
            if given:  # the activation's input is an output too: the self-test holds its golden values
                out["input"] = given[0]
        return out

    def _args(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {spec.key: self._encode(spec, feeds[spec.name]) for spec in self.segment.inputs}

    def _to_cpu(self, error: Exception) -> None:
        """The accelerator failed a call: from now on the fallback model runs on the CPU (said once)."""
        shared = self._shared
        cpu = _load(shared.fallback, [], self.segment, None)
        shared.interpreter, shared.runner, shared.inputs, shared.outputs, shared.fallback = (
            cpu.interpreter, cpu.runner, cpu.inputs, cpu.outputs, None)
        why = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
        self.note = (f"{self.segment.device} stopped answering ({why}): segment {self.segment.id} runs its int8 "
                     "model on the CPU from now on")
        print(f"runtime: warning: {self.note}", file=sys.stderr, flush=True)

    def _encode(self, spec: TensorSpec, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        if spec.perm:  # onnx = transpose(t, perm)  =>  t = transpose(onnx, perm^-1)
            x = np.transpose(x, np.argsort(spec.perm))
        return quantized(self._shared.inputs[spec.key], x)

    def _decode(self, spec: TensorSpec, y: np.ndarray) -> np.ndarray:
        if spec.dtype.startswith("float"):
            y = dequantized(self._shared.outputs[spec.key], y)
        if spec.perm:
            y = np.transpose(y, spec.perm)
        return np.asarray(y, order="C")  # ascontiguousarray would make a 0-d output 1-d


def quantized(detail: dict, x: np.ndarray) -> np.ndarray:
    """`x` as the interpreter tensor `detail` takes it: float values quantized with its scale and zero
    point where it is an integer tensor."""
    dtype = np.dtype(detail["dtype"])
    if dtype.kind in "iu" and x.dtype.kind == "f":
        scale, zero = detail["quantization"]
        info = np.iinfo(dtype)
        x = np.clip(np.round(x / scale + zero), info.min, info.max)
    return np.asarray(x, dtype, order="C")


def dequantized(detail: dict, y: np.ndarray) -> np.ndarray:
    """The interpreter tensor `detail`'s values `y` as float32 where it is an integer tensor."""
    if np.dtype(detail["dtype"]).kind in "iu":
        scale, zero = detail["quantization"]
        return (y.astype(np.float32) - zero) * np.float32(scale)
    return y


def _libedgetpu_present() -> bool:
    """Whether Coral's runtime library loads at all. Asking first spares the user LiteRT's noisy
    `Delegate.__del__` error that a failed load_delegate leaves behind."""
    import ctypes

    try:
        ctypes.CDLL("libedgetpu.so.1")
        return True
    except OSError:
        return False


def open_runner(bundle: Path, segment: Segment, physical_device: str | None, *, alone: bool = False) -> TfliteRunner:
    """A runner on the Edge TPU when the segment is compiled and the TPU opens, else on the CPU."""
    bundle = Path(bundle)
    fallback = segment.fallback_artifact or segment.artifact
    compiled = segment.artifact != fallback
    if not compiled:
        note = (f"segment {segment.id} is not compiled for the Edge TPU: its int8 model runs on the CPU interpreter"
                if segment.device.startswith("edgetpu") else "")
        return TfliteRunner(bundle / fallback, segment, [], note)
    where = f"{segment.device} ({physical_device})" if physical_device else segment.device
    if physical_device and not _libedgetpu_present():
        note = f"{where} not found (libedgetpu.so.1 is not installed): segment {segment.id} runs its int8 model on the CPU"
    elif physical_device:
        try:
            delegate = _interpreter_module().load_delegate("libedgetpu.so.1", {"device": physical_device})
            return TfliteRunner(bundle / segment.artifact, segment, [delegate], "", fallback=bundle / fallback)
        except (ValueError, OSError, RuntimeError):
            pass
        note = f"{where} not found: segment {segment.id} runs its int8 model on the CPU"
    else:
        note = f"{where} has no physical device in this bundle: segment {segment.id} runs its int8 model on the CPU"
    return TfliteRunner(bundle / fallback, segment, [], note)
