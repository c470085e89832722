"""HTML reports for people, rendered from what a stage computed (never recomputed here)."""

from __future__ import annotations

import base64
import html
from typing import Any

from .text import accuracy_lines, chosen_line, remedy_lines


def schedule_page(plan: dict[str, Any], rows: list[dict[str, Any]], charts: list[tuple[str, bytes]]) -> str:
    """The schedule stage's `schedule.html`: predicted figures, baselines on the same cost model,
    inter-operator parallelism, utilization, the Gantt charts (title, PNG bytes) and the placement
    table (`rows`: node, op, device, reason, ms, bytes_moved)."""
    images = "".join(f"<h2>{html.escape(title)}</h2><img src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
                     for title, png in charts)
    placement = "".join(f"<tr><td>{html.escape(r['node'])}</td><td>{r['op']}</td><td>{r['device']}</td>"
                        f"<td>{html.escape(r['reason'])}</td><td>{r['ms']:.4f}</td><td>{r['bytes_moved']:,}</td></tr>"
                        for r in rows)
    base = "".join(f"<tr><td>{html.escape(k)}</td><td>{v.get('latency_ms', '—')}</td><td>{v.get('throughput_fps', '—')}</td></tr>"
                   for k, v in plan["baselines"].items())
    p = plan["predicted"]
    return f"""<!doctype html><meta charset="utf-8"><title>edgesdk schedule: {html.escape(plan['target'])}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 6px;font-size:13px}}</style>
<h1>Schedule for {html.escape(plan['target'])} ({plan['mode']})</h1>
<p>Predicted: {p['latency_ms']:.3f} ms per inference (simulated; {p['sequential_ms']:.3f} ms with no overlap),
{p['throughput_fps']:.1f} frames/s on a stream. Search: {html.escape(plan['search'])}; {plan['scheduler_s']} s.</p>
<p>Cost model: {html.escape(plan['cost_model'])}.</p>
<h2>Baselines, same cost model</h2>{_chosen(plan)}<table><tr><th>rule</th><th>latency ms</th><th>frames/s</th></tr>
<tr><td><b>this plan</b></td><td>{p['latency_ms']}</td><td>{p['throughput_fps']}</td></tr>{base}</table>
{_caches(plan)}{_decisions(plan)}{_inter_op(plan)}
<h2>Utilization on the stream</h2><p>{', '.join(f'{k} {v:.0%}' for k, v in plan['utilization'].items())}</p>
{images}
<h2>Placement</h2><table><tr><th>node</th><th>op</th><th>device</th><th>reason</th><th>predicted ms</th><th>bytes moved</th></tr>
{placement}</table>
"""


def _caches(plan: dict[str, Any]) -> str:
    """Each accelerator's parameter cache under the plan (and its replicas), the co-compile order, the
    place-and-recost rounds."""
    caches = plan.get("caches") or {}
    if not caches:
        return ""
    rows = "".join(f"<tr><td>{d}</td><td>{c['capacity_bytes']:,}</td><td>{c['weights_bytes']:,}</td>"
                   f"<td>{c['cached_bytes']:,}</td><td>{c['streamed_bytes']:,}</td>"
                   f"<td>{html.escape(', '.join(c['compile_order']))}</td><td>{html.escape(c['capacity_source'])}</td></tr>"
                   for d, c in caches["instances"].items())
    rounds = ", ".join(f"{html.escape(r['start'])} {r['round']}: {r['objective']:g}" for r in caches["rounds"])
    replicas = "".join(f"<p>Replica {k}: frames alternate with the devices moved as {html.escape(str(m))}.</p>"
                       for k, m in enumerate(plan.get("replicas", ()), 1))
    return ("<h2>Parameter caches</h2><table><tr><th>device</th><th>capacity bytes</th><th>distinct weights</th>"
            "<th>cached</th><th>streamed every inference</th><th>co-compile order</th><th>capacity from</th></tr>"
            f"{rows}</table><p>{html.escape(caches['search'])}; rounds (objective, lower is better): {rounds}.</p>"
            + replicas)


def _chosen(plan: dict[str, Any]) -> str:
    """Which candidate the plan is (each baseline is one), against the best other."""
    line = chosen_line(plan.get("chosen") or {})
    kept = plan.get("keep_on_cpu") or {}
    if kept:  # the constraint every candidate kept, and what it costs
        p = kept["predicted"]
        rounds = [f"round {r['round']}: " + ", ".join(f"{m['node']} ({m['cause']}, {m['added_error']:.1%} of its range "
                                                        f"lost there)" for m in r["moved"]) for r in kept.get("remedy", ())]
        line = (f"{line}. " if line else "") + (
            f"Kept in float on the cpu: {', '.join(kept['nodes'])} ({'; '.join(rounds) or '--keep-on-cpu'}): "
            f"{p['latency_ms']:.3f} ms per inference, {p['latency_ms_without']:.3f} ms without that constraint "
            f"({p['cost_ms']:+.3f} ms)")
    return f"<p>{html.escape(line[0].upper() + line[1:])}.</p>" if line else ""


def _decisions(plan: dict[str, Any]) -> str:
    items = "".join(f"<li>{html.escape(d)}</li>" for d in plan.get("decisions", ()))
    return f"<h2>Decisions</h2><ul>{items}</ul>" if items else ""


def _inter_op(plan: dict[str, Any]) -> str:
    inter_op = plan.get("inter_op", {})
    if not inter_op:
        return ""
    by_id = {s["id"]: s for s in plan["segments"]}
    def describe(sid: str) -> str:
        seg = by_id[sid]
        return f"{sid} ({len(seg['nodes'])} nodes, {seg['threads']} thread(s), {seg['predicted_ms']:.3f} ms)"

    steps = "".join(f"<li>{', '.join(describe(i) for i in step)}</li>" for step in plan["parallel_steps"])
    rows = "".join(f"<tr><td>{r['nodes']}</td><td>{r['stages']}</td><td>{r['parallel_stages']}</td>"
                   f"<td>{r['sequential_ms']:.3f}</td><td>{r['parallel_ms']:.3f}</td>"
                   f"<td>{html.escape(r.get('reason', 'taken'))}</td></tr>"
                   for r in [*inter_op["runs"], *inter_op["not_taken"]])
    return (f"<h2>Inter-operator parallelism</h2><p>Search: {html.escape(inter_op['search'])}.</p>"
            "<table><tr><th>cpu nodes</th><th>stages</th><th>concurrent stages</th><th>one at a time ms</th>"
            f"<th>with concurrent groups ms</th><th>decision</th></tr>{rows}</table>"
            + (f"<p>Steps run at once:</p><ul>{steps}</ul>" if steps else ""))


_BELOW = ' style="background:#fdd"'


def accuracy_page(accuracy: dict[str, Any]) -> str:
    """The package stage's `accuracy.html`: the accuracy gate's verdict on the bundle, each output part's
    figures against fp32 and the culprit layers with their causes (the manifest's `accuracy`)."""
    lines = accuracy_lines(accuracy)
    failed = {f["part"] for f in accuracy.get("failures") or ()}
    parts = "".join(
        f"<tr{_BELOW if part in failed else ''}><td>{html.escape(part)}</td>"
        f"<td>{html.escape(m.get('kind', ''))}{' (' + html.escape(m['activation']) + ')' if m.get('activation') else ''}</td>"
        f"<td>{m['cosine']:.4f}</td><td>{m['mean_error']:.2%}</td><td>{m['max_error']:.1%}</td>"
        f"<td>{'' if m.get('top1') is None else format(m['top1'], '.1%')}</td>"
        f"<td>{'BELOW THE GATE' if part in failed else 'passes'}</td></tr>"
        for part, m in (accuracy.get("parts") or {}).items())
    culprits = "".join(
        f"<tr><td>{html.escape(c['node'])}</td><td>{html.escape(c['segment'])}</td><td>{html.escape(c['op'])} -&gt; "
        f"{html.escape(c.get('int8_op') or '')}</td><td>{c['added_error']:.1%}</td><td>{c['added_snr_db']:.1f}</td>"
        f"<td>{c['error']:.1%}</td><td>{html.escape(c['cause'])}</td><td>{html.escape(c['why'])}</td></tr>"
        for c in accuracy.get("culprits") or ())
    gate = accuracy.get("gate") or {}
    thresholds = "; ".join(f"{kind}: " + ", ".join(f"{k} {v:g}" for k, v in t.items())
                           for kind, t in (gate.get("thresholds") or {}).items())
    return f"""<!doctype html><meta charset="utf-8"><title>edgesdk accuracy</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 6px;font-size:13px}}</style>
<h1>Accuracy against fp32</h1><p>{html.escape(lines[0] if lines else 'no output judged')}</p>
<p>Thresholds: {html.escape(thresholds or 'none (nothing quantized)')}. Reference: {html.escape(str(accuracy.get('reference', '')))}.</p>
{''.join(f'<p><b>{html.escape(line)}</b></p>' for line in lines if line.startswith('calibration'))}
<h2>Output parts</h2><table><tr><th>part</th><th>kind</th><th>cosine</th><th>mean error (of its range)</th>
<th>max error</th><th>top-1</th><th>verdict</th></tr>{parts}</table>
{f'<h2>Culprit layers</h2><table><tr><th>node</th><th>segment</th><th>op</th><th>lost there (of its range)</th><th>SNR there dB</th><th>lost up to there</th><th>cause</th><th>why</th></tr>{culprits}</table>' if culprits else ''}
{_remedy_section(accuracy)}"""


def _remedy_section(accuracy: dict[str, Any]) -> str:
    """The nodes kept in float on the CPU (the accuracy remedy's, `--keep-on-cpu`): the summary's lines."""
    lines = remedy_lines(accuracy.get("remedy") or {}, accuracy.get("parts") or {})
    return ("<h2>Kept in float on the CPU</h2>" + "".join(f"<p>{html.escape(line)}</p>" for line in lines)) if lines else ""
