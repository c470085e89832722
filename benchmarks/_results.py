"""Write a benchmark question's answer to benchmarks/results/<question>.json.

Every results file says where its figures come from: the host's CPU (/proc/cpuinfo's model name), the commit
(`git rev-parse HEAD`), the command line and the date, next to the data and the table that RESULTS.md shows.
benchmarks/report.py renders RESULTS.md from these files alone.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def path(question: str) -> Path:
    return RESULTS / f"{question}.json"


def host_cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


# the instruction sets a CPU timing depends on: two hosts of one model name (a cloud's "AMD EPYC") may differ
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "avx512_fp16")


def host_isa() -> list[str]:
    """Which of ISA_FLAGS this host's CPU has (/proc/cpuinfo's flags; empty where there are none)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line.split(":", 1)[1].split() for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return [f for f in ISA_FLAGS if f in flags]


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command_line() -> str:
    """The command that ran this script, as a user would type it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return shlex.join([".venv/bin/python", str(script), *sys.argv[1:]])


def parse_table(markdown: str) -> dict:
    """The first markdown table in `markdown` (header, rule, rows) as {"columns": [...], "rows": [[...], ...]}."""
    lines: list[str] = []
    for line in markdown.strip().splitlines():  # the first table, where the text holds more than one
        if line.strip().startswith("|"):
            lines.append(line.strip())
        elif lines:
            break

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip().strip("|").split("|")]

    return {"columns": cells(lines[0]), "rows": [cells(line) for line in lines[2:]]}


def load(question: str) -> dict | None:
    p = path(question)
    return json.loads(p.read_text()) if p.exists() else None


def write(question: str, data, table: str | dict, command: str | None = None, notes: list[str] | None = None,
          out: Path | None = None) -> Path:
    """Write the question's results file (or `out`) and return its path.

    `table` is what RESULTS.md shows for the question: a markdown table or {"columns", "rows"}. `notes` are
    short lines printed under it (a figure's caveat); what a question answers comes from questions.py.
    """
    from questions import QUESTIONS

    q = QUESTIONS[question]
    result = {
        "question": question,
        "title": q.title,
        "answers": q.answers,
        "how": q.how,
        "host": {"cpu": host_cpu(), "cores": os.cpu_count(), "isa": host_isa()},
        "commit": commit(),
        "command": command or command_line(),
        "date": datetime.date.today().isoformat(),
        "table": parse_table(table) if isinstance(table, str) else table,
        "notes": notes or [],
        "data": data,
    }
    target = out or path(question)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"{question}: wrote {target}", file=sys.stderr)
    return target
