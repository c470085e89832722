"""The `edgesdk` command line. Logs go to stderr, data to stdout; heavy imports stay inside commands.

Exit codes: 0 ok, 1 the model/bundle/data is at fault (a failed self-test too), 2 a wrong invocation
or target file, 3 an internal error (a bug: run again with --debug and report the traceback), 130
interrupted (Ctrl-C).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
import warnings
from dataclasses import MISSING
from inspect import Parameter, Signature, signature
from pathlib import Path
from typing import Any, List, Optional, get_origin

import typer
from typer.core import TyperCommand

from .api import VERSION_0_WARNING as api_warning
from .api import check_timeout, reproducible, stamper, trusted_keys
from .crashes import report_native_crashes
from .errors import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, EdgeSDKError, UsageError, UserError
from .option_values import _parse_shapes, checked_together, from_given
from .options import GENERAL, PANELS, check_choice, default_of, field_type, flag_of, flagged

app = typer.Typer(
    name="edgesdk",
    help="Compile a trained model for an industrial edge device and package it as a self-verifying bundle.\n\n"
    "Stages, in order: import, legalize, schedule, tune, compress, package.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
targets_app = typer.Typer(help="List, show, validate target files; write their JSON Schema.", no_args_is_help=True)
app.add_typer(targets_app, name="targets")
keys_app = typer.Typer(help="Signing keys: generate a key pair; sign and check release files (SHA256SUMS).",
                       no_args_is_help=True)
app.add_typer(keys_app, name="keys")

_state = {"debug": False, "progress_open": False}


def _err(line: str) -> None:
    if _state["progress_open"]:  # a progress line is being redrawn: the next line starts below it
        sys.stderr.write("\n")
        _state["progress_open"] = False
    print(line, file=sys.stderr, flush=True)


@app.callback(invoke_without_command=True)
def _root(ctx: typer.Context, debug: bool = typer.Option(False, "--debug", help="Show tracebacks of errors, and TensorFlow's own log."),
          version: bool = typer.Option(False, "--version", help="Print the version and exit.")) -> None:
    _state["debug"] = debug
    if debug:  # TensorFlow's own log too, from its first line (it is imported only by commands that need it)
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")
    if version:
        from . import __version__

        print(f"edgesdk {__version__}")
        raise typer.Exit(0)
    if ctx.invoked_subcommand is None:
        print(ctx.get_help())
        raise typer.Exit(0)


def _progress_line():
    """A progress line for long work: redrawn in place on a terminal, printed as lines in a log
    (CI); None ends it."""
    tty = sys.stderr.isatty()

    def show(line: str | None) -> None:
        if line is None:
            if _state["progress_open"]:
                sys.stderr.write("\n")
                sys.stderr.flush()
            _state["progress_open"] = False
        elif tty:
            sys.stderr.write(f"\r\x1b[K    {line}")
            sys.stderr.flush()
            _state["progress_open"] = True
        else:
            _err(f"    {line}")

    return show


VERSION_0_WARNING = f"warning: {api_warning}"


@contextlib.contextmanager
def _native_stderr_silenced(active: bool):
    """With --quiet, what TensorFlow, LiteRT and TVM print from native code (absl and XNNPACK
    banners) goes nowhere; our own errors are printed after this block, on the restored stderr."""
    if not active:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _failure_as_json(command):
    """`command` (one with `--json`) such that, with `--json`, a failure still prints one JSON object on
    stdout: `{"error": {"code", "message", "notes", "hint", "exit_code"}}`, what the `error:`, note and
    `hint:` lines say (they go to stderr as without `--json`, and the exit code is the same)."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except Exception as e:
            if kwargs.get("as_json"):
                print(json.dumps({"error": _error_json(e)}, indent=2, default=str), flush=True)
            raise

    return run


def _error_json(e: Exception) -> dict:
    if isinstance(e, EdgeSDKError):
        return {"code": e.code, "message": e.message, "notes": e.notes, "hint": e.hint, "exit_code": e.exit_code}
    return {"code": "internal", "message": f"internal error: {type(e).__name__}: {str(e)[:500]}", "notes": [],
            "hint": "this is a bug in edgesdk; run again with --debug and report the traceback",
            "exit_code": EXIT_INTERNAL}


def _typer_parameter(name: str, help: str | None, panels: bool) -> Parameter:
    """The typer parameter of BuildOptions field `name`, as its `Flag` declares it."""
    f = flag_of(name)
    spelled = bool if f.negated else f.spelled or field_type(name)
    if f.negated:
        default = False
    elif get_origin(spelled) is list:
        default = []
    else:
        default = ... if default_of(name) is MISSING else default_of(name)
    # what rich would read as markup ("[default: ...]") is shown as written
    shown = dict(help=(help or f.help).replace("[", "\\["),
                 rich_help_panel=PANELS[f.stage] if panels and f.stage else None,
                 parser=functools.partial(check_choice, name) if f.refusal else None)
    info = (typer.Argument(default, **shown) if f.argument else
            typer.Option(default, *f.flags(name), min=f.min, **shown))
    return Parameter(name, Parameter.KEYWORD_ONLY, default=info, annotation=spelled)


def _with_options(*names: str, help: dict[str, str] | None = None, panels: bool = True):
    """A command that takes these BuildOptions fields (options.py declares each once) as typer parameters,
    into its `**given`, beside its own; with `panels`, --help shows each in the panel of the stage that owns
    it, the stages in order."""
    def add(command):
        made = [_typer_parameter(n, (help or {}).get(n), panels) for n in names]
        own = [p.replace(kind=Parameter.KEYWORD_ONLY) for p in signature(command).parameters.values()
               if p.kind is not Parameter.VAR_KEYWORD]
        order = [None, *PANELS.values()]
        params = sorted(made + own, key=lambda p: order.index(getattr(p.default, "rich_help_panel", None)))
        command.__signature__ = Signature(params, return_annotation=None)
        command.__annotations__ = {**command.__annotations__, **{p.name: p.annotation for p in made}}
        return command

    return add


class _RefusalsAsJson(TyperCommand):
    """A command (with `_failure_as_json`) whose `--json` also covers a value refused while the command line
    is read, before the command runs (a choice, options.py `Refusal`); `--json` is eager, read first, so
    it is known by then."""

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except EdgeSDKError as e:
            if ctx.params.get("as_json"):
                print(json.dumps({"error": _error_json(e)}, indent=2, default=str), flush=True)
            raise


@app.command(cls=_RefusalsAsJson)
@_failure_as_json
@_with_options(*flagged())
def build(
    sign_key: Optional[Path] = typer.Option(None, "--sign-key", envvar="EDGESDK_SIGN_KEY", rich_help_panel=PANELS["package"], help="Sign the bundle with this ed25519 private key (edgesdk keys generate): manifest.sig; the key never enters the bundle."),
    bundle_version: Optional[int] = typer.Option(None, "--bundle-version", envvar="EDGESDK_BUNDLE_VERSION", rich_help_panel=PANELS["package"], help="The bundle's version, 0 to 2^63 - 1, increasing with every release of this product: devices refuse to install a bundle older than theirs \\[default: 0]."),
    check_reproducible: bool = typer.Option(False, "--check-reproducible", rich_help_panel=PANELS[GENERAL], help="Build again in a fresh directory (the tune stage's measurements replayed) and compare the bundles byte for byte, naming any difference (exit 1)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", rich_help_panel=PANELS[GENERAL], help="Only errors on stderr."),
    as_json: bool = typer.Option(False, "--json", is_eager=True, rich_help_panel=PANELS[GENERAL], help="Print the build summary as JSON on stdout (a failure: its error, as {\"error\": {code, message, notes, hint, exit_code}})."),
    **given: Any,
) -> None:
    """Run the pipeline and write DIR/bundle and DIR/bundle.tar.gz."""
    if check_reproducible and given["until"] is not None:
        raise UsageError("cli.reproducible-until", "--check-reproducible compares whole bundles: --until does not go "
                         "with it", "drop --until")
    stamp = stamper(sign_key, bundle_version, warn=lambda s: _err(f"warning: {s}"))
    options = from_given(checked_together(given))
    from .pipeline import build as run_build

    log = (lambda s: None) if quiet else (lambda s: _err(f"    {s}"))
    on_stage = _stage_lines(quiet)
    t0 = time.perf_counter()
    with _native_stderr_silenced(quiet):
        result = run_build(options, log=log, on_stage=on_stage, progress=None if quiet else _progress_line(),
                           stamp=stamp)
    summary = result.summary()
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    if result.bundle is not None:
        summary["signed_by"] = _stamped(result.bundle, quiet)
    if as_json:
        if check_reproducible:
            summary["reproducible"] = _check_reproducible(options, result, stamp, quiet, log, on_stage)
        print(json.dumps(summary, indent=2, default=str))
        return
    if not quiet:
        _report_build(result, options.out, summary["seconds"])
    if check_reproducible:  # after the build's own report: the rebuild's verdict is the last word
        _check_reproducible(options, result, stamp, quiet, log, on_stage)


def _stage_lines(quiet: bool):
    """The build's `on_stage`: a line on stderr as each stage starts and ends."""
    from .pipeline import PHASE_NAMES

    total = len(PHASE_NAMES)

    def on_stage(name: str, state: str, secs: float) -> None:
        if quiet:
            return
        i = PHASE_NAMES.index(name) + 1
        if state == "start":
            _err(f"[{i}/{total}] {name} ...")
        elif state == "done":
            _err(f"[{i}/{total}] {name} done in {secs:.2f} s")
        elif state == "replayed":
            _err(f"[{i}/{total}] {name} replayed from the first build")
        else:
            _err(f"[{i}/{total}] {name} cached")

    return on_stage


def _report_build(result, out: Path, seconds: float) -> None:
    """What the build did, on stderr: each stage's summary, the plan, the accuracy, cached stages' warnings."""
    from .pipeline import stage_dir
    from .report.text import accuracy_summary, import_summary, legalize_summary, placement_summary

    for s in result.stages:
        if s.name == "import":
            _err(import_summary(s.record))
        if s.name == "legalize" and (text := legalize_summary(s.record)):
            _err(text)
    # the tune stage's plan (each CPU span on its measured backend) where the build got that far
    plan_path = next((p for p in (stage_dir(out, "tune") / "plan.json", stage_dir(out, "schedule") / "plan.json")
                      if p.exists()), None)
    if plan_path is not None:
        _err(placement_summary(json.loads(plan_path.read_text())))
        _err(f"schedule report: {stage_dir(out, 'schedule') / 'schedule.html'}")
    for s in result.stages:
        if s.name == "package" and (text := accuracy_summary(s.record.get("accuracy") or {})):
            _err(text)
            _err(f"accuracy report: {stage_dir(out, 'package') / 'accuracy.html'}")
    for s in result.stages:
        for w in s.record.get("warnings", []) if s.cached else []:
            _err(f"warning: {w}")
    _err(f"built in {seconds:.1f} s" + (f": {result.bundle} and {out / 'bundle.tar.gz'}" if result.bundle else ""))


def _stamped(bundle: Path, quiet: bool) -> str | None:
    from .runtime.manifest import Manifest

    m = Manifest.load(bundle)
    key = m.signing.get("key_id")
    if not quiet:
        _err(f"bundle version {m.bundle_version}, " + (f"signed by key {key} (manifest.sig)" if key else
                                                      "unsigned (--sign-key or EDGESDK_SIGN_KEY signs it)"))
        if key and m.bundle_version == 0:  # as `sign` warns: a signed release is one a device compares
            _err(VERSION_0_WARNING)
    return key


def _check_reproducible(options, result, stamp, quiet: bool, log, on_stage) -> dict:
    with _native_stderr_silenced(quiet):
        return reproducible(options, result, stamp, say=(lambda line: None) if quiet else _err, log=log,
                            on_stage=on_stage)


@app.command()
def sign(
    bundle: Path = typer.Argument(..., help="A bundle directory (DIR/bundle: DIR/bundle.tar.gz is written again too) or a .tar.gz."),
    key: Path = typer.Option(..., "--key", "-k", envvar="EDGESDK_SIGN_KEY", help="The ed25519 private key (edgesdk keys generate)."),
    bundle_version: Optional[int] = typer.Option(None, "--bundle-version", help="Set the bundle's version as it is signed, 0 to 2^63 - 1 \\[default: keep the manifest's]."),
) -> None:
    """Sign a bundle built earlier: manifest.sig over manifest.json, with its key id and version."""
    from .api import sign as sign_bundle

    written, manifest = sign_bundle(bundle, key, bundle_version=bundle_version, log=_err)
    print(f"signed {', '.join(map(str, written))}: key {manifest.signing['key_id']}, bundle version "
          f"{manifest.bundle_version}")


@keys_app.command("generate")
def keys_generate(
    out: Path = typer.Option(..., "--out", "-o", help="Directory for NAME.key (private, mode 0600) and NAME.pub."),
    name: str = typer.Option("edgesdk", "--name", help="The files' name."),
) -> None:
    """A new ed25519 signing key pair (EDGESDK_SIGN_KEY_PASSPHRASE set: the private key is encrypted)."""
    from .bundling import signing

    private, public, key_id = signing.generate_keys(out, name)
    print(f"key {key_id}\n  private: {private} (mode 0600: keep it off devices and out of bundles)\n"
          f"  public:  {public} (put it into the devices' trust directory)")


@keys_app.command("sign")
def keys_sign(
    files: List[Path] = typer.Argument(..., help="Files to sign (SHA256SUMS): FILE.sig is written beside each."),
    key: Path = typer.Option(..., "--key", "-k", envvar="EDGESDK_SIGN_KEY", help="The ed25519 private key."),
) -> None:
    """Detached signatures of release files."""
    from .bundling import signing

    signer = signing.load_private_key(key, warn=lambda s: _err(f"warning: {s}"))
    for f in files:
        if not f.is_file():
            raise UsageError("keys.no-file", f"{f}: no such file", "give files to sign, e.g. dist/SHA256SUMS")
        print(f"{signing.sign_file(f, signer)}: key {signer.key_id}")


@keys_app.command("verify")
def keys_verify(
    files: List[Path] = typer.Argument(..., help="Signed files (FILE.sig beside each)."),
    public_key: Optional[Path] = typer.Option(None, "--public-key", help="An ed25519 public key file."),
    trust_dir: Optional[Path] = typer.Option(None, "--trust", help="A directory of public keys (*.pub)."),
) -> None:
    """Check detached signatures (FILE.sig) of release files."""
    from .bundling import signing

    keys = trusted_keys(public_key, trust_dir, None, required=True)
    for f in files:
        if not f.is_file():
            raise UsageError("keys.no-file", f"{f}: no such file", "give the signed files, e.g. dist/SHA256SUMS")
        k = signing.verify_file(f, keys)
        print(f"{f}: signed by key {k.key_id} ({k.path.name})")


@app.command(cls=_RefusalsAsJson)
@_failure_as_json
@_with_options("model", "target", "input_shapes", "input_values", "batch", "calib", "calib_samples", "calib_preprocess",
               "input_ranges", "max_abs_error", "max_error_lsb", "allow_cpu_fallback", "seed",
               help={"input_values": "Freeze an input to a constant: NAME=16000 or NAME=1,2,3 (repeatable).",
                     "calib": "Directory of .npy / .npz samples or images: the ranges approximations are fitted on.",
                     "allow_cpu_fallback": "Fail on functions that miss the bound instead of reporting them as CPU "
                                           "fallbacks.",
                     "seed": "Seed of the synthetic calibration samples."})
def check(
    nodes: bool = typer.Option(False, "--nodes", help="List every node, not only each op type."),
    as_json: bool = typer.Option(False, "--json", is_eager=True, help="Print the analysis as JSON on stdout (a failure: its error, as build --json prints it)."),
    **given: Any,
) -> None:
    """Analyse MODEL for TARGET without building: which devices can run each op and why not,
    accelerator coverage by ops and FLOPs, CPU<->accelerator transitions, what legalize would rewrite."""
    from .pipeline import check as run_check

    options = from_given(given, out=Path("."))
    report = run_check(options, log=lambda s: None if as_json else _err(f"    {s}"))
    if as_json:
        print(json.dumps(report, indent=2, default=float))
        return
    from .report.text import check_summary

    print(check_summary(report, nodes=nodes))


@app.command()
@_with_options("target", "tuning_db", panels=False, help={
    "target": "The target whose CPU figures to fit (its CPU must be this host's architecture).",
    "tuning_db": "The tuning database whose records TVM compiles with, as the build would (default: the build's, "
                 "~/.cache/edgesdk/tuning/TARGET)."})
def calibrate(
    model: List[str] = typer.Option(..., "--model", "-m", help="A model whose ops are measured and fitted (repeatable); PATH@NAME=1x3x48x192 fixes its input shapes."),
    holdout: List[str] = typer.Option([], "--holdout", help="A model measured only to evaluate the fit (repeatable), PATH or PATH@NAME=DIMS."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="Intra-op threads, as the bundle will run, at most this host's CPUs \\[default: 2, or the host's CPUs if fewer]."),
    runs: int = typer.Option(20, "--runs", min=1, help="Profiled runs per model (the median per op is kept); inferences per timing of a backend's run."),
    cpu_backends: str = typer.Option("tvm,onnxruntime,litert", "--backends", help="The CPU backends whose own figures are fitted from runs timed as a bundle runs them: a comma-separated subset of tvm,onnxruntime,litert,openvino; 'none': only the per-op fit."),
    cuts: int = typer.Option(4, "--cuts", min=1, help="Each fitted model is timed on each backend whole and cut into this many runs of nodes."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Timings of each run on each backend, the runs in turn, each in a fresh process (the quickest round's median is kept); more on a busy host."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write the target with the fitted CPU figures to this YAML file."),
    as_json: bool = typer.Option(False, "--json", help="Print the fits and their evaluation as JSON on stdout."),
    **given: Any,
) -> None:
    """Measure per-op latencies on this host and fit the target's CPU cost figures; time runs of each
    model on each CPU backend as a bundle runs them and fit the backend's own figures; report predicted
    vs measured on held-out models, per backend."""
    import yaml

    from .pipeline import calibrate as run_calibrate
    from .runtime.output_file import refusal

    target, tuning_db = given["target"], given["tuning_db"]

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads is None:
        threads = min(2, cpus)
    elif threads > cpus:  # more threads than CPUs measure their contention, not the ops, and take without end
        raise UsageError("cli.bad-threads", f"--threads {threads}: this host has {cpus} CPU(s)",
                         f"calibrate with the threads the bundle will run with on this device, at most {cpus}")
    if output is not None and (why := refusal(output)):
        raise UsageError("calibrate.bad-output", f"--output {output}: {why}", "give the name of the target file "
                         "(YAML) to write, in a directory that exists; a file there is replaced")

    def spec(text: str) -> tuple[Path, dict]:
        path, _, shapes = text.partition("@")
        return Path(path), _parse_shapes([x for x in shapes.split(",") if x])

    from .backends import cpu_candidates
    known = cpu_candidates()

    chosen = () if cpu_backends == "none" else tuple(dict.fromkeys(b.strip() for b in cpu_backends.split(",")
                                                                    if b.strip()))
    unknown = [b for b in chosen if b not in known]
    if unknown or (cpu_backends != "none" and not chosen):
        raise UsageError("cli.bad-backends", f"--backends {cpu_backends!r}: " + (
            f"unknown backend {', '.join(repr(b) for b in unknown)}" if unknown else "names no backend"),
            f"choose among {','.join(known)}, or none for the per-op fit alone")
    result = run_calibrate(target, [spec(m) for m in model], [spec(h) for h in holdout], threads=threads, runs=runs,
                           backends=chosen, cuts=cuts, rounds=rounds, tuning_db=tuning_db,
                           log=(lambda s: None) if as_json else (lambda s: _err(f"    {s}")))
    if output is not None:
        text = yaml.safe_dump(result["fitted_target"], sort_keys=False)
        _write_output(output, lambda f: f.write(text.encode()))
    if as_json:
        print(json.dumps({k: v for k, v in result.items() if k != "fitted_target"}, indent=2, default=float))
        return
    from .report.text import calibrate_summary

    print(calibrate_summary(result, output))


@app.command("run")
def run_bundle(
    ctx: typer.Context,
    bundle: Path = typer.Argument(..., help="A bundle directory or .tar.gz."),
    inputs: List[str] = typer.Option(..., "--input", "-i", help="FILE.npy for a single-input model, or NAME=FILE.npy per input."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write the outputs to this file, exactly: FILE.npz holds every output by name, FILE.npy the one output of a single-output model."),
    allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite", help="Run inputs that hold NaN or inf (refused by default)."),
) -> None:
    """Run a bundle on the given inputs (on this host), once every file matches the manifest. An aarch64
    bundle runs under qemu-user in the arm64 root file system (`make rootfs`), emulated and slowly."""
    import numpy as np

    from .errors import UserError
    from .runtime import InputError, ManifestError
    from .runtime.output_file import refusal
    from .verify import check_bundle, opened_bundle, run_bundle, where_runnable

    if output is not None and (why := refusal(output, (".npz", ".npy"))):
        raise UsageError("run.bad-output", f"--output {output}: {why}", "give a file name ending in .npz (every "
                         "output, by name) or .npy (the one output), in a directory that exists; a file there is "
                         "replaced")
    root = ctx.with_resource(opened_bundle(bundle))  # an unpacked archive is removed when the command ends
    manifest = check_bundle(root, bundle)
    where_runnable(manifest, bundle)
    if output is not None and output.suffix.lower() == ".npy" and len(manifest.outputs) != 1:
        raise UsageError("run.bad-output", f"--output {output}: a .npy file holds one array, and the model has "
                         f"{len(manifest.outputs)} outputs", "give a .npz file name: it holds every output by name")
    feeds = {}
    names = [t.name for t in manifest.inputs]
    for spec in inputs:
        name, sep, file = spec.rpartition("=")
        if not sep:
            if len(names) != 1:
                raise UsageError("run.input-name", f"--input {spec}: the model has {len(names)} inputs",
                                 f"give NAME=FILE.npy for each of: {', '.join(names)}")
            name = names[0]
        if name not in names:
            raise UsageError("run.unknown-input", f"--input {spec}: the model has no input '{name}'",
                             f"its inputs: {', '.join(names)}")
        if not Path(file).is_file():
            raise UsageError("run.bad-input-file", f"--input {spec}: {file} does not exist or is not a file",
                             "give a .npy file written by numpy.save") from None
        try:
            feeds[name] = np.load(file)
        except Exception as e:  # the file is there, its content is at fault
            from .ir.calibration import numpy_load_error

            raise UserError("run.bad-input-file", f"--input {spec}: {file} is not a numpy file ({numpy_load_error(e)})",
                            "give a .npy file written by numpy.save") from None
    try:
        outputs = run_bundle(root, feeds, manifest=manifest, allow_nonfinite=allow_nonfinite, say=_err, shown=bundle)
    except InputError as e:  # the data is at fault (an index outside its table, NaN, a lossy dtype)
        raise UserError("run.input-refused", str(e), e.hint) from None
    except ManifestError as e:  # the manifest does not describe the artifacts it names
        raise UserError("bundle.bad-manifest", f"{bundle}: {e}", "the bundle is damaged or was not written by "
                        "this edgesdk; rebuild it") from None
    except ValueError as e:
        raise UsageError("run.bad-input", str(e), "preprocess inputs to the shapes in `edgesdk inspect`") from None
    if output is None:
        for name, value in outputs.items():
            print(f"{name}: shape {list(value.shape)} {value.dtype}")
            print(np.array2string(value.ravel()[:16], precision=5) + (" ..." if value.size > 16 else ""))
    elif output.suffix.lower() == ".npy":
        _write_output(output, lambda f: np.save(f, next(iter(outputs.values()))))
    else:
        _write_output(output, lambda f: np.savez(f, **outputs))


def _write_output(path: Path, write) -> None:
    """`-o PATH` written whole (runtime/output_file.py); a write the file system refuses (full, over a size
    limit, read-only) is a user error, and leaves nothing."""
    from .runtime.output_file import write_whole

    try:
        write_whole(path, write)
    except OSError as e:
        raise UserError("cli.output-unwritable", f"--output {path}: cannot be written ({e.strerror or e})",
                        "free space where it goes, or write it elsewhere; nothing was written") from None


@app.command()
def verify(
    bundle: Path = typer.Argument(..., help="A bundle directory or .tar.gz."),
    public_key: Optional[Path] = typer.Option(None, "--public-key", help="Check the signature with this ed25519 public key (NAME.pub); the key never comes from the bundle."),
    trust_dir: Optional[Path] = typer.Option(None, "--trust", help="Check the signature with any key in this directory (*.pub): the old and the new key while one is rotated."),
    root: Optional[Path] = typer.Option(None, "--root", help="A device's install root (python -m runtime install): its trust/ keys, and its floor, the newest version it ever installed, below which a bundle is refused."),
    installed_version: Optional[int] = typer.Option(None, "--installed-version", min=0, help="Refuse a bundle whose version is lower (rollback protection)."),
    allow_downgrade: bool = typer.Option(False, "--allow-downgrade", help="Accept a bundle older than the installed one (stated in the report)."),
    no_selftest: bool = typer.Option(False, "--no-selftest", help="Only check the signature, hashes and version."),
    selftest_timeout: float = typer.Option(900.0, "--selftest-timeout", help="Seconds the self-test may take; then it is stopped with every process it started (exit 1)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
) -> None:
    """Check the signature (with a key you give), every file's hash and the version, with edgesdk's own
    code, then run the golden self-test on the bundle's own architecture."""
    from .verify import verify as run_verify

    check_timeout(selftest_timeout, "--selftest-timeout")
    keys = trusted_keys(public_key, trust_dir, root)
    if root is not None and installed_version is None:
        from .runtime.install import InstallError, version_floor

        try:
            installed_version = version_floor(root)  # not the active one's: a rollback does not lower it
        except InstallError as e:
            raise UserError("install.bad-state", str(e), e.hint) from None
    report = run_verify(bundle, run_selftest=not no_selftest, keys=keys, installed_version=installed_version,
                        allow_downgrade=allow_downgrade, selftest_timeout=selftest_timeout)
    if as_json:
        print(json.dumps({"bundle": str(report.bundle), "hashes_ok": report.hashes_ok, "files": report.files,
                          "signature": report.signature, "bundle_version": report.bundle_version,
                          "trust_notes": report.trust_notes,
                          "selftest": report.selftest, "detail": report.detail, "outputs": report.outputs,
                          "segments": report.segments, "stream": report.stream, "notes": report.notes}, indent=2))
    else:
        print(f"signature: {report.signature}")
        for n in report.trust_notes:
            print(f"note: {n}")
        print(f"hashes: ok ({report.files} files match the manifest); bundle version {report.bundle_version}"
              + (f" (installed: {installed_version})" if installed_version is not None else ""))
        for n in report.notes:
            print(f"note: {n}")
        from .runtime.selftest import described

        for seg in report.segments:
            for o in seg["outputs"]:
                print(f"  {'ok' if o['passed'] else 'FAIL'} segment {seg['segment']} ({seg['device']}) {o['output']}: "
                      + described(o))
        for o in report.outputs:
            print(f"  {'ok' if o['passed'] else 'FAIL'} {o['output']}: " + described(o))
        if s := report.stream:
            print(f"  {'ok' if s['passed'] else 'FAIL'} pipelined stream: {s['frames']} frames equal run() frame by "
                  f"frame" + (f" except frames {s['mismatched_frames']}" if s["mismatched_frames"] else "")
                  + f" ({s['stream_seconds']:.3f} s streamed, {s['sequential_seconds']:.3f} s one after another)")
        if report.selftest == "not-run":
            print(f"self-test: {report.detail}")
        else:
            print(f"self-test: {report.selftest} {report.detail}")
    if report.selftest == "failed":
        raise UserError("verify.selftest-failed", f"{bundle}: the self-test failed {report.detail}".rstrip(),
                        "the report above names each output and segment that differs; rebuild the bundle, and "
                        "report it if a fresh build fails too")


@app.command()
def bench(
    bundle: Path = typer.Argument(..., help="A bundle directory or .tar.gz."),
    runs: int = typer.Option(100, "--runs", "-n", min=1, help="Timed run() calls, after the warm-up."),
    warmup: int = typer.Option(10, "--warmup", min=0, help="Untimed calls first."),
    callers: str = typer.Option("1,2,4", "--callers", "-c", help="Concurrent callers to measure, joined by ','."),
    depth: Optional[str] = typer.Option(None, "--depth", "-d", help="Depths of the pipelined stream, joined by ',' \\[default: 1 and the devices + 1]."),
    frames: Optional[int] = typer.Option(None, "--frames", min=1, help="Frames per stream \\[default: from --runs]."),
    timeout: float = typer.Option(3600.0, "--timeout", help="Seconds the bench may take; then it is stopped with every process it started (exit 1)."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON on stdout."),
) -> None:
    """How fast a bundle runs here: load time, latency percentiles, concurrent callers, the pipelined
    stream, each segment against the plan's prediction, peak memory. An aarch64 bundle runs under
    qemu-user, and its figures are marked emulated. On a board: python -B -m runtime bench."""
    from .api import bench as run_bench
    from .runtime.bench import report
    from .verify import check_bundle, opened_bundle

    with opened_bundle(bundle) as root:
        manifest = check_bundle(root, bundle)
        result = run_bench(root, manifest, bundle, runs=runs, warmup=warmup, callers=callers, depth=depth,
                           frames=frames, timeout=timeout)
    failed = result.pop("exit_code", 0)
    print(json.dumps(result, indent=2) if as_json else report(result))
    if failed:
        raise typer.Exit(1)


@app.command()
def inspect(
    ctx: typer.Context,
    bundle: Path = typer.Argument(..., help="A bundle directory or .tar.gz."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
) -> None:
    """What is inside a bundle: segments, devices, predicted latency, accuracy, warnings."""
    from .report.text import inspect_bundle
    from .verify import load_manifest, opened_bundle

    root = ctx.with_resource(opened_bundle(bundle))
    manifest = load_manifest(root, bundle)
    print(manifest.to_json() if as_json else inspect_bundle(manifest, bundle))


@targets_app.command("list")
def targets_list() -> None:
    """The shipped targets."""
    from .config import builtin_targets, load_target

    for name, path in builtin_targets().items():
        t, _ = load_target(path)
        print(f"{name:<10} {t.description}")


@targets_app.command("show")
def targets_show(target: str = typer.Argument(..., help="A target file or a shipped target's name.")) -> None:
    """A target's devices, their physical ids and cost figures with sources."""
    from .config import load_target

    t, path = load_target(target)
    print(f"{t.name}: {t.description}  ({path})")
    for d in t.devices:
        print(f"  {d.kind:<8} {d.name}  logical {', '.join(d.logical_ids())}"
              + (f"  physical {', '.join(d.physical)}" if hasattr(d, "physical") else ""))
        for field_name, value in d:
            figures = value.items() if isinstance(value, dict) else [(field_name, value)]
            for label, fig in figures:
                if hasattr(fig, "source"):
                    label = field_name if label == field_name else f"{field_name}.{label}"
                    print(f"      {label:<26} {fig.value:g} {fig.unit}  [{fig.source}]")
            if hasattr(value, "bandwidth"):
                for part in ("bandwidth", "latency"):
                    fig = getattr(value, part)
                    print(f"      link.{part:<21} {fig.value:g} {fig.unit}  [{fig.source}]")
    print(f"  legalize.max_abs_error {t.legalize.max_abs_error}")


@targets_app.command("validate")
def targets_validate(files: List[Path] = typer.Argument(..., help="Target files to check.")) -> None:
    """Check target files; every problem is reported with its file and line (exit 2)."""
    from .config import load_target

    for f in files:
        t, _ = load_target(f)
        print(f"{f}: ok ({t.name}, {len(t.devices)} device kinds)")


@targets_app.command("schema")
def targets_schema(output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write to a file instead of stdout.")) -> None:
    """The JSON Schema of target files, for editor completion."""
    from .config import target_schema

    text = json.dumps(target_schema(), indent=2) + "\n"
    if output:
        output.write_text(text)
    else:
        print(text, end="")


@functools.cache
def _click_command():
    """The click command typer makes of `app`, made once per process: typer makes it anew on every call of
    `app` (26 ms: each command's parameters read from its signature), which a process that runs many
    commands (the Python API's callers, the test suite) paid on each."""
    return typer.main.get_command(app)


def main(argv: list[str] | None = None) -> int:
    report_native_crashes()
    try:  # typer >= 0.20 carries its own copy of click
        from typer._click import exceptions as click_exc
    except ImportError:
        from click import exceptions as click_exc

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        # Outside standalone mode, click returns the code of a `typer.Exit` instead of raising it, and
        # typer turns Ctrl-C (KeyboardInterrupt) into such an exit with code 130: both are returned here.
        code = _click_command()(args=argv, prog_name="edgesdk", standalone_mode=False)
        code = code if isinstance(code, int) else EXIT_OK
        if code == EXIT_INTERRUPTED:
            _err("error: interrupted")
        return code
    except EdgeSDKError as e:
        if debug:
            import traceback

            traceback.print_exc()
        _err(f"error: {e.message}")
        for note in e.notes:
            _err(f"  {note}")
        if e.hint:
            _err(f"hint: {e.hint}")
        return e.exit_code
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort as e:
        # click raises Abort for an EOFError that escaped a command: a bug, not an interruption
        cause = e.__cause__ or e
        if debug:
            raise cause from None
        _err(f"error: internal error: {type(cause).__name__}: {str(cause)[:500]}")
        _err("hint: this is a bug in edgesdk; run again with --debug and report the traceback")
        return EXIT_INTERNAL
    except click_exc.ClickException as e:
        msg = e.format_message().rstrip(".")
        _err(f"error: {msg[:1].lower() + msg[1:]}")
        ctx = getattr(e, "ctx", None)
        _err(f"hint: see '{ctx.command_path if ctx else 'edgesdk'} --help'")
        return EXIT_USAGE
    except KeyboardInterrupt:
        _err("error: interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:  # a bug in edgesdk: say so, keep the traceback for --debug
        if debug:
            raise
        _err(f"error: internal error: {type(e).__name__}: {str(e)[:500]}")
        _err("hint: this is a bug in edgesdk; run again with --debug and report the traceback")
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
