"""A plan made into a bundle: every segment compiled by its backend and finished by its device kind's
own compiler where one is registered, the manifest, the runtime, the golden self-test and the
tarball (DESIGN §5). It decides nothing new: what it changes of the plan is the corrected prediction
of a segment that its accelerator's compiler maps only in part."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx

from .. import __version__, backends
from ..ir import index_ranges
from ..ir.calibration import load_calibration
from ..runtime import manifest as mf
from ..runtime.executor import BundleModel
from ..scheduling.correction import corrected_prediction, edgetpu_correction
from ..scheduling.plan import Plan, PlanSegment
from . import golden
from .archive import file_table, write_tarball

RUNTIME_DIR = Path(mf.__file__).parent
TOOLCHAIN = ("apache-tvm", "apache-tvm-ffi", "tensorflow-cpu", "onnx", "onnxruntime", "ai-edge-litert", "numpy")


@dataclass(frozen=True)
class Sources:
    """The earlier stages' outputs a bundle is made of."""

    imported: Path  # model.onnx (the fp32 reference), import.json (the model's inputs and outputs)
    scheduled: Path  # plan.json, segments/*.onnx, model.onnx (the tune stage's: the plan with its CPU backends)
    tuned: Path  # tuning_db/ (one database per device kind), tune.json
    compressed: Path  # compress.json and its segments/


@dataclass(frozen=True)
class _Shipped:
    """The segments as they ship, and what their finishing compilers said."""

    plan: Plan  # the plan's segments with their artifacts, its prediction corrected
    segments: tuple[mf.Segment, ...]
    twins: dict[str, Path]
    tuned: dict[str, dict]
    finishing: dict  # the manifest's `edgetpu` record: compiled or not, the compilers' logs, corrections
    device_needs: tuple[str, ...]  # what the device needs beyond the runtime's packages, each line once


def package(src: Sources, target, options, out: Path, *, log: Callable[[str], None],
            warn: Callable[[str], None], warnings: Callable[[], list[str]]) -> dict:
    """Write `out/bundle/` and `out/bundle.tar.gz`; the record of the package stage."""
    plan = Plan.load(src.scheduled)
    imported = json.loads((src.imported / "import.json").read_text())
    bundle = out / "bundle"
    (bundle / "segments").mkdir(parents=True)
    # 1. each segment compiled by its backend, then finished by its device kind's compiler
    shipped = _compile(plan, src, target, bundle, out / "twin", log, warn)
    # 2. the manifest, the runtime, the requirements and the plan as shipped
    manifest = _manifest(shipped, src, target, imported, log, warnings)
    (bundle / "manifest.json").write_text(manifest.to_json())
    shutil.copytree(RUNTIME_DIR, bundle / "runtime", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (bundle / "requirements.txt").write_text(requirements(manifest.segments, target.host.arch, shipped.device_needs))
    (bundle / "plan.json").write_text(shipped.plan.to_json())
    # 3. the golden self-test and the accuracy: this plan, on this host (twins for foreign CPU/GPU code)
    log("package: running the bundle's plan on the build host for the golden output")
    samples, _ = load_calibration(options, imported["inputs"])
    host_model = BundleModel(bundle, artifacts=shipped.twins, log=log)
    golden.write_golden(bundle, manifest, host_model, samples)
    accuracy = golden.accuracy(host_model, onnx.load(str(src.imported / "model.onnx")), shipped.plan,
                               samples[:golden.ACCURACY_SAMPLES])
    _judge(accuracy, shipped.plan.segments, log, warn)
    # 4. the file table, and the reproducible tarball
    manifest = dataclasses.replace(manifest, accuracy=accuracy)
    manifest = dataclasses.replace(manifest, files=file_table(bundle))
    (bundle / "manifest.json").write_text(manifest.to_json())
    write_tarball(bundle, out / "bundle.tar.gz")
    return {"bundle_bytes": sum(f["size"] for f in manifest.files.values()), "files": len(manifest.files),
            "twins": sorted(shipped.twins), "edgetpu": shipped.finishing, "accuracy": accuracy,
            "tuned": shipped.tuned}


def _compile(plan: Plan, src: Sources, target, bundle: Path, twin_dir: Path, log, warn) -> _Shipped:
    compress = json.loads((src.compressed / "compress.json").read_text())
    int8 = _cpu_int8(src)
    segments: list[mf.Segment] = []
    twins: dict[str, Path] = {}
    tuned: dict[str, dict] = {}
    unfinished: list[tuple[backends.Finisher, str]] = []
    compiler_logs: dict[str, dict] = {}
    corrections: list[dict] = []
    planned: list[PlanSegment] = []  # the plan's segments as shipped: artifact and corrected prediction
    needs: dict[str, None] = {}
    for seg in plan.segments:
        sid, kind = seg.id, seg.device.split(":")[0]
        compressed = ({**compress["segments"][sid], "dir": str(src.compressed)} if sid in compress["segments"] else
                      {**int8["segments"][sid], "dir": str(src.tuned / "int8")} if sid in int8["segments"] else None)
        compiled = backends.backend(seg.backend).compile(backends.CompileJob(
            segment=seg, model=onnx.load(str(src.scheduled / seg.artifact)),
            device=target.device(kind), segments_dir=bundle / "segments",
            tuning_db=src.tuned / "tuning_db" / kind, compressed=compressed,
            twin_dir=twin_dir, log=log))
        art = compiled.artifact
        if compiled.twin is not None:
            twins[sid] = compiled.twin
        if compiled.tuned is not None:
            tuned[sid] = compiled.tuned
        needs.update(dict.fromkeys(compiled.device_needs))
        finisher = backends.finisher(kind)
        if finisher is not None and finisher.available():
            art, compiler_logs[sid], correction, seg = finish_segment(finisher, bundle, art, seg,
                                                                      src.scheduled / "model.onnx", target)
            if correction:
                corrections.append(correction)
                warn(finisher.describe(correction))
        elif finisher is not None:
            unfinished.append((finisher, art))
        planned.append(dataclasses.replace(seg, artifact=art))
        segments.append(mf.Segment(id=sid, device=seg.device, backend=backends.backend(seg.backend).runner,
                                   artifact=art, inputs=compiled.inputs, outputs=compiled.outputs,
                                   fallback_artifact=compiled.fallback_artifact, nodes=len(seg.nodes),
                                   predicted_ms=seg.predicted_ms, threads=seg.threads))
    finishing: dict = {}
    if any(s.fallback_artifact is not None for s in segments):
        finishing = {"edgetpu_compiled": not unfinished, "compiler": compiler_logs}
        if corrections:
            finishing["corrections"] = corrections
            plan = dataclasses.replace(plan, predicted=corrected_prediction(plan.predicted, corrections))
        for f in {f.name: f for f, _ in unfinished}.values():  # one command per finisher
            arts = [a for g, a in unfinished if g is f]
            finishing["finish_command"] = f"cd bundle && {f.finish_command(arts)}"
            warn(f.unfinished_warning(arts))
    return _Shipped(dataclasses.replace(plan, segments=tuple(planned)), tuple(segments), twins, tuned, finishing,
                    tuple(needs))


def finish_segment(finisher: backends.Finisher, bundle: Path, artifact: str, seg: PlanSegment, scheduled: Path,
                   target) -> tuple[str, dict, dict | None, PlanSegment]:
    """One segment's `artifact` (relative to `bundle`) finished by its device kind's compiler: the
    artifact to ship, the compiler's record, and where it maps only part of the segment the correction
    (`scheduling.correction`: what really runs where, costed by the scheduler's model) and the segment
    with the corrected prediction; else None and the segment as it was."""
    finished = finisher.run(backends.FinishJob(bundle, artifact, seg))
    if finished.partial is None:
        return finished.artifact, finished.record, None, seg
    correction = edgetpu_correction(seg.to_json(), finished.partial, onnx.load(str(scheduled)), target)
    return (finished.artifact, finished.record, correction,
            dataclasses.replace(seg, predicted_ms=correction["predicted_ms_after"]))


def _manifest(shipped: _Shipped, src: Sources, target, imported: dict, log, warnings) -> mf.Manifest:
    """The manifest before the golden run: its accuracy and file table come last."""
    # model-level tensors: the producing segment's spec carries the int8 quantization, if any
    produced = {t.name: t for s in shipped.segments for t in s.outputs}
    outputs = tuple(mf.TensorSpec(name=o["name"], shape=tuple(o["shape"]), dtype=o["dtype"],
                                  quant=produced[o["name"]].quant) for o in imported["outputs"])
    # an input that indexes a table (token ids) carries the range the table allows; the runtime refuses others
    ranges = index_ranges.infer(onnx.load(str(src.imported / "model.onnx")))
    for r in ranges.values():
        log(f"package: {r.describe()}")
    inputs = tuple(mf.TensorSpec(name=i["name"], shape=tuple(i["shape"]), dtype=i["dtype"],
                                 valid_range=ranges[i["name"]].valid_range if i["name"] in ranges else None)
                   for i in imported["inputs"])
    compress = json.loads((src.compressed / "compress.json").read_text())
    plan, source = shipped.plan, imported["source"]
    return mf.Manifest(
        schema_version=mf.SCHEMA_VERSION, sdk_version=__version__, min_runtime_version=mf.RUNTIME_VERSION,
        model={"name": source["name"], "sha256": source["sha256"], "format": source["format"],
               "converter": source.get("converter"), "opset": source["opset"]},
        target={"name": target.name, "sha256": target.digest(), "description": target.description},
        arch=target.host.arch, device_map=target.device_map(), inputs=inputs, outputs=outputs,
        segments=shipped.segments, pipeline_stages=plan.pipeline_stages, parallel_steps=plan.parallel_steps,
        cpu_threads=target.host.cores,
        predicted=plan.predicted, toolchain=toolchain(), calibration=compress.get("calibration") or _cpu_int8(src)["calibration"],
        edgetpu=shipped.finishing,
        tuning=tuning_provenance(json.loads((src.tuned / "tune.json").read_text()), shipped.tuned,
                                 plan.cpu_selection),
        warnings=tuple(warnings()),
    )


def _cpu_int8(src: Sources) -> dict:
    """The tune stage's int8 CPU segments (`--cpu-precision int8`) and their calibration."""
    path = src.tuned / "int8.json"
    return json.loads(path.read_text()) if path.exists() else {"segments": {}, "calibration": {}}


def _judge(accuracy: dict, segments, log, warn) -> None:
    """Log the bundle's accuracy; a float plan that disagrees with the model has a wrong kernel."""
    quantized = any(backends.backend(s.backend).quantizes for s in segments)
    for name, a in accuracy["tensors"].items():
        log(f"package: accuracy of {name} vs the fp32 model: cosine {a['cosine']:.5f}, "
            f"max abs error {a['max_abs_error']:.4g}")
        if not quantized and a["cosine"] < 0.9999:
            warn(f"{name} differs from the fp32 model (cosine {a['cosine']:.5f}) although no segment is "
                 f"quantized: a compiled kernel computes wrong results; rebuild with --tuning-db pointing "
                 f"at an empty directory to rule out a tuning record, and report it")


def toolchain() -> dict[str, str]:
    """The versions of edgesdk and of the libraries that built the bundle."""
    out = {"edgesdk": __version__}
    for dist in TOOLCHAIN:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def requirements(segments, arch: str, needs: tuple[str, ...] = ()) -> str:
    """requirements.txt: numpy and the runtime distributions of the backends the segments use, pinned,
    then as comments what else the device needs (`Compiled.device_needs`)."""
    used = {s.backend for s in segments}
    dists = dict.fromkeys(["numpy", *(d for b in backends.backends() if b.runner in used for d in b.runtime_dists)])
    lines = [f"# runtime dependencies of this bundle on the device ({arch}); installed from wheels, offline"]
    for d in dists:
        lines.append(f"{d}=={importlib.metadata.version(d)}")
    return "\n".join(lines + [f"# {line}" for line in needs]) + "\n"


def tuning_provenance(tune: dict, tuned: dict, cpu_selection: dict) -> dict:
    """Where the kernels' schedules come from: the digest and size of the database the package
    stage applied (a build that replays it is the same bytes), per segment how many of its
    functions got a record, and the CPU backends' measured times and the choice (when measured)."""
    return {"database_sha256": tune["database_sha256"], "database_records": tune.get("database_records", 0),
            "segments": tuned, **({"cpu_selection": cpu_selection} if cpu_selection else {})}
