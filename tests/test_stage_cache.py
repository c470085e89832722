"""The stage cache: a stage's key covers the outputs it READS and nothing else.

A tiny model whose one segment is an Edge TPU segment on arm_2tpu, so compress really converts it to
int8 with TensorFlow: when tune's output changes, tune's readers (package) run again, and compress,
which reads of tune only its pruning plan, is a cache hit unless that plan changed."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgesdk.pipeline import (PHASE_NAMES, BuildOptions, StageContext, build, stage_dir, stage_read_files,
                              stage_reads)
from edgesdk.ir.digest import tree_sha256
from tests.test_interrupted_build import tiny_model


def _cached(result) -> dict[str, bool]:
    return {s.name: s.cached for s in result.stages}


def _new_output(stage: Path, extra: str = "changed.txt") -> None:
    """The stage's output as another run of it would leave it: a file changed or added, and the digest
    written beside it made anew (a digest that does not match its files is a damaged entry, rebuilt:
    tests/test_build_faults.py)."""
    if extra:
        (stage / extra).write_text("another tuning database gave another output\n")
    (stage / "digest").write_text(tree_sha256(stage, exclude=("digest", "key")))


def test_a_changed_tune_output_reruns_package_not_the_int8_conversion(tmp_path):
    options = BuildOptions(model=tiny_model(tmp_path / "m.onnx", 0), target="arm_2tpu", out=tmp_path / "out",
                           tuning_db=tmp_path / "db")
    first = build(options)
    assert first.stages[PHASE_NAMES.index("compress")].record["int8_segments"] == 1  # a real int8 conversion
    assert not any(_cached(first).values())
    build(options)  # the first build created the tuning database, which tune's key covers
    assert all(_cached(build(options)).values())  # nothing changed: every stage a cache hit

    # tune's output changes (as a new tuning database would change it): only its readers run again
    _new_output(stage_dir(options.out, "tune"))
    assert _cached(build(options)) == {"import": True, "legalize": True, "schedule": True, "tune": True,
                                       "compress": True, "package": False}


def test_every_stage_declares_what_it_reads_and_may_read_nothing_else(tmp_path):
    import importlib

    from edgesdk.pipeline import PHASES

    reads = {p.name: stage_reads(importlib.import_module(p.module), p.name) for p in PHASES}
    assert reads["import"] == () and reads["compress"] == ("import", "schedule")
    ctx = StageContext(None, tmp_path, None, tmp_path / ".build", tmp_path, print, reads=("import", "schedule"))
    assert ctx.artifact("schedule") == stage_dir(tmp_path, "schedule")
    with pytest.raises(RuntimeError, match="READS"):
        ctx.artifact("tune")
    # of the tune stage, compress reads the pruning plan alone
    files = {p.name: stage_read_files(importlib.import_module(p.module), p.name) for p in PHASES}
    assert files["compress"] == {"tune": ("prune_plan.json",)}
    ctx = StageContext(None, tmp_path, None, tmp_path / ".build", tmp_path, print, reads=("import", "schedule"),
                       read_files=files["compress"])
    assert ctx.file("tune", "prune_plan.json") == stage_dir(tmp_path, "tune") / "prune_plan.json"
    with pytest.raises(RuntimeError, match="READS_FILES"):
        ctx.file("tune", "tune.json")


def test_compress_reruns_when_the_pruning_plan_changes_not_when_the_rest_of_tune_does(tmp_path):
    options = BuildOptions(model=tiny_model(tmp_path / "m.onnx", 0), target="arm_2tpu", out=tmp_path / "out",
                           tuning_db=tmp_path / "db", prune="2:4", prune_layers="all", calib_samples=4)
    build(options)
    assert all(_cached(build(options)).values())
    _new_output(stage_dir(options.out, "tune"))  # the rest of tune's output changed
    assert _cached(build(options))["compress"] is True
    plan = stage_dir(options.out, "tune") / "prune_plan.json"
    plan.write_text(plan.read_text().replace('"source"', '"edited": 1, "source"'))
    _new_output(stage_dir(options.out, "tune"), extra="")
    assert _cached(build(options)) == {"import": True, "legalize": True, "schedule": True, "tune": True,
                                       "compress": False, "package": False}
