"""A TEST DOUBLE for Coral's `edgetpu_compiler` that co-compiles (the real one cannot be installed here)."""

from __future__ import annotations

import os
from pathlib import Path

CO_COMPILING = r"""#!/bin/sh
# TEST DOUBLE for Coral's edgetpu_compiler (the real one cannot be installed here): co-compiles by
# copying each model, appends its argument list to calls.txt, and prints one block per model, the
# first model caching 1 MiB, each later one nothing (the cache is full), every op mapped.
out=.; models=""
while [ $# -gt 0 ]; do case "$1" in -o) out=$2; shift 2;; -s) shift;; *) models="$models $1"; shift;; esac; done
echo "$models" >> "$(dirname "$0")/calls.txt"
echo "Edge TPU Compiler version 16.0.384591198 (test double)"
echo ""
first=1
for m in $models; do
  base=$(basename "$m" .tflite); cp "$m" "$out/${base}_edgetpu.tflite"
  if [ $first = 1 ]; then chip=1.00MiB; off=0.00B; first=0; else chip=0.00B; off=512.00KiB; fi
  echo "Input model: $m"
  echo "On-chip memory used for caching model parameters: $chip"
  echo "On-chip memory remaining for caching model parameters: 2.00KiB"
  echo "Off-chip memory used for streaming uncached model parameters: $off"
  echo "Number of operations that will run on Edge TPU: 6"
  echo "Number of operations that will run on CPU: 0"
  echo ""
done
"""


def install_co_compiling_double(bindir: Path, monkeypatch) -> Path:
    """Put the double on PATH as `edgetpu_compiler`; it appends each call's models to `bindir/calls.txt`."""
    bindir.mkdir(parents=True, exist_ok=True)
    double = bindir / "edgetpu_compiler"
    double.write_text(CO_COMPILING)
    double.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return double
