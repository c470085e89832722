"""The zoo's rtx3090 bundles packed for a GPU host, in parts that each fit one transfer, to run their self-tests there.

    .venv/bin/python benchmarks/gpu/zoo_pack.py DIR [--part-mib 56] [--parts 4] [--models a,b]
    # on the GPU host (Python 3.12, numpy, onnxruntime, cuda-bindings, an NVIDIA driver; no network), each part:
    bash benchmarks/gpu/zoo_selftest.sh DIR/part-K.tar RESULTS
    # back here: the results into benchmarks/results/zoo.json
    .venv/bin/python benchmarks/bench_zoo.py --gpu-selftests RESULTS/*.jsonl

Each part holds TVM's runtime alone for Python 3.12 (`site.tar.xz`: the pinned wheels without the compiler, as
prepare.sh packs it; the bundle runs TVM with TVM_USE_RUNTIME_LIB=1) and as many of the zoo's rtx3090 bundles as
fit (first fit, largest first), each as the archive its build wrote (`.cache/zoo-runs/M/out-rtx3090/bundle.tar.gz`, byte for
byte what a user ships). The bundles that fit in no part are listed in DIR/parts.json as left out.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / ".cache" / "zoo-runs"
# what a bundle's runtime does not need of TVM's wheel: its compiler (260 MB) and sources
DROPPED = ("tvm/lib/libtvm_compiler.so", "tvm/3rdparty", "tvm/web", "tvm/src", "tvm_ffi/include", "tvm_ffi/3rdparty")


def site(into: Path) -> Path:
    """TVM's runtime for CPython 3.12 on x86-64 Linux, at the versions pyproject.toml pins, as site.tar.xz."""
    pins = re.findall(r'"(apache-tvm(?:-ffi)?==[^"]+)"', (ROOT / "pyproject.toml").read_text())
    wheels, unpacked = into / "wheels", into / "site"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                    "-d", str(wheels), *pins], check=True)
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(unpacked)
    for name in DROPPED:
        path = unpacked / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    out = into / "site.tar.xz"
    with tarfile.open(out, "w:xz") as tar:
        tar.add(unpacked, arcname="site")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--part-mib", type=float, default=56.0, help="the largest part (a transfer's limit, less the tree)")
    p.add_argument("--parts", type=int, default=4)
    p.add_argument("--models", default="", help="these models' bundles only (default: every one built)")
    args = p.parse_args()
    wanted = set(filter(None, args.models.split(",")))
    built = {d.name: d / "out-rtx3090" / "bundle.tar.gz" for d in sorted(WORK.iterdir())
             if (d / "out-rtx3090" / "bundle.tar.gz").is_file() and (not wanted or d.name in wanted)}
    args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        runtime = site(Path(tmp))
        room = int(args.part_mib * 2**20) - runtime.stat().st_size
        parts: list[list[str]] = []
        left_out = []
        sizes = {n: b.stat().st_size for n, b in built.items()}
        free: list[int] = []
        for name in sorted(built, key=sizes.get, reverse=True):  # first fit, largest first: few parts, little room left
            k = next((i for i, f in enumerate(free) if sizes[name] <= f), None)
            if k is None and len(parts) < args.parts and sizes[name] <= room:
                parts.append([])
                free.append(room)
                k = len(parts) - 1
            if k is None:
                left_out.append(name)
                continue
            parts[k].append(name)
            free[k] -= sizes[name]
        for k, names in enumerate(parts, 1):
            with tarfile.open(args.dir / f"part-{k}.tar", "w") as tar:  # the archives are compressed already
                tar.add(runtime, arcname="site.tar.xz")
                for name in names:
                    tar.add(built[name], arcname=f"{name}.tar.gz")
    summary = {"parts": {f"part-{k}.tar": names for k, names in enumerate(parts, 1)}, "left_out": left_out,
               "bytes": {f"part-{k}.tar": (args.dir / f"part-{k}.tar").stat().st_size for k in range(1, len(parts) + 1)}}
    (args.dir / "parts.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
