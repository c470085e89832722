#!/usr/bin/env bash
# Fetch the real pretrained models the demo, tests and benchmarks use, from PyPI wheels that carry
# them (`pip download --no-deps`; the packages are never installed). Offline afterwards.
#   rapidocr-onnxruntime 1.4.4  PP-OCRv4 detector/recognizer, PP-OCR direction classifier (ONNX)
#   silero-vad 6.2.3            voice activity detector (ONNX: If, LSTM)
#   mediapipe 0.10.18           face detector, face landmarks (PReLU), iris landmarks and selfie segmenter
#                               (TFLite, float16 weights)
#   nudenet 3.4.2               320n.onnx: a YOLOv8n detector (Ultralytics 8.2.46 export, 18 classes, output
#                               [1, 22, anchors]), the anchor-grid head YOLOv8 users put on a Coral
#   scikit-image 0.25.2         real inputs, not a model: its sample photographs, two scanned text pages and
#                               lfw_subset.npy (100 face crops of Labeled Faces in the Wild, then 100 non-faces)
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
  mediapipe/modules/selfie_segmentation/selfie_segmentation.tflite \
  mediapipe/modules/face_landmark/face_landmark.tflite mediapipe/modules/iris_landmark/iris_landmark.tflite
fetch nudenet==3.4.2 nudenet/320n.onnx
echo "c15d8273adad2d0a92f014cc69ab2d6c311a06777a55545f2c4eb46f51911f0f  $dest/320n.onnx" | sha256sum -c --quiet
skimage=(astronaut.png coffee.png chelsea.png camera.png rocket.jpg motorcycle_left.png coins.png moon.png
         hubble_deep_field.jpg ihc.png gravel.png brick.png grass.png page.png text.png lfw_subset.npy)
fetch scikit-image==0.25.2 "${skimage[@]/#/skimage/data/}"
# the benchmarks' figures are on these exact files: a changed one is a different measurement
(cd "$dest" && sha256sum -c --quiet) <<'SUMS'
1055cb9d4a9ca8b8c688902a3a5194311138ba256bcc94e336d8373a5f30c814  face_landmark.tflite
d1744d2a09c25f501d39eba4faff47e53ecca8852c5ce19bce8eeac39357521f  iris_landmark.tflite
88431cd9653ccd539741b555fb0a46b61558b301d4110412b5bc28b5e3ea6cb5  astronaut.png
cc02f8ca188b167c775a7101b5d767d1e71792cf762c33d6fa15a4599b5a8de7  coffee.png
596aa1e7cb875eb79f437e310381d26b338a81c2da23439704a73c4651e8c4bb  chelsea.png
b0793d2adda0fa6ae899c03989482bff9a42d3d5690fc7e3648f2795d730c23a  camera.png
c2dd0de7c538df8d111e479619b129464d0269d0ae5fd18ca91d33a7fdfea95c  rocket.jpg
db18e9c4157617403c3537a6ba355dfeafe9a7eabb6b9b94cb33f6525dd49179  motorcycle_left.png
f8d773fc9cfa6f4d8e5942dc34d0a0788fcaed2a4fefbbed0aef5398d7ef4cba  coins.png
78739619d11f7eb9c165bb5d2efd4772cee557812ec847532dbb1d92ef71f577  moon.png
3a19c5dd8a927a9334bb1229a6d63711b1c0c767fb27e2286e7c84a3e2c2f5f4  hubble_deep_field.jpg
f8dd1aa387ddd1f49d8ad13b50921b237df8e9b262606d258770687b0ef93cef  ihc.png
c48615b451bf1e606fbd72c0aa9f8cc0f068ab7111ef7d93bb9b0f2586440c12  gravel.png
7966caf324f6ba843118d98f7a07746d22f6a343430add0233eca5f6eaaa8fcf  brick.png
b6b6022426b38936c43a4ac09635cd78af074e90f42ffa8227ac8b7452d39f89  grass.png
341a6f0a61557662b02734a9b6e56ec33a915b2c41886b97509dedf2a43b47a3  page.png
bd84aa3a6e3c9887850d45d606c96b2e59433fbef50338570b63c319e668e6d1  text.png
9560ec2f5edfac01973f63a8a99d00053fecd11e21877e18038fbe500f8e872c  lfw_subset.npy
SUMS
