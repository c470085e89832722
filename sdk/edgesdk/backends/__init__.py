"""Backends: code generation and execution per device kind (TVM, TFLite, onnxruntime, edgetpu_compiler, qemu).

The three that compile segments are registered by name, and Coral's compiler as the Edge TPU's
finisher (`registry.py`).
"""

from .registry import (KERNEL_TIMES, AccuracyTarget, Backend, Boards, CompileJob, Compiled, FinishJob, Finished,
                       Finisher, LayerTimesJob, QuantizeJob, TuneJob, backend, backends, finisher, register,
                       register_finisher, registered, unregister, unregister_finisher)

register(Backend("tvm", runner="tvm", rank=0, runtime_dists=("apache-tvm", "apache-tvm-ffi"),
                 compiler="edgesdk.backends.tvm.segment:compile_segment",
                 tuner="edgesdk.backends.tvm.segment:tune_segments",
                 coverage="edgesdk.backends.tvm.segment:untuned",
                 lowering="edgesdk.backends.tvm.segment:lowering_reason",
                 layer_timer="edgesdk.backends.tvm.layer_times:time_layers",
                 # 1: x86 convolutions' prime-width rows computed wider (rewrites.py); 2: exp, sigmoid, tanh, erf
                 # as vectorizable polynomials on CPUs (fast_math.py); 3: pruned convolutions as sparse kernels (sparse.py);
                 # 4: depthwise convolutions inside sparse runs in CHWN, the pixel block fitted to the registers;
                 # 5: batch-1 sparse convolutions on x86 as sparse.row_kernel (masked tails); 6: strided ones too;
                 # 7: row_kernel's output channels in parallel parts; 8: sparse kernels timed as compiled (the
                 # per-layer choice may differ)
                 revision=8))
register(Backend("tflite", runner="tflite", rank=1, runtime_dists=("ai-edge-litert",),
                 compiler="edgesdk.backends.tflite.segment:compile_segment",
                 quantizer="edgesdk.backends.tflite.segment:quantize_segment",
                 lowering="edgesdk.backends.tflite.lowering:lowering_reason"))
register(Backend("onnxruntime", runner="onnxruntime", rank=2, runtime_dists=("onnxruntime",),
                 compiler="edgesdk.backends.onnxruntime:compile_segment",
                 lowering="edgesdk.backends.onnxruntime:lowering_reason",
                 revision=3))  # 1: affine maps as BatchNormalization; 2: Keras GELU as Gelu; 3: the runner's threads
# fp32 on the CPU through LiteRT's XNNPACK kernels: a candidate the tune stage measures for CPU spans
register(Backend("litert", runner="tflite", rank=3, runtime_dists=("ai-edge-litert",),
                 compiler="edgesdk.backends.tflite.segment:compile_float_segment",
                 lowering="edgesdk.backends.tflite.lowering:cpu_lowering_reason"))
# int8 on the CPU (`--cpu-precision int8`): candidates the tune stage measures behind an accuracy gate,
# quantized with the build's calibration samples by the compress stage
register(Backend("litert-int8", runner="tflite", rank=4, runtime_dists=("ai-edge-litert",),
                 compiler="edgesdk.backends.tflite.segment:compile_int8_segment",
                 quantizer="edgesdk.backends.tflite.segment:quantize_cpu_segment",
                 lowering="edgesdk.backends.tflite.lowering:cpu_lowering_reason"))
register(Backend("onnxruntime-int8", runner="onnxruntime", rank=5, runtime_dists=("onnxruntime",),
                 compiler="edgesdk.backends.onnxruntime:compile_int8_segment",
                 quantizer="edgesdk.backends.onnxruntime:quantize_segment",
                 lowering="edgesdk.backends.onnxruntime:lowering_reason"))
register_finisher(Finisher("edgetpu", "edgetpu_compiler", "edgesdk.backends.edgetpu_compiler"))

__all__ = ["KERNEL_TIMES", "AccuracyTarget", "Backend", "Boards", "CompileJob", "Compiled", "FinishJob", "Finished",
           "Finisher", "LayerTimesJob", "QuantizeJob", "TuneJob", "backend", "backends", "finisher", "register",
           "register_finisher", "registered", "unregister", "unregister_finisher"]
