"""Plain-text reports: placement summary, bundle inspection."""

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
                     key=lambda op: -abs(before.get(op, 0) - after.get(op, 0)))
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
    lines.append(f"predicted: {p['latency_ms']:.3f} ms per inference, {p['throughput_fps']:.1f} frames/s pipelined "
                 f"({plan['cost_model']})")
    return "\n".join(lines)


def inspect_bundle(manifest, bundle: Path) -> str:
    m = manifest
    out = [f"bundle      {bundle}",
           f"model       {m.model['name']} (sha256 {m.model['sha256'][:16]}…, opset {m.model.get('opset')})",
           f"target      {m.target['name']}: {m.target.get('description', '')}",
           f"arch        {m.arch}; edgesdk {m.sdk_version}; runtime >= {m.min_runtime_version}",
           "inputs      " + ", ".join(f"{t.name} {list(t.shape)} {t.dtype}" for t in m.inputs),
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
    if m.edgetpu:
        state = "compiled" if m.edgetpu.get("edgetpu_compiled") else "NOT compiled (int8 runs on the CPU until compiled)"
        out.append(f"edge tpu    {state}")
        if m.edgetpu.get("finish_command"):
            out.append(f"            finish with: {m.edgetpu['finish_command']}")
    if m.calibration:
        out.append(f"calibration {'SYNTHETIC' if m.calibration.get('synthetic') else 'from ' + str(m.calibration.get('source'))}"
                   f", {m.calibration.get('samples')} samples")
    for name, a in (m.accuracy.get("tensors") or {}).items():
        out.append(f"accuracy    {name}: cosine {a['cosine']:.5f}, max abs error {a['max_abs_error']:.4g} vs fp32")
    if "top1_agreement" in m.accuracy:
        out.append(f"            top-1 agreement {m.accuracy['top1_agreement']:.0%} on {m.accuracy['samples']} samples")
    size = sum(f["size"] for f in m.files.values())
    out.append(f"files       {len(m.files)} files, {size:,} bytes")
    for w in m.warnings:
        out.append(f"warning     {w}")
    return "\n".join(out)
