#!/usr/bin/env bash
# On the GPU host, in the unpacked directory: each bundle's self-test (NVRTC, then cls with nvcc), then
# the bundle against onnxruntime on this host's CPU (50 interleaved runs, medians).
cd "$(dirname "$0")"
export PYTHONPATH=$PWD/site TVM_USE_RUNTIME_LIB=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader; lscpu | grep "Model name"
for b in b/*; do
  n=$(basename "$b")
  (cd "$b" && timeout 200 python3 -B -m runtime selftest --json >"../../selftest_$n.json" 2>"../../selftest_$n.err"
   echo "selftest $n rc=$?")
  if [ "$n" = cls ]; then
    (cd "$b" && TVM_CUDA_COMPILE_MODE=nvcc timeout 200 python3 -B -m runtime selftest --json >/dev/null 2>&1
     echo "selftest $n (nvcc) rc=$?")
  fi
  (cd "$b" && timeout 200 python3 -B ../../bundle_vs_ort.py "../../m/$n.onnx" 50)
done
