"""Backends: code generation and execution per device kind (TVM, TFLite, onnxruntime, edgetpu_compiler, qemu)."""
