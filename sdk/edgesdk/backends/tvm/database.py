"""The tuning database: a directory per target (`target.json` names it) holding MetaSchedule's two
JSON-lines files and two of ours: `searched.json` (workload -> the largest budget a finished search
had) and `baseline.json` (workload -> the untuned default schedule's latency).

Opened for one target (`_open_database`), applied to a module at compilation (`_apply_database`:
the fastest sound record per function), repaired after an interrupted write (`repair_database`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import UserError
from ...runtime.files import write_whole
from .schedules import _runs_every_instance


RECORDS = "database_tuning_record.json"
WORKLOADS = "database_workload.json"


def _open_database(path: Path, target: dict, *, must_exist: bool) -> Any:
    """The JSON tuning database in directory `path`, which belongs to one target.

    MetaSchedule looks records up by workload alone, not by target, so a database shared
    by two targets would hand one CPU's schedules to another. `target.json` in the
    directory names the target the records were measured for; another target is refused.
    A database that is named but absent is refused too when it must exist (a wrong path
    would otherwise build an untuned library without a word).
    """
    from tvm.s_tir import meta_schedule as ms

    owner = path / "target.json"
    if must_exist and not (path / "database_workload.json").exists():
        raise UserError(
            "tvm.no-tuning-db",
            f"tuning database {path} does not exist",
            hint="run the tune stage first, or build without a tuning database",
        )
    canonical = json.loads(json.dumps(target))
    if owner.exists() and json.loads(owner.read_text()) != canonical:
        raise UserError(
            "tvm.tuning-db-target",
            f"tuning database {path} holds records for target {owner.read_text().strip()}, "
            f"not {json.dumps(target, sort_keys=True)}",
            hint="use one tuning database directory per target",
        )
    path.mkdir(parents=True, exist_ok=True)
    if not owner.exists() and not must_exist:  # the tuning run that creates the records
        owner.write_text(json.dumps(target, sort_keys=True) + "\n")
    return ms.database.JSONDatabase(work_dir=str(path), allow_missing=True)


def _apply_database(mod: Any, database: Any, top_k: int = 8) -> Any:
    """Give each function with records the schedule of its fastest sound record.

    This is MetaSchedule's `MetaScheduleApplyDatabase`, plus a check: TVM 0.27's search can
    produce a schedule that leaves part of a block's iteration domain unrun (a convolution fused
    with the next layer's padding, computed per output tile, leaves the padding's border
    unwritten). It measures fast and computes garbage, so a record whose schedule does not run
    every instance of every block is passed over for the next best.
    """
    from tvm import s_tir, tirx
    from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

    for gvar, func in list(mod.functions_items()):
        if not isinstance(func, tirx.PrimFunc) or func.attrs.get("tirx.is_scheduled", False):
            continue
        workload = _normalize_mod(func)
        if not database.has_workload(workload):
            continue
        for record in database.get_top_k(database.commit_workload(workload), top_k):
            sch = s_tir.Schedule(workload)
            try:
                record.trace.apply_to_schedule(sch, remove_postproc=False)
            except Exception:  # noqa: BLE001 -- a trace that no longer replays
                continue
            if not _runs_every_instance(sch.copy()):
                continue
            new = sch.mod["main"]
            if "global_symbol" not in (func.attrs or {}):  # as MetaScheduleApplyDatabase keeps it
                new = new.without_attr("global_symbol")
            mod[gvar] = new.with_attr("tirx.is_scheduled", True)
            break
    return mod


def repair_database(path: Path) -> int:
    """Drop an incomplete last line from the database's JSON-lines files (a write cut short by
    a killed process); returns how many lines were dropped. A bad line anywhere else is not
    ours to guess about: a user error naming the file and line."""
    dropped = 0
    for name in (WORKLOADS, RECORDS):
        file = path / name
        if not file.exists():
            continue
        lines = file.read_bytes().split(b"\n")
        complete, tail = lines[:-1], lines[-1]  # after the last newline: "" when the file is whole
        bad = [i for i, line in enumerate(complete) if line.strip() and not _parses(line)]
        if bad and bad != [len(complete) - 1]:
            raise UserError(
                "tune.db-corrupt",
                f"tuning database file {file}, line {bad[0] + 1}, is not a JSON record",
                hint="restore the database from a copy (each build keeps one in build/tune/tuning_db), "
                     "or delete the file to start over",
            )
        if bad or tail.strip():
            keep = complete[:-1] if bad else complete
            dropped += len(bad) + (1 if tail.strip() else 0)
            data = b"".join(line + b"\n" for line in keep)
            write_whole(file, lambda f: f.write(data))
    return dropped


def _parses(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def _workload_key(mod: Any) -> str:
    from tvm.s_tir.meta_schedule.utils import shash2hex

    return shash2hex(mod)


def _record_counts(database: Any, *, valid_only: bool = False) -> dict[str, int]:
    """Records per workload structural hash; with `valid_only`, those of candidates that ran
    (MetaSchedule records a failed build or run with a latency of 1e10 s)."""
    counts: dict[str, int] = {}
    for record in database.get_all_tuning_records():
        if valid_only and (not record.run_secs or min(float(s) for s in record.run_secs) >= 1e9):
            continue
        key = _workload_key(record.workload.mod)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _best_ms(database: Any, mod: Any) -> float | None:
    if not database.has_workload(mod):
        return None
    top = database.get_top_k(database.commit_workload(mod), 1)
    if not top or not top[0].run_secs:
        return None
    secs = [float(s) for s in top[0].run_secs]
    return round(1e3 * sum(secs) / len(secs), 6)


def _read(path: Path, name: str) -> dict:
    file = path / name
    return json.loads(file.read_text()) if file.exists() else {}


def _merge(path: Path, name: str, values: dict, combine: Callable[[Any, Any], Any]) -> None:
    """Merge `values` into the JSON object in `path/name`, written atomically."""
    merged = _read(path, name)
    for key, value in values.items():
        merged[key] = combine(merged[key], value) if key in merged else value
    text = json.dumps(merged, indent=1, sort_keys=True) + "\n"
    write_whole(path / name, lambda f: f.write(text.encode()))
