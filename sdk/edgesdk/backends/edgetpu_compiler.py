"""Coral's `edgetpu_compiler`: run it when it is installed, and read what it says.

The compiler cannot be installed on our build machines (no registry carries it), so without it
the bundle ships the uncompiled int8 segments and `finish_command` says exactly how to compile
them later. Tests put a stand-in script named `edgetpu_compiler` on PATH (a test double).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


@dataclass(frozen=True)
class CompileLog:
    version: str
    ops_on_tpu: int
    ops_on_cpu: int
    on_chip_bytes: int
    off_chip_bytes: int
    text: str


def find() -> str | None:
    return shutil.which("edgetpu_compiler")


def finish_command(tflite_files: list[str]) -> str:
    return "edgetpu_compiler -s -o segments " + " ".join(tflite_files)


def compile_segment(tflite: Path, out_dir: Path, *, num_segments: int = 1) -> tuple[Path, CompileLog]:
    exe = find()
    assert exe, "compile_segment needs edgetpu_compiler on PATH"
    cmd = [exe, "-s", "-o", str(out_dir), str(tflite)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    compiled = out_dir / f"{tflite.stem}_edgetpu.tflite"
    if proc.returncode != 0 or not compiled.exists():
        raise UserError("package.edgetpu-compiler", f"edgetpu_compiler failed on {tflite.name} (exit {proc.returncode})",
                        "see its output above; the uncompiled int8 model still runs on the CPU",
                        notes=(proc.stdout + proc.stderr).strip().splitlines()[-10:])
    return compiled, parse_log(proc.stdout)


def parse_log(text: str) -> CompileLog:
    def count(pattern: str) -> int:
        m = re.search(pattern, text)
        return int(m.group(1)) if m else 0

    def size(pattern: str) -> int:
        m = re.search(pattern + r"\s*([\d.]+)\s*(B|KiB|MiB|GiB)", text)
        return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else 0

    version = re.search(r"Edge TPU Compiler version ([\w.]+)", text)
    return CompileLog(
        version=version.group(1) if version else "unknown",
        ops_on_tpu=count(r"Number of operations that will run on Edge TPU:\s*(\d+)"),
        ops_on_cpu=count(r"Number of operations that will run on CPU:\s*(\d+)"),
        on_chip_bytes=size(r"On-chip memory used for caching model parameters:"),
        off_chip_bytes=size(r"Off-chip memory used for streaming uncached model parameters:"),
        text=text,
    )
