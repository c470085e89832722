#!/usr/bin/env bash
# Build rtx3090 bundles on this (GPU-less) host and pack them, with TVM's runtime alone, for a GPU host
# that has Python 3.12, numpy, onnxruntime, cuda-bindings (NVRTC) and an NVIDIA driver but no network.
#   benchmarks/gpu/prepare.sh DIR        (from the repository root, after `make setup`)
# writes DIR/pack.tar.xz (~50 MB: TVM's runtime libraries without its 260 MB compiler, the bundles, the
# source models) beside run.sh and bundle_vs_ort.py; on the GPU host: tar xJf pack.tar.xz && bash run.sh
set -euo pipefail
out=$(realpath -m "$1"); work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$out" "$work/b" "$work/m" "$work/site"
models=".cache/models"
build() {  # name model [shape]
  .venv/bin/edgesdk build "$2" --target targets/rtx3090.yaml -o "$work/out/$1" --tuning-db "$work/db" \
    ${3:+--input-shape "$3"} >"$work/$1.log" 2>&1 || { tail -5 "$work/$1.log"; exit 1; }
  cp -r "$work/out/$1/bundle" "$work/b/$1"; cp "$2" "$work/m/$1.onnx"
}
build cls "$models/ch_ppocr_mobile_v2.0_cls_infer.onnx" x=1x3x48x192
build rec "$models/ch_PP-OCRv4_rec_infer.onnx" x=1x3x48x320
build det "$models/ch_PP-OCRv4_det_infer.onnx" x=1x3x480x640
tvm=$(grep -o 'apache-tvm==[^"]*' pyproject.toml); ffi=$(grep -o 'apache-tvm-ffi==[^"]*' pyproject.toml)
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$work/whl" "$tvm" "$ffi"
for w in "$work"/whl/*.whl; do (cd "$work/site" && unzip -q -o "$w"); done
# the bundle runs TVM with TVM_USE_RUNTIME_LIB=1: the compiler and the sources are not needed
rm -rf "$work/site/tvm/lib/libtvm_compiler.so" "$work/site/tvm/3rdparty" "$work/site/tvm/web" "$work/site/tvm/src" \
  "$work/site/tvm_ffi/include" "$work/site/tvm_ffi/3rdparty"
tar cf - -C "$work" b m site | xz -T0 -6 >"$out/pack.tar.xz.tmp" && mv "$out/pack.tar.xz.tmp" "$out/pack.tar.xz"
cp benchmarks/gpu/run.sh benchmarks/gpu/bundle_vs_ort.py "$out/"
ls -la "$out"
