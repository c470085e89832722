"""Backends: code generation and execution per device kind (TVM, TFLite, onnxruntime, OpenVINO, edgetpu_compiler,
qemu).

Those that compile segments are registered by name, and Coral's compiler as the Edge TPU's
finisher (`registry.py`).
"""

from .registry import (KERNEL_TIMES, REDUCED, AccuracyTarget, Backend, Boards, CompileJob, Compiled, FinishJob,
                       Finished, Finisher, LayersJob, LayerTimesJob, QuantizeJob, TuneJob, backend, backends,
                       cpu_candidates, finisher, policy_fallback, register, register_finisher, registered, unregister,
                       unregister_finisher, variant)
from .tflite.limits import (CONVERTER_BASE_BYTES, CONVERTER_BYTES_PER_WEIGHT_BYTE, CONVERTER_INT8_BYTES_PER_WEIGHT_BYTE,
                            FLATBUFFER_LIMIT)

# What each compiler holds while it compiles a segment (beyond the build's own copies of the model), measured
# on this project's machines (benchmarks/bench_memory.py; benchmarks/RESULTS.md, question build-memory):
# TensorFlow's TFLite converter (backends/tflite/convert.py); TVM's Relax import and build, the weights lifted
# out of the library into its weights file (1.4 to 1.7 x above the compile's base for a 768 MiB MLP and VGG16;
# 2 covers the 2.25 GiB MLP's aarch64 and CUDA packages with their x86 twin, docs/design-notes.md); onnxruntime's
# session over arrays it is handed (irm.onnxruntime_session).
TFLITE_MEMORY = {"compile_base_bytes": CONVERTER_BASE_BYTES, "compile_bytes_per_weight_byte": CONVERTER_BYTES_PER_WEIGHT_BYTE,
                 "max_weight_bytes": FLATBUFFER_LIMIT}
TFLITE_INT8_MEMORY = {**TFLITE_MEMORY, "compile_bytes_per_weight_byte": CONVERTER_INT8_BYTES_PER_WEIGHT_BYTE}
TVM_MEMORY = {"compile_base_bytes": 0, "compile_bytes_per_weight_byte": 2.0}
ONNXRUNTIME_MEMORY = {"compile_base_bytes": 0, "compile_bytes_per_weight_byte": 2.0}
# OpenVINO's ONNX frontend reading a segment and its saver writing the IR: the frontend's graph and the IR's
# weights beside the build's copy, as onnxruntime's session holds them (an estimate, not measured)
OPENVINO_MEMORY = {"compile_base_bytes": 0, "compile_bytes_per_weight_byte": 2.0}

register(Backend("tvm", runner="tvm", rank=0, runtime_dists=("apache-tvm", "apache-tvm-ffi"), cpu_order=0,
                 compiler="edgesdk.backends.tvm.segment:compile_segment",
                 tuner="edgesdk.backends.tvm.segment:tune_segments",
                 coverage="edgesdk.backends.tvm.segment:untuned",
                 lowering="edgesdk.backends.tvm.segment:lowering_reason",
                 layer_timer="edgesdk.backends.tvm.layer_times:time_layers",
                 # 1: x86 convolutions' prime-width rows computed wider (rewrites.py); 2: exp, sigmoid, tanh, erf
                 # as vectorizable polynomials on CPUs (fast_math.py); 3: pruned convolutions as sparse kernels (sparse.py);
                 # 4: depthwise convolutions inside sparse runs in CHWN, the pixel block fitted to the registers;
                 # 5: batch-1 sparse convolutions on x86 as sparse_kernels.row_kernel (masked tails); 6: strided ones too;
                 # 7: row_kernel's output channels in parallel parts; 8: sparse kernels timed as compiled (the
                 # per-layer choice may differ); 9: weights in a file beside the library, mapped by the runner
                 revision=9, **TVM_MEMORY))
register(Backend("tflite", runner="tflite", rank=1, runtime_dists=("ai-edge-litert",),
                 compiler="edgesdk.backends.tflite.segment:compile_segment",
                 quantizer="edgesdk.backends.tflite.segment:quantize_segment",
                 layers="edgesdk.backends.tflite.layers:int8_layers",
                 lowering="edgesdk.backends.tflite.lowering:lowering_reason", **TFLITE_INT8_MEMORY))
register(Backend("onnxruntime", runner="onnxruntime", rank=2, runtime_dists=("onnxruntime",), cpu_order=1,
                 compiler="edgesdk.backends.onnxruntime:compile_segment",
                 lowering="edgesdk.backends.onnxruntime:lowering_reason",
                 revision=3, **ONNXRUNTIME_MEMORY))  # 1: affine maps as BatchNormalization; 2: Keras GELU as Gelu; 3: the runner's threads
# fp32 on the CPU through LiteRT's XNNPACK kernels: a candidate the tune stage measures for CPU spans
register(Backend("litert", runner="tflite", rank=3, runtime_dists=("ai-edge-litert",), cpu_order=2, cpu_policy=True,
                 compiler="edgesdk.backends.tflite.segment:compile_float_segment",
                 lowering="edgesdk.backends.tflite.lowering:cpu_lowering_reason", **TFLITE_MEMORY))
# int8 on the CPU (`--cpu-precision int8`): candidates the tune stage measures behind an accuracy gate,
# quantized with the build's calibration samples by the compress stage
register(Backend("litert-int8", runner="tflite", rank=4, runtime_dists=("ai-edge-litert",), cpu_order=2,
                 precision="int8", variant_of="litert",
                 compiler="edgesdk.backends.tflite.segment:compile_int8_segment",
                 quantizer="edgesdk.backends.tflite.segment:quantize_cpu_segment",
                 layers="edgesdk.backends.tflite.layers:int8_cpu_layers",
                 lowering="edgesdk.backends.tflite.lowering:cpu_lowering_reason", **TFLITE_INT8_MEMORY))
register(Backend("onnxruntime-int8", runner="onnxruntime", rank=5, runtime_dists=("onnxruntime",), cpu_order=1,
                 precision="int8", variant_of="onnxruntime",
                 compiler="edgesdk.backends.onnxruntime:compile_int8_segment",
                 quantizer="edgesdk.backends.onnxruntime:quantize_segment",
                 lowering="edgesdk.backends.onnxruntime:lowering_reason", **ONNXRUNTIME_MEMORY))
# a quantized TFLite model's own file, shipped as given, run by LiteRT: the tune stage's candidate for a CPU span
# that holds the whole imported graph (`scheduling/selection.py`, `OWN`), never one of `cpu_candidates`. It reduces
# nothing (precision fp32: checked, not gated): it computes what the model computes, the accuracy gate's reference
register(Backend("litert-own", runner="tflite", rank=3, runtime_dists=("ai-edge-litert",),
                 compiler="edgesdk.backends.tflite.own:compile_segment",
                 lowering="edgesdk.backends.tflite.own:lowering_reason"))
# fp32 on the CPU through OpenVINO's CPU plugin: a candidate the tune stage measures for CPU spans
register(Backend("openvino", runner="openvino", rank=6, runtime_dists=("openvino", "openvino-telemetry"), cpu_order=3,
                 compiler="edgesdk.backends.openvino:compile_segment",
                 lowering="edgesdk.backends.openvino:lowering_reason", **OPENVINO_MEMORY))
# bfloat16 on the CPU through OpenVINO (`--cpu-precision bf16` or auto, where the target's CPU has AVX512_BF16 or
# AMX): a candidate the tune stage admits only behind its accuracy gate
register(Backend("openvino-bf16", runner="openvino", rank=7, runtime_dists=("openvino", "openvino-telemetry"),
                 cpu_order=3, precision="bf16", variant_of="openvino",
                 compiler="edgesdk.backends.openvino:compile_bf16_segment",
                 lowering="edgesdk.backends.openvino:lowering_reason", **OPENVINO_MEMORY))
# float16 on the CPU through OpenVINO (`--cpu-precision fp16` or auto, where the target's CPU has AVX512-FP16)
register(Backend("openvino-fp16", runner="openvino", rank=8, runtime_dists=("openvino", "openvino-telemetry"),
                 cpu_order=3, precision="fp16", variant_of="openvino",
                 compiler="edgesdk.backends.openvino:compile_fp16_segment",
                 lowering="edgesdk.backends.openvino:lowering_reason", **OPENVINO_MEMORY))
register_finisher(Finisher("edgetpu", "edgetpu_compiler", "edgesdk.backends.edgetpu_compiler"))

__all__ = ["KERNEL_TIMES", "REDUCED", "AccuracyTarget", "Backend", "Boards", "CompileJob", "Compiled", "FinishJob",
           "Finished", "Finisher", "LayersJob", "LayerTimesJob", "QuantizeJob", "TuneJob", "backend", "backends",
           "cpu_candidates", "finisher", "policy_fallback", "register", "register_finisher", "registered", "unregister",
           "unregister_finisher", "variant"]
