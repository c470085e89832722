#!/usr/bin/env bash
# arm64_rootfs.sh [DEST]: the emulated aarch64 system that runs bundles' self-tests under qemu-user.
#
# A minimal Debian bookworm arm64 root file system, built without chroot or binfmt:
#   1. debootstrap's first stage (--foreign) downloads and unpacks the minbase system plus Python 3.11;
#      the second stage would need to execute arm64 code, so the packages it would configure are
#      unpacked with dpkg-deb instead (nothing is configured: no maintainer script runs). The rootfs
#      also gets a Cortex-A72's /proc/cpuinfo and /sys/devices/system/cpu, without which LiteRT
#      crashes under qemu-user (see below).
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

# The Debian mirror is the one apt on this machine uses: no host name is hard-coded. Prefer the entry
# for the suite itself; a host on another Debian release has a mirror that carries it too (any main,
# non-security entry). EDGESDK_DEBIAN_MIRROR overrides both, e.g. on an Ubuntu host.
mirror=${EDGESDK_DEBIAN_MIRROR:-$(apt-get indextargets --no-release-info \
  --format '$(RELEASE) $(COMPONENT) $(REPO_URI)' 'Identifier: Packages' 2>/dev/null |
  awk -v s="$suite" '$2 == "main" && $1 == s { exact = $3 }
                     $2 == "main" && $0 !~ /security/ && other == "" { other = $3 }
                     END { print (exact != "" ? exact : other) }')}
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
  "$root"/usr/share/{doc,man,info,locale} "$root"/var/lib/apt/lists/*_dists_*
[ -x "$root/usr/bin/python3.11" ] || die "python3.11 missing from the root file system" "see $cache/debootstrap.log"

# An arm64 view of the CPUs. qemu-user passes /proc and /sys through from the x86-64 host unless the
# same path exists under QEMU_LD_PREFIX, and LiteRT's CPU detection (pytorch/cpuinfo, for XNNPACK and
# ruy) dereferences NULL on the host's x86 /proc/cpuinfo and cache topology: allocate_tensors() dies
# with SIGSEGV. So the rootfs carries /proc/cpuinfo and /sys/devices/system/cpu of a Cortex-A72 (the
# CPU model qemu emulates, QEMU_CPU=cortex-a72) with as many cores as the build host has, up to 8, so
# that thread pools do not oversubscribe it. Every file cpuinfo reads is here: a missing one would
# silently fall back to the host's. All other /proc paths (/proc/self/...) still reach the host.
say "writing a Cortex-A72 /proc/cpuinfo and /sys/devices/system/cpu"
cores=$(nproc); cores=$((cores > 8 ? 8 : cores)); last=$((cores - 1))
rm -rf "$root/proc"
mkdir -p "$root/proc"
cpus="$root/sys/devices/system/cpu"
mkdir -p "$cpus"
for f in possible present online; do echo "0-$last" >"$cpus/$f"; done
echo "$last" >"$cpus/kernel_max"
echo >"$cpus/offline"
cache_level() {  # cache_level CPU INDEX LEVEL TYPE SIZE SHARED_LIST WAYS SETS (64-byte lines)
  local d="$cpus/cpu$1/cache/index$2"
  mkdir -p "$d"
  echo "$3" >"$d/level"; echo "$4" >"$d/type"; echo "$5" >"$d/size"; echo "$6" >"$d/shared_cpu_list"
  echo "$7" >"$d/ways_of_associativity"; echo "$8" >"$d/number_of_sets"; echo 64 >"$d/coherency_line_size"
}
for ((i = 0; i < cores; i++)); do
  printf 'processor\t: %d\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm crc32 cpuid\n' "$i"
  printf 'CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd08\nCPU revision\t: 3\n\n'
  c="$cpus/cpu$i"
  mkdir -p "$c/topology" "$c/cpufreq"
  echo 1 >"$c/online"
  echo 0 >"$c/topology/physical_package_id"; echo 0 >"$c/topology/cluster_id"; echo "$i" >"$c/topology/core_id"
  for f in core_siblings_list cluster_cpus_list package_cpus_list; do echo "0-$last" >"$c/topology/$f"; done
  for f in thread_siblings_list core_cpus_list; do echo "$i" >"$c/topology/$f"; done
  echo 1500000 >"$c/cpufreq/cpuinfo_max_freq"; echo 600000 >"$c/cpufreq/cpuinfo_min_freq"
  # Cortex-A72: 32 KiB 2-way L1d and 48 KiB 3-way L1i per core, a shared 16-way L2 (1 MiB here)
  cache_level "$i" 0 1 Data 32K "$i" 2 256
  cache_level "$i" 1 1 Instruction 48K "$i" 3 256
  cache_level "$i" 2 2 Unified 1024K "0-$last" 16 1024
done >"$root/proc/cpuinfo"

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
# The device runs TVM's runtime only (TVM_USE_RUNTIME_LIB=1); the 250 MB compiler library
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
