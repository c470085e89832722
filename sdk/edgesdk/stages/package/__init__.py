"""package: compile every segment with its backend and write the bundle.

Needs: the plan (schedule), the tuning database copy (tune), the int8 segments (compress).
Guarantees: `bundle/` as DESIGN §5 lays it out — manifest.json with the sha256 and size of every
other file, plan.json, segments/, runtime/, golden/, requirements.txt — and a reproducible
`bundle.tar.gz` (sorted members, fixed mtime/uid/gid). It decides nothing new.

The golden output is produced by running the bundle's own plan on the build host: the very same
TFLite files, and for CPU/GPU segments built for another machine (aarch64, CUDA) an x86-64 twin
compiled from the same segment and tuning records. The twin never ships.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.metadata
import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np
import onnx

from ... import __version__, backends
from ...backends import edgetpu_compiler
from ...backends import onnxruntime as ort_backend
from ...backends import tflite as tflite_backend
from ...errors import UserError
from ...ir import index_ranges
from ...ir.calibration import load_calibration
from ...ir.digest import file_sha256
from ...ir.numeric import compare
from ...runtime import manifest as mf
from ...runtime.executor import BundleModel
from ...runtime.inputs import InputError, check_feeds
from ...scheduling.correction import corrected_prediction, edgetpu_correction
from ...scheduling.plan import Plan, PlanSegment

OPTIONS = ("calib", "calib_preprocess", "seed")
READS = ("import", "legalize", "schedule", "tune", "compress")  # the earlier stages whose outputs it reads (its cache key covers them)
RUNTIME_DIR = Path(mf.__file__).parent


def run(artifact: Path, ctx) -> dict:
    sched, tune_dir, comp_dir = ctx.artifact("schedule"), ctx.artifact("tune"), ctx.artifact("compress")
    plan = Plan.load(sched)
    compress = json.loads((comp_dir / "compress.json").read_text())
    imported = json.loads((ctx.artifact("import") / "import.json").read_text())
    target = ctx.target
    bundle = ctx.out / "bundle"
    (bundle / "segments").mkdir(parents=True)
    twin_dir = ctx.out / "twin"
    db = tune_dir / "tuning_db"

    segments: list[mf.Segment] = []
    twins: dict[str, Path] = {}
    tuned: dict[str, dict] = {}
    unfinished: list[str] = []
    compiler_logs: dict[str, dict] = {}
    corrections: list[dict] = []
    planned: list[PlanSegment] = []  # the plan's segments as shipped: artifact and corrected prediction
    for seg in plan.segments:
        sid, kind = seg.id, seg.device.split(":")[0]
        compressed = compress["segments"].get(sid)
        compiled = backends.backend(seg.backend).compile(backends.CompileJob(
            segment=seg, model=onnx.load(str(sched / seg.artifact)),
            device=target.device(kind), segments_dir=bundle / "segments",
            tuning_db=db / kind, compressed={**compressed, "dir": str(comp_dir)} if compressed else None,
            twin_dir=twin_dir, log=ctx.log))
        art = compiled.artifact
        if compiled.twin is not None:
            twins[sid] = compiled.twin
        if compiled.tuned is not None:
            tuned[sid] = compiled.tuned
        if compiled.fallback_artifact is not None:  # an accelerator's model, which its own compiler finishes
            if edgetpu_compiler.find():
                art, compiler_logs[sid], correction = compile_for_edgetpu(bundle, art, seg.to_json(),
                                                                          sched / "model.onnx", target)
                if correction:
                    corrections.append(correction)
                    seg = dataclasses.replace(seg, predicted_ms=correction["predicted_ms_after"])
                    ctx.warn(edgetpu_compiler.describe(correction))
            else:
                unfinished.append(art)
        planned.append(dataclasses.replace(seg, artifact=art))
        segments.append(mf.Segment(id=sid, device=seg.device, backend=backends.backend(seg.backend).runner,
                                   artifact=art, inputs=compiled.inputs, outputs=compiled.outputs,
                                   fallback_artifact=compiled.fallback_artifact, nodes=len(seg.nodes),
                                   predicted_ms=seg.predicted_ms, threads=seg.threads))

    edgetpu_info: dict = {}
    if any(s.fallback_artifact is not None for s in segments):
        edgetpu_info = {"edgetpu_compiled": not unfinished, "compiler": compiler_logs}
        if corrections:
            edgetpu_info["corrections"] = corrections
            plan = dataclasses.replace(plan, predicted=corrected_prediction(plan.predicted, corrections))
        if unfinished:
            cmd = edgetpu_compiler.finish_command(unfinished)
            edgetpu_info["finish_command"] = f"cd bundle && {cmd}"
            ctx.warn(f"edgetpu_compiler is not installed: {len(unfinished)} Edge TPU segment(s) ship uncompiled "
                     f"and run their int8 model on the CPU until compiled; to finish: cd bundle && {cmd}")

    # model-level tensors: the producing segment's spec carries the int8 quantization, if any
    produced = {t.name: t for s in segments for t in s.outputs}
    outputs = tuple(mf.TensorSpec(name=o["name"], shape=tuple(o["shape"]), dtype=o["dtype"],
                                  quant=produced[o["name"]].quant) for o in imported["outputs"])
    # an input that indexes a table (token ids) carries the range the table allows; the runtime refuses others
    ranges = index_ranges.infer(onnx.load(str(ctx.artifact("import") / "model.onnx")))
    for r in ranges.values():
        ctx.log(f"package: {r.describe()}")
    inputs = tuple(mf.TensorSpec(name=i["name"], shape=tuple(i["shape"]), dtype=i["dtype"],
                                 valid_range=ranges[i["name"]].valid_range if i["name"] in ranges else None)
                   for i in imported["inputs"])

    calibration = compress.get("calibration") or {}
    manifest = mf.Manifest(
        schema_version=mf.SCHEMA_VERSION, sdk_version=__version__, min_runtime_version=mf.RUNTIME_VERSION,
        model={"name": imported["source"]["name"], "sha256": imported["source"]["sha256"],
               "format": imported["source"]["format"], "converter": imported["source"].get("converter"),
               "opset": imported["source"]["opset"]},
        target={"name": target.name, "sha256": target.digest(), "description": target.description},
        arch=target.host.arch, device_map=target.device_map(), inputs=inputs, outputs=outputs,
        segments=tuple(segments), pipeline_stages=plan.pipeline_stages, parallel_steps=plan.parallel_steps,
        cpu_threads=target.host.cores,
        predicted=plan.predicted, toolchain=_toolchain(), calibration=calibration, edgetpu=edgetpu_info,
        tuning=_tuning_provenance(json.loads((tune_dir / "tune.json").read_text()), tuned),
        warnings=tuple(_all_warnings(ctx)),
    )
    (bundle / "manifest.json").write_text(manifest.to_json())
    shutil.copytree(RUNTIME_DIR, bundle / "runtime", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (bundle / "requirements.txt").write_text(_requirements(segments, target.host.arch))
    (bundle / "plan.json").write_text(dataclasses.replace(plan, segments=tuple(planned)).to_json())

    # golden input/output: this plan, on this host (twins for foreign CPU/GPU code)
    ctx.log("package: running the bundle's plan on the build host for the golden output")
    samples, _ = load_calibration(ctx.options, imported["inputs"])
    host_model = BundleModel(bundle, artifacts=twins, log=ctx.log)
    golden_in = samples[0]
    # every tensor crossing a segment boundary too: the self-test checks each segment on its own
    # golden inputs, so a device whose int8 kernels round differently is judged segment by segment
    crossing = sorted({t.name for seg in manifest.segments for t in (*seg.inputs, *seg.outputs)}
                      - set(golden_in) - {t.name for t in manifest.outputs})
    for k, sample in enumerate(samples):  # a --calib sample the bundle would refuse (an id beyond its table)
        try:
            check_feeds(manifest.inputs, sample)
        except InputError as e:
            raise UserError("package.bad-sample", f"calibration sample {k + 1} is not a valid input: {e}",
                            "give --calib samples the deployed model accepts; " + e.hint) from None
    golden_all = host_model.run(golden_in, extra_outputs=crossing)
    golden_out = {t.name: golden_all[t.name] for t in manifest.outputs}
    (bundle / "golden").mkdir()
    _savez(bundle / "golden" / "inputs.npz", golden_in)
    _savez(bundle / "golden" / "outputs.npz", golden_out)
    _savez(bundle / "golden" / "boundaries.npz", {n: golden_all[n] for n in crossing})

    accuracy = _accuracy(host_model, onnx.load(str(ctx.artifact("import") / "model.onnx")), plan, samples[:8])
    for name, a in accuracy["tensors"].items():
        ctx.log(f"package: accuracy of {name} vs the fp32 model: cosine {a['cosine']:.5f}, "
                f"max abs error {a['max_abs_error']:.4g}")
        if not any(backends.backend(s.backend).quantizes for s in segments) and a["cosine"] < 0.9999:
            # nothing is quantized: a float plan that disagrees with the model has a wrong kernel
            ctx.warn(f"{name} differs from the fp32 model (cosine {a['cosine']:.5f}) although no segment is "
                     f"quantized: a compiled kernel computes wrong results; rebuild with --tuning-db pointing "
                     f"at an empty directory to rule out a tuning record, and report it")
    manifest = dataclasses.replace(manifest, accuracy=accuracy)
    manifest = dataclasses.replace(manifest, files=_file_table(bundle))
    (bundle / "manifest.json").write_text(manifest.to_json())
    write_tarball(bundle, ctx.out / "bundle.tar.gz")
    size = sum(f["size"] for f in manifest.files.values())
    return {"bundle_bytes": size, "files": len(manifest.files), "twins": sorted(twins),
            "edgetpu": edgetpu_info, "accuracy": accuracy, "tuned": tuned}


def compile_for_edgetpu(bundle: Path, tflite: str, seg: dict, scheduled: Path, target) -> tuple[str, dict, dict | None]:
    """Compile one Edge TPU segment's int8 model (`tflite`, relative to `bundle`) with edgetpu_compiler.

    Returns the artifact to ship, the compiler's log (less its text) and, when the compiler maps only
    part of the model, the correction (`edgetpu_correction`); `seg`, the plan's segment, then carries
    the corrected predicted_ms. A model the compiler maps nothing of ships uncompiled: the compiled one
    would only add the delegate's overhead to a model that runs on the CPU anyway."""
    compiled, log = edgetpu_compiler.compile_segment(bundle / tflite, bundle / "segments")
    record = {k: v for k, v in dataclasses.asdict(log).items() if k != "text"}
    mapped = edgetpu_compiler.mapping(tflite_backend.operators((bundle / tflite).read_bytes())[0], log)
    if not mapped.on_cpu:
        return f"segments/{compiled.name}", record, None
    correction = edgetpu_correction(seg, mapped, onnx.load(str(scheduled)), target)
    seg["predicted_ms"] = correction["predicted_ms_after"]
    if not mapped.on_tpu:
        compiled.unlink()
        return tflite, record, correction
    return f"segments/{compiled.name}", record, correction


def _accuracy(host_model: BundleModel, reference: onnx.ModelProto, plan: dict, samples: list[dict]) -> dict:
    """The bundle against the fp32 model, on logits where a trailing softmax would hide errors."""
    probes = {o: p for o, p in plan.probes.items()
              if any(p == t.name for s in host_model.manifest.segments for t in s.outputs)}
    names = [o.name for o in host_model.manifest.outputs if o.name not in probes] + list(probes.values())
    got = [host_model.run(f, extra_outputs=probes.values()) for f in samples]
    ref = [ort_backend.run(reference, f, names) for f in samples]
    tensors = {n: compare(np.stack([g[n] for g in got]), np.stack([r[n] for r in ref])) for n in names}
    out = {"reference": "onnxruntime on the imported fp32 model", "samples": len(samples), "tensors": tensors}
    if probes:
        p = next(iter(probes.values()))
        # per position along the last (class) axis: a sequence model has one decision per step
        agree = [np.mean(np.argmax(g[p], -1) == np.argmax(r[p], -1)) for g, r in zip(got, ref)]
        out["top1_agreement"] = round(float(np.mean(agree)), 4)
    return out


def _toolchain() -> dict[str, str]:
    out = {"edgesdk": __version__}
    for dist in ("apache-tvm", "apache-tvm-ffi", "tensorflow-cpu", "onnx", "onnxruntime", "ai-edge-litert", "numpy"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _requirements(segments: list[mf.Segment], arch: str) -> str:
    used = {s.backend for s in segments}
    dists = ["numpy", *(d for b in backends.backends() if b.runner in used for d in b.runtime_dists)]
    lines = [f"# runtime dependencies of this bundle on the device ({arch}); installed from wheels, offline"]
    for d in dists:
        lines.append(f"{d}=={importlib.metadata.version(d)}")
    if any(s.device.startswith("gpu") for s in segments):
        lines.append("# CUDA segments carry CUDA source that TVM compiles when the library is loaded: the device")
        lines.append("# needs the CUDA toolkit's nvcc (TVM_CUDA_COMPILE_MODE=nvcc) or NVRTC, and an NVIDIA driver")
    return "\n".join(lines) + "\n"


def _all_warnings(ctx) -> list[str]:
    warnings = []
    for stage in ("import", "legalize", "schedule", "tune", "compress"):
        rec = ctx.artifact(stage) / "record.json"
        if rec.exists():
            warnings += json.loads(rec.read_text()).get("warnings", [])
    return warnings + ctx.warnings


def _savez(path: Path, arrays: dict[str, np.ndarray]) -> None:
    # np.savez writes zip entries with the current time; write them with a fixed one instead
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arrays[name]), allow_pickle=False)
            z.writestr(zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)), buf.getvalue())


def _file_table(bundle: Path) -> dict[str, dict]:
    return {p.relative_to(bundle).as_posix(): {"sha256": file_sha256(p), "size": p.stat().st_size}
            for p in sorted(bundle.rglob("*")) if p.is_file() and p.name != "manifest.json"}


def write_tarball(bundle: Path, dest: Path) -> None:
    """Same files, same bytes: sorted members, mtime SOURCE_DATE_EPOCH (or 0), root ownership."""
    mtime = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    tmp = dest.with_name(dest.name + ".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=mtime) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for p in [bundle, *sorted(bundle.rglob("*"))]:
                rel = "bundle" if p == bundle else f"bundle/{p.relative_to(bundle).as_posix()}"
                info = tarfile.TarInfo(rel)
                info.mtime, info.uid, info.gid, info.uname, info.gname = mtime, 0, 0, "", ""
                if p.is_dir():
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(info)
                else:
                    info.size, info.mode = p.stat().st_size, 0o644
                    with open(p, "rb") as f:
                        tar.addfile(info, f)
    tmp.replace(dest)


def _tuning_provenance(tune: dict, tuned: dict) -> dict:
    """Where the kernels' schedules come from: the digest and size of the database the package
    stage applied (a build that replays it is the same bytes), and per segment how many of its
    functions got a record."""
    return {"database_sha256": tune["database_sha256"], "database_records": tune.get("database_records", 0),
            "segments": tuned}
