"""What TFLite's full-int8 conversion does to the quantization of each builtin op's tensors.

Some int8 kernels compute without rescaling: their input and output share one scale and zero point
(the converter gives the output the input's, or the inputs the output's). Where the two ranges
differ in float, one of them is then represented on the other's grid: a MINIMUM(x, 0) gives x the
range of its output, so x's positive half is clipped for every op that reads x (PReLU written as
Relu(x) + Min(x, 0)*s lost every positive value that way). Both tables are measured, not taken
from documentation: tests/backends/test_tflite_shared_quantization.py converts one model holding one op of
each kind with the output's calibrated range made different from its input's, and reads the
scales the converter chose (TensorFlow 2.21).

`SHARED_QUANTIZATION_OPS`: the int8 input(s) and output share one quantization.
`OUTPUT_RANGE_TO_INPUTS`: of those, the ops whose converter gives the inputs the output's range
(the rest give the output the input's). Where such an op's input is read by another op too, that
op sees it clipped (MAXIMUM, MINIMUM: the output's range is narrower on one side) or coarsened
(CONCATENATION, PACK, PADV2: wider): the lowering keeps these ops' inputs to themselves
(lowering.py, docs/legalize.md "int8: ops that share one quantization").
"""

from __future__ import annotations

SHARED_QUANTIZATION_OPS: frozenset[str] = frozenset({
    "AVERAGE_POOL_2D", "BATCH_TO_SPACE_ND", "BROADCAST_TO", "CONCATENATION", "DEPTH_TO_SPACE", "GATHER",
    "GATHER_ND", "MAXIMUM", "MAX_POOL_2D", "MINIMUM", "MIRROR_PAD", "PACK", "PAD", "PADV2", "REDUCE_MAX",
    "REDUCE_MIN", "RESHAPE", "RESIZE_BILINEAR", "RESIZE_NEAREST_NEIGHBOR", "SLICE", "SPACE_TO_BATCH_ND",
    "SPACE_TO_DEPTH", "SPLIT", "SPLIT_V", "STRIDED_SLICE", "TILE", "TRANSPOSE",
})

OUTPUT_RANGE_TO_INPUTS: frozenset[str] = frozenset({"CONCATENATION", "MAXIMUM", "MINIMUM", "PACK", "PADV2"})
