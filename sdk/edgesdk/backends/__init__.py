"""Backends: code generation and execution per device kind (TVM, TFLite, onnxruntime, edgetpu_compiler, qemu).

The three that compile segments are registered by name (`registry.py`).
"""

from .registry import Backend, backend, backends, register, registered, unregister

register(Backend("tvm", runner="tvm", rank=0, runtime_dists=("apache-tvm", "apache-tvm-ffi"), tunes=True))
register(Backend("tflite", runner="tflite", rank=1, runtime_dists=("ai-edge-litert",), quantizes=True))
register(Backend("onnxruntime", runner="onnxruntime", rank=2, runtime_dists=("onnxruntime",)))

__all__ = ["Backend", "backend", "backends", "register", "registered", "unregister"]
