"""tune: search tensor programs for the TVM segments (CPU and GPU) with MetaSchedule.

Needs: the plan and its segment models.
Guarantees: `tuning_db/`, a copy of the tuning database as the package stage will apply it
(so a rebuild replays exactly these records), and `tune.json` with a summary per segment.
With `--trials 0` (the default) nothing is searched: records already in the database are used.
The database (`--tuning-db`, default under the user's cache directory, one per target) is
persisted between builds and shared between models.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import onnx

from ...backends import tvm as tvm_backend
from ...ir.digest import tree_sha256

OPTIONS = ("trials", "tuning_db", "seed")


def default_tuning_db(target_name: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "edgesdk" / "tuning" / target_name


def codegen_for(target, device_id: str) -> dict:
    kind = device_id.split(":")[0]
    return next(d for d in target.devices if d.kind == kind).codegen


def _db_path(options, target) -> Path:
    return Path(options.tuning_db) if options.tuning_db else default_tuning_db(target.name)


def cache_inputs(options, target) -> dict:
    """The database's content decides what the package stage compiles: a changed database is a miss."""
    db = _db_path(options, target)
    return {"tuning_db_sha256": tree_sha256(db) if db.is_dir() else None}


def run(artifact: Path, ctx) -> dict:
    plan = json.loads((artifact / "plan.json").read_text())
    db = _db_path(ctx.options, ctx.target)
    db.mkdir(parents=True, exist_ok=True)
    summaries = {}
    for seg in plan["segments"]:
        if seg["backend"] != "tvm":
            continue
        if ctx.options.trials > 0:
            model = onnx.load(str(artifact / seg["artifact"]))
            ctx.log(f"tune: {seg['id']} on {seg['device']}: up to {ctx.options.trials} trials")
            # one database per device kind: MetaSchedule keys records by workload, not by target
            summaries[seg["id"]] = tvm_backend.tune_onnx(
                model, codegen_for(ctx.target, seg["device"]), db / seg["device"].split(":")[0],
                trials=ctx.options.trials,
                seed=ctx.options.seed, progress=lambda line, s=seg["id"]: ctx.log(f"tune: {s}: {line}"))
        else:
            summaries[seg["id"]] = {"trials": 0, "note": "no search (--trials 0): records in the database are applied"}
    shutil.copytree(db, ctx.out / "tuning_db")
    record = {"database": str(db), "database_sha256": tree_sha256(ctx.out / "tuning_db"),
              "trials": ctx.options.trials, "seed": ctx.options.seed, "segments": summaries}
    (ctx.out / "tune.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    return record
