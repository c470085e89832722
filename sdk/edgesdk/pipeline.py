"""The build pipeline: the six stages in order, a content-addressed stage cache, --from/--until.

Each stage is a module under `edgesdk.stages` with

    OPTIONS: tuple[str, ...]          # the BuildOptions fields its result depends on
    READS: tuple[str, ...]            # the earlier stages whose outputs it reads (import: none, the model)
    READS_FILES: dict[str, tuple]     # optional: single files of other earlier stages it reads, by stage
    def cache_inputs(options, target) -> dict   # optional: outside state it reads (a database)
    def run(artifact: Path, ctx: StageContext) -> dict   # writes into ctx.out, returns its record

`artifact` is the output of the last stage in READS (for import, the model file); `ctx.artifact(name)`
gives any other stage in READS and refuses one that is not; `ctx.file(stage, name)` gives a file named
in READS_FILES (compress reads the tune stage's pruning plan, not the rest of its output). A stage writes its own directory,
`stage_dir(DIR, stage)` = `DIR/.build/<n>-<stage>/`, immutable once written: the stage writes into
a temporary directory that is renamed into place when it succeeds.

Cache key of a stage = sha256(the digests of the outputs it READS (import: of the model file) and of
the files it READS_FILES (None where absent), the target (unless USES_TARGET is False), the values of the options it names, its outside state, the
sdk's code). So a stage re-runs when what it reads changes, and only then: a new tuning database
re-runs tune and package, not compress's int8 conversion, which never reads it. A stage whose key
matches the one stored beside its output is a cache hit and does not run. `--from S` forces S and
everything after it to run; `--until S` stops after S.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import importlib
import json
import os
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import __version__
from .config import HOST, Target, load_target
from .errors import UsageError, UserError
from .ir import model as irm
from .ir.calibration import check_input_ranges, check_output_activations
from .ir.digest import file_sha256, tree_sha256, value_sha256
from .ir.memory import give_back, resident_bytes, shown
from .options import BuildOptions, check_choice
from .scheduling.plan import Plan
from .stages import memory as build_memory


@dataclass(frozen=True)
class Phase:
    name: str
    module: str
    summary: str


# The one place the order of the pipeline lives.
PHASES: tuple[Phase, ...] = (
    Phase("import", "edgesdk.stages.import_", "read the model into canonical ONNX: static shapes, batch fixed"),
    Phase("legalize", "edgesdk.stages.legalize", "check every node against the target's devices"),
    Phase("schedule", "edgesdk.stages.schedule", "place nodes on devices and cut the graph into segments"),
    Phase("tune", "edgesdk.stages.tune", "search tensor programs for CPU/GPU segments (MetaSchedule)"),
    Phase("compress", "edgesdk.stages.compress", "quantize Edge TPU segments to full int8 TFLite"),
    Phase("package", "edgesdk.stages.package", "compile every segment and write the verified bundle"),
)
PHASE_NAMES = tuple(p.name for p in PHASES)
# Test hook: EDGESDK_BUILD_CRASH_AFTER=<stage> SIGKILLs the build once that stage's output is in place,
# so the tests can stop a build at every stage boundary and check what the next build reuses.
CRASH_ENV = "EDGESDK_BUILD_CRASH_AFTER"


def stage_dir(out: Path, stage: str) -> Path:
    """Where `stage` of a build into `out` keeps its output: DIR/.build/<n>-<stage>."""
    return Path(out) / ".build" / f"{PHASE_NAMES.index(stage) + 1}-{stage}"


def stage_reads(module: Any, stage: str) -> tuple[str, ...]:
    """The earlier stages a stage module reads (READS; by default the one before it)."""
    i = PHASE_NAMES.index(stage)
    reads = tuple(getattr(module, "READS", PHASE_NAMES[i - 1:i]))
    if any(r not in PHASE_NAMES[:i] for r in reads):
        raise ValueError(f"stage {stage} READS {reads}: only earlier stages ({', '.join(PHASE_NAMES[:i])})")
    return reads


def stage_read_files(module: Any, stage: str) -> dict[str, tuple[str, ...]]:
    """The single files of earlier stages a stage module reads (READS_FILES), by stage."""
    i = PHASE_NAMES.index(stage)
    files = {k: tuple(v) for k, v in getattr(module, "READS_FILES", {}).items()}
    if any(r not in PHASE_NAMES[:i] for r in files):
        raise ValueError(f"stage {stage} READS_FILES {sorted(files)}: only earlier stages "
                         f"({', '.join(PHASE_NAMES[:i])})")
    return files


@dataclass
class StageContext:
    target: Target
    target_path: Path
    options: BuildOptions
    build_dir: Path
    out: Path  # where this stage writes (a temporary directory, renamed on success)
    log: Callable[[str], None]
    warnings: list[str] = field(default_factory=list)
    # a progress line redrawn in place on a terminal (None ends it); None: progress goes to `log`
    progress: Callable[[str | None], None] | None = None
    # the stages this one declared in READS (its cache key covers exactly those); None: not checked
    reads: tuple[str, ...] | None = None
    # the single files of other stages it declared in READS_FILES; None: not checked
    read_files: dict[str, tuple[str, ...]] | None = None
    sdk: str = ""  # the SDK's code digest (the stage cache's keys cover it; so must any a stage keeps itself)

    def file(self, stage: str, name: str) -> Path:
        """A file of an earlier stage's output that this stage names in READS_FILES (it may not exist)."""
        if self.read_files is not None and name not in self.read_files.get(stage, ()):
            raise RuntimeError(f"a stage read {stage}/{name} without naming it in READS_FILES, so its cache key "
                               f"does not cover it")
        return stage_dir(self.build_dir.parent, stage) / name

    def artifact(self, stage: str) -> Path:
        """The output directory of an earlier stage, one this stage READS."""
        if self.reads is not None and stage not in self.reads:
            raise RuntimeError(f"a stage read the output of {stage} without naming it in READS, so its cache "
                               f"key does not cover it")
        return stage_dir(self.build_dir.parent, stage)

    def warn(self, message: str) -> None:
        self.warnings.append(message)
        self.log(f"warning: {message}")


@dataclass
class StageResult:
    name: str
    cached: bool
    seconds: float
    record: dict[str, Any]


@dataclass
class BuildResult:
    out: Path
    stages: list[StageResult]
    bundle: Path | None
    # the options the result was built with: the accuracy remedy's (`build`) where it planned again
    options: BuildOptions | None = None

    def summary(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "bundle": str(self.bundle) if self.bundle else None,
            "stages": [asdict(s) for s in self.stages],
        }


REMEDY_ROUNDS = 3  # the accuracy remedy's rounds at most: each plans again with more culprits on the CPU
# a round moves the culprits on an accelerator that lose at least this share of what the worst of them loses
# itself (`added_error`): the rest are mostly that loss passed on, and each node moved can cost a round trip
# over the accelerator's link; a culprit that still matters is named again by the next round's search
REMEDY_SHARE = 0.1


def build(options: BuildOptions, *, log: Callable[[str], None] = lambda s: None,
          on_stage: Callable[[str, str, float], None] = lambda name, state, secs: None,
          progress: Callable[[str | None], None] | None = None,
          stamp: Callable[[Path, Path], None] | None = None, replay: dict[str, Path] | None = None) -> BuildResult:
    """Run the pipeline for `options`; returns what each stage did (cached or not) and its record.

    `stamp(bundle_dir, tarball)` finishes the published bundle before it is renamed into place: its
    version and signature (`bundling.signing.stamp`), which are no stage's output, so that neither a
    key nor a version enters the stage cache. `replay` maps a stage to an output of it from another
    build, used as it is instead of running the stage (`check_reproducible` replays tune's measurements).

    The accuracy remedy: where the package stage finds the bundle below the target's accuracy gate
    (`accuracy.gate`) and the user neither accepts the loss nor turned the remedy off, the culprit layers
    that run on an accelerator are kept in float on the CPU (`keep_on_cpu`) and the build plans again from
    the schedule stage (import and legalize stay cached), at most `REMEDY_ROUNDS` times, each adding the
    new culprits; where the gate still fails, or no culprit is left on an accelerator, the build fails
    with what was tried in the error's notes. `options.remedy` carries each round's figures before it
    into the schedule stage, which records them in plan.json (docs/accuracy.md)."""
    from .bundling.gate import GateFailure

    said: set[str] = set()

    def once(line: str) -> None:  # a warning is said once, though stages and the remedy's rounds repeat it
        if line.startswith("warning: "):
            if line in said:
                return
            said.add(line)
        log(line)

    while True:
        try:
            result = _build(options, log=once, on_stage=on_stage, progress=progress, stamp=stamp, replay=replay)
            if options.remedy and result.bundle is not None:
                _warn_all_on_cpu(result.bundle, len(options.remedy), once)
            return dataclasses.replace(result, options=options)
        except GateFailure as e:
            remedied = _remedy(options, e, once)
            if remedied is None:
                raise
            options = remedied


def _warn_all_on_cpu(bundle: Path, rounds: int, log: Callable[[str], None]) -> None:
    """A bundle the accuracy remedy left with no node on an accelerator is said to be one, loudly: it passes
    the gate only as the CPU's float model (a random-weight MobileNetV3-large lost so much in int8 anywhere
    that three rounds moved all 219 nodes)."""
    plan = json.loads((bundle / "plan.json").read_text())
    if all(seg["device"] == "cpu" for seg in plan["segments"]):
        log(f"warning: the accuracy remedy kept every node in float on the CPU ({rounds} round(s)): no accelerator "
            "runs any of this model, the bundle is the CPU's alone; int8 missed the accuracy gate wherever it ran: "
            "calibrate on more inputs like the deployed ones (--calib), or publish the int8 plan with "
            "--accept-accuracy-loss (--no-accuracy-remedy keeps the first plan)")


def _remedy(options: BuildOptions, failure, log: Callable[[str], None]) -> BuildOptions | None:
    """The options of the accuracy remedy's next round after `failure` (the gate's verdict on the plan in
    the tune stage's output), or None where none is to be tried, `failure`'s notes then saying what was."""
    from .bundling.gate import culprit_nodes

    tried = list(options.remedy)
    if not options.accuracy_remedy or options.accept_accuracy_loss or not (stage_dir(options.out, "tune")
                                                                            / "plan.json").is_file():
        return None
    plan = Plan.load(stage_dir(options.out, "tune"))
    on_accelerator = {s.id: s.device for s in plan.segments if s.device != "cpu"}
    culprits = [c for c in failure.accuracy.get("culprits") or () if c["segment"] in on_accelerator]
    worst = max((c["added_error"] for c in culprits), default=0.0)
    moved = [{"node": n, "segment": c["segment"], "device": on_accelerator[c["segment"]], "op": c["op"],
              "cause": c["cause"], "added_error": c["added_error"], "error": c["error"],
              "added_snr_db": c["added_snr_db"], "why": c["why"]}
             for c in culprits if c["added_error"] >= REMEDY_SHARE * worst
             for n in culprit_nodes(c["node"]) if n not in options.keep_on_cpu]
    # the culprits first (a few nodes, a small price in latency); where their round was not enough, the set of
    # segments whose float version the probe measured to help the most, end to end
    probed, probe_said = _probed(failure.accuracy.get("probe"), plan, options.keep_on_cpu) if tried else ([], None)
    moved = list({m["node"]: m for m in probed or moved}.values())
    if not moved or len(tried) >= REMEDY_ROUNDS:
        if tried:
            failure.notes += [f"accuracy remedy: round {r['round']} kept {', '.join(m['node'] for m in r['moved'])} "
                              f"on the cpu in float ({r['latency_ms']:.3f} ms predicted before it)" for r in tried]
            failure.notes.append("accuracy remedy: " + (f"stopped after {len(tried)} round(s), still below the gate"
                                                         if moved else "no culprit is left on an accelerator"))
        return None
    step = {"round": len(tried) + 1, "moved": moved, "latency_ms": plan.predicted["latency_ms"],
            "parts": failure.accuracy["parts"], "failures": failure.accuracy.get("failures") or [],
            **({"probe": probe_said} if probed else {})}
    if probed:
        said = (f"{len(moved)} node(s) ({', '.join(m['node'] for m in moved[:4])}{', ...' if len(moved) > 4 else ''}): "
                f"{probe_said}")
    else:
        said = ", ".join(m["node"] + " (" + m["cause"] + ")" for m in moved)
    log(f"accuracy remedy: round {step['round']}: the bundle misses the accuracy gate; keeping {said} in float on "
        "the cpu and planning again from the schedule stage")
    return dataclasses.replace(options, keep_on_cpu=(*options.keep_on_cpu, *(m["node"] for m in moved)),
                               remedy=(*tried, step), start=None)


def _probed(probe: dict | None, plan: Plan, kept: tuple[str, ...]) -> tuple[list[dict], str | None]:
    """The nodes of the int8 segments whose float version helped the failing measure the most in the package
    stage's probe (bundling/probe.py), as the remedy moves them, and the probe's sentence (said once per round:
    a set can be most of a model); none where no set in float did better than all int8."""
    if not probe or not probe.get("float"):
        return [], None
    best, base = probe["float"][0], probe["int8"]
    where = {n: s for s in plan.segments if s.device != "cpu" for n in s.nodes}
    if not (best["met"] and not base["met"] or best["shortfall"] < base["shortfall"]):
        return [], None  # no better than all int8 on the probe's samples: they cannot tell which segment matters
    segments = ", ".join(best["segments"])
    said = (f"with {segments} ({len(best['nodes'])} nodes) in float and every other segment int8, "
            f"{probe['measure']}: {best['said']} (all int8: {base['said']})")
    moved = [{"node": n, "segment": where[n].id, "device": where[n].device, "op": "", "cause": "end-to-end",
              "added_error": round(base["shortfall"] - best["shortfall"], 6), "error": 0.0, "added_snr_db": 0.0,
              "why": f"in float with {segments}: the round's probe"} for n in best["nodes"] if n in where and n not in kept]
    return moved, said if moved else None


def _build(options: BuildOptions, *, log: Callable[[str], None], on_stage: Callable[[str, str, float], None],
           progress: Callable[[str | None], None] | None, stamp: Callable[[Path, Path], None] | None,
           replay: dict[str, Path] | None) -> BuildResult:
    check_choice("until", options.until)
    check_choice("start", options.start)
    target, target_path = load_target(options.target)
    model = Path(options.model)
    if not model.exists():
        raise UsageError("build.model-not-found", f"model {model} does not exist",
                         "give an .onnx, .keras, .h5 or .tflite file, or a SavedModel directory")

    out = Path(options.out)
    build_dir = out / ".build"
    created_out = not out.exists()
    stop = PHASE_NAMES.index(options.until) if options.until else len(PHASES) - 1
    force_from = PHASE_NAMES.index(options.start) if options.start else len(PHASES)

    # a SavedModel is a directory: its digest covers every file in it
    sdk = _sdk_digest()
    model_digest = _model_digest(model)
    digests: dict[str, str] = {}  # each stage's output digest, as the stages after it read them
    results: list[StageResult] = []
    weight_bytes = None  # the model's, once import has run (the memory checks)
    try:
        for i, phase in enumerate(PHASES[: stop + 1]):
            stage = importlib.import_module(phase.module)
            reads = stage_reads(stage, phase.name)
            read_files = stage_read_files(stage, phase.name)
            opts = {name: options.value(name) for name in getattr(stage, "OPTIONS", ())}
            if hasattr(stage, "cache_inputs"):  # state outside the build dir the stage reads
                opts["external"] = stage.cache_inputs(options, target)
            # a stage that never reads the target (import) keeps its cache when only the target changes
            uses_target = getattr(stage, "USES_TARGET", True)
            files = {f"{r}/{n}": _file_digest(stage_dir(out, r) / n) for r, names in read_files.items() for n in names}
            key = value_sha256({"stage": phase.name, "reads": {r: digests[r] for r in reads},
                                **({"files": files} if files else {}),
                                "model": None if reads else model_digest,
                                "target": target.digest() if uses_target else None, "options": opts, "sdk": sdk})
            dest = stage_dir(out, phase.name)
            artifact = stage_dir(out, reads[-1]) if reads else model
            if replay and phase.name in replay:
                shutil.rmtree(dest, ignore_errors=True)
                shutil.copytree(replay[phase.name], dest)
                record = json.loads((dest / "record.json").read_text())
                results.append(StageResult(phase.name, True, 0.0, record))
                on_stage(phase.name, "replayed", 0.0)
            elif i < force_from and _cache_hit(dest, key, phase.name, log):
                record = json.loads((dest / "record.json").read_text())
                results.append(StageResult(phase.name, True, 0.0, record))
                on_stage(phase.name, "cached", 0.0)
            else:
                on_stage(phase.name, "start", 0.0)
                t0 = time.perf_counter()
                record = _run_stage(stage, phase, artifact, dest, key, target, target_path, options, build_dir, log,
                                    progress, reads, read_files, sdk)
                secs = time.perf_counter() - t0
                results.append(StageResult(phase.name, False, secs, record))
                _say_size(phase.name, dest, log)
                on_stage(phase.name, "done", secs)
            # the keys of the stages that read this one cover its output, whatever produced it
            digests[phase.name] = (dest / "digest").read_text()
            if phase.name == "import" and i < stop and options.output_activations:
                check_output_activations(options, json.loads((dest / "import.json").read_text()))
            if phase.name == "import" and i < stop and options.input_ranges:
                # --input-range names the model's inputs: said now, not after the stages before compress
                check_input_ranges(options, json.loads((dest / "import.json").read_text())["inputs"])
            if phase.name == "import" and i < stop and record.get("weight_bytes") is not None:
                # before the stages that hold the weights several times over: stop now if they cannot fit
                weight_bytes = record["weight_bytes"]
                build_memory.check(weight_bytes, target, options, log, converter_peak=record.get("converter_peak_rss"))
            if phase.name == "schedule" and i < stop and weight_bytes is not None:
                # before the compilers: stop now if those of the devices the plan uses cannot fit
                build_memory.check(weight_bytes, target, options, log, plan=Plan.load(dest))
            if os.environ.get(CRASH_ENV) == phase.name:  # the fault-injection hook: killed between stages
                os.kill(os.getpid(), signal.SIGKILL)
        try:
            bundle = _publish(dest, out, stamp) if stop == len(PHASES) - 1 else None
        except (OSError, shutil.Error) as e:
            full = _disk_full(e)
            if not full:
                raise
            shutil.rmtree(out / ".bundle.tmp", ignore_errors=True)
            (out / ".bundle.tar.gz.tmp").unlink(missing_ok=True)
            raise _no_space(out, "the bundle was published", full) from None
    except BaseException:
        if created_out and not results:
            shutil.rmtree(out, ignore_errors=True)
        else:
            # a bundle left from an earlier build must not pass for the result of this failed one
            shutil.rmtree(out / "bundle", ignore_errors=True)
            (out / "bundle.tar.gz").unlink(missing_ok=True)
        raise
    return BuildResult(out, results, bundle)


def _say_size(stage: str, dest: Path, log: Callable[[str], None]) -> None:
    """For a large model, what a stage wrote and what the build holds (once it has handed back what the
    stage freed): progress with sizes."""
    written = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    if written >= LARGE_OUTPUT:
        give_back()  # what the stage freed, before the next one
        log(f"{stage}: wrote {shown(written)} to {dest.name}; the build holds {shown(resident_bytes())}")


# a stage that writes this much says so (and what the build holds) as it finishes
LARGE_OUTPUT = 256 << 20


_DISK_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
              errno.EFBIG: "a file grew past the size limit", errno.EROFS: "the file system is read-only"}


def _disk_full(e: BaseException) -> str | None:
    """What of the disk failed a write (`_DISK_FULL`), for an OSError or a shutil.Error (copytree's list
    of failed copies, each with its error as text); None for any other error."""
    if isinstance(e, OSError) and e.errno in _DISK_FULL:
        return _DISK_FULL[e.errno]
    if isinstance(e, shutil.Error):
        text = str(e.args[0]) if e.args else ""
        return next((why for no, why in _DISK_FULL.items() if f"[Errno {no}]" in text), None)
    return None


def _no_space(where: Path, when: str, what: str) -> UserError:
    return UserError("build.disk-full", f"{what} under {where} while {when}: nothing of it was kept",
                     "free space there (the stage cache DIR/.build can be removed) or build into another -o; "
                     "the stages that finished are kept and the next build reuses them")


def _file_digest(path: Path) -> str | None:
    return file_sha256(path) if path.is_file() else None


def _model_digest(model: Path) -> str:
    """What import reads: a SavedModel directory's every file; an ONNX file and the external data files it
    names (weights changed in a `.data` file are a new model)."""
    if model.is_dir():
        return tree_sha256(model)
    digest = file_sha256(model)
    if model.suffix.lower() != ".onnx":
        return digest
    import onnx
    from onnx import external_data_helper as ext

    try:
        proto = onnx.load(str(model), load_external_data=False)
        names = sorted({ext.ExternalDataInfo(t).location for t in irm.external_tensors(proto)})
    except Exception:  # noqa: BLE001 - import reads the file again and says what is wrong with it
        return digest
    data = {}
    for name in names:
        try:
            data[name] = _file_digest(model.parent / name)
        except (OSError, ValueError):  # a name no file can have: import says so
            data[name] = None
    return value_sha256({"model": digest, "external_data": data}) if data else digest


@functools.lru_cache(maxsize=1)
def _sdk_digest() -> str:
    """The version and the code: a cached stage is never reused by an SDK whose code has changed."""
    root = Path(__file__).resolve().parent
    code = {str(p.relative_to(root)): file_sha256(p) for p in sorted(root.rglob("*.py"))}
    return value_sha256({"version": __version__, "code": code})


def _publish(package_dir: Path, out: Path, stamp: Callable[[Path, Path], None] | None = None) -> Path:
    """Copy the package stage's bundle to DIR/bundle and DIR/bundle.tar.gz.

    Both are copied beside their places first (and stamped there: version and signature); then the previous pair is removed, the tarball
    before the directory, and the new pair renamed in, the directory before the tarball. A build
    killed at any point (SIGKILL runs no cleanup) leaves the previous pair, a part of it, nothing,
    the new directory alone, or the new pair: never a directory and a tarball of different builds."""
    tmp_dir, tmp_tar = out / ".bundle.tmp", out / ".bundle.tar.gz.tmp"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    shutil.copytree(package_dir / "bundle", tmp_dir)
    shutil.copyfile(package_dir / "bundle.tar.gz", tmp_tar)
    if stamp is not None:
        stamp(tmp_dir, tmp_tar)
    (out / "bundle.tar.gz").unlink(missing_ok=True)
    if (out / "bundle").exists():  # renamed aside first: a rename is atomic, a tree removal is not
        shutil.rmtree(out / ".bundle.old", ignore_errors=True)
        (out / "bundle").rename(out / ".bundle.old")
        shutil.rmtree(out / ".bundle.old")
    tmp_dir.rename(out / "bundle")
    tmp_tar.rename(out / "bundle.tar.gz")
    return out / "bundle"


def _cache_hit(dest: Path, key: str, stage: str = "", log: Callable[[str], None] = lambda s: None) -> bool:
    """The stage's output at `dest` was made for `key` and is still what was made: its files hash to the
    digest written beside them. A changed, added or missing file (a disk error, a hand edit) is never
    trusted: the stage runs again, and says why."""
    if not ((dest / "key").is_file() and (dest / "key").read_text() == key and (dest / "digest").is_file()):
        return False
    if tree_sha256(dest, exclude=("digest", "key")) != (dest / "digest").read_text():
        log(f"{stage}: its cached output in {dest} no longer matches its digest (changed since it was written): "
            "running the stage again")
        return False
    return True


def _run_stage(stage, phase: Phase, artifact: Path, dest: Path, key: str, target: Target, target_path: Path,
               options: BuildOptions, build_dir: Path, log: Callable[[str], None],
               progress: Callable[[str | None], None] | None = None,
               reads: tuple[str, ...] | None = None,
               read_files: dict[str, tuple[str, ...]] | None = None, sdk: str = "") -> dict[str, Any]:
    build_dir.mkdir(parents=True, exist_ok=True)
    tmp = build_dir / f".{dest.name}.tmp"
    try:  # from the first write on: a Ctrl-C anywhere leaves no temporary directory behind
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        ctx = StageContext(target, target_path, options, build_dir, tmp, log, progress=progress, reads=reads,
                           read_files=read_files, sdk=sdk)
        t0 = time.perf_counter()
        record = stage.run(artifact, ctx)
        record = {"stage": phase.name, "seconds": round(time.perf_counter() - t0, 3),
                  "warnings": ctx.warnings, **record}
        (tmp / "record.json").write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
        digest = tree_sha256(tmp)
        (tmp / "digest").write_text(digest)
        (tmp / "key").write_text(key)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        full = _disk_full(e)
        if full:
            raise _no_space(build_dir.parent, f"the {phase.name} stage wrote its output", full) from None
        raise
    # later stages' outputs depend on this one: drop them so nothing stale survives
    for later in PHASE_NAMES[PHASE_NAMES.index(phase.name):]:
        shutil.rmtree(build_dir / f"{PHASE_NAMES.index(later) + 1}-{later}", ignore_errors=True)
    tmp.rename(dest)
    return record


def check_reproducible(options: BuildOptions, first: BuildResult, *, log: Callable[[str], None] = lambda s: None,
                       on_stage: Callable[[str, str, float], None] = lambda name, state, secs: None,
                       stamp: Callable[[Path, Path], None] | None = None) -> dict[str, Any]:
    """Build `options` again in a fresh temporary directory and compare with `first` byte for byte.

    Every stage runs again except the tune stage, whose output (the tuning search's records, the CPU
    backends' timings and the choices made by them) is replayed from `first`: a measurement is not
    reproducible, what is built from it must be. Returns the differences by file (for manifest.json, by
    field) and the stages whose outputs differ (their records and reports aside, which hold times), the first of them
    being where reproducibility is lost."""
    import dataclasses
    import tempfile

    with tempfile.TemporaryDirectory(prefix="edgesdk-rebuild-") as tmp:
        fresh = Path(tmp) / "out"
        # the first build's own options: where its accuracy remedy planned again, the rebuild plans so at once
        again = build(dataclasses.replace(first.options or options, out=fresh, start=None, until=None), log=log,
                      on_stage=on_stage,
                      stamp=stamp, replay={"tune": stage_dir(first.out, "tune")})
        stages = [p for p in PHASE_NAMES if _content(stage_dir(first.out, p)) != _content(stage_dir(fresh, p))]
        files = compare_bundles(first.out / "bundle", fresh / "bundle")
        tar_same = file_sha256(first.out / "bundle.tar.gz") == file_sha256(fresh / "bundle.tar.gz")
        rebuilt = [s.name for s in again.stages if not s.cached]
    return {"identical": not files and tar_same, "differences": files, "tarball_identical": tar_same,
            "stages_differing": stages, "stages_rebuilt": rebuilt,
            "files": sum(1 for p in (first.out / "bundle").rglob("*") if p.is_file())}


def _content(stage_output: Path) -> dict[str, str]:
    """A stage's output files and their digests, but its record and HTML reports (they hold times), key
    and digest."""
    return {p.relative_to(stage_output).as_posix(): file_sha256(p) for p in sorted(stage_output.rglob("*"))
            if p.is_file() and p.suffix != ".html"
            and p.relative_to(stage_output).as_posix() not in ("record.json", "key", "digest")}


def _read(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


def compare_bundles(a: Path, b: Path) -> list[str]:
    """Each difference between bundle directories `a` and `b`: a file only in one, a file whose bytes
    differ (manifest.json: the fields that differ)."""
    def files(root: Path) -> dict[str, Path]:
        return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}

    fa, fb = files(a), files(b)
    out = [f"{rel}: only in the first build" for rel in sorted(set(fa) - set(fb))]
    out += [f"{rel}: only in the rebuild" for rel in sorted(set(fb) - set(fa))]
    for rel in sorted(set(fa) & set(fb)):
        if file_sha256(fa[rel]) == file_sha256(fb[rel]):
            continue
        if rel == "manifest.json":
            fields = _json_differences(json.loads(fa[rel].read_text()), json.loads(fb[rel].read_text()), "manifest")
            out.append(f"manifest.json: differs in {', '.join(fields[:8])}" + (" ..." if len(fields) > 8 else ""))
        else:
            out.append(f"{rel}: differs ({fa[rel].stat().st_size:,} and {fb[rel].stat().st_size:,} bytes, sha256 "
                       f"{file_sha256(fa[rel])[:12]} and {file_sha256(fb[rel])[:12]})")
    return out


def _json_differences(a: Any, b: Any, where: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _json_differences(a.get(k), b.get(k), f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _json_differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [where]


def check(options: BuildOptions, *, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """`edgesdk check`: import the model (in a temporary directory) and ask legalize what it would do;
    nothing is rewritten and nothing is written."""
    import dataclasses
    import tempfile


    from .legalization.legalize import analyze

    target, target_path = load_target(options.target)
    with tempfile.TemporaryDirectory(prefix="edgesdk-check-") as tmp:
        result = build(dataclasses.replace(options, out=Path(tmp) / "out", until="import", start=None), log=log)
        imported = stage_dir(Path(tmp) / "out", "import")
        model = irm.read(imported / "model.onnx")
        io = json.loads((imported / "import.json").read_text())
        ctx = StageContext(target, target_path, options, Path(tmp), Path(tmp), log)
        report = analyze(model, target, options, io["inputs"], log=ctx.log, warn=ctx.warn)
    return {"model": str(options.model), "target": target.name, "import": result.stages[0].record,
            "warnings": ctx.warnings, **report}


def calibrate(target_name: str, models: list[tuple[Path, dict]], holdout: list[tuple[Path, dict]],
              *, threads: int, runs: int, backends: tuple[str, ...] = (), cuts: int = 4, rounds: int = 3,
              tuning_db: Path | None = None, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """`edgesdk calibrate`: measure every op of `models` (each with its input shapes) on this host, fit
    the target's CPU figures, and evaluate the fit on the `holdout` models. With `backends`, also time
    each fitted model (whole and cut into `cuts` runs of nodes) and each held-out model (whole) on each
    of those CPU backends as a bundle runs them (`rounds` timings each), fit each backend's own figures
    to its runs, and evaluate them on the held-out models (`devices/calibrate.py`); TVM compiles with
    the records of `tuning_db` (the build's database by default). Returns the fits, their evaluations
    and the target with the fitted figures (as a dict ready for YAML)."""
    import dataclasses
    import platform
    import tempfile


    from .config import CpuBackendFigures
    from .devices import calibrate as cal
    from .devices.cost import node_ms

    target, _ = load_target(target_name)
    cpu = target.host
    if cpu.arch != platform.machine():
        raise UsageError("calibrate.foreign-arch", f"target '{target.name}' has a {cpu.arch} CPU; this host is "
                         f"{platform.machine()}", "calibrate on the device itself, with a target of its architecture")
    samples: dict[str, list] = {"fit": [], "holdout": []}
    timed: dict[str, list] = {"fit": [], "holdout": []}  # RunSamples of every backend
    skipped: dict[str, list[str]] = {b: [] for b in backends}
    with tempfile.TemporaryDirectory(prefix="edgesdk-calibrate-") as tmp:
        for role, paths in (("fit", models), ("holdout", holdout)):
            for i, (path, shapes) in enumerate(paths):
                out = Path(tmp) / f"{role}{i}"
                build(BuildOptions(model=Path(path), target=target_name, out=out, until="import",
                                   input_shapes=shapes), log=log)
                model = irm.read(stage_dir(out, "import") / "model.onnx")
                log(f"calibrate: measuring {len(model.graph.node)} ops of {Path(path).name} ({runs} runs, "
                    f"{threads} threads)")
                samples[role] += cal.measure_ops(model, threads, runs, name=Path(path).name)
                if role == "fit" and i == len(paths) - 1:  # before any backend is timed
                    _enough_to_fit(samples["fit"], models)
                if backends:
                    terms = cal.node_terms_of(model, Path(path).name)
                    # a fitted model is cut where its predicted time (the input target's figures) is about even
                    parts = cal.cuts([node_ms(target, HOST, flops=f, param_bytes=p, act_bytes=a, grouped=g)
                                      for f, p, a, g in terms], cuts) if role == "fit" and cuts > 1 else []
                    new, why = _time_backends(model, Path(path).name,
                                              [range(len(terms))] + (parts if len(parts) > 1 else []),
                                              backends, target, tuning_db, out / "timing", threads, runs, rounds,
                                              log)
                    timed[role] += [cal.run_sample(t.model, t.label, t.backend, t.ms, [terms[k] for k in t.nodes],
                                                   t.cut_bytes) for t in new]
                    for b, lines in why.items():
                        skipped[b] += lines
                    shutil.rmtree(out, ignore_errors=True)
    fit = cal.fit_cpu(samples["fit"])
    names = ", ".join(Path(p).name for p, _ in models)
    source = (f"fitted by edgesdk calibrate on an {platform.machine()} host, "
              f"{threads} threads, per-op onnxruntime profiles of {names}")
    fitted = target.model_copy(deep=True)
    per_backend: dict[str, dict] = {}
    for b in backends:
        runs_b = [s for s in timed["fit"] if s.backend == b]
        try:
            per_backend[b] = {"fit": cal.fit_backend(runs_b, fit), "runs": len(runs_b)}
        except ValueError as e:  # too few runs timed (the others could not be built, checked or timed)
            per_backend[b] = {"fit": None, "runs": len(runs_b), "error": str(e)}
    for i, d in enumerate(fitted.devices):
        if d.kind == HOST:
            figures = fit.figures(source)
            peak = {**d.peak_gflops, **figures.pop("peak_gflops")}
            own = dict(d.backends)
            for b, entry in per_backend.items():
                if entry["fit"] is not None:
                    own[b] = CpuBackendFigures(**cal.backend_figures(entry["fit"], _backend_source(
                        b, threads, entry["runs"], names, tuning_db, target.name)))
            fitted.devices[i] = d.model_copy(update={**figures, "peak_gflops": peak, "backends": own})
    # the fitted target validated as a target file would be: its figures within their bounds
    fitted = Target.model_validate(fitted.model_dump(mode="json"))
    for b, entry in per_backend.items():
        held = [s for s in timed["holdout"] if s.backend == b]
        bfit = entry["fit"]
        entry.update({
            "fit": dataclasses.asdict(bfit) if bfit is not None else None,
            "skipped": skipped[b],
            "on_fitted": cal.evaluate_backend(fitted, b, [s for s in timed["fit"] if s.backend == b], bfit)
            if bfit is not None else None,
            "held_out": cal.evaluate_backend(fitted, b, held, bfit) if bfit is not None and held else None})
    return {"target": target.name, "fit": dataclasses.asdict(fit), "samples": len(samples["fit"]),
            "on_fitted": cal.evaluate(fit, samples["fit"]),
            "held_out": cal.evaluate(fit, samples["holdout"]) if samples["holdout"] else None,
            "threads": threads, "backends": per_backend,
            "fitted_target": fitted.model_dump(mode="json")}


def _enough_to_fit(samples: list, models: list[tuple[Path, dict]]) -> None:
    """Refuse fit models too small to fit the CPU's figures: three unknowns need three timed ops."""
    from .devices.calibrate import MIN_FIT_SAMPLES

    if len(samples) < MIN_FIT_SAMPLES:
        counts = ", ".join(f"{Path(p).name}: {sum(s.model == Path(p).name for s in samples)}" for p, _ in models)
        raise UserError("calibrate.too-few-ops", f"the model(s) to fit give {len(samples)} timed op(s) ({counts}); "
                        f"fitting the CPU's figures (peak rate, bandwidth, overhead) needs at least {MIN_FIT_SAMPLES}",
                        "fit on a model of the kind the device will run (dozens of ops or more), with -m; a tiny model "
                        "can be a --holdout")


def _time_backends(model, name: str, runs_of_nodes: list, names: tuple[str, ...], target, tuning_db: Path | None,
                   work: Path, threads: int, runs: int, rounds: int,
                   log: Callable[[str], None]) -> tuple[list, dict[str, list[str]]]:
    """The runs of `model` timed on each backend of `names` (`scheduling/backend_timing.py`): those
    with a time, and per backend the lines of those without one. TVM is not timed where this host
    lacks instructions of the target's code."""
    from . import backends
    from .devices import calibrate as cal
    from .scheduling import backend_timing, selection

    # a backend that compiles for the target's CPU (TVM) runs its code only where this host has its instructions
    native = {b for b in names if backends.backend(b).tunes}
    why_not = selection.unmeasurable(target) if native else None
    timeable = tuple(b for b in names if not (b in native and why_not))
    with backend_timing.runner_threads(threads):
        result = backend_timing.time_runs(model, name, runs_of_nodes, timeable, target, cal.random_feeds(model, name),
                                          tuning_db=_cpu_tuning_db(tuning_db, target.name), work=work,
                                          threads=threads, runs=runs, rounds=rounds, log=log)
    why: dict[str, list[str]] = {b: [] for b in names}
    for b in native if why_not else ():
        why[b].append(f"{name}: not timed: {why_not}")
    for t in result:
        if t.ms is None:
            why[t.backend].append(f"{name} {t.label}: {t.skipped}")
    return [t for t in result if t.ms is not None], why


def _cpu_tuning_db(tuning_db: Path | None, target_name: str) -> Path:
    """The CPU's database as the build reads it: `--tuning-db DIR`'s cpu/ (default: the build's)."""
    from .stages.tune import default_tuning_db

    return (Path(tuning_db) if tuning_db else default_tuning_db(target_name)) / "cpu"


def _backend_source(backend: str, threads: int, runs: int, names: str, tuning_db: Path | None, target_name: str) -> str:
    """Where a backend's fitted figures come from: the host's CPU, the threads, the runs and, for a
    backend that compiles with tuning records, which database."""
    import platform

    from . import backends
    from .ir.digest import tree_sha256
    from .scheduling import selection

    text = (f"fitted by edgesdk calibrate on an {platform.machine()} host ({selection.host_name()}), {threads} threads, "
            f"{runs} runs of nodes of {names} timed on {backend} as a bundle runs them")
    if backends.backend(backend).tunes:
        db = _cpu_tuning_db(tuning_db, target_name)
        records = (f"the tuning database {db} (sha256 {tree_sha256(db)[:12]})"
                   if (db / "database_workload.json").exists() else "no tuning records (default schedules)")
        text += f", with {records}"
    return text
