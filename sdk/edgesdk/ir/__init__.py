"""Helpers over ONNX / onnx_ir: loading with clear errors, digests, annotations, numeric checks."""
