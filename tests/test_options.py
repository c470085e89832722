"""The build's options, declared once in edgesdk.options: the choices agree with the lists the stages act
on, every field the command line sets reaches a typer parameter of `edgesdk build`, a refused choice
reads as the hand-written checks it replaced read, and the module stays importable without typer."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from edgesdk.errors import UsageError
from edgesdk.options import PANELS, BuildOptions, check_choice, choices, flag_of, flagged

ROOT = Path(__file__).resolve().parents[1]


def test_the_choices_are_the_lists_the_stages_act_on():
    from edgesdk.compression import tasks
    from edgesdk.ir.calibrators import METHODS
    from edgesdk.pipeline import PHASE_NAMES

    assert choices("until") == choices("start") == PHASE_NAMES
    assert choices("calib_method") == (*METHODS, "auto")
    assert choices("task") == tasks.TASKS and choices("decoder") == tasks.DECODERS


def test_build_options_is_still_importable_from_the_pipeline():
    from edgesdk import pipeline

    assert pipeline.BuildOptions is BuildOptions


def test_every_flag_is_declared_once_with_a_stage_panel():
    names = [n for f in flagged() for n in flag_of(f).flags(f)]
    assert len(names) == len(set(names))
    for name in flagged():
        f = flag_of(name)
        assert f.help and (f.stage is None or f.stage in PANELS), name
        assert (f.refusal is not None) == (name in {"calib_method", "mode", "cpu_precision", "sparse_kernels", "task",
                                                     "decoder", "until", "start"}), name
    assert "remedy" not in flagged()  # the build sets it, no user


def test_the_build_command_takes_every_flagged_field_and_parses_each_spelling():
    import typer.main

    from edgesdk.cli import app
    from edgesdk.option_values import SPELLINGS

    build = typer.main.get_command(app).commands["build"]
    params = {p.name for p in build.params}
    assert set(flagged()) <= params
    assert {"sign_key", "bundle_version", "check_reproducible", "quiet", "as_json"} <= params
    spelled = {n for n in flagged() if flag_of(n).spelled is not None}
    assert spelled <= set(SPELLINGS) <= set(flagged())


def test_the_defaults_on_the_command_line_are_the_fields_defaults(tmp_path):
    from edgesdk.option_values import from_given

    given = {}
    for f in dataclasses.fields(BuildOptions):
        if f.name in flagged():
            flag = flag_of(f.name)
            given[f.name] = (False if flag.negated else [] if flag.spelled == list[str] else
                             None if f.default is dataclasses.MISSING else f.default)
    given.update(model=tmp_path / "m.onnx", target="x86", out=tmp_path / "o")
    assert from_given(given) == BuildOptions(model=tmp_path / "m.onnx", target="x86", out=tmp_path / "o")


@pytest.mark.parametrize("name, value, code, message, hint", [
    ("mode", "fast", "cli.bad-mode", "--mode fast: expected latency or throughput", "see edgesdk build --help"),
    ("cpu_precision", "int4", "cli.bad-cpu-precision", "--cpu-precision int4: expected fp32, bf16, fp16, int8 or auto",
     "bf16, fp16 and int8 measure CPU candidates in that precision behind an accuracy gate"),
    ("sparse_kernels", "fast", "cli.bad-sparse-kernels", "--sparse-kernels fast: expected measured, sparse or dense",
     "measured chooses per layer"),
    ("calib_method", "kl", "cli.bad-calib-method",
     "--calib-method kl: expected one of minmax, percentile, mse, entropy, auto", "auto chooses per tensor"),
    ("task", "pose", "cli.bad-task", "--task pose: expected one of classification, detection, ocr, segmentation, "
     "generic", "classification, detection (with --decoder)"),
    ("decoder", "rcnn", "cli.bad-decoder", "--decoder rcnn: expected one of yolov8, yolov5, ssd", "yolov8: [1, 4+C, N]"),
    ("until", "deploy", "build.bad-stage", "--until deploy: no such stage",
     "stages, in order: import, legalize, schedule, tune, compress, package"),
    ("start", "deploy", "build.bad-stage", "--from deploy: no such stage", "stages, in order: import"),
])
def test_a_refused_choice_names_the_flag_and_the_choices(name, value, code, message, hint):
    with pytest.raises(UsageError) as e:
        check_choice(name, value)
    assert (e.value.code, e.value.message, e.value.exit_code) == (code, message, 2)
    assert e.value.hint.startswith(hint)


def test_an_admitted_choice_and_an_unset_optional_one_pass():
    assert check_choice("mode", "throughput") == "throughput"
    assert check_choice("cpu_precision", None) is None
    with pytest.raises(UsageError):
        check_choice("mode", None)  # mode is not optional


def test_the_options_module_imports_no_typer():
    code = "import sys, edgesdk.options; assert 'typer' not in sys.modules and 'click' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": str(ROOT / "sdk")})
