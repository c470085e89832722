"""Backends: code generation and execution per device kind (TVM, TFLite, onnxruntime, edgetpu_compiler, qemu).

The three that compile segments are registered by name (`registry.py`).
"""

from .registry import Backend, CompileJob, Compiled, backend, backends, register, registered, unregister

register(Backend("tvm", runner="tvm", rank=0, runtime_dists=("apache-tvm", "apache-tvm-ffi"), tunes=True,
                 compiler="edgesdk.backends.tvm.segment:compile_segment"))
register(Backend("tflite", runner="tflite", rank=1, runtime_dists=("ai-edge-litert",), quantizes=True,
                 compiler="edgesdk.backends.tflite.segment:compile_segment"))
register(Backend("onnxruntime", runner="onnxruntime", rank=2, runtime_dists=("onnxruntime",),
                 compiler="edgesdk.backends.onnxruntime:compile_segment"))

__all__ = ["Backend", "CompileJob", "Compiled", "backend", "backends", "register", "registered", "unregister"]
