"""A plan made into a bundle: every segment compiled by its backend and finished by its device kind's
own compiler where one is registered, the manifest, the runtime, the golden self-test and the
tarball (docs/bundle.md). It decides nothing new: what it changes of the plan is the corrected prediction
of a segment that its accelerator's compiler maps only in part."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import platform
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from .. import __version__, backends
from ..compression import accuracy as accuracy_views
from ..compression import build as pruning
from ..config import HOST
from ..errors import UserError
from ..frontends import OWN_TFLITE
from ..ir import index_ranges
from ..ir import model as irm
from ..ir.calibration import load_calibration
from ..ir.digest import tree_sha256
from ..report.html import accuracy_page
from ..runtime import manifest as mf
from ..runtime.executor import BundleModel
from ..scheduling.correction import cache_correction, corrected_prediction, edgetpu_correction
from ..scheduling.plan import Plan, PlanSegment
from ..scheduling.selection import held_out_split
from . import evaluation, gate, golden
from .archive import file_table, write_tarball
from .sbom import SBOM_FILE, source_date_epoch, write_sbom

RUNTIME_DIR = Path(mf.__file__).parent
TOOLCHAIN = ("apache-tvm", "apache-tvm-ffi", "tensorflow-cpu", "onnx", "onnxruntime", "ai-edge-litert", "openvino", "numpy")
# what the runtime itself needs on the device besides numpy: `cryptography` verifies manifest.sig
# (runtime/trust.py), and on CPython it loads its bindings through cffi, which parses with pycparser
RUNTIME_DISTS = ("numpy", "cryptography", "cffi", "pycparser")


@dataclass(frozen=True)
class Sources:
    """The earlier stages' outputs a bundle is made of."""

    imported: Path  # model.onnx (the fp32 reference), import.json (the model's inputs and outputs)
    scheduled: Path  # plan.json, segments/*.onnx, model.onnx (the tune stage's: the plan with its CPU backends)
    tuned: Path  # tuning_db/ (one database per device kind), tune.json
    compressed: Path  # compress.json and its segments/
    legalized: Path | None = None  # legalize.json: its approximations, which the culprit search names


@dataclass(frozen=True)
class _Shipped:
    """The segments as they ship, and what their finishing compilers said."""

    plan: Plan  # the plan's segments with their artifacts, its prediction corrected
    segments: tuple[mf.Segment, ...]
    twins: dict[str, Path]
    tuned: dict[str, dict]
    finishing: dict  # the manifest's `edgetpu` record: compiled or not, the compilers' logs, corrections
    device_needs: tuple[str, ...]  # what the device needs beyond the runtime's packages, each line once
    replicas: tuple[tuple[str, ...], ...] = ()  # per replica, the segment ids its frames run


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
    pinned = requirements(manifest.segments, target.host.arch, shipped.device_needs)
    (bundle / "requirements.txt").write_text(pinned)
    (bundle / "plan.json").write_text(shipped.plan.to_json())
    # 3. the golden self-test and the accuracy: this plan, on this host (twins for foreign CPU/GPU code)
    log("package: running the bundle's plan on the build host for the golden output")
    samples, calibration = load_calibration(options, imported["inputs"])
    host_model = BundleModel(bundle, artifacts=shipped.twins, log=log)
    tolerances = golden.write_golden(bundle, manifest, host_model, samples)
    pruned = _pruned(src)
    reference, name = ((lambda: pruned[0], "the pruned fp32 model (--prune)") if pruned else
                       (lambda: irm.read(src.imported / "model.onnx"), "the imported fp32 model"))
    # never the samples the int8 ranges were calibrated on (compress and tune calibrate on the rest)
    calibrated, held = held_out_split(samples)
    held_out = held is not calibrated  # a single sample is both
    held = held[:golden.ACCURACY_SAMPLES]
    declared = accuracy_views.declared(options)  # outputs the user's code reads through an activation
    # a quantized model (Q/DQ nodes: a full-int8 TFLite file, an onnxruntime-quantized ONNX) computes in int8
    # wherever it runs: its bundle is held to the accuracy gate, not to float's tolerance (TVM's QuantizeLinear
    # rounds a tie otherwise than onnxruntime's, and a step moved early in a deep network moves its answer), and
    # a TFLite file's reference is LiteRT running it
    int8_model = bool(json.loads((src.imported / "record.json").read_text()).get("nodes_after", {})
                      .get("QuantizeLinear"))
    own = src.imported / OWN_TFLITE
    own = own if own.is_file() and not pruned else None
    if own is not None:
        name = f"the imported {imported['source']['format']} file (its own int8 arithmetic)"
    accuracy = golden.accuracy(host_model, reference, held, name, held_out=held_out, declared=declared, own=own)
    del host_model  # released by `accuracy`
    try:
        accuracy = _judge(accuracy, shipped.plan, log, target=target, options=options, calibration=calibration,
                          int8_model=int8_model,
                          conditioning=lambda: golden.conditioning(reference(), held, list(accuracy["tensors"])),
                          warn=warn, search=lambda failures: _culprits(src, reference, held, log, declared))
        if shipped.plan.keep_on_cpu:  # nodes kept in float on the CPU: what moved which figure, at what latency
            accuracy = {**accuracy, "remedy": gate.remedy(shipped.plan.keep_on_cpu, accuracy)}
        if options.eval_data:  # the task's own measure on held-out samples, against the fp32 model as imported
            task = evaluation.evaluate(bundle, shipped.twins, src.imported, options, log, warn)
            accuracy = gate.judge_task({**accuracy, "task": task}, shipped.plan, options, calibration, warn=warn,
                                       search=lambda failures: _culprits(src, reference, held, log, declared))
    except gate.GateFailure as e:
        # the remedy's rounds after the first plan again from it, and the failure after them says it; a first
        # round keeps the culprits on the CPU, unless none is on an accelerator
        on_accelerator = {s.id for s in shipped.plan.segments if s.device != "cpu"}
        wanted = getattr(options, "remedy", ()) or not any(c["segment"] in on_accelerator
                                                          for c in e.accuracy.get("culprits") or ())
        if getattr(options, "accuracy_remedy", True) and wanted:
            found = e.accuracy["probe"] = _probe(src, e, held, target, options, declared, log)
            if found:
                e.notes += [f"probe, {found['measure']}, all int8: {found['int8']['said']}"]
                e.notes += [f"probe: {', '.join(r['segments'])} ({len(r['nodes'])} nodes on {', '.join(r['devices'])}) "
                            f"in float, the rest int8: {r['said']}" for r in found["float"][:3]]
        raise
    # 4. the provenance and the SBOM, then the file table (which lists, so signs, the SBOM), and the tarball
    (out / "accuracy.html").write_text(accuracy_page(accuracy))
    manifest = dataclasses.replace(manifest, accuracy=accuracy, golden=tolerances, warnings=tuple(warnings()),
                                   provenance=provenance(manifest, samples, calibration))
    write_sbom(bundle, manifest, pinned)
    manifest = dataclasses.replace(manifest, files=file_table(bundle))
    (bundle / "manifest.json").write_text(manifest.to_json())
    write_tarball(bundle, out / "bundle.tar.gz")
    return {"bundle_bytes": sum(f["size"] for f in manifest.files.values()), "files": len(manifest.files),
            "twins": sorted(shipped.twins), "edgetpu": shipped.finishing, "accuracy": accuracy,
            "tuned": shipped.tuned}


def _compile(plan: Plan, src: Sources, target, bundle: Path, twin_dir: Path, log, warn) -> _Shipped:
    compress = json.loads((src.compressed / "compress.json").read_text())
    int8 = _cpu_int8(src)
    pruned = _pruned(src)
    twins: dict[str, Path] = {}
    tuned: dict[str, dict] = {}
    needs: dict[str, None] = {}
    compiled: dict[str, backends.Compiled] = {}
    # 1. each segment compiled by its backend; a shared segment (`same_as`) ships its first use's artifact,
    # and so does a replica's segment on the other accelerator (`Plan.replica_segments`)
    replicas = plan.replica_segments()
    own = {s.id for s in plan.segments}
    replica_of = {s.id: k for k, rep in enumerate(replicas, 1) for s in rep if s.id not in own}
    everything = [*plan.segments, *(s for rep in replicas for s in rep if s.id in replica_of)]
    by_id = {s.id: s for s in everything}
    own_file = src.imported / OWN_TFLITE  # a quantized TFLite model's own file, for a segment that ships it as given
    own_file = own_file if own_file.is_file() else None
    for seg in everything:
        sid, kind = seg.id, seg.device.split(":")[0]
        if seg.same_as in compiled:
            compiled[sid] = _renamed(compiled[seg.same_as], by_id[seg.same_as], seg)
            if seg.same_as in twins:   # the build host's golden run uses the same twin for it
                twins[sid] = twins[seg.same_as]
            continue
        compressed = ({**compress["segments"][sid], "dir": str(src.compressed)} if sid in compress["segments"] else
                      {**int8["segments"][sid], "dir": str(src.tuned / "int8")} if sid in int8["segments"] else None)
        model = irm.read(src.scheduled / seg.artifact)
        if pruned and kind == HOST:  # --prune: the CPU's layers read the compress stage's pruned weights
            model = pruning.apply(model, *pruned)
        c = compiled[sid] = backends.backend(seg.backend).compile(backends.CompileJob(
            segment=seg, model=model,
            device=target.device(kind), segments_dir=bundle / "segments",
            tuning_db=src.tuned / "tuning_db" / kind, compressed=compressed,
            twin_dir=twin_dir, log=log, source=own_file))
        if c.twin is not None:
            twins[sid] = c.twin
        if c.tuned is not None:
            tuned[sid] = c.tuned
        needs.update(dict.fromkeys(c.device_needs))
    # 2. each device instance's segments finished together by its kind's compiler, in cache priority
    done = _finish(plan, everything, compiled, src, target, bundle, log, warn)
    shipped, fallback = done.shipped, done.fallback
    segments = tuple(mf.Segment(id=sid, device=seg.device, backend=backends.backend(seg.backend).runner,
                                artifact=art, inputs=compiled[sid].inputs, outputs=compiled[sid].outputs,
                                fallback_artifact=fallback[sid], nodes=len(seg.nodes),
                                predicted_ms=seg.predicted_ms, threads=seg.threads, replica=replica_of.get(sid, 0))
                     for sid, (art, seg) in shipped.items())
    finishing: dict = {}
    if any(s.fallback_artifact is not None for s in segments):
        finishing = {"edgetpu_compiled": not done.unfinished, "compiler": done.logs,
                     "co_compiled": {d: list(ids) for d, ids in done.groups.items()}}
        if done.logs:
            finishing["caches"] = _caches_from_logs(done.groups, done.logs)
        if done.corrections:
            finishing["corrections"] = done.corrections
        if done.cache_corrections:
            finishing["cache_corrections"] = done.cache_corrections
        # the plan's own segments move its latency; a replica's run only in a stream
        moved = [c for c in done.corrections + done.cache_corrections if c["segment"] not in replica_of]
        if moved:
            plan = dataclasses.replace(plan, predicted=corrected_prediction(plan.predicted, moved))
        for f, arts in done.unfinished.items():
            finishing["finish_command"] = f"cd bundle && {f.group_command(arts)}"
            warn(f.unfinished_warning([a for g in arts for a in g], f.group_command(arts)))
    planned = tuple(dataclasses.replace(seg, artifact=art) for sid, (art, seg) in shipped.items() if sid not in replica_of)
    return _Shipped(dataclasses.replace(plan, segments=planned), segments, twins, tuned, finishing, tuple(needs),
                    tuple(tuple(s.id for s in rep) for rep in replicas))


@dataclass
class _Finished:
    """What the devices' own compilers made of the segments (`_finish`)."""

    shipped: dict[str, tuple[str, PlanSegment]]  # segment id -> (artifact that ships, the segment as corrected)
    fallback: dict[str, str | None]  # segment id -> what the CPU runs without the device
    groups: dict[str, list[str]]  # device -> its segments in the order compiled together
    logs: dict[str, dict] = field(default_factory=dict)  # segment id -> its model's compiler record
    corrections: list[dict] = field(default_factory=list)  # segments the compiler maps only partly
    cache_corrections: list[dict] = field(default_factory=list)  # segments priced again by what it cached
    unfinished: dict = field(default_factory=dict)  # finisher -> its groups of artifacts, where not installed


def _finish(plan: Plan, everything: list[PlanSegment], compiled: dict[str, backends.Compiled], src: Sources,
            target, bundle: Path, log, warn) -> _Finished:
    """Each device instance's segments finished by its kind's compiler in one call, in the plan's cache
    priority: an artifact once per device, a copy of its own on a second device (the compiler names its
    output after its input, and the two devices' co-compiled models differ); each segment corrected
    where the compiler maps only part of it or caches another share of its weights than planned."""
    by_id = {s.id: s for s in everything}
    out = _Finished({sid: (c.artifact, by_id[sid]) for sid, c in compiled.items()},
                    {sid: c.fallback_artifact for sid, c in compiled.items()}, finish_groups(plan, everything))
    scheduled = None
    taken: set[str] = set()  # artifacts a device's call compiled already
    for device, ids in out.groups.items():
        finisher = backends.finisher(device.split(":")[0])
        mine: dict[str, list[str]] = {}
        for i in ids:
            mine.setdefault(compiled[i].artifact, []).append(i)
        arts = [_own_copy(bundle, a, device) if a in taken else a for a in mine]
        taken.update(mine)
        for a, users in zip(arts, mine.values()):   # a copy is also what the CPU runs without the device
            out.fallback.update({sid: a for sid in users if a not in mine})
        items = [(a, by_id[sid]) for a, users in zip(arts, mine.values()) for sid in users]
        if not finisher.available():
            out.unfinished.setdefault(finisher, []).append(arts)
            out.shipped.update({seg.id: (a, seg) for a, seg in items})
            continue
        for art, record, correction, seg in finish_segments(finisher, bundle, items, src.scheduled / "model.onnx",
                                                            target, plan):
            if correction:
                out.corrections.append(correction)
                warn(finisher.describe(correction))
            elif "off_chip_bytes" in record:   # priced again with the share the compiler really streams
                scheduled = scheduled or irm.read(src.scheduled / "model.onnx")
                cached = cache_correction(seg.to_json(), record["on_chip_bytes"], record["off_chip_bytes"],
                                          scheduled, target)
                if cached:
                    out.cache_corrections.append(cached)
                    seg = dataclasses.replace(seg, predicted_ms=cached["predicted_ms_after"])
                    (warn if cached["predicted_ms_after"] > cached["predicted_ms_before"] else log)(
                        f"{seg.id}: edgetpu_compiler caches {_mib(record['on_chip_bytes'])} of its parameters "
                        f"on {seg.device} and streams {_mib(record['off_chip_bytes'])} every invocation "
                        f"({cached['streamed_share']:.0%}); predicted {cached['predicted_ms_before']:.3f} -> "
                        f"{cached['predicted_ms_after']:.3f} ms")
            out.shipped[seg.id], out.logs[seg.id] = (art, seg), record
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _renamed(rep: backends.Compiled, rep_seg: PlanSegment, seg: PlanSegment) -> backends.Compiled:
    """`rep`, the compiled artifact of `rep_seg`, for `seg` that computes the same: its tensor specs under
    `seg`'s names (inputs and outputs correspond in order)."""
    rename = dict(zip(rep_seg.inputs + rep_seg.outputs, seg.inputs + seg.outputs))
    return dataclasses.replace(rep, inputs=tuple(dataclasses.replace(t, name=rename[t.name]) for t in rep.inputs),
                               outputs=tuple(dataclasses.replace(t, name=rename[t.name]) for t in rep.outputs),
                               twin=None, tuned=None)


def _own_copy(bundle: Path, artifact: str, device: str) -> str:
    """A copy of `artifact` for `device` (segments/s3.tflite -> segments/s3.edgetpu1.tflite)."""
    path = Path(artifact)
    copy = path.with_name(f"{path.stem}.{device.replace(':', '')}{path.suffix}").as_posix()
    shutil.copyfile(bundle / artifact, bundle / copy)
    return copy


def finish_groups(plan: Plan, segments: list[PlanSegment] | None = None) -> dict[str, list[str]]:
    """Per device instance whose kind has a finishing compiler, its segments (`segments`, default the
    plan's) in the order to compile them together: the plan's cache priority (`Plan.caches`,
    scheduling/cache.py), else plan order."""
    order = {d: rec.get("compile_order", []) for d, rec in plan.caches.get("instances", {}).items()}
    groups: dict[str, list[str]] = {}
    for seg in plan.segments if segments is None else segments:
        if backends.finisher(seg.device.split(":")[0]) is not None:
            groups.setdefault(seg.device, []).append(seg.id)
    for d, ids in groups.items():
        rank = {sid: k for k, sid in enumerate(order.get(d, []))}
        ids.sort(key=lambda sid: rank.get(sid, len(rank)))   # sorted() is stable: the rest in plan order
    return groups


def _caches_from_logs(groups: dict[str, list[str]], logs: dict[str, dict]) -> dict[str, dict]:
    """Each instance's cache as its compiler reported it: every model's on-chip and off-chip
    parameters, and the usable capacity (what they all used plus what the last left)."""
    out = {}
    for d, ids in groups.items():
        mine = list({id(logs[i]): logs[i] for i in ids if i in logs}.values())   # a shared model's record once
        if mine:
            out[d] = {"capacity_bytes": sum(r["on_chip_bytes"] for r in mine) + mine[-1].get("on_chip_remaining_bytes", 0),
                      "cached_bytes": sum(r["on_chip_bytes"] for r in mine),
                      "streamed_bytes": sum(r["off_chip_bytes"] for r in mine),
                      "capacity_source": "the compiler's log: on-chip memory used by its models + remaining"}
    return out


def finish_segments(finisher: backends.Finisher, bundle: Path, items: list[tuple[str, PlanSegment]], scheduled: Path,
                    target, plan: Plan | None = None) -> list[tuple[str, dict, dict | None, PlanSegment]]:
    """One device instance's segments (`artifact` relative to `bundle`, the plan's segment), finished
    together by its kind's compiler: per segment the artifact to ship, the compiler's record, and where
    it maps only part of the segment the correction (`scheduling.correction`: what really runs where,
    costed by the scheduler's model) and the segment with the corrected prediction; else None and the
    segment as it was. An artifact several segments share is compiled once. `plan` (the whole plan)
    prices the corrections by its caches."""
    first = {art: seg for art, seg in reversed(items)}   # each artifact's first segment, in order
    once = list(dict.fromkeys(art for art, _ in items))
    done = dict(zip(once, finisher.run_group([backends.FinishJob(bundle, art, first[art]) for art in once])))
    model = None
    out = []
    for art, seg in items:
        finished = done[art]
        if finished.partial is None:
            out.append((finished.artifact, finished.record, None, seg))
            continue
        model = model or irm.read(scheduled)
        correction = edgetpu_correction(seg.to_json(), finished.partial, model, target,
                                        [s.to_json() for s in plan.segments] if plan else None)
        out.append((finished.artifact, finished.record, correction,
                    dataclasses.replace(seg, predicted_ms=correction["predicted_ms_after"])))
    return out


def finish_segment(finisher: backends.Finisher, bundle: Path, artifact: str, seg: PlanSegment, scheduled: Path,
                   target) -> tuple[str, dict, dict | None, PlanSegment]:
    """One segment finished alone (`finish_segments` of one)."""
    return finish_segments(finisher, bundle, [(artifact, seg)], scheduled, target)[0]


def _manifest(shipped: _Shipped, src: Sources, target, imported: dict, log, warnings) -> mf.Manifest:
    """The manifest before the golden run: its accuracy and file table come last."""
    # model-level tensors: the producing segment's spec carries the int8 quantization, if any
    produced = {t.name: t for s in shipped.segments for t in s.outputs}
    outputs = tuple(mf.TensorSpec(name=o["name"], shape=tuple(o["shape"]), dtype=o["dtype"],
                                  quant=produced[o["name"]].quant) for o in imported["outputs"])
    # an input that indexes a table (token ids) carries the range the table allows; the runtime refuses others
    ranges = index_ranges.infer(irm.read(src.imported / "model.onnx"))
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
        replicas=shipped.replicas,
        cpu_threads=target.host.cores,
        predicted=plan.predicted, toolchain=toolchain(), calibration=compress.get("calibration") or _cpu_int8(src)["calibration"],
        edgetpu=shipped.finishing,
        tuning=tuning_provenance(json.loads((src.tuned / "tune.json").read_text()), shipped.tuned,
                                 plan.cpu_selection),
        pruning=pruning_summary(compress, shipped.tuned),
        warnings=tuple(warnings()),
    )


def _pruned(src: Sources) -> tuple[onnx.ModelProto, list[dict]] | None:
    """The compress stage's pruned model and its per-layer records (`--prune`), or None."""
    path = src.compressed / "pruned.onnx"
    if not path.exists():
        return None
    record = json.loads((src.compressed / "compress.json").read_text())["pruning"]
    return irm.read(path), record["layers"]


def pruning_summary(compress: dict, tuned: dict[str, dict]) -> dict:
    """The manifest's `pruning`: the compress stage's record in short, and the sparse kernels compiled."""
    entry = compress.get("pruning")
    if not entry:
        return {}
    return {"method": entry["method"], "layers": len(entry["layers"]), "sparsity": entry["sparsity"],
            "corrected": "correction" in entry, "retrained": False,
            "fidelity": entry["fidelity"], "accelerator_layers_dense": entry.get("accelerator_layers_dense", []),
            "sparse_kernels": sum(t.get("sparse_kernels", 0) for t in tuned.values()),
            **({"plan": entry["plan"]} if entry.get("plan") else {}),
            **({"accuracy": entry["accuracy"]} if "accuracy" in entry else {})}


def _cpu_int8(src: Sources) -> dict:
    """The tune stage's int8 CPU segments (`--cpu-precision int8`) and their calibration."""
    path = src.tuned / "int8.json"
    return json.loads(path.read_text()) if path.exists() else {"segments": {}, "calibration": {}}


def _judge(accuracy: dict, plan: Plan, log, *, target=None, options=None, calibration: dict | None = None,
           warn=None, search=None, int8_model: bool = False,
           conditioning: Callable[[], dict[str, list[float]]] | None = None) -> dict:
    """Log the bundle's accuracy against the fp32 model, and refuse a bundle that is off it where nothing
    excuses it (no bundle is published then); returns the accuracy record with the verdict:

    - with reduced precision anywhere (int8 segments on the Edge TPU or the CPU, 16-bit float ones on the CPU, or a
      model quantized itself: `int8_model`), every output part must reach the target's accuracy gate (bundling/gate.py), or the user
      accepts the loss;
    - with none, every output must agree within the tolerance the tune stage's check of float candidates
      allows (`selection.TOLERANCE` of its largest magnitude): a float plan that does not has a wrong
      kernel or a wrong tuning record. Except on a sample where the fp32 model is itself ill-conditioned
      (`conditioning()`, asked only where an output is off: per output, per sample, how far fp32 moves by
      itself, `golden.conditioning`): there the output is held within `golden.CONDITION_MARGIN` times that."""
    from ..scheduling import selection

    quantized = [s for s in plan.segments if backends.backend(s.backend).quantizes
                 or backends.backend(s.backend).precision != "fp32"]
    n = accuracy["samples"]
    if quantized or int8_model:  # judged by part: one cosine over a whole output hides its scores behind its boxes
        return gate.judge(accuracy, plan, target, options, calibration or {}, search=search or (lambda f: []),
                          log=log, warn=warn or log)
    for name, a in accuracy["tensors"].items():
        log(f"package: accuracy of {name} vs the fp32 model: cosine {a['cosine']:.5f}, "
            f"max abs error {a['max_abs_error']:.4g}")
    own = None
    for name, a in accuracy["tensors"].items():
        err, rel = a["max_abs_error"], a["max_rel_error"]
        scale = err / rel if rel else 0.0
        allowed = selection.TOLERANCE * max(scale, 1e-6)
        if err <= allowed:  # NaN fails
            continue
        if conditioning is not None and "sample_errors" in a and np.isfinite(err):
            own = conditioning() if own is None else own
            held = _within_fp32s_own_spread(name, a["sample_errors"], own.get(name), allowed, scale, log)
            if held is not None:
                accuracy["tensors"][name] = {**a, "ill_conditioned": held}
                continue
        raise UserError(
            "package.float-mismatch",
            f"the bundle's {name} differs from the fp32 model by {err:.4g} ({rel:.3g} of its largest "
            f"magnitude, more than the float tolerance {selection.TOLERANCE:g}) on {n} samples, although "
            f"nothing is quantized: a compiled kernel or a tuning record computes wrong results",
            hint="rebuild with --tuning-db pointing at an empty directory to rule out a tuning record; "
                 "if it persists, report it with the model")
    return accuracy


def _within_fp32s_own_spread(name: str, errors: list[float], spread: list[float] | None, allowed: float,
                             scale: float, log) -> dict | None:
    """The record of an output off by more than `allowed` on some samples, where each of those is one the fp32
    model is ill-conditioned on (it moves by itself by more than `allowed`) and the bundle is within
    `golden.CONDITION_MARGIN` times that; None where any sample is off otherwise (a wrong kernel)."""
    if spread is None or len(spread) != len(errors):
        return None
    off = [i for i, e in enumerate(errors) if not e <= allowed]
    if not all(spread[i] > allowed and errors[i] <= golden.CONDITION_MARGIN * spread[i] for i in off):
        return None
    ill = [i for i, s in enumerate(spread) if s > allowed]
    log(f"package: {name}: fp32 itself moves by up to {max(spread[i] for i in ill) / scale:.3g} of its largest "
        f"magnitude on held-out sample(s) {', '.join(str(i) for i in ill)} of {len(errors)} (its inputs moved by "
        f"{golden.CONDITION_STEP:.2g} of their values, or onnxruntime's graph optimizations off): ill-conditioned "
        f"there, the bundle is within {golden.CONDITION_MARGIN:g}x that (largest "
        f"{max(errors[i] for i in off) / scale:.3g}); within the float tolerance on the rest")
    return {"samples": ill, "fp32_moves": [round(spread[i] / scale, 6) for i in ill],
            "bundle_error": [round(errors[i] / scale, 6) for i in ill], "step": golden.CONDITION_STEP,
            "margin": golden.CONDITION_MARGIN}


def _probe(src: Sources, failure, held: list[dict], target, options, declared: dict[str, str], log) -> dict | None:
    """The failing measure with each int8 segment on an accelerator in float in turn (bundling/probe.py): the
    task's on --eval's samples where the task failed, else the gate's parts on the held-out samples."""
    from ..compression.accuracy import Gate
    from . import probe

    plan = Plan.load(src.scheduled)
    entries = json.loads((src.compressed / "compress.json").read_text()).get("segments", {})
    try:
        if failure.code == "accuracy.task":
            e = evaluation.eval_inputs(options, src.imported)
            judge = probe.task_judge(e["task"], e["labels"], e["spec"])
            samples, measure = e["samples"], f"the {e['task']} goal on --eval's samples"
        else:
            parts = accuracy_views.views(irm.read(src.imported / "model.onnx"), declared)
            judge = probe.parts_judge(parts, Gate.of(target.accuracy))
            samples, measure = held, "the accuracy gate on the held-out samples"
        return probe.probe(plan, src.scheduled, src.compressed, entries, samples, judge, measure, log)
    except Exception as e:  # noqa: BLE001 - a diagnosis that fails must not hide the gate's verdict
        log(f"package: accuracy probe failed ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})")
        return None


def _culprits(src: Sources, reference, samples: list[dict], log, declared: dict[str, str] | None = None) -> list:
    """The layers that lose the most in the plan's int8 segments (bundling/gate.py)."""
    plan = Plan.load(src.scheduled)  # the segments' own graphs, before packaging named their artifacts
    segments = gate.searchable(plan, src.compressed, json.loads((src.compressed / "compress.json").read_text()),
                               src.tuned / "int8", _cpu_int8(src))
    return gate.search(segments, src.scheduled, reference(), samples, gate.legalize_approximations(src.legalized), log,
                       declared)


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
    """requirements.txt: the runtime's own distributions (RUNTIME_DISTS) and those of the backends the
    segments use, pinned to the build host's versions, then as comments what else the device needs
    (`Compiled.device_needs`)."""
    used = {s.backend for s in segments}
    dists = dict.fromkeys([*RUNTIME_DISTS,
                           *(d for b in backends.backends() if b.runner in used for d in b.runtime_dists)])
    lines = [f"# runtime dependencies of this bundle on the device ({arch}); installed from wheels, offline"]
    for d in dists:
        lines.append(f"{d}=={importlib.metadata.version(d)}")
    return "\n".join(lines + [f"# {line}" for line in needs]) + "\n"


def provenance(manifest: mf.Manifest, samples: list[dict[str, np.ndarray]], calibration: dict) -> dict:
    """The manifest's `provenance`: the digests of what the bundle was built from — taken from the
    manifest's own records, not hashed again, but for the calibration data — what built it, and the SBOM.
    `samples` and `calibration` are `load_calibration`'s."""
    return {"model_sha256": manifest.model["sha256"], "target_sha256": manifest.target["sha256"],
            "tuning_database_sha256": manifest.tuning["database_sha256"],
            **calibration_provenance(samples, calibration),
            "sdk_version": manifest.sdk_version, "toolchain": manifest.toolchain,
            "python": platform.python_version(), "sbom": SBOM_FILE, "source_date_epoch": source_date_epoch()}


def calibration_provenance(samples: list[dict[str, np.ndarray]], calibration: dict) -> dict:
    """The calibration data's digest: with --calib, the directory's (`tree_sha256`, as the stages' cache
    keys take it); without, the synthesized samples' (`samples_sha256`), with the seed that makes them."""
    if not calibration["synthetic"]:
        return {"calibration_sha256": tree_sha256(Path(calibration["source"])),
                "calibration": {"source": "directory", "samples": len(samples)}}
    return {"calibration_sha256": samples_sha256(samples),
            "calibration": {"source": "synthesized", "seed": calibration["seed"], "samples": len(samples),
                            "distribution": calibration["distribution"]}}


def samples_sha256(samples: list[dict[str, np.ndarray]]) -> str:
    """sha256 over the samples in order, each one's inputs by name: name, dtype, shape, then the C-order bytes."""
    h = hashlib.sha256()
    for feed in samples:
        for name in sorted(feed):
            a = np.ascontiguousarray(feed[name])
            h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
            h.update(a.data)
    return h.hexdigest()


def tuning_provenance(tune: dict, tuned: dict, cpu_selection: dict) -> dict:
    """Where the kernels' schedules come from: the digest and size of the database the package
    stage applied (a build that replays it is the same bytes), per segment how many of its
    functions got a record, and the CPU backends' measured times and the choice (when measured)."""
    return {"database_sha256": tune["database_sha256"], "database_records": tune.get("database_records", 0),
            "segments": tuned, **({"cpu_selection": cpu_selection} if cpu_selection else {})}
