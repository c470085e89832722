"""Plain-text reports: placement summary, bundle inspection, calibration."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def import_summary(record: dict[str, Any], top: int = 8) -> str:
    """What import read and how the graph-level optimizations changed it: rules fired, op counts."""
    before, after = record["nodes_before"], record["nodes_after"]
    nb, na = sum(before.values()), sum(after.values())
    source = record["format"] + (f" via {record['converter']}" if record.get("converter") else "")
    opset = record["opset"]
    lines = [f"import: {source}, opset {opset['source']}"
             + (f" -> {opset['canonical']}" if opset["canonical"] != opset["source"] else "")
             + f"; {nb} nodes -> {na} after optimization" + (f" ({(na - nb) / nb:+.0%})" if nb else "")]
    fired = sorted(((n, c) for n, c in record["rules"].items() if c), key=lambda nc: (-nc[1], nc[0]))
    lines.append("  rules fired: " + (", ".join(f"{n} x{c}" for n, c in fired) if fired else "none"))
    changed = sorted((op for op in set(before) | set(after) if before.get(op, 0) != after.get(op, 0)),
                     key=lambda op: (-abs(before.get(op, 0) - after.get(op, 0)), op))  # ties by name: stable output
    if changed:
        shown = ", ".join(f"{op} {before.get(op, 0)}->{after.get(op, 0)}" for op in changed[:top])
        lines.append("  ops changed: " + shown + (f", and {len(changed) - top} more" if len(changed) > top else ""))
    return "\n".join(lines)


def placement_summary(plan: dict[str, Any]) -> str:
    lines = [f"{'segment':<8} {'device':<11} {'backend':<12} {'nodes':>5} {'predicted ms':>13}"]
    for s in plan["segments"]:
        lines.append(f"{s['id']:<8} {s['device']:<11} {s['backend']:<12} {len(s['nodes']):>5} {s['predicted_ms']:>13.3f}")
    p = plan["predicted"]
    by_dev = ", ".join(f"{d}: {n} nodes" for d, n in plan["placement"].items())
    lines.append(f"placement: {by_dev}")
    for k, moved in enumerate(plan.get("replicas") or (), 1):
        lines.append(f"replica {k}: a stream's frames alternate with a copy of the plan on "
                     + ", ".join(f"{a} -> {b}" for a, b in moved.items()))
    lines.append(f"predicted: {p['latency_ms']:.3f} ms per inference, {p['throughput_fps']:.1f} frames/s on a stream "
                 f"(simulated on the cost model of devices/cost.py)")
    if line := chosen_line(plan.get("chosen") or {}):
        lines.append(f"  {line}")
    if kept := plan.get("keep_on_cpu"):
        k = kept["predicted"]
        by = (f"the accuracy remedy, {len(kept['remedy'])} round(s)" if kept.get("remedy") else "--keep-on-cpu")
        lines.append(f"  kept in float on the cpu ({by}): {', '.join(kept['nodes'])}: {k['latency_ms_without']:.3f} ms "
                     f"per inference without that constraint ({k['cost_ms']:+.3f} ms)")
    for name, b in (plan.get("baselines") or {}).items():
        if "error" not in b:
            lines.append(f"  vs {name}: {b['latency_ms']:.3f} ms, {b['throughput_fps']:.1f} frames/s")
    lines += cpu_selection_summary(plan.get("cpu_selection") or {})
    return "\n".join(lines)


def chosen_line(chosen: dict[str, Any]) -> str:
    """Which candidate the plan is, against the best other one (`Plan.chosen`); "" for a plan without it."""
    if not chosen:
        return ""
    key = chosen["objective"]
    unit = " ms per inference" if key == "latency_ms" else " frames/s"

    def who(name: str) -> str:
        return f"the placement of the baseline '{name[len('baseline: '):]}'" if name.startswith("baseline: ") else name

    line = f"chosen: {who(chosen['candidate'])} ({chosen[key]:g}{unit})"
    if "versus" in chosen:
        margin = chosen["margin_percent"]
        line += (f", {margin:.2f} % better than " if margin else ", as good as ") + \
            f"{who(chosen['versus'])} ({chosen['versus_' + key]:g}{unit})"
    return line


def cpu_selection_summary(selection: dict[str, Any]) -> list[str]:
    """The tune stage's choice of each CPU span's backend: what was measured, where, and what won."""
    if not selection or not selection.get("spans"):   # no CPU span: nothing was chosen
        return []
    if selection.get("measured_on") is None:  # chosen by policy (or, in older bundles, the plan kept)
        lines = [f"cpu backends: {selection.get('note', 'not measured')}"]
        for span in selection.get("spans", []):
            ids = span["segments"]
            why = span.get("why", "").split("; not measured: ")[0]  # the reason is the note's
            lines.append(f"  {ids[0] if len(ids) == 1 else ids[0] + '..' + ids[-1]} ({span.get('nodes', '?')} nodes): "
                         f"{span['chosen']} chosen; {why}")
        return lines
    lines = [f"cpu backends measured on {selection['measured_on']} (median of interleaved runs):"]
    if selection.get("target_cpu"):
        cpu = selection["target_cpu"]
        lines.append(f"  built for this host's CPU ({cpu['mcpu']}: {', '.join(cpu['features']) or 'none of the features said'})")
    for p, why in (selection.get("precisions_not_offered") or {}).items():
        lines.append(f"  no {p} candidate: {why}")
    if selection.get("precision") == "int8" and selection.get("gate"):
        g = selection["gate"]
        lines.append(f"  int8 candidates quantized on {g['calibration_samples']} calibration samples, admitted at cosine "
                     f">= {g['cosine']} and top-1 agreement >= {g['top1']:.0%} with fp32 on "
                     + (f"{g['held_out_samples']} held-out samples" if g["held_out_samples"] else "the calibration sample (none held out)"))
    for span in selection.get("spans", []):
        ids = span["segments"]
        times = ", ".join(f"{name} {c['ms']:.3f} ms{_gate_text(c.get('gate'), c.get('mixed'))}"
                          for name, c in sorted(span["candidates"].items(), key=lambda kv: kv[1].get("ms", 1e30))
                          if "ms" in c)
        skipped = "; ".join(f"{name} skipped: {c['skipped']}" for name, c in span["candidates"].items() if "skipped" in c)
        close = span.get("within_noise")
        noise = (f" (within the measured noise: {close['margin']:.1%} ahead of {close['runner_up']}, rounds spread up "
                 f"to {close['noise']:.1%})" if close else "") + _replay_text(span)
        lines.append(f"  {ids[0] if len(ids) == 1 else ids[0] + '..' + ids[-1]} ({span.get('nodes', '?')} nodes): "
                     f"{span['chosen']} chosen{noise}; {times}" + (f"; {skipped}" if skipped else ""))
    return lines


def _replay_text(span: dict) -> str:
    """Where the replayed winner, timed once more, refuted the timing cache and every candidate was timed again."""
    if (refuted := span.get("replay_refuted")) is None:
        return ""
    now = "failed to time" if refuted["now_ms"] is None else f"measured {refuted['now_ms']:.3f} ms"
    return (f" (timed again: {refuted['candidate']}, {refuted['cached_ms']:.3f} ms in the timing cache, {now} on "
            f"this build, behind {refuted['runner_up']}'s {refuted['runner_up_ms']:.3f} ms)")


def _gate_text(gate: dict | None, mixed: dict | None = None) -> str:
    if not gate:
        return ""
    top1 = f", top-1 {gate['top1']:.0%}" if gate.get("top1") is not None else ""
    kept = f"; mixed precision, {mixed['float_ops']} of {mixed['ops']} ops float" if mixed else ""
    return f" (cosine {gate['cosine']:.4f}{top1}{kept})"


def inspect_bundle(manifest, bundle: Path) -> str:
    m = manifest
    out = [f"bundle      {bundle}",
           f"model       {m.model['name']} (sha256 {m.model.get('sha256', '?')[:16]}…, opset {m.model.get('opset')})",
           f"target      {m.target['name']}: {m.target.get('description', '')}",
           f"arch        {m.arch}; edgesdk {m.sdk_version}; runtime >= {m.min_runtime_version}",
           "inputs      " + ", ".join(f"{t.name} {list(t.shape)} {t.dtype}" + (
               f" (indices, valid [{t.valid_range[0]}, {t.valid_range[1]}])" if t.valid_range else "") for t in m.inputs),
           "outputs     " + ", ".join(f"{t.name} {list(t.shape)} {t.dtype}" + (" (int8 segment)" if t.quant else "")
                                      for t in m.outputs),
           "",
           f"{'segment':<8} {'device':<11} {'physical':<9} {'backend':<12} {'nodes':>5} {'predicted ms':>13}  artifact (bytes)"]
    for s in m.segments:
        size = m.files.get(s.artifact, {}).get("size", 0)
        out.append(f"{s.id:<8} {s.device:<11} {m.device_map.get(s.device, '?'):<9} {s.backend:<12} {s.nodes:>5} "
                   f"{s.predicted_ms:>13.3f}  {s.artifact} ({size:,})")
    out.append("")
    out.append(f"predicted   {m.predicted.get('latency_ms', 0):.3f} ms per inference, "
               f"{m.predicted.get('throughput_fps', 0):.1f} frames/s pipelined")
    for k, ids in enumerate(m.replicas, 1):
        moved = [s for s in m.segments if s.replica == k]
        out.append(f"replica {k}   a stream's frames alternate between the plan and replica {k}: "
                   + ", ".join(f"{s.id} on {s.device}" for s in moved) + " (run() uses the plan's own segments)")
    if m.edgetpu:
        state = "compiled" if m.edgetpu.get("edgetpu_compiled") else "NOT compiled (int8 runs on the CPU until compiled)"
        out.append(f"edge tpu    {state}")
        if m.edgetpu.get("finish_command"):
            out.append(f"            finish with: {m.edgetpu['finish_command']}")
        for device, ids in (m.edgetpu.get("co_compiled") or {}).items():
            arts = list(dict.fromkeys(s.artifact for s in m.segments if s.id in ids))
            cache = (m.edgetpu.get("caches") or {}).get(device)
            held = (f"; cache {_bytes(cache['cached_bytes'])} of {_bytes(cache['capacity_bytes'])}, "
                    f"{_bytes(cache['streamed_bytes'])} streamed (the compiler's log)" if cache else "")
            out.append(f"            {device}: {len(ids)} segment(s) in {len(arts)} model(s) co-compiled in this "
                       f"order (cache priority): {', '.join(ids)}{held}")
        for c in m.edgetpu.get("cache_corrections") or []:
            out.append(f"            {c['segment']}: the compiler streams {c['streamed_share']:.0%} of its parameters; "
                       f"predicted {c['predicted_ms_before']:.3f} -> {c['predicted_ms_after']:.3f} ms")
        out += [f"            {line}" for line in edgetpu_mapping(m.edgetpu)]
    out += cpu_selection_summary(m.tuning.get("cpu_selection") or {})
    out += calibration_summary(m.calibration)
    out += pruning_summary(m.pruning)
    out += provenance_summary(m.provenance, m.bundle_version, m.signing)
    reference = "the pruned fp32 model" if m.pruning else "fp32"
    lines = accuracy_lines(m.accuracy, reference)
    if lines:
        out += [f"{'accuracy' if k == 0 else '':<12}{line}" for k, line in enumerate(lines)]
    else:  # a bundle from before the gate judged parts
        for name, a in (m.accuracy.get("tensors") or {}).items():
            out.append(f"accuracy    {name}: cosine {a['cosine']:.5f}, max abs error {a['max_abs_error']:.4g} vs {reference}")
        if "top1_agreement" in m.accuracy:
            out.append(f"            top-1 agreement {m.accuracy['top1_agreement']:.0%} on {m.accuracy.get('samples', '?')} samples")
    task = m.accuracy.get("task")
    if isinstance(task, dict):  # --eval: the task's own measure against the fp32 model, and its verdict
        out.append(f"task        {_text(task.get('task'))} on {task.get('samples', '?')} --eval sample(s): "
                   f"{_text(task.get('summary'))}")
    size = sum(f["size"] for f in m.files.values())
    out.append(f"files       {len(m.files)} files, {size:,} bytes")
    for w in m.warnings:
        out.append(f"warning     {w}")
    return "\n".join(out)


def calibration_summary(c: dict[str, Any]) -> list[str]:
    """Where the int8 ranges came from: real samples, or synthetic ones (each input's range and its source),
    then said loudly that accuracy on real inputs is unknown; the method, and how many tensors each method
    calibrated. The manifest's schema leaves `calibration` open: each value is shown only as what it is."""
    if not c:
        return []
    inputs = c.get("inputs") if isinstance(c.get("inputs"), dict) else {}
    if c.get("synthetic"):
        drawn = "; ".join(f"{_text(k)}: [{_nums(r.get('low'))}, {_nums(r.get('high'))}] from {_text(r.get('source'))}"
                          for k, r in inputs.items() if isinstance(r, dict))
        out = [f"calibration SYNTHETIC, {_value(c.get('samples'))} samples" + (f" ({drawn})" if drawn else ""),
               "            int8 accuracy on real inputs is UNKNOWN: " + _text(c.get("hint") or "give real inputs with --calib DIR")]
    else:
        out = [f"calibration from {_text(c.get('source'))}, {_value(c.get('samples'))} samples"]
    methods = c.get("methods") if isinstance(c.get("methods"), dict) else {}
    if c.get("method"):
        counts = ", ".join(f"{_text(k)} {_value(v)}" for k, v in methods.items())
        out.append(f"            method {_text(c.get('method'))}" + (f": tensors by method {counts}" if counts else ""))
    return out


def _value(v: Any) -> str:
    """A number or text from an open part of the manifest as it is; anything else as '?'."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return f"{v:.4g}"
    return _text(v)


def _nums(v: Any) -> str:
    return ":".join(_value(x) for x in v) if isinstance(v, list) else _value(v)


def accuracy_summary(accuracy: dict[str, Any]) -> str:
    """The build summary's accuracy: the gate's verdict, each output part's figures, the culprits."""
    lines = accuracy_lines(accuracy)
    return "\n".join(["accuracy: " + lines[0], *(f"  {line}" for line in lines[1:])]) if lines else ""


def accuracy_lines(accuracy: dict[str, Any], reference: str = "fp32") -> list[str]:
    """The package stage's accuracy record (the manifest's `accuracy`) as lines: the verdict first, loud
    where the bundle is below its gate or its calibration was synthetic; [] for a record without parts."""
    parts = accuracy.get("parts") or {}
    if reference == "fp32" and str(accuracy.get("reference", "")).startswith("LiteRT"):
        reference = "the model's own int8 (LiteRT)"  # a quantized TFLite model, run as given
    if not parts:
        return []
    gate = accuracy.get("gate") or {}
    n = accuracy.get("samples", "?")
    on = f"{n} held-out samples" if accuracy.get("held_out", True) else "the calibration sample (none held out)"
    failed = {f["part"]: f for f in accuracy.get("failures") or ()}
    ill = {name: t["ill_conditioned"] for name, t in (accuracy.get("tensors") or {}).items() if t.get("ill_conditioned")}
    if not gate:
        verdict = "float throughout: judged within the float tolerance"
        if ill:
            verdict += (", but where fp32 itself is ill-conditioned: there within "
                        f"{max(i['margin'] for i in ill.values()):g}x how far fp32 moves by itself")
    elif accuracy.get("accepted_loss"):
        verdict = ("BELOW THE ACCURACY GATE: published only because of --accept-accuracy-loss "
                   f"({len(failed)} part(s) under the target's thresholds)")
    elif failed:
        verdict = f"BELOW THE ACCURACY GATE ({len(failed)} part(s))"
    else:
        verdict = "within the target's accuracy gate"
    lines = [f"each output against {reference} on {on}: {verdict}"]
    for part, m in parts.items():
        kind = f"scores, after its {m.get('activation')}" if m.get("kind") == "scores" else "values"
        top1 = f", top-1 {m['top1']:.1%}" if m.get("top1") is not None else ""
        mark = f": BELOW ({', '.join(_missed(failed[part]))})" if part in failed else ""
        lines.append(f"{part} ({kind}): cosine {m['cosine']:.4f}, mean error {m['mean_error']:.2%} and max error "
                     f"{m['max_error']:.1%} of its range{top1}{mark}")
    for name, i in ill.items():
        lines.append(f"{name}: fp32 ill-conditioned on held-out sample(s) {', '.join(map(str, i['samples']))} (it moves by "
                     f"up to {max(i['fp32_moves']):.2%} of its largest magnitude by itself; the bundle is off by up to "
                     f"{max(i['bundle_error']):.2%} there)")
    for c in accuracy.get("culprits") or ():
        lines.append(f"culprit {c['node']} in {c['segment']} ({c['op']} -> {c.get('int8_op') or '?'}): "
                     f"{c['added_error']:.1%} of its range lost there, SNR {c['added_snr_db']:.1f} dB; {c['cause']}")
    lines += remedy_lines(accuracy.get("remedy") or {}, parts)
    if gate.get("calibration") == "synthetic":
        lines.append("calibration SYNTHETIC (no --calib): the accuracy on real data is UNKNOWN")
    return lines


def remedy_lines(remedy: dict[str, Any], parts: dict[str, Any]) -> list[str]:
    """The nodes kept in float on the CPU (the accuracy remedy's, `--keep-on-cpu`): which and why, each failing
    part's figures before the first round and now, and the predicted latency the constraint costs."""
    if not remedy:
        return []
    said = []
    probed = {r["round"]: r["probe"] for r in remedy.get("rounds") or () if r.get("probe")}
    for k in remedy.get("kept_on_cpu") or ():
        if k.get("round") in probed:
            continue  # a probe's round moves a whole set of segments: said once below
        if "round" in k:
            said.append(f"{k['node']} (round {k['round']}: {k['cause']}, {k['added_error']:.1%} of its range lost "
                        f"there on {k['device']})")
        else:
            said.append(f"{k['node']} (--keep-on-cpu)")
    for r in remedy.get("rounds") or ():
        if r["round"] in probed:
            nodes = r["nodes"]
            said.append(f"{len(nodes)} node(s) ({', '.join(nodes[:4])}{', ...' if len(nodes) > 4 else ''}; round "
                        f"{r['round']}, end to end: {probed[r['round']]})")
    p = remedy.get("predicted") or {}
    lines = [f"kept in float on the cpu: {'; '.join(said)}",
             f"predicted latency {p.get('latency_ms_without', 0):.3f} ms without that, {p.get('latency_ms', 0):.3f} ms "
             f"with it ({p.get('cost_ms', 0):+.3f} ms)"]
    rounds = remedy.get("rounds") or ()
    if rounds:
        before = rounds[0]
        for f in before.get("failures_before") or ():
            b, a = before["parts_before"].get(f["part"], {}), parts.get(f["part"], {})
            lines.append(f"{f['part']}: before the remedy {_figures(b)}; after it {_figures(a)}")
    return lines


def _figures(m: dict[str, Any]) -> str:
    if not m:
        return "?"
    top1 = f", top-1 {m['top1']:.1%}" if m.get("top1") is not None else ""
    return f"cosine {m['cosine']:.4f}, mean error {m['mean_error']:.2%}{top1}"


def _missed(failure: dict[str, Any]) -> list[str]:
    out = []
    for m, f in failure.get("missed", {}).items():
        side = ">=" if m in ("cosine", "top1") else "<="
        out.append(f"{m.replace('_', ' ')} {f['value']:.4g}, the gate wants {side} {f['threshold']:g}")
    return out


def provenance_summary(p: dict[str, Any], bundle_version: int = 0, signing: dict[str, Any] | None = None) -> list[str]:
    """What the bundle was built from (digests to 12 hex digits), by which SDK, its SBOM; its version and
    signing key. The manifest's schema leaves `provenance` open, so each value is shown only as what it is."""
    out = []
    if p:
        digests = [f"{label} {_short(p.get(key))}" for label, key in (
            ("model", "model_sha256"), ("target", "target_sha256"), ("tuning db", "tuning_database_sha256"),
            ("calibration", "calibration_sha256"))]
        calib = p.get("calibration") if isinstance(p.get("calibration"), dict) else {}
        if calib.get("source") == "synthesized":
            digests[-1] += f" (synthesized, seed {calib.get('seed')})"
        out += [f"provenance  {', '.join(digests)}",
                f"            edgesdk {_text(p.get('sdk_version'))}; SBOM {_text(p.get('sbom'))}"]
    signing = signing or {}
    version = f"bundle version {bundle_version}" if bundle_version else ""
    signed = (f"signed by key {signing['key_id']} ({signing.get('algorithm', '?')})" if signing.get("key_id")
              else "unsigned")
    out.append(f"signing     {'; '.join(x for x in (version, signed) if x)}")
    return out


def _short(digest: Any) -> str:
    return digest[:12] if isinstance(digest, str) and digest else "?"


def _text(value: Any) -> str:
    return value if isinstance(value, str) and value else "?"


def pruning_summary(p: dict[str, Any]) -> list[str]:
    """A pruned bundle's method, sparsity, sparse kernels and fidelity to the dense model (docs/pruning.md)."""
    if not p:
        return []
    out = [f"pruning     {p['method']}: {p['layers']} layer(s), {p['sparsity']:.1%} of their weights zero"
           f"{', least-squares correction' if p.get('corrected') else ''}, no retraining; "
           f"{p.get('sparse_kernels', 0)} convolution(s) on sparse kernels"]
    if p.get("accelerator_layers_dense"):
        out.append(f"            {len(p['accelerator_layers_dense'])} layer(s) on an accelerator kept dense "
                   "(the Edge TPU gains nothing from sparsity)")
    fid = p.get("fidelity") or {}
    for name, f in (fid.get("end_to_end") or {}).items():
        top1 = f", top-1 agreement {f['top1_agreement']:.1%}" if f.get("top1_agreement") is not None else ""
        out.append(f"            fidelity of {name} to the dense model: cosine {f['cosine']:.5f}{top1}, max error "
                   f"{f['max_error_of_scale']:.2%} of its scale ({fid.get('samples', '?')} samples; not accuracy)")
    acc = p.get("accuracy")
    if acc:
        top1 = acc["top1"]
        out.append(f"            top-1 accuracy on {acc['labels']} labelled sample(s) (--eval): dense {top1['dense']:.2%}, "
                   f"pruned {top1['pruned']:.2%}" + (f", corrected {top1['corrected']:.2%}" if "corrected" in top1 else ""))
    plan = p.get("plan") or {}
    if plan.get("source") == "auto" and "dense_ms" not in plan:
        out.append(f"            per-layer plan under a {plan['budget_ms']:g} ms budget: the dense model met it "
                   f"({plan.get('predicted_ms', 0):.3f} ms, CPU time on the build host): nothing pruned")
    elif plan.get("source") == "auto":
        measured = f", measured {plan['measured_ms']:.3f} ms" if "measured_ms" in plan else ""
        out.append(f"            per-layer plan chosen under a {plan['budget_ms']:g} ms budget: dense {plan['dense_ms']:.3f} ms, "
                   f"predicted {plan['predicted_ms']:.3f} ms{measured} (CPU time on the build host)")
    elif plan.get("source"):
        out.append(f"            per-layer plan: {plan['source']}")
    return out


def edgetpu_mapping(edgetpu: dict[str, Any]) -> list[str]:
    """Per compiled Edge TPU segment: what the compiler mapped, its parameter memory, and where a
    partly mapped segment's ops go to the CPU with the corrected prediction."""
    corrected = {c["segment"]: c for c in edgetpu.get("corrections", ())}
    lines = []
    for sid, log in (edgetpu.get("compiler") or {}).items():
        memory = f"parameters {_bytes(log['on_chip_bytes'])} on chip, {_bytes(log['off_chip_bytes'])} streamed"
        c = corrected.get(sid)
        if c is None:
            lines.append(f"{sid}: every op mapped to the Edge TPU ({log['ops_on_tpu']} ops; {memory})")
            continue
        tail = "it runs" if c["ops_on_cpu"] == 1 else f"it and the {c['ops_on_cpu'] - 1} ops after it run"
        where = ("nothing runs on the TPU: ships the uncompiled int8 model" if not c["ops_on_tpu"] else
                 f"{tail} on the host CPU (from node {c['first_cpu_node']})")
        lines.append(f"{sid}: {c['ops_on_tpu']} of {c['ops']} ops mapped to the Edge TPU ({memory}); first unmapped: "
                     f"op {c['ops_on_tpu'] + 1}, {c['first_unmapped']} ({c['status']}); {where}; predicted "
                     f"{c['predicted_ms_before']:.3f} -> {c['predicted_ms_after']:.3f} ms")
    return lines


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def check_summary(report: dict[str, Any], nodes: bool = False) -> str:
    """`edgesdk check`: per op type (or per node), the devices that can run it and why others cannot;
    coverage, transitions, and what legalize would do."""
    rows: dict[tuple, list[str]] = {}
    for n in report["nodes"]:
        refused = "; ".join(f"{r['device']}: {r['code']} ({r['reason']})" for r in n["refusals"]
                            if not r["device"].startswith("cpu"))
        key = (n["node"] if nodes else n["op"], ", ".join(n["devices"]) or "none", refused)
        rows.setdefault(key, []).append(n["node"])
    width = max([len(k[0]) for k in rows] + [4])
    lines = [f"{report['model']} for {report['target']}: {len(report['nodes'])} nodes, "
             f"{sum(n['flops'] for n in report['nodes']) / 1e9:.3g} GFLOP",
             f"{'node' if nodes else 'op':<{width}}  {'' if nodes else 'count':>5}  devices  [refused on: code (reason)]"]
    for (what, devices, refused), names in sorted(rows.items(), key=lambda kv: (kv[0][2] == "", kv[0][0])):
        count = "" if nodes else str(len(names))
        lines.append(f"{what:<{width}}  {count:>5}  {devices}" + (f"  [{refused}]" if refused else ""))
    for when in ("before", "after"):
        summary = report.get(when)
        if not summary:
            continue
        cov = ", ".join(f"{kind} {c['ops']}/{c['of_ops']} ops ({c['ops_fraction']:.1%}), {c['flops_fraction']:.1%} of FLOPs"
                        for kind, c in summary["coverage"].items()) or "no accelerator"
        lines.append(f"{'as imported' if when == 'before' else 'after legalize'}: {cov}; "
                     f"{summary['transitions']} tensor(s) cross between the CPU and an accelerator")
    rewrites = report.get("rewrites") or {}
    approx = report.get("approximations") or []
    fallbacks = report.get("fallbacks") or []
    if not (rewrites or approx or fallbacks):
        lines.append("legalize would rewrite nothing")
    else:
        lines.append("legalize would:")
        for name, r in rewrites.items():
            lines.append(f"  rewrite {name} x{r['count']} ({r['exactness']})")
        for a in approx:
            lines.append(f"  approximate {', '.join(a['nodes'])} ({' -> '.join(a['ops'])}) by {len(a['knots'])} ReLUs on "
                         f"[{a['range'][0]:.4g}, {a['range'][1]:.4g}]: max error {a['grid_error']:.2e}"
                         + (f", {a['int8_error']:.2e} after int8" if "int8_error" in a else "")
                         + (f"; {_moves(a['end_to_end'])}" if a.get("end_to_end") else ""))
        for f in fallbacks:
            lines.append(f"  keep {', '.join(f['nodes'])} on the CPU: {f['reason']}")
        if report.get("end_to_end"):
            e = report["end_to_end"]
            lines.append(f"  end to end, on {e['samples']} calibration sample(s): outputs move by at most "
                         f"{e['max_abs_error']:.3g} ({e['max_error_of_range']:.2%} of their range{_most(report, e)})")
    return "\n".join(lines)


def _moves(e: dict[str, Any]) -> str:
    """How far an approximation moves the model's outputs (legalize's `end_to_end` of one entry)."""
    if not e.get("output"):  # a report from before the per-output figures
        return f"outputs move by {e['max_abs_error']:.2e}"
    moved = e["outputs"][e["output"]]
    return f"moves output '{e['output']}' by {moved['max_abs_error']:.3g} ({moved['share']:.2%} of its range)"


def _most(report: dict[str, Any], e: dict[str, Any]) -> str:
    """After the share of range the legalized model's outputs move by: the output that moves most, and the
    share legalize warns above where this one passes it."""
    if not e.get("output"):  # a report from before the per-output figures
        return ""
    warning = (report.get("output_shares") or {}).get("warning")
    return f", output '{e['output']}'" + (f"; more than the {warning:.0%} legalize warns above"
                                         if warning is not None and e["max_error_of_range"] > warning else "")


def legalize_summary(record: dict[str, Any]) -> str | None:
    """`edgesdk build`: the accelerator coverage legalize reached and what it changed for it."""
    before, after = record.get("before"), record.get("after")
    if not before or not after or not after.get("coverage"):
        return None
    lines = []
    for kind, c in after["coverage"].items():
        b = before["coverage"].get(kind, c)
        lines.append(f"legalize: {kind} runs {b['ops_fraction']:.1%} -> {c['ops_fraction']:.1%} of ops, "
                     f"{b['flops_fraction']:.1%} -> {c['flops_fraction']:.1%} of FLOPs; CPU<->{kind} tensors "
                     f"{before['transitions']} -> {after['transitions']}")
    rewrites = record.get("rewrites") or {}
    if rewrites:
        lines.append("  rewrites: " + ", ".join(f"{k} x{v['count']}" for k, v in rewrites.items()))
    approx = record.get("approximations") or []
    if approx:
        worst = max(a["grid_error"] for a in approx)
        worst8 = max((a.get("int8_error", 0.0) for a in approx), default=0.0)
        lines.append(f"  {len(approx)} function(s) approximated by sums of ReLUs (bound {record['max_abs_error']:g}): "
                     f"worst error {worst:.2e}" + (f", {worst8:.2e} after int8" if worst8 else ""))
        moving = max((a for a in approx if (a.get("end_to_end") or {}).get("output")),
                     key=lambda a: a["end_to_end"]["max_error_of_range"], default=None)
        if moving is not None:
            lines.append(f"  the one that moves an output most, {', '.join(moving['nodes'])}, "
                         f"{_moves(moving['end_to_end'])}")
    if record.get("end_to_end"):
        e = record["end_to_end"]
        lines.append(f"  outputs move by at most {e['max_abs_error']:.3g} ({e['max_error_of_range']:.2%} of their "
                     f"range{_most(record, e)}) on {e['samples']} calibration sample(s)")
    for f in record.get("fallbacks") or []:
        lines.append(f"  kept on the CPU: {', '.join(f['nodes'])} ({f['reason']})")
    return "\n".join(lines)


def calibrate_summary(result: dict[str, Any], output: Path | None = None) -> str:
    """`edgesdk calibrate`: the per-op fit and its errors per model, then each backend's own fit and,
    per held-out model, its prediction against the measured time (and the one-set-of-figures
    prediction beside it)."""
    f = result["fit"]
    lines = [f"fitted on {result['samples']} ops: peak {f['peak_gflops']:.1f} GFLOP/s"
             + (f" ({f['grouped_gflops']:.1f} for grouped convolutions)" if f.get("grouped_gflops") else "")
             + f", memory {f['bandwidth_gbps']:.1f} GB/s, overhead {f['overhead_us']:.2f} us per op"]
    for what in ("on_fitted", "held_out"):
        ev = result[what]
        for name, m in (ev or {}).get("models", {}).items():
            lines.append(f"{'held out' if what == 'held_out' else 'fitted  '} {name}: predicted {m['predicted_ms']:.2f} ms, "
                         f"measured {m['measured_ms']:.2f} ms ({m['total_rel_error']:.0%} off); per op median "
                         f"{m['median_rel_error']:.0%} off")
    lines += [f"note: {n}" for n in f.get("notes", [])]
    for backend, b in result.get("backends", {}).items():
        bf = b["fit"]
        if bf is None:
            lines.append(f"backend {backend}: not fitted: {b['error']}")
        else:
            runs = b["on_fitted"]["runs"]
            lines.append(f"backend {backend}: fitted on {b['runs']} timed runs: peak {bf['peak_gflops']:.1f} GFLOP/s"
                         + (f" ({bf['grouped_gflops']:.1f} for grouped convolutions)" if bf.get("grouped_gflops") else "")
                         + f", memory {bf['bandwidth_gbps']:.1f} GB/s"
                         + (f" ({bf['cache_gbps']:.0f} GB/s for nodes of at most {bf['cache_mb']:g} MiB)"
                            if bf.get("cache_gbps") is not None else "")
                         + f", overhead {bf['overhead_us']:.2f} us per op"
                         + (f"; a cut-out run pays {bf['cut_overhead_us']:.1f} us and its cut tensors at "
                            f"{bf['cut_gbps']:.1f} GB/s" if bf.get("cut_overhead_us") is not None else "")
                         + f"; runs median {runs['median_rel_error']:.0%} off, at most {runs['max_rel_error']:.0%}")
            for name, m in (b["held_out"] or {}).get("models", {}).items():
                lines.append(f"  held out {name}: predicted {m['predicted_ms']:.2f} ms, measured {m['measured_ms']:.2f} ms "
                             f"({m['rel_error']:.0%} off, {'within' if m['within_tolerance'] else 'NOT within'} "
                             f"{b['held_out']['tolerance']:.0%}); with the CPU's one set of figures "
                             f"{m['predicted_shared_ms']:.2f} ms ({m['shared_rel_error']:.0%} off)")
            lines += [f"  note: {n}" for n in bf.get("notes", [])]
        lines += [f"  not timed: {line}" for line in b.get("skipped", [])]
    if output is not None:
        lines.append(f"wrote {output}")
    return "\n".join(lines)
