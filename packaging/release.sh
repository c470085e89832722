#!/usr/bin/env bash
# make release: the wheel, the sdist and the demo bundle for each target into dist/, with SHA256SUMS.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
edgesdk=.venv/bin/edgesdk
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}
model=.cache/models/ch_PP-OCRv4_rec_infer.onnx
rm -rf dist && mkdir -p dist
echo "release: wheel and sdist"
"$py" -m build --no-isolation --outdir dist . >/dev/null
for target in arm_2tpu x86 rtx3090; do
  echo "release: demo bundle for $target"
  "$edgesdk" build "$model" --input-shape x=1x3x48x320 --target "$target" -o "out/release-$target" --quiet
  cp "out/release-$target/bundle.tar.gz" "dist/edgesdk-demo-$target.bundle.tar.gz"
done
(cd dist && sha256sum -- * > SHA256SUMS)
cat dist/SHA256SUMS
