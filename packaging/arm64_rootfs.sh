#!/usr/bin/env bash
# arm64_rootfs.sh [DEST]: the emulated aarch64 system that runs bundles' self-tests under qemu-user.
#
# A minimal Debian bookworm arm64 root file system, built without chroot or binfmt (DESIGN §7):
#   1. debootstrap's first stage (--foreign) downloads and unpacks the minbase system plus Python 3.11;
#      the second stage would need to execute arm64 code, so the packages it would configure are
#      unpacked with dpkg-deb instead (nothing is configured: no maintainer script runs).
#   2. pip downloads the cp311 aarch64 wheels pinned in packaging/requirements-aarch64.txt and installs
#      them with --target into DEST/opt/edgesdk-site, resolving offline from exactly those files.
#   3. The host's Python 3.11 precompiles the stdlib and the site: Debian compiles .pyc files in a
#      postinst that never ran, and compiling under emulation on every run costs seconds per import.
# Run Python in it with `qemu-aarch64-static DEST/usr/bin/python3` and QEMU_LD_PREFIX=DEST
# (sdk/edgesdk/backends/qemu.py does this). Idempotent: DEST/.complete holds the recipe's hash (this
# script + the pins); a complete DEST with the same hash is left alone. Downloads are cached in
# DEST.downloads/, so a rebuild after a recipe change fetches only what changed.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
script="$repo/packaging/arm64_rootfs.sh"
reqs="$repo/packaging/requirements-aarch64.txt"
pip=${PIP:-$repo/.venv/bin/pip}
py=${PYTHON:-$repo/.venv/bin/python}
suite=bookworm
dest=${1:-$repo/.cache/arm64-rootfs}
mkdir -p "$(dirname "$dest")"
dest="$(cd "$(dirname "$dest")" && pwd)/$(basename "$dest")"

die() { printf 'rootfs: error: %s\nhint: %s\n' "$1" "$2" >&2; exit 1; }
say() { printf 'rootfs: %s (%ds)\n' "$1" "$SECONDS"; }

recipe=$(cat "$script" "$reqs" | sha256sum | cut -d' ' -f1)
up_to_date() { [ -f "$dest/.complete" ] && [ "$(head -n1 "$dest/.complete")" = "recipe $recipe" ]; }
if up_to_date; then echo "rootfs: $dest is up to date"; exit 0; fi

for tool in qemu-aarch64-static debootstrap dpkg-deb flock; do
  command -v "$tool" >/dev/null ||
    die "$tool not found" "run \`make system\` (apt-get install qemu-user-static debootstrap gcc-aarch64-linux-gnu)"
done
[ -x "$pip" ] || die "$pip not found" "run \`make venv\` first, or set PIP to a pip of Python 3.11"
debootstrap=(debootstrap)
if [ "$(id -u)" != 0 ]; then
  command -v fakeroot >/dev/null || die "debootstrap needs root" "run as root, or install fakeroot"
  debootstrap=(fakeroot debootstrap)
fi

# One build at a time per DEST (two test sessions may start together); the loser finds it done.
exec 9>"$dest.lock"
flock 9
if up_to_date; then echo "rootfs: $dest is up to date"; exit 0; fi

# The Debian mirror is the one apt on this machine uses for the suite: no host name is hard-coded.
mirror=${EDGESDK_DEBIAN_MIRROR:-$(apt-get indextargets --no-release-info \
  --format '$(RELEASE) $(COMPONENT) $(REPO_URI)' 'Identifier: Packages' 2>/dev/null |
  awk -v s="$suite" '$1 == s && $2 == "main" { print $3; exit }')}
[ -n "$mirror" ] ||
  die "no Debian $suite mirror in apt's sources" "add one to /etc/apt/sources.list.d/ or set EDGESDK_DEBIAN_MIRROR"

cache="$dest.downloads"
root="$dest.partial"
site="$root/opt/edgesdk-site"
mkdir -p "$cache/debs" "$cache/wheels"
rm -rf "$root"
SECONDS=0

say "debootstrap first stage, arm64 $suite minbase from $mirror"
if ! "${debootstrap[@]}" --foreign --arch=arm64 --variant=minbase --cache-dir="$cache/debs" \
    --include=python3.11-minimal,libpython3.11-stdlib,libstdc++6 \
    "$suite" "$root" "$mirror" >"$cache/debootstrap.log" 2>&1; then
  tail -n 20 "$cache/debootstrap.log" >&2
  die "debootstrap failed (log: $cache/debootstrap.log)" "check that $mirror is reachable"
fi

# The first stage unpacked the 'required' packages; 'base' (Python and its libraries) is left to the
# second stage, which cannot run here. --keep-directory-symlink keeps merged /usr's /lib -> usr/lib.
base=$(cat "$root/debootstrap/base")
say "unpacking $(wc -w <<<"$base") more packages with dpkg-deb"
for pkg in $base; do
  deb=$(awk -v p="$pkg" '$1 == p { print $2; exit }' "$root/debootstrap/debpaths")
  [ -n "$deb" ] || die "debootstrap did not fetch $pkg" "see $cache/debootstrap.log"
  dpkg-deb --fsys-tarfile "$root$deb" | tar -x --keep-directory-symlink -C "$root"
done
ln -sfn python3.11 "$root/usr/bin/python3"
rm -rf "$root/debootstrap" "$root"/var/cache/apt/archives/*.deb \
  "$root"/usr/share/{doc,man,info,locale}
[ -x "$root/usr/bin/python3.11" ] || die "python3.11 missing from the root file system" "see $cache/debootstrap.log"

# pip warns about this machine's unused local indexes on every call: show its output only on failure.
pip_quiet() {
  local log rc=0
  log=$(mktemp)
  "$pip" "$@" >"$log" 2>&1 || rc=$?
  if [ "$rc" != 0 ]; then cat "$log" >&2; fi
  rm -f "$log"
  return "$rc"
}
wheel_tags=(--only-binary=:all: --python-version 3.11 --implementation cp
  --platform manylinux_2_28_aarch64 --platform manylinux_2_27_aarch64
  --platform manylinux_2_24_aarch64 --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64)
say "downloading the aarch64 wheels pinned in packaging/requirements-aarch64.txt"
pip_quiet download -q --no-deps "${wheel_tags[@]}" -d "$cache/wheels" -r "$reqs" ||
  die "pip download of the aarch64 wheels failed" "check PyPI access and the pins in $reqs"
say "installing them into /opt/edgesdk-site"
pip_quiet install -q --no-index --find-links "$cache/wheels" "${wheel_tags[@]}" --no-compile \
    --target "$site" -r "$reqs" ||
  die "pip install of the aarch64 wheels failed" "a dependency is probably not pinned in $reqs"
# The device runs TVM's runtime only (TVM_USE_RUNTIME_LIB=1, DESIGN §7); the 250 MB compiler library
# would double the size of the root file system and is never loaded.
rm -f "$site"/tvm/lib/libtvm_compiler.so
rm -rf "$site/bin"

if [ "$("$py" -c 'import sys; print(sys.version_info[:2] == (3, 11))')" = True ]; then
  say "precompiling the stdlib and the site with the host's Python 3.11 (same .pyc format)"
  "$py" -m compileall -q -q -j 0 "$root/usr/lib/python3.11" "$site" || true
fi

say "smoke test under qemu-aarch64-static"
env -i PATH=/usr/bin:/bin QEMU_LD_PREFIX="$root" QEMU_CPU=cortex-a72 PYTHONPATH="$site" \
    TVM_USE_RUNTIME_LIB=1 qemu-aarch64-static "$root/usr/bin/python3" -c '
import platform, numpy, tvm.runtime, ai_edge_litert.interpreter
assert platform.machine() == "aarch64", platform.machine()
print("rootfs: python", platform.python_version(), platform.machine(), "numpy", numpy.__version__,
      "tvm", tvm.__version__)' || die "python does not run under qemu" "see the error above"

{
  echo "recipe $recipe"
  echo "suite $suite arm64 from $mirror"
  grep -v '^#' "$reqs"
} >"$root/.complete"
rm -rf "$dest"
mv "$root" "$dest"
say "done: $dest, $(du -sh "$dest" | cut -f1)"
