#!/usr/bin/env bash
# make release: the wheel, the sdist and the demo bundle for each target into dist/, SHA256SUMS, and with
# a signing key their signatures (docs/trust.md).
#
#   EDGESDK_SIGN_KEY=PATH      the ed25519 private key (edgesdk keys generate): every bundle is signed
#                              (manifest.sig) and so is SHA256SUMS (SHA256SUMS.sig). Without it the release
#                              is built unsigned, and says so.
#   EDGESDK_BUNDLE_VERSION=N   the bundles' version [default: SOURCE_DATE_EPOCH, the commit's time, which
#                              increases along a branch]
#   SOURCE_DATE_EPOCH          the time in every archive [default: the last commit's]
#   RELEASE_TARGETS, RELEASE_MODEL, RELEASE_SHAPE, DIST, RELEASE_OUT, RELEASE_WHEEL=0
#                              what is built and where (the tests make a small release this way)
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
edgesdk=${EDGESDK:-.venv/bin/edgesdk}
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}
export EDGESDK_BUNDLE_VERSION=${EDGESDK_BUNDLE_VERSION:-$SOURCE_DATE_EPOCH}
model=${RELEASE_MODEL:-.cache/models/ch_PP-OCRv4_rec_infer.onnx}
shape=${RELEASE_SHAPE:-x=1x3x48x320}
targets=${RELEASE_TARGETS:-arm_2tpu x86 rtx3090}
dist=${DIST:-dist}
outs=${RELEASE_OUT:-out}

if [ -n "${EDGESDK_SIGN_KEY:-}" ]; then
  [ -f "$EDGESDK_SIGN_KEY" ] || { echo "release: error: EDGESDK_SIGN_KEY=$EDGESDK_SIGN_KEY: no such file" >&2; exit 2; }
  echo "release: signing with $EDGESDK_SIGN_KEY, bundle version $EDGESDK_BUNDLE_VERSION"
else
  echo "release: UNSIGNED: EDGESDK_SIGN_KEY is not set, so neither the bundles nor SHA256SUMS are signed;" \
       "devices that verify signatures will refuse these bundles"
fi

# everything is written into a staging directory that replaces $dist at the end: an interrupted
# release leaves the previous one, never a mixture
stage="$dist.tmp"
rm -rf "$stage" && mkdir -p "$stage"
if [ "${RELEASE_WHEEL:-1}" != 0 ]; then
  echo "release: wheel and sdist"
  "$py" -m build --no-isolation --outdir "$stage" . >/dev/null
fi
for target in $targets; do
  echo "release: demo bundle for $target"
  # --sign-key and --bundle-version come from EDGESDK_SIGN_KEY and EDGESDK_BUNDLE_VERSION
  "$edgesdk" build "$model" --input-shape "$shape" --target "$target" -o "$outs/release-$target" --quiet
  cp "$outs/release-$target/bundle.tar.gz" "$stage/edgesdk-demo-$target.bundle.tar.gz"
done
(cd "$stage" && sha256sum -- * > SHA256SUMS)
if [ -n "${EDGESDK_SIGN_KEY:-}" ]; then
  "$edgesdk" keys sign "$stage/SHA256SUMS" >/dev/null
fi
rm -rf "$dist" && mv "$stage" "$dist"
cat "$dist/SHA256SUMS"
if [ -n "${EDGESDK_SIGN_KEY:-}" ]; then
  echo "release: signed: $dist/SHA256SUMS.sig; check with: edgesdk keys verify $dist/SHA256SUMS --public-key KEY.pub"
else
  echo "release: UNSIGNED release in $dist (set EDGESDK_SIGN_KEY to sign it)"
fi
