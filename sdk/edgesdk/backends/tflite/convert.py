"""Conversion of a traced segment by `tf.lite.TFLiteConverter`: full int8, mixed precision, or fp32.

int8 runs in the converter's own two steps (calibrate, then quantize from the calibrated ranges);
between them a calibration method other than min-max chooses each range (narrowing.py), and the
second step may keep some ops float (mixed.py: for LiteRT on the CPU, never for the Edge TPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import os
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import onnx

from ...crashes import report_native_crashes
from ...errors import UserError
from ...ir import calibrators
from ...ir.calibrators import METHODS
from ...ir.memory import available_bytes, shown
from ...runtime.manifest import QuantParams, TensorSpec
from .limits import (CONVERTER_BASE_BYTES, CONVERTER_BYTES_PER_WEIGHT_BYTE, CONVERTER_INT8_BYTES_PER_WEIGHT_BYTE,
                     FLATBUFFER_LIMIT)
from . import mixed as mixed_precision
from .flatbuffer import op_counts
from .layers import tensors_of_nodes
from . import narrowing
from .trace import _Lowered, _lower, _to_tf_layout


@dataclass(frozen=True)
class TfliteResult:
    inputs: tuple[TensorSpec, ...]  # ONNX order; key = signature key; perm; quant for int8
    outputs: tuple[TensorSpec, ...]
    op_counts: dict[str, int]  # TFLite builtin op histogram of the converted model
    ranges: dict[str, Any] = field(default_factory=dict)  # how activation ranges were chosen (int8 only)
    mixed: mixed_precision.Mixed | None = None  # the ops kept float, where a target or a list was given
    # with method auto and an `alternatives_dir`: each candidate of `_auto` written whole, by label
    alternatives: dict[str, tuple[Path, "TfliteResult"]] = field(default_factory=dict)
    # each ONNX activation the trace made: the `p` of its TFLite tensor (onnx == transpose(tflite, p)),
    # what the culprit search reads the int8 tensors with (layers.py)
    layouts: dict[str, tuple[int, ...]] = field(default_factory=dict)


CALIBRATION_METHODS = (*METHODS, "auto")


def convert_int8(model: onnx.ModelProto, calibration: Iterable[dict[str, np.ndarray]], out_path: Path, *,
                 method: str = "minmax", percentile: float = 99.99, target: Any = None,
                 keep_float: tuple[str, ...] | None = None, reference: list[dict[str, np.ndarray]] | None = None,
                 log: Any = None, cpu: bool = False, alternatives_dir: Path | None = None,
                 activations: dict[str, str] | None = None, model_inputs: tuple[str, ...] = (),
                 grids: dict[str, tuple[float, float]] | None = None) -> TfliteResult:
    """Write a full-int8 .tflite of `model` to `out_path` (atomically: a temporary file, then a
    rename). `model` is a segment with static shapes and float32 inputs; `calibration` yields
    feeds keyed by ONNX input names, in ONNX layout, that the activation ranges are taken from.

    Mixed precision (float inputs and outputs): `keep_float` names ops to keep float (as
    mixed.op_names names them); else with `target` (a registry.AccuracyTarget) and `reference` (the
    float model's outputs on each calibration feed, by ONNX name), the fewest ops float that meet
    the target on the calibration feeds (mixed.search; `log` hears its progress).
    `cpu`: for LiteRT on the CPU, which also takes the ops the Edge TPU lacks (`CPU_LOWERINGS`).

    `method` chooses each activation's range (`ir.calibrators`): "minmax", the smallest and largest
    value seen (the converter's own calibration); "percentile", the `percentile`-th and
    (100 - `percentile`)-th percentiles of the values seen; "mse", the range of least squared error of
    the values through int8; "entropy", TensorRT's KL calibration; "auto", per tensor the method of
    least measured error, kept where the segment's outputs are nearer float than with any one method
    for every tensor (`_auto`; `log` hears its choice). Weights are per-channel in all. With "auto" and
    `alternatives_dir` (full int8 only), every candidate `_auto` weighed is written there too
    (`<out_path's stem>.<label>.tflite`), so that a caller may weigh them by more than this segment's
    outputs (the compress stage: the whole model's). `activations`: outputs (by ONNX name) the user's code
    reads through an activation, whose int8 range is where that activation moves (narrowing.saturating),
    whatever the method. `model_inputs`: the segment's inputs that are the model's own, whose range stays
    the min-max one whatever the method: every value of an input the preprocessing makes is real data (a
    percentile cut the black of PP-OCR's text, (0 - 0.485) / 0.229, off its detector's normalized pages).
    `grids`: tensors (by ONNX name) the imported model had quantized itself, with the range of its grid
    (legalization/quantized.py): each keeps that range whatever the method, so it rounds as the model did.
    Raises UserError naming every node that cannot be lowered, or a feed that does not fit."""
    if method not in CALIBRATION_METHODS:
        raise UserError("compress.calib-method", f"calibration method '{method}' is not known",
                        f"choose one of {', '.join(CALIBRATION_METHODS)}")
    if not 50.0 < percentile <= 100.0:
        raise UserError("compress.calib-percentile", f"calibration percentile {percentile} is outside (50, 100]",
                        "99.99 keeps all but one value in 10,000 per tail; 100 is min-max")
    require_memory(model, int8=True)
    lowered = _lower(model, cpu=cpu)
    samples = [_to_tf_layout(lowered, feed) for feed in calibration]
    if not samples:
        raise UserError("compress.no-calibration", "int8 conversion needs at least one calibration sample",
                        "give calibration inputs (--calibration DIR) or let the build use random ones")
    weighed: dict[str, bytes] | None = {} if alternatives_dir is not None and keep_float is None and target is None \
        else None
    saturate = {spec.key: a for spec in lowered.outputs if (a := (activations or {}).get(spec.name))}
    pinned = {spec.key for spec in lowered.inputs if spec.name in model_inputs}
    calibrated, ranges, quantize = _quiet(_calibrate, lowered, samples, method, percentile, weighed, saturate, pinned,
                                          (model, grids) if grids else None)
    if log is not None and "auto" in ranges:
        log(describe_auto(ranges))
    found = None
    if keep_float is not None:
        model_bytes = quantize(tuple(keep_float))
        found = mixed_precision.Mixed(tuple(keep_float), len(mixed_precision.op_names(calibrated)), None, None,
                                      searched=False)
    elif target is not None and reference is not None:
        model_bytes, found = mixed_precision.search(
            mixed_precision.op_names(calibrated), quantize,
            lambda m, n: _outputs(lowered, m, samples[:n] if n > 0 else samples), reference, target,
            log or (lambda line: None))
    else:
        model_bytes = quantize(())
        if "auto" not in ranges:  # auto ran it; else a model LiteRT refuses is the user's error here, not the bundle's
            _quiet(_outputs, lowered, model_bytes, samples[:1])
    result = _finish(lowered, model_bytes, Path(out_path))
    written: dict[int, tuple[Path, TfliteResult]] = {}
    alternatives = {}
    for label, candidate in (weighed or {}).items():
        if id(candidate) not in written:  # candidates of the same ranges are one model, written once
            path = Path(alternatives_dir) / f"{Path(out_path).stem}.{label.replace(' ', '-')}.tflite"
            written[id(candidate)] = (path, _finish(lowered, candidate, path))
        alternatives[label] = written[id(candidate)]
    return dataclasses.replace(result, ranges=ranges, mixed=found, alternatives=alternatives)


def convert_float(model: onnx.ModelProto, out_path: Path, *, cpu: bool = False) -> TfliteResult:
    """Write an fp32 .tflite of `model` (same lowering, no quantization): LiteRT's fp32 CPU segments
    (`cpu`: with the ops the Edge TPU lacks), and the lowering itself tested against onnxruntime."""
    require_memory(model)
    lowered = _lower(model, cpu=cpu)
    return _finish(lowered, _convert(lowered, None), Path(out_path))


def converter_memory(model: onnx.ModelProto, int8: bool = False) -> tuple[int, int]:
    """The segment's weight bytes and what the converter would hold converting it (an estimate)."""
    weights = sum(_tensor_bytes(t) for t in model.graph.initializer)
    return weights, CONVERTER_BASE_BYTES + _bytes_per_weight_byte(int8) * weights


def _bytes_per_weight_byte(int8: bool) -> int:
    return CONVERTER_INT8_BYTES_PER_WEIGHT_BYTE if int8 else CONVERTER_BYTES_PER_WEIGHT_BYTE


def require_memory(model: onnx.ModelProto, int8: bool = False) -> None:
    """Refuse, before it starts, a conversion that would take more memory than the machine has left:
    the kernel would kill the build (or another process) partway instead."""
    available = available_bytes()
    weights, need = converter_memory(model, int8)
    if weights >= FLATBUFFER_LIMIT:
        raise UserError("tflite.too-large",
                        f"graph '{model.graph.name}' holds {shown(weights)} of weights, and a TFLite model is a "
                        f"FlatBuffer, which holds less than {shown(FLATBUFFER_LIMIT)}",
                        "keep this part of the model off the TFLite backends (--cpu-backends without litert); "
                        "onnxruntime and TVM read weights of any size")
    if available is not None and need > available:
        raise UserError("tflite.out-of-memory",
                        f"converting graph '{model.graph.name}' to TFLite needs about {shown(need)} "
                        f"({shown(weights)} of weights, about {_bytes_per_weight_byte(int8)} bytes per byte in "
                        f"TensorFlow's converter), and this machine has {shown(available)} available",
                        "build on a machine with more memory, or keep this part of the model off the TFLite "
                        "backends (--cpu-backends without litert; for the Edge TPU, a smaller model)")


def _tensor_bytes(t: onnx.TensorProto) -> int:
    count = 1
    for d in t.dims:
        count *= d
    return count * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize if t.data_type else 0


SIGNATURE = "serving_default"  # the converted model's one signature (the runner's `get_signature_runner()`)


@contextlib.contextmanager
def _converter(lowered: _Lowered, samples: list[list[np.ndarray]] | None) -> Iterator[Any]:
    """TensorFlow's converter for the traced segment: float when `samples` is None, else full int8 with
    min-max ranges from `samples` (in the function's layout).

    The function is saved to a SavedModel in a temporary folder and then let go (`lowered.release()`:
    the `lowered` keeps only its specs), so the converter's importer is the one holder of the weights
    while it runs. (`from_concrete_functions` makes the same SavedModel, but kept the function's
    variables and a copy it loads back held beside the importer's.) The conversion metadata is left
    out, and two steps run only where they change the model (`_only_if`): deduplicating equal buffers,
    and the calibrator's intermediate tensors for LSTM ops. Each of those rebuilt the whole FlatBuffer
    as Python objects, about four times its size. TensorFlow's oneDNN allocator, which kept what it
    freed, is off (`ir.memory.TENSORFLOW_ENV`). Per byte of weights, above TensorFlow's base: fp32 9.1
    -> 3.1, int8 12.5 -> 6.0 (a 512 MiB MatMul segment, docs/design-notes.md "TensorFlow's TFLite
    converter memory")."""
    import tensorflow as tf
    from tensorflow.lite.python import lite
    from tensorflow.lite.python.optimize import calibrator

    # the converter's calibrator builds a tf.lite.Interpreter internally and TF warns about its
    # own deprecation on every conversion: noise for our users, who never see that interpreter
    warnings.filterwarnings("ignore", message=r"\s*Warning: tf.lite.Interpreter is deprecated")

    folder = tempfile.mkdtemp(prefix="edgesdk-tflite-")
    try:
        tf.saved_model.save(lowered.module, folder, signatures={SIGNATURE: lowered.function.get_concrete_function()})
        lowered.release()  # the variables go with it: no garbage collection needed (measured the same without)
        converter = tf.lite.TFLiteConverter.from_saved_model(folder, signature_keys=[SIGNATURE])
        converter.exclude_conversion_metadata = True
        if samples is not None:
            converter.optimizations = [tf.lite.Optimize.DEFAULT]
            # keyed by signature name: the converter's input order need not be ours
            keys = [spec.key for spec in lowered.inputs]
            converter.representative_dataset = lambda: (dict(zip(keys, sample)) for sample in samples)
            converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
            converter.inference_input_type = tf.int8
            converter.inference_output_type = tf.int8
        # two steps of the converter that rebuild the whole FlatBuffer as objects (about four times its
        # size), run only where they would change it
        dedup = _only_if(_has_equal_buffers, lite._deduplicate_readonly_buffers)
        intermediates = _only_if(_has_ops_with_intermediates, calibrator.add_intermediate_tensors)
        with _replaced(lite, "_deduplicate_readonly_buffers", dedup), \
                _replaced(calibrator, "add_intermediate_tensors", intermediates):
            yield converter
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(owner, name)  # an AttributeError where TensorFlow renamed it: loud, not silent
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _only_if(needed: Callable[[bytes], bool], step: Callable[[bytes], bytes]) -> Callable[[bytes], bytes]:
    """A converter step that rebuilds the whole FlatBuffer, run only where `needed` says it changes it."""
    return lambda model: step(model) if needed(model) else model


# the builtin ops TensorFlow's calibrator gives intermediate tensors to (its operator properties)
_OPS_WITH_INTERMEDIATES = ("LSTM", "UNIDIRECTIONAL_SEQUENCE_LSTM", "BIDIRECTIONAL_SEQUENCE_LSTM")


def _has_ops_with_intermediates(model: bytes) -> bool:
    """Whether TensorFlow's `add_intermediate_tensors` has an op of `model` to add to. Our lowerings make
    none of those ops (tested: it adds nothing to them)."""
    from tensorflow.lite.python import schema_py_generated as schema

    root = schema.Model.GetRootAsModel(model, 0)
    codes = {getattr(schema.BuiltinOperator, name) for name in _OPS_WITH_INTERMEDIATES}
    return any(max(root.OperatorCodes(i).BuiltinCode(), root.OperatorCodes(i).DeprecatedBuiltinCode()) in codes
               for i in range(root.OperatorCodesLength()))


def _has_equal_buffers(model: bytes) -> bool:
    """Whether two buffers of `model` hold the same bytes: what TensorFlow's deduplication of read-only
    buffers merges. Buffers are compared where they lie (hashes of views into `model`, only among
    buffers of one size)."""
    from tensorflow.lite.python import schema_py_generated as schema

    root = schema.Model.GetRootAsModel(model, 0)
    by_size: dict[int, list[int]] = {}
    for i in range(root.BuffersLength()):
        size = root.Buffers(i).DataLength()
        if size:
            by_size.setdefault(size, []).append(i)
    for indices in by_size.values():
        if len(indices) > 1:
            digests = {hashlib.sha256(memoryview(root.Buffers(i).DataAsNumpy())).digest() for i in indices}
            if len(digests) < len(indices):
                return True
    return False


def _convert(lowered: _Lowered, samples: list[list[np.ndarray]] | None) -> bytes:
    """The converter in one step: float when `samples` is None, else full int8 (min-max ranges)."""
    with _converter(lowered, samples) as converter, _collecting_its_own_garbage_only():
        return _quiet(converter.convert)


@contextlib.contextmanager
def _collecting_its_own_garbage_only() -> Iterator[None]:
    """The converter calls `gc.collect()` on every conversion, to free the SavedModel it loaded: a full
    collection walks every object of the process, TensorFlow's and TVM's modules included (a quarter of a
    second each time, a fifth of an Edge TPU build's time). Frozen (`gc.freeze`) for the conversion, the
    objects that were there before it are passed over, and what the conversion made is collected as before;
    they are handed back to the collector after. A caller that froze objects itself keeps them frozen."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _quiet(call: Any, *args: Any) -> Any:
    """`call(*args)` with what native code writes to fd 2 held back, unless it fails: the converter's
    own diagnostics belong with its error. A crash in it is still reported (`crashes`)."""
    report_native_crashes()  # importing TVM put its own handler on the signal
    with _native_stderr_captured() as captured:
        try:
            return call(*args)
        except Refused:  # its message holds what the kernels said
            raise
        except Exception:
            sys.stderr.write(captured())
            raise


def _calibrate(lowered: _Lowered, samples: list[list[np.ndarray]], method: str, percentile: float,
               alternatives: dict[str, bytes] | None = None, saturate: dict[str, str] | None = None,
               pinned: set[str] | None = None, grids: tuple[onnx.ModelProto, dict] | None = None
               ) -> tuple[bytes, dict[str, Any], Any]:
    """The converter's first int8 step: a float model whose activation tensors carry the range each
    is quantized over (min-max, or the method's: narrowing.py), how the ranges were chosen, and the
    second step as a function of the ops to keep float: `quantize(())` is full int8, and with "minmax"
    the converter's own one-step conversion (tested). A tensor whose range is one value on every sample
    is widened first (narrowing.widen_degenerate). With "auto", `alternatives` (where given) receives
    every candidate's full-int8 model, by label. `saturate` (signature output key -> activation): outputs
    whose range, and that of the tensors sharing its quantization, is where the activation moves
    (narrowing.saturating), in every candidate; `pinned` (signature input keys): inputs that keep their
    min-max range in every candidate; `grids` (the segment, and ranges by ONNX tensor name): tensors that keep
    the given range in every candidate, over all of these (`_grid_tensors`)."""
    with _converter(lowered, samples) as converter, _collecting_its_own_garbage_only():
        converter._experimental_calibrate_only = True  # pylint: disable=protected-access
        calibrated = converter.convert()
    per_channel_off = converter._experimental_disable_per_channel  # pylint: disable=protected-access
    calibrated, widened = narrowing.widen_degenerate(calibrated)
    ranges: dict[str, Any] = {"method": method}
    clips = {i: ("minmax", r) for i, r in narrowing.saturating(calibrated, saturate or {}).items()}
    if clips:
        names = {spec.key: spec.name for spec in lowered.outputs}
        ranges["saturated"] = {"outputs": {names[k]: a for k, a in saturate.items()}, "tensors": len(clips),
                               "range": [round(v, 6) for v in next(iter(clips.values()))[1]],
                               "why": "read through a sigmoid by the user's code: its int8 range is where the sigmoid "
                                      f"moves, from its least value seen (at least -{narrowing.SIGMOID_LOGITS:g}) to "
                                      f"{narrowing.SIGMOID_LOGITS:g}"}
    if grids:
        own = _grid_tensors(calibrated, lowered, *grids)
        clips.update(own)
        ranges["model_grids"] = {"tensors": len(own), "why": "the imported model quantized these tensors itself: "
                                                             "each keeps its grid's range, rounding as the model did"}
    if method == "minmax":
        count = _calibrated_tensors(calibrated)
        ranges.update(tensors=count, methods={"minmax": count})
        if clips:
            calibrated = narrowing.with_ranges(calibrated, clips)
    else:
        found = narrowing.measure(calibrated, lowered, samples, percentile, errors=method == "auto")
        clips = {**{i: ("minmax", found.seen[i]) for i in narrowing.signature_inputs(calibrated, pinned or set())
                    if i in found.seen}, **clips}
        if method == "auto":
            assigned, ranges["auto"] = _auto(found, calibrated, lowered, samples, per_channel_off, alternatives, clips)
        else:
            assigned = {**narrowing.assign(found, method), **clips}
        calibrated = narrowing.with_ranges(calibrated, assigned)
        ranges.update(narrowing.summary(found, assigned, percentile))
    if widened:
        ranges["widened"] = widened
    return calibrated, ranges, _quantizer(calibrated, per_channel_off)


GRID = "model"  # the label of a range the imported model's own grid gave (convert_int8's `grids`)


def _grid_tensors(calibrated: bytes, lowered: _Lowered, model: onnx.ModelProto,
                  grids: dict[str, tuple[float, float]]) -> dict[int, tuple[str, Any]]:
    """The calibrated model's tensors that hold one of `grids`' ONNX tensors (a signature input or output
    by its key, else the node's tensor: layers.tensors_of_nodes), each with its range, by tensor index;
    those the converter folded into another op's tensor, or that carry no calibrated range, left out."""
    from ai_edge_litert.interpreter import Interpreter

    interp = Interpreter(model_content=calibrated)
    details = {d["index"]: d for d in interp.get_tensor_details()}
    found = {name: index for name, (index, _) in
             tensors_of_nodes(model, interp._get_ops_details(), details).items()}  # pylint: disable=protected-access
    found.update(narrowing.signature_tensors(calibrated, {s.key: s.name for s in (*lowered.inputs, *lowered.outputs)}))
    ranged = narrowing.ranged_tensors(calibrated)
    return {found[name]: (GRID, narrowing.exact_grid(*r)) for name, r in grids.items() if found.get(name) in ranged}


def _calibrated_tensors(model: bytes) -> int:
    """How many tensors of `model` carry a calibrated range (one min and max)."""
    from tensorflow.lite.python import schema_py_generated as schema

    graph = schema.Model.GetRootAsModel(model, 0).Subgraphs(0)
    count = 0
    for i in range(graph.TensorsLength()):
        q = graph.Tensors(i).Quantization()
        count += q is not None and q.MinLength() == 1
    return count


# TensorFlow's quantizer (`mlir_quantize`), given the same calibrated model, now and then leaves an op float in
# a full-int8 model, a DEQUANTIZE before it and QUANTIZEs after (an LSTM cell's split: 2 calls in 12, each time
# other bytes); its all-int8 answer is always the same. A full-int8 model is asked for again until it has no
# DEQUANTIZE, or gives an answer it gave before (a model that keeps one however asked), at most this many times
QUANTIZE_ATTEMPTS = 8


def _quantizer(calibrated: bytes, per_channel_off: bool) -> Callable[[tuple[str, ...]], bytes]:
    """The converter's second int8 step on `calibrated`, as a function of the ops to keep float."""
    import tensorflow as tf
    from tensorflow.lite.python import convert

    def quantize(keep_float: tuple[str, ...]) -> bytes:
        # the converter's own second step, with the arguments its one-step path passes. A mixed model
        # takes and gives float (mixed.py says why): its first and last ops quantize and dequantize
        # inside it where they are int8
        io = tf.float32 if keep_float else tf.int8
        seen: set[bytes] = set()
        for _ in range(1 if keep_float else QUANTIZE_ATTEMPTS):
            quantized = _quiet(partial(convert.mlir_quantize, calibrated, per_channel_off, input_data_type=io,
                                       output_data_type=io, denylisted_nodes=list(keep_float) or None))
            if keep_float or quantized in seen or "DEQUANTIZE" not in op_counts(quantized):
                break
            seen.add(quantized)
        return _only_if(_has_equal_buffers, convert.deduplicate_readonly_buffers)(quantized)

    return quantize


AUTO_SAMPLES = 16  # calibration samples on which `auto` compares the whole segment's outputs
PER_TENSOR = "per tensor"  # auto's own assignment, among its candidates


def _auto(found: narrowing.Measured, calibrated: bytes, lowered: _Lowered, samples: list[list[np.ndarray]],
          per_channel_off: bool, alternatives: dict[str, bytes] | None = None,
          clips: dict[int, tuple[str, Any]] | None = None) -> tuple[dict, dict[str, Any]]:
    """`auto`: each tensor the method of least error on its own values (narrowing.assign); then that
    assignment and each method alone are quantized whole, and the one whose outputs are nearest the
    float segment's on the calibration samples is kept (a tensor's own error does not see how it
    propagates: a range good for a tensor may still cost an output more than another method's). The
    outputs' error: per output, the squared error over the squared deviation of the float values from
    their mean, averaged over the outputs; ties go to the earlier candidate, the per-tensor one first.
    `alternatives` (where given) receives each candidate's model (one object for candidates alike)."""
    shown = samples[:AUTO_SAMPLES]
    reference = _outputs(lowered, calibrated, shown)
    candidates = {PER_TENSOR: {**narrowing.assign(found, "auto"), **(clips or {})},
                  **{m: {**narrowing.assign(found, m), **(clips or {})} for m in METHODS}}
    writer = narrowing.Ranges(calibrated)
    figures: dict[str, float] = {}
    refused: dict[str, str] = {}
    done: dict[tuple, str] = {}
    for label, assigned in candidates.items():
        key = tuple(sorted((i, r) for i, (_, r) in assigned.items()))
        if key in done:  # the same ranges: the same model
            figures[label] = figures[done[key]]
            if done[key] in refused:
                refused[label] = refused[done[key]]
            elif alternatives is not None:
                alternatives[label] = alternatives[done[key]]
            continue
        done[key] = label
        model = _quantizer(writer.model(assigned), per_channel_off)(())
        try:
            figures[label] = calibrators.output_error(_outputs(lowered, model, shown), reference)
        except Refused as e:
            refused[label], figures[label] = e.message, float("inf")
            continue
        if alternatives is not None:
            alternatives[label] = model
    order = [k for k in candidates if k not in refused]
    if not order:
        raise _refused_all(refused)
    chosen = min(order, key=lambda k: (figures[k], order.index(k)))
    record = {"chosen": chosen, "output_error": {k: float(f"{v:.6g}") for k, v in figures.items() if k not in refused},
              "samples": len(shown), "measure": calibrators.OUTPUT_ERROR}
    if refused:
        record["refused"] = refused
    return candidates[chosen], record


def _tensor_name(tensor: dict[str, Any]) -> str:
    """A converted tensor's name as the error shows it: the ONNX node it came of first (the converter names a
    fused op's tensor by all its ops, `n4.r2/Relu;n3.c3/BiasAdd;...`)."""
    return narrowing._name(tensor["name"]).split(";")[0]  # pylint: disable=protected-access


def _refused_all(refused: dict[str, str]) -> Refused:
    first = next(iter(refused.values()))
    return Refused("compress.int8-refused", f"{first}; with every calibration candidate ({', '.join(refused)})",
                   REFUSED_HINT)


def describe_auto(ranges: dict[str, Any]) -> str:
    """One line of what `auto` chose: the methods per tensor, and the outputs' error of each candidate."""
    auto = ranges["auto"]
    methods = ", ".join(f"{m} {n}" for m, n in ranges.get("methods", {}).items())
    chosen = f"per tensor ({methods})" if auto["chosen"] == PER_TENSOR else f"{auto['chosen']} for every tensor"
    return (f"calibration auto: {chosen}; output error " + ", ".join(f"{k} {v:.3g}" for k, v in auto["output_error"].items())
            + f" on {auto['samples']} calibration samples")


def _outputs(lowered: _Lowered, model: bytes, samples: list[list[np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """A converted model's outputs on `samples` (in the function's layout), by ONNX name, in ONNX
    layout, as float: what the runtime's tflite runner hands on."""
    from ai_edge_litert.interpreter import Interpreter

    from ...runtime.backends.tflite_runner import dequantized, quantized

    threads = int(os.environ.get("EDGESDK_NUM_THREADS") or 0) or None
    runner = Interpreter(model_content=model, num_threads=threads).get_signature_runner()
    ins, outs = runner.get_input_details(), runner.get_output_details()
    got = []
    for k, sample in enumerate(samples):
        feeds = {spec.key: quantized(ins[spec.key], x) for spec, x in zip(lowered.inputs, sample)}
        try:
            raw = runner(**feeds)
        except RuntimeError as e:
            if k or "failed to prepare" not in str(e):
                raise
            raise _refused(model, str(e)) from None
        values = {}
        for spec in lowered.outputs:
            y = dequantized(outs[spec.key], raw[spec.key])
            values[spec.name] = np.transpose(y, spec.perm) if spec.perm else y
        got.append(values)
    return got


# XNNPACK's int8 convolutions and fully connected ops take a requantization (the input's step, times the weights'
# step, over the output's step) below 256; creating its runtime fails on one above. Ops without weights whose
# steps it cannot take (an add of inputs 1e5 apart) it leaves to LiteRT's own kernels instead
REQUANTIZE_MAX = 256.0
WEIGHTED_OPS = ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED", "TRANSPOSE_CONV")


REFUSED_HINT = ("an int8 step far finer or coarser than its input's comes of activations that (nearly) vanish on the "
                "calibration samples: calibrate on inputs like the deployed ones (--calib DIR); activations that "
                "vanish on real inputs in float too are the model's own (weights drawn at too small a deviation, "
                "batch norm statistics never computed)")


class Refused(UserError):
    """LiteRT's CPU kernels refuse an int8 model (XNNPACK "failed to prepare")."""


def _refused(model: bytes, message: str) -> Refused:
    """The error for an int8 `model` LiteRT's CPU kernels refused with `message`, naming the ops whose
    requantization (their input's int8 step, times their weights', over their output's) is outside what the
    kernels take: activations that (nearly) vanish on the calibration samples, whose steps are 1e-8 and less."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    interpreter = Interpreter(model_content=model,
                              experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
    tensors = {t["index"]: t for t in interpreter.get_tensor_details()}

    def step(i: int) -> float | None:
        scales = tensors[i]["quantization_parameters"]["scales"] if i >= 0 else []
        return float(np.max(scales)) if len(scales) else None

    odd = []
    for op in interpreter._get_ops_details():  # pylint: disable=protected-access
        ins = [i for i in op["inputs"] if i >= 0 and tensors[i]["dtype"] in (np.int8, np.uint8) and step(i)]
        out = [o for o in op["outputs"] if step(o)]
        if op["op_name"] not in WEIGHTED_OPS or len(ins) < 2 or not out:
            continue
        if step(ins[0]) * step(ins[1]) / step(out[0]) >= REQUANTIZE_MAX:
            odd.append(f"{op['op_name']} of {_tensor_name(tensors[ins[0]])} step {step(ins[0]):.3g} into "
                       f"{_tensor_name(tensors[out[0]])} step {step(out[0]):.3g}")
    where = f": {'; '.join(odd[:3])}{f' and {len(odd) - 3} more' if len(odd) > 3 else ''}" if odd else ""
    said = message.strip().rstrip(".").replace("runtimeNode", "runtime: node")
    return Refused("compress.int8-refused", f"LiteRT's int8 kernels refuse the quantized segment ({said}){where}",
                   REFUSED_HINT)


@contextlib.contextmanager
def _native_stderr_captured():
    """Capture what native code writes to fd 2 (the converter prints `fully_quantize: ...` on every
    conversion, which a `--quiet` build must not show). Yields a function returning the text."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lambda: (tmp.seek(0), tmp.read().decode(errors="replace"))[1]
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def _finish(lowered: _Lowered, model: bytes, out_path: Path) -> TfliteResult:
    from ai_edge_litert.interpreter import Interpreter

    runner = Interpreter(model_content=model).get_signature_runner()
    details = {"in": runner.get_input_details(), "out": runner.get_output_details()}

    def with_quant(specs: list[TensorSpec], side: str) -> tuple[TensorSpec, ...]:
        out = []
        for spec in specs:
            d = details[side][spec.key]
            scale, zero = d["quantization"]
            quant = QuantParams(float(scale), int(zero)) if d["dtype"] in (np.int8, np.uint8) else None
            out.append(TensorSpec(spec.name, spec.shape, spec.dtype, spec.key, spec.perm, quant))
        return tuple(out)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_path.parent, prefix=out_path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(model)
        os.replace(tmp, out_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return TfliteResult(with_quant(lowered.inputs, "in"), with_quant(lowered.outputs, "out"), op_counts(model),
                        layouts=dict(lowered.layouts))
