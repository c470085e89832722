#!/usr/bin/env bash
# Fetch the real pretrained models the demo and tests use, from PyPI wheels that carry them
# (`pip download --no-deps`; the packages are never installed). Offline afterwards.
set -euo pipefail
dest=${1:-.cache/models}
pip=${PIP:-.venv/bin/pip}
mkdir -p "$dest"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "models: fetching rapidocr-onnxruntime 1.4.4 (PP-OCRv4 detector/recognizer, PP-OCR direction classifier)"
"$pip" download -q --no-deps rapidocr-onnxruntime==1.4.4 -d "$tmp" 2>&1 | grep -v "^WARNING: Location" || true
wheel=$(ls "$tmp"/rapidocr_onnxruntime-*.whl)
python3 - "$wheel" "$dest" <<'PY'
import sys, zipfile, pathlib, os
wheel, dest = sys.argv[1], pathlib.Path(sys.argv[2])
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith("rapidocr_onnxruntime/models/") and name.endswith(".onnx"):
            out = dest / pathlib.Path(name).name
            tmp = out.with_suffix(".part")
            tmp.write_bytes(z.read(name))
            os.replace(tmp, out)
            print(f"models: {out} ({out.stat().st_size:,} bytes)")
PY
