"""Edge TPU segments as TFLite: our own ONNX → TF lowering in NHWC, then full-int8 conversion.

An Edge TPU segment (an ONNX graph with static shapes and float32 inputs) is traced into one
`tf.function` by `LOWERINGS`, one lowering per ONNX op, saved as a SavedModel and converted by
`tf.lite.TFLiteConverter.from_saved_model` to a full-int8 model (int8 weights per channel, int8
activations calibrated on the given feeds, int8 inputs and outputs).

    lowering.py    the per-op tables (`LOWERINGS`, the Edge TPU's ops, `lowering_reason`; `CPU_LOWERINGS`,
                   what LiteRT also runs on the CPU, `cpu_lowering_reason`)
    layout.py      the NCHW/NHWC bookkeeping of one trace (`_Ctx`, `_Value`, `_input_perm`)
    trace.py       a segment traced into a tf.function (`_lower`), feeds brought to its layout
    convert.py     TFLiteConverter: full int8 or mixed (`convert_int8`) or fp32 (`convert_float`)
    mixed.py       mixed precision for LiteRT on the CPU: the ops int8 hurts most kept float
    int8_ops.py    the builtin ops whose int8 input and output share one quantization (measured)
    narrowing.py   activation ranges by a calibration method (percentile, mse, entropy, auto per tensor)
    flatbuffer.py  a .tflite's operators and op counts
    limits.py      what a conversion needs: the converter's memory, the FlatBuffer's 2 GiB

Heavy imports (TensorFlow, LiteRT) happen inside the functions that convert, so that
`lowering_reason` can be asked by legalize without loading TensorFlow.
"""

from __future__ import annotations

from .convert import TfliteResult, _convert, convert_float, convert_int8
from .flatbuffer import operators
from .int8_ops import OUTPUT_RANGE_TO_INPUTS, SHARED_QUANTIZATION_OPS
from .lowering import CPU_LOWERINGS, LOWERINGS, cpu_lowering_reason, lowering_reason
from .trace import _lower, _static_shapes, _to_tf_layout

# `_convert`, `_lower`, `_static_shapes` and `_to_tf_layout` are here for tests/backends/test_tflite.py
__all__ = ["CPU_LOWERINGS", "LOWERINGS", "OUTPUT_RANGE_TO_INPUTS", "SHARED_QUANTIZATION_OPS", "TfliteResult", "_convert",
           "_lower", "_static_shapes", "_to_tf_layout", "convert_float", "convert_int8", "cpu_lowering_reason",
           "lowering_reason", "operators"]
