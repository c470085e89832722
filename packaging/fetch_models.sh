#!/usr/bin/env bash
# Fetch the real pretrained models the demo, tests and benchmarks use, from PyPI wheels that carry
# them (`pip download --no-deps`; the packages are never installed). Offline afterwards.
#   rapidocr-onnxruntime 1.4.4  PP-OCRv4 detector/recognizer, PP-OCR direction classifier (ONNX)
#   silero-vad 6.2.3            voice activity detector (ONNX: If, LSTM)
#   mediapipe 0.10.18           face detector and selfie segmenter (TFLite, float16 weights)
#   nudenet 3.4.2               320n.onnx: a YOLOv8n detector (Ultralytics 8.2.46 export, 18 classes, output
#                               [1, 22, anchors]), the anchor-grid head YOLOv8 users put on a Coral
set -euo pipefail
dest=${1:-.cache/models}
pip=${PIP:-.venv/bin/pip}
mkdir -p "$dest"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# fetch WHEEL_SPEC PATH_IN_WHEEL...: the model files are platform-independent; the wheel's platform
# is fixed so that every host downloads the same file
fetch() {
  local spec=$1; shift
  echo "models: fetching $spec"
  rm -rf "$tmp/wheel" && mkdir -p "$tmp/wheel"
  "$pip" download -q --no-deps "$spec" -d "$tmp/wheel" --only-binary=:all: \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --python-version 3.11 2>&1 \
    | grep -v "^WARNING: Location" || true
  python3 - "$(ls "$tmp"/wheel/*.whl)" "$dest" "$@" <<'PY'
import os, pathlib, sys, zipfile
wheel, dest, members = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3:]
with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
    for member in members:
        matches = [n for n in names if n == member or (member.endswith("/") and n.startswith(member) and n.endswith(".onnx"))]
        if not matches:
            sys.exit(f"models: {member} is not in {os.path.basename(wheel)}")
        for name in matches:
            out = dest / pathlib.Path(name).name
            part = out.with_name(out.name + ".part")
            part.write_bytes(z.read(name))
            os.replace(part, out)
            print(f"models: {out} ({out.stat().st_size:,} bytes)")
PY
}

fetch rapidocr-onnxruntime==1.4.4 rapidocr_onnxruntime/models/
fetch silero-vad==6.2.3 silero_vad/data/silero_vad.onnx silero_vad/data/silero_vad_16k_op15.onnx
fetch mediapipe==0.10.18 mediapipe/modules/face_detection/face_detection_short_range.tflite \
  mediapipe/modules/selfie_segmentation/selfie_segmentation.tflite
fetch nudenet==3.4.2 nudenet/320n.onnx
echo "c15d8273adad2d0a92f014cc69ab2d6c311a06777a55545f2c4eb46f51911f0f  $dest/320n.onnx" | sha256sum -c --quiet
