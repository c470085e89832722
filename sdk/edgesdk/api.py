"""The Python API: what the `edgesdk` commands do, for a CI script or a notebook.

    import edgesdk

    build = edgesdk.build("model.onnx", "arm_2tpu", "out/", calib="calib/")
    with edgesdk.Bundle.open(build.bundle.path) as bundle:
        outputs = bundle.run({"x": image})

The command line is a layer over these functions: the same options (`options.BuildOptions`, as keywords),
the same checks and the same errors (`EdgeSDKError` with its code, message, hint and notes; `UserError`
where the model, bundle or data is at fault, `UsageError` where the call is), and a build from either gives
the same bundle, byte for byte. Nothing is printed: what the command line prints on stderr goes to the
`log` callback where one is given, else to Python's logging (the `edgesdk` logger, INFO).

A model may be a path the command line reads (.onnx, .keras, .h5, .tflite, a SavedModel directory, a
`torch.export` program saved as .pt2) or an object in memory: an `onnx.ModelProto`, a PyTorch `nn.Module`
or `torch.export.ExportedProgram` (with `example_inputs`), a Keras model, or TFLite flatbuffer bytes. An
object is written to OUT/.build/source/ first, as the file the command line would read.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import UsageError, UserError
from .option_values import checked_together
from .options import BuildOptions, flagged

if TYPE_CHECKING:
    import numpy as np

    from .runtime.manifest import Manifest
    from .verify import VerifyReport

__all__ = ["Build", "Bundle", "build", "check", "generate_keys", "sign"]

_logger = logging.getLogger("edgesdk")

# said where a bundle is signed at version 0 (the command line's --bundle-version is `bundle_version` here)
VERSION_0_WARNING = "bundle version 0: devices cannot tell this bundle from an older one; give --bundle-version"


def _say(log: Callable[[str], None] | None) -> Callable[[str], None]:
    """Where a line goes: the caller's `log`, else the `edgesdk` logger (warnings at WARNING)."""
    if log is not None:
        return log

    def to_logging(line: str) -> None:
        line = line.strip()
        if line.startswith("warning: "):
            _logger.warning(line.removeprefix("warning: "))
        else:
            _logger.info(line)

    return to_logging


def options(model: Any, target: str | os.PathLike, out: str | os.PathLike, **given: Any) -> BuildOptions:
    """The `BuildOptions` of a build: `given` are its keywords (the fields of `BuildOptions`), as typed values
    or, for those the command line spells as text, as that text: `input_shapes={"x": (1, 3, 224, 224)}` or
    `input_shapes=["x=1x3x224x224"]`, `time_budget=1200.0` or `"20m"`, `cpu_backends=("tvm", "litert")` or
    `"tvm,litert"`. Checked as the command line checks them, with the same errors (UsageError)."""
    from .option_values import SPELLINGS
    from .options import check_choice, flag_of

    known = set(flagged()) - {"model", "target", "out"}
    unknown = sorted(set(given) - known)
    if unknown:
        import difflib

        close = [m for n in unknown for m in difflib.get_close_matches(n, known, n=1)]
        raise UsageError("api.unknown-option", f"no build option {', '.join(map(repr, unknown))}",
                         (f"did you mean {', '.join(map(repr, close))}? " if close else "")
                         + "the options are the fields of edgesdk.BuildOptions: the command line's flags with '_' "
                         "for '-' (--calib-method: calib_method)")
    fields = {f.name: f for f in dataclasses.fields(BuildOptions)}
    values: dict[str, Any] = {}
    for name in known:
        f = fields[name]
        if name not in given:
            values[name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
            continue
        value = given[name]
        if name in SPELLINGS:
            value = SPELLINGS[name](_as_spelled(name, value, flag_of(name).spelled))
        elif isinstance(value, os.PathLike):
            value = Path(os.fspath(value))
        if flag_of(name).refusal is not None and value is not None:
            check_choice(name, value, shown=name)
        values[name] = value
    values.update(model=Path(os.fspath(model)), target=os.fspath(target), out=Path(os.fspath(out)))
    return BuildOptions(**checked_together(values))


def _as_spelled(name: str, value: Any, spelled: Any) -> Any:
    """A typed value of a field the command line spells as text, in that text, so that one parser checks both."""
    if value is None or isinstance(value, str) and spelled != list[str]:
        return value
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        def text(v: Any) -> str:
            if name == "input_shapes":
                return "x".join(str(int(d)) for d in v)
            return ",".join(str(x) for x in v) if isinstance(v, (list, tuple)) else str(v)
        return [f"{k}={text(v)}" for k, v in value.items()]
    if name == "cpu_backends" and isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    if name == "time_budget" and isinstance(value, (int, float)):
        return f"{value!r}"
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return value


def build(model: Any, target: str | os.PathLike, out: str | os.PathLike, *, example_inputs: Any = None,
          name: str | None = None, sign_key: str | os.PathLike | None = None, bundle_version: int | None = None,
          check_reproducible: bool = False, log: Callable[[str], None] | None = None,
          on_stage: Callable[[str, str, float], None] | None = None,
          progress: Callable[[str | None], None] | None = None, **options_: Any) -> Build:
    """Build `model` for `target` (a target file or a shipped target's name) into `out`: OUT/bundle and
    OUT/bundle.tar.gz, OUT/.build the stages' cache; what `edgesdk build` does.

    `options_`: the build's options, the fields of `BuildOptions` (`edgesdk build --help` lists them as
    flags: `--calib-method` is `calib_method`). `example_inputs`: a tuple of tensors for a PyTorch model
    (their shapes are the bundle's); `name`: the model's name in the bundle for an object in memory
    (default: its class). `sign_key`, `bundle_version`: sign and version the bundle as it is published.
    `check_reproducible`: build again in a fresh directory and compare (UserError `build.not-reproducible`
    where they differ). `log` gets each line the command line prints on stderr; `on_stage(name, state,
    seconds)` each stage's start and end; `progress` the tuning's progress line (None: it ended).

    Raises `UserError` (the model or data is at fault) or `UsageError` (the call or the target is)."""
    say = _say(log)
    t0 = time.perf_counter()
    if check_reproducible and options_.get("until") is not None:
        raise UsageError("cli.reproducible-until", "check_reproducible compares whole bundles: until does not go "
                         "with it", "drop until")
    from .frontends.objects import kind, model_file

    # every option, the key and the version checked before anything is written (an object's file included)
    opts = options(model if kind(model) == "path" else "<in memory>", target, out, **options_)
    stamp = stamper(sign_key, bundle_version, warn=lambda s: say(f"warning: {s}"))
    path = model_file(model, opts.out, example_inputs=example_inputs, name=name, log=say)
    opts = dataclasses.replace(opts, model=path)
    from .pipeline import build as run_build

    result = run_build(opts, log=say, on_stage=on_stage or _stage_logger(say), progress=progress, stamp=stamp)
    summary = result.summary()
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    signed_by = None
    if result.bundle is not None:
        from .runtime.manifest import Manifest

        signed_by = Manifest.load(result.bundle).signing.get("key_id")
        summary["signed_by"] = signed_by
    if check_reproducible:
        summary["reproducible"] = reproducible(opts, result, stamp, say=say, log=say,
                                               on_stage=on_stage or _stage_logger(say))
    return Build(out=opts.out, options=result.options or opts, result=result, summary=summary)


def _stage_logger(say: Callable[[str], None]) -> Callable[[str, str, float], None]:
    def on_stage(name: str, state: str, secs: float) -> None:
        if state == "done":
            say(f"{name} done in {secs:.2f} s")
        elif state in ("cached", "replayed"):
            say(f"{name} {state}")

    return on_stage


def stamper(sign_key: str | os.PathLike | None, version: int | None, *, warn: Callable[[str], None]):
    """The bundle's version and signature, applied as the build publishes it; the key is read and the version
    checked now, so that a wrong one fails before the build and not after it."""
    check_bundle_version(version)
    if sign_key is None and version is None:
        return None
    from .bundling import signing

    key = signing.load_private_key(Path(os.fspath(sign_key)), warn=warn) if sign_key else None
    return lambda bundle, tarball: signing.stamp(bundle, version=version, key=key, tarball=tarball)


def check_bundle_version(version: int | None, flag: str = "--bundle-version") -> None:
    """A version the manifest's schema accepts, refused before anything is built or written."""
    from .runtime.manifest import MAX_BUNDLE_VERSION

    if version is not None and not 0 <= version <= MAX_BUNDLE_VERSION:
        raise UsageError("cli.bad-bundle-version", f"{flag} {version}: outside the versions a manifest holds, 0 to "
                         f"{MAX_BUNDLE_VERSION} (2^63 - 1, manifest.bundle_version)",
                         "give a version in that range, e.g. the release's commit time in seconds")


def reproducible(opts: BuildOptions, result: Any, stamp: Any, *, say: Callable[[str], None],
                 log: Callable[[str], None], on_stage: Callable[[str, str, float], None]) -> dict:
    """Build again in a fresh directory (tune's measurements replayed) and compare: the report, or UserError
    `build.not-reproducible` naming what differs. `say` gets the verdict's lines, `log` the rebuild's."""
    from .pipeline import check_reproducible

    say("reproducibility: building again in a fresh directory (the tune stage's measurements replayed)")
    report = check_reproducible(opts, result, log=log, on_stage=on_stage, stamp=stamp)
    if not report["identical"]:
        where = (f"; the first stage whose output differs: {report['stages_differing'][0]}"
                 if report["stages_differing"] else "")
        raise UserError("build.not-reproducible",
                        f"the rebuild in a fresh directory differs from {result.bundle}: "
                        f"{len(report['differences'])} file(s)"
                        + ("" if report["tarball_identical"] else " and bundle.tar.gz") + where,
                        "an input the build reads changed between the builds (a tuning database being written, "
                        "the SDK's code), or a stage is not deterministic: report it with the differences",
                        notes=report["differences"][:20])
    say(f"reproducible: the rebuild is byte-identical ({report['files']} files and bundle.tar.gz; stages "
        f"rebuilt: {', '.join(report['stages_rebuilt'])})")
    return report


@dataclasses.dataclass(frozen=True)
class Build:
    """What `build` did: the bundle (None where `until` stopped the build before package), each stage's
    record, and `summary`, what `edgesdk build --json` prints."""

    out: Path
    options: BuildOptions
    result: Any  # pipeline.BuildResult
    summary: dict

    @property
    def bundle(self) -> Bundle | None:
        return Bundle(self.result.bundle) if self.result.bundle is not None else None

    @property
    def tarball(self) -> Path | None:
        return self.out / "bundle.tar.gz" if self.result.bundle is not None else None

    @property
    def stages(self) -> dict[str, dict]:
        """Each stage's record by name (the stage's JSON in OUT/.build)."""
        return {s.name: s.record for s in self.result.stages}

    @property
    def warnings(self) -> list[str]:
        return [w for s in self.result.stages for w in s.record.get("warnings", [])]

    @property
    def accuracy(self) -> dict:
        """The bundle against the fp32 model, output by output, and the task's own measure with `eval_data`."""
        return self.stages.get("package", {}).get("accuracy") or {}


def check(model: Any, target: str | os.PathLike, *, example_inputs: Any = None, name: str | None = None,
          log: Callable[[str], None] | None = None, **options_: Any) -> dict:
    """What `edgesdk check --json` prints: which devices can run each op and why not, accelerator coverage,
    transitions, what legalize would rewrite; nothing is built and nothing written (an object in memory
    goes to a temporary directory)."""
    import tempfile

    from .frontends.objects import kind, model_file
    from .pipeline import check as run_check

    say = _say(log)
    opts = options(model if kind(model) == "path" else "<in memory>", target, Path("."), **options_)
    with tempfile.TemporaryDirectory(prefix="edgesdk-check-") as tmp:
        path = model_file(model, Path(tmp), example_inputs=example_inputs, name=name, log=say)
        report = run_check(dataclasses.replace(opts, model=path), log=say)
    if kind(model) != "path":  # the temporary file is gone: the object's name, as a build would write it
        report["model"] = f"{path.name} (in memory)"
    return report


class Bundle:
    """A bundle directory or .tar.gz, its files checked against its manifest as it is opened (an archive is
    unpacked safely into a temporary directory, removed by `close`). Use it in a `with` block."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(os.fspath(path))
        self._opened: Any = None
        self._root: Path | None = None
        self._model: Any = None
        self._manifest: Manifest | None = None

    @classmethod
    def open(cls, path: str | os.PathLike) -> Bundle:
        """The bundle at `path`, checked: every file's hash against the manifest (UserError where one differs)."""
        bundle = cls(path)
        bundle._check()
        return bundle

    def _check(self) -> Path:
        if self._root is None:
            from .verify import check_bundle, opened_bundle

            self._opened = opened_bundle(self.path)
            self._root = self._opened.__enter__()
            try:
                self._manifest = check_bundle(self._root, self.path)
            except BaseException:
                self.close()
                raise
        return self._root

    @property
    def manifest(self) -> Manifest:
        self._check()
        return self._manifest

    @property
    def inputs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Each input's shape and dtype, by name."""
        return {t.name: (tuple(t.shape), t.dtype) for t in self.manifest.inputs}

    @property
    def outputs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {t.name: (tuple(t.shape), t.dtype) for t in self.manifest.outputs}

    def inspect(self) -> dict:
        """The manifest, as `edgesdk inspect --json` prints it."""
        return json.loads(self.manifest.to_json())

    def _feeds(self, inputs: Any) -> dict:
        import numpy as np

        if isinstance(inputs, Mapping):
            return dict(inputs)
        names = [t.name for t in self.manifest.inputs]
        if len(names) != 1:
            raise UsageError("run.input-name", f"{self.path}: the model has {len(names)} inputs",
                             f"give a dict by input name: {', '.join(names)}")
        return {names[0]: np.asarray(inputs)}

    def run(self, inputs: Mapping[str, np.ndarray] | np.ndarray, *, allow_nonfinite: bool = False,
            log: Callable[[str], None] | None = None) -> dict[str, np.ndarray]:
        """The outputs by name for `inputs` (a dict by input name; an array for a single-input model), on this
        host: natively where it runs the bundle's code, an aarch64 bundle under qemu-user (emulated, slowly:
        `log` is told). Inputs are checked against the manifest first (UserError `run.input-refused`)."""
        from .runtime import InputError

        root = self._check()
        feeds = self._feeds(inputs)
        try:
            if self._native():
                return self._loaded(log).run(feeds, allow_nonfinite=allow_nonfinite)
            from .verify import run_bundle

            return run_bundle(root, feeds, manifest=self._manifest, allow_nonfinite=allow_nonfinite,
                              say=_say(log), shown=self.path)
        except InputError as e:  # the data is at fault (NaN, an index outside its table, a lossy dtype)
            raise UserError("run.input-refused", str(e), e.hint) from None
        except ValueError as e:  # the call is: names or shapes the model does not take
            raise UsageError("run.bad-input", str(e), "give the inputs Bundle.inputs names, in their shapes") from None

    def stream(self, frames: Iterable[Mapping[str, np.ndarray] | np.ndarray], *, depth: int | None = None,
               allow_nonfinite: bool = False) -> Iterator[dict[str, np.ndarray]]:
        """Outputs of each frame in input order, pipelined over the bundle's devices (at most `depth` frames
        in flight); natively only (a bundle of another architecture: UsageError `run.foreign-arch`)."""
        if not self._native():
            from .verify import where_runnable

            where_runnable(self.manifest, self.path)  # says how it would run
            raise UsageError("run.foreign-arch", f"{self.path} is built for {self.manifest.arch}: a stream runs "
                             "natively only", "run() runs it frame by frame under qemu-user; stream it on the device")
        return self._loaded(None).stream((self._feeds(f) for f in frames), depth=depth,
                                         allow_nonfinite=allow_nonfinite)

    def verify(self, *, public_key: str | os.PathLike | None = None, trust_dir: str | os.PathLike | None = None,
               root: str | os.PathLike | None = None, installed_version: int | None = None,
               allow_downgrade: bool = False, selftest: bool = True, selftest_timeout: float = 900.0) -> VerifyReport:
        """What `edgesdk verify` checks: the signature (with the key given; never one from the bundle), every
        file's hash, the version against `installed_version` (or `root`'s floor), then the golden self-test
        on the bundle's own architecture. A failed self-test is UserError `verify.selftest-failed`."""
        from .verify import verify as run_verify

        check_timeout(selftest_timeout, "--selftest-timeout")
        keys = trusted_keys(_path(public_key), _path(trust_dir), _path(root))
        if root is not None and installed_version is None:
            from .runtime.install import InstallError, version_floor

            try:
                installed_version = version_floor(Path(os.fspath(root)))
            except InstallError as e:
                raise UserError("install.bad-state", str(e), e.hint) from None
        report = run_verify(self.path, run_selftest=selftest, keys=keys, installed_version=installed_version,
                            allow_downgrade=allow_downgrade, selftest_timeout=selftest_timeout)
        if report.selftest == "failed":
            raise UserError("verify.selftest-failed", f"{self.path}: the self-test failed {report.detail}".rstrip(),
                            "each output and segment that differs is in the report (edgesdk verify shows it); "
                            "rebuild the bundle, and report it if a fresh build fails too")
        return report

    def bench(self, *, runs: int = 100, warmup: int = 10, callers: Iterable[int] = (1, 2, 4),
              depth: Iterable[int] | None = None, frames: int | None = None, timeout: float = 3600.0) -> dict:
        """What `edgesdk bench --json` prints: load time, latency percentiles, concurrent callers, the pipelined
        stream, each segment against the plan's prediction, peak memory; in the bundle's own runtime in a
        fresh process (an aarch64 bundle under qemu-user, its figures marked emulated)."""
        return bench(self._check(), self.manifest, self.path, runs=runs, warmup=warmup,
                     callers=",".join(str(int(c)) for c in callers),
                     depth=None if depth is None else ",".join(str(int(d)) for d in depth), frames=frames,
                     timeout=timeout)

    def _native(self) -> bool:
        import platform

        return self.manifest.arch == platform.machine()

    def _loaded(self, log: Callable[[str], None] | None) -> Any:
        if self._model is None:
            from .runtime import BundleModel

            self._model = BundleModel(self._check(), log=_say(log))
        return self._model

    def close(self) -> None:
        if self._model is not None:
            self._model.release()
            self._model = None
        if self._opened is not None:
            self._opened.__exit__(None, None, None)
            self._opened, self._root = None, None

    def __enter__(self) -> Bundle:
        self._check()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Bundle({str(self.path)!r})"


def _path(value: str | os.PathLike | None) -> Path | None:
    return None if value is None else Path(os.fspath(value))


def check_timeout(seconds: float, flag: str) -> None:
    from .runtime.process import MAX_TIMEOUT_S

    if not 0 < seconds <= MAX_TIMEOUT_S:  # NaN fails too
        raise UsageError("cli.bad-timeout", f"{flag} {seconds:g}: not a number of seconds above 0 and at most "
                         f"{MAX_TIMEOUT_S:g} (a week)", f"e.g. {flag} 1800")


def trusted_keys(public_key: Path | None, trust_dir: Path | None, root: Path | None, *, required: bool = False):
    """The keys given (a public key file, a trust directory or ROOT/trust), or None when none is given."""
    from .runtime import trust

    given = [x for x in (public_key, trust_dir) if x is not None]
    if len(given) > 1:
        raise UsageError("verify.keys", "--public-key and --trust do not go together",
                         "a trust directory holds every key a device accepts: put the key there")
    source = given[0] if given else (root / "trust" if root is not None else None)
    if source is None:
        if required:
            raise UsageError("verify.no-key", "no key to check with", "give --public-key PUB or --trust DIR")
        return None
    try:
        return trust.load_trust(source)
    except trust.KeyFileError as e:
        raise UsageError("verify.bad-key", str(e), "give the NAME.pub that `edgesdk keys generate` wrote, or a "
                         "directory of them") from None


def bench(root: Path, manifest: Manifest, shown: Path, *, runs: int, warmup: int, callers: str, depth: str | None,
          frames: int | None, timeout: float, stdout_lines: bool = False) -> dict:
    """The bundle unpacked at `root` benched by its own runtime in a fresh process: its figures (`runtime.bench`),
    with "exit_code" where the runtime's bench failed a check (the command line exits 1 then)."""
    import subprocess

    from .verify import runtime_process, where_it_runs

    check_timeout(timeout, "--timeout")
    for flag, value in (("--callers", callers), ("--depth", depth)):
        if value is not None and not all(x.strip().isdigit() and int(x) > 0 for x in value.split(",")):
            raise UsageError("bench.bad-counts", f"{flag} {value}: expected positive integers joined by ','",
                             "e.g. --callers 1,2,4,8 --depth 1,3")
    how, why_not = where_it_runs(manifest)
    if how is None:
        raise UserError("bench.cannot-run", f"{shown} cannot run on this host: {why_not}",
                        "run `python -B -m runtime bench` on the device the bundle was built for")
    args = ["bench", str(root.resolve()), "--json", "--runs", str(runs), "--warmup", str(warmup),
            "--callers", callers, *(["--depth", depth] if depth else []), *(["--frames", str(frames)] if frames else [])]
    # the runtime's progress goes straight to this process's stderr; its result comes back on stdout
    try:
        proc = runtime_process(root, manifest, args, timeout=timeout, stdout=subprocess.PIPE, text=True,
                               errors="replace")
    except subprocess.TimeoutExpired:
        raise UserError("bench.timeout", f"{shown}: the bench ({how}) did not finish in {timeout:g} s; it was "
                        "stopped with every process it started",
                        "give it longer with --timeout SECONDS, or fewer --runs; if it never finishes, run "
                        "`edgesdk verify` on the bundle: its self-test shows whether it hangs") from None
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        if proc.returncode == 2:  # the bundle's own runtime refused the invocation
            raise UserError("bench.old-runtime", f"{shown}: its runtime ({manifest.min_runtime_version}) has no bench "
                            "command", "rebuild the bundle with this edgesdk") from None
        raise UserError("bench.failed", f"the runtime's bench of {shown} ended with exit code {proc.returncode} and "
                        "no result", "run `edgesdk verify` on the bundle: its self-test shows what fails") from None
    if proc.returncode != 0:
        result["exit_code"] = proc.returncode
    return result


def sign(bundle: str | os.PathLike, key: str | os.PathLike, *, bundle_version: int | None = None,
         log: Callable[[str], None] | None = None) -> tuple[list[Path], Any]:
    """Sign a bundle built earlier (a directory, signed in place, its DIR/bundle.tar.gz beside it written again;
    or a .tar.gz, replaced whole): manifest.sig over manifest.json. The files written and the manifest."""
    import tempfile

    from .bundling import signing
    from .verify import opened_bundle

    say = _say(log)
    bundle = Path(os.fspath(bundle))
    check_bundle_version(bundle_version)
    signer = signing.load_private_key(Path(os.fspath(key)), warn=lambda s: say(f"warning: {s}"))
    if bundle.is_dir():
        tarball = bundle.parent / "bundle.tar.gz" if bundle.name == "bundle" else None
        tarball = tarball if tarball is not None and tarball.exists() else None
        with opened_bundle(bundle) as root:
            manifest = signing.stamp(root, version=bundle_version, key=signer, tarball=tarball)
        written = [bundle] + ([tarball] if tarball else [])
    else:  # unpacked safely, signed, packed again beside the archive, then renamed over it
        with opened_bundle(bundle) as root, tempfile.TemporaryDirectory(dir=bundle.parent, prefix=".sign-") as tmp:
            staged = Path(tmp) / bundle.name
            manifest = signing.stamp(root, version=bundle_version, key=signer, tarball=staged)
            staged.replace(bundle)
        written = [bundle]
    if manifest.bundle_version == 0:
        say(f"warning: {VERSION_0_WARNING}")
    return written, manifest


def generate_keys(out_dir: str | os.PathLike, name: str = "edgesdk") -> tuple[Path, Path, str]:
    """A new ed25519 key pair in `out_dir`: NAME.key (private, mode 0600; encrypted where
    EDGESDK_SIGN_KEY_PASSPHRASE is set) and NAME.pub; returns both paths and the key id."""
    from .bundling import signing

    return signing.generate_keys(Path(os.fspath(out_dir)), name)
