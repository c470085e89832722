"""What a TFLite conversion needs: memory, and the size its format holds (no TensorFlow imported)."""

# What TensorFlow's converter holds while it converts a traced segment: the function saved to a SavedModel
# and let go, so its importer reads the weights once, with no step that rebuilds the FlatBuffer as Python
# objects unless it changes it (convert.py). Measured on this project's build host (benchmarks/RESULTS.md,
# question converter-memory; docs/design-notes.md): a 512 MiB MatMul segment held 3.1 bytes per byte of weights converting
# to fp32 and 6.0 to int8 (calibration and quantization each copy the model), above a 0.6 GiB base. Before,
# 9.1 and 12.5; with the weights as constants of the traced graph, 42, and VGG16 was killed.
CONVERTER_BASE_BYTES = 600 << 20
CONVERTER_BYTES_PER_WEIGHT_BYTE = 4  # fp32 (LiteRT on the CPU)
CONVERTER_INT8_BYTES_PER_WEIGHT_BYTE = 7  # int8 (the Edge TPU, LiteRT int8)
# FlatBuffers address their buffers with 32-bit offsets: a .tflite is smaller than 2 GiB
FLATBUFFER_LIMIT = 1 << 31
