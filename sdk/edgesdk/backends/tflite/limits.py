"""What a TFLite conversion needs: memory, and the size its format holds (no TensorFlow imported)."""

# What TensorFlow's converter holds while it converts a traced segment, its weights held as variables
# of the module (trace.py) and read once by the converter's SavedModel import. Measured on this
# project's build host (benchmarks/RESULTS.md, issue 22): MatMul segments of 16 and 64 MiB and VGG16's
# 528 MiB peaked at 0.78, 1.20 and 5.72 GiB, about 10 bytes per byte of weights above a 0.6 GiB base.
# (With the weights as constants of the traced graph it was 42 bytes per byte, and VGG16 was killed.)
CONVERTER_BASE_BYTES = 600 << 20
CONVERTER_BYTES_PER_WEIGHT_BYTE = 10
# FlatBuffers address their buffers with 32-bit offsets: a .tflite is smaller than 2 GiB
FLATBUFFER_LIMIT = 1 << 31
