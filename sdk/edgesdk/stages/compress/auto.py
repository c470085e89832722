"""`--calib-method auto` weighed by the whole model: which calibration candidate every int8 segment takes.

Each segment's quantizer weighs its candidates (each tensor its method of least error, or one method for
every tensor) by that segment's own outputs against the float segment's, on the float segment's inputs
(backends/tflite/convert.py `_auto`). A model cut into several int8 segments, with float ones between,
adds their errors up, and a choice that is best for each segment alone need not be best for the outputs:
so each candidate is also run for every segment at once, the segments chained as the plan runs them (the
int8 ones by LiteRT, the others float by onnxruntime), on the calibration samples, and the one whose model
outputs are nearest the float model's (`ir.calibrators.output_error`) is kept; `per segment` (each
segment its own choice) is one of them, and wins ties. The outputs are weighed part by part, cut as the
accuracy gate cuts them (`compression.accuracy.views`): a YOLOv8 head's one output holds box coordinates in
pixels and class scores in [0, 1], and weighed whole its error is the boxes' alone, so that a method that
halves every class score can win.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ...bundling.chain import run
from ...ir import calibrators

PER_SEGMENT = "per segment"
SAMPLES = 16  # calibration samples the candidates are run end to end on


def choose(plan, scheduled: Path, out: Path, entries: dict[str, dict], samples: list[dict], reference: list[dict],
           log, parts: dict | None = None) -> dict | None:
    """The candidate kept for every int8 segment (the record of the choice), with `entries` (the compress
    stage's records, by segment id) and their artifacts under `out` rewritten to it and the other
    candidates' files removed; None where no segment weighed candidates. `samples`: the model's inputs,
    `reference`: its float outputs on them; `parts`: each output's parts (`accuracy.views`), each weighed
    as an output of its own."""
    weighed = [e for e in entries.values() if "alternatives" in e and not e.get("same_as")]
    if not weighed:
        return None
    # every segment's candidates (one the kernels refused is missing from its segment's: _candidate and _apply
    # keep that segment's own choice under it)
    labels = [PER_SEGMENT, *dict.fromkeys(label for e in weighed for label in e["alternatives"])]
    shown = samples[:SAMPLES]
    figures = {}
    want = by_part(reference[:len(shown)], parts or {})
    runners: dict = {}  # the float segments' sessions, opened once for every candidate
    for label in labels:
        got = run(plan, scheduled, out, {k: _candidate(e, label, entries) for k, e in entries.items()}, shown, runners)
        figures[label] = calibrators.output_error(by_part(got, parts or {}), want)
    chosen = min(labels, key=lambda k: (figures[k], labels.index(k)))
    _apply(entries, chosen, out)
    shown_figures = {k: float(f"{v:.6g}") for k, v in figures.items()}
    log(f"compress: calibration auto, the whole model: {chosen} (output error "
        + ", ".join(f"{k} {v:.3g}" for k, v in shown_figures.items()) + f" on {len(shown)} calibration samples)")
    return {"chosen": chosen, "output_error": shown_figures, "samples": len(shown),
            "measure": calibrators.OUTPUT_ERROR + (", each output's parts as outputs of their own" if parts else "")}


def by_part(runs: list[dict], parts: dict) -> list[dict]:
    """`runs` (per sample, outputs by name) with each output cut into its parts in `parts` (output ->
    `accuracy.View`s), by the part's name; an output without parts stays whole."""
    return [{v.name: v.of(np.asarray(y), batched=False) for o, y in r.items() for v in parts.get(o, ())}
            | {o: y for o, y in r.items() if not parts.get(o)} for r in runs]


def _candidate(entry: dict, label: str, entries: dict[str, dict]) -> dict:
    """A segment's artifact and tensor specs under candidate `label` (a shared segment: its source's, with
    its own tensor names; a segment whose backend weighed no candidates: its own model)."""
    source = entries[entry["same_as"]] if entry.get("same_as") else entry
    chosen = source.get("alternatives", {}).get(label, source)
    if not entry.get("same_as"):
        return chosen
    rename = {t["name"]: u["name"] for k in ("inputs", "outputs") for t, u in zip(source[k], entry[k])}
    return {**chosen, **{k: [{**t, "name": rename[t["name"]]} for t in chosen[k]] for k in ("inputs", "outputs")}}


def _apply(entries: dict[str, dict], chosen: str, out: Path) -> None:
    """Every weighed segment's artifact, specs, accuracy and ranges record made `chosen`'s; the other
    candidates' files removed and `alternatives` dropped from the records."""
    for entry in entries.values():
        if "alternatives" not in entry or entry.get("same_as"):
            continue
        alternatives = entry.pop("alternatives")
        entry["ranges"].setdefault("auto", {})["whole_model"] = chosen
        # a segment whose kernels refused the chosen candidate (ranges.auto.refused) keeps its own choice, as it
        # did while the candidates were run end to end (_candidate)
        pick = alternatives.get(chosen) if chosen != PER_SEGMENT else None
        if pick is not None:
            os.replace(out / pick["artifact"], out / entry["artifact"])
            entry.update(inputs=pick["inputs"], outputs=pick["outputs"], accuracy_vs_float=pick["accuracy_vs_float"])
            _relabel(entry["ranges"], chosen)
        for alt in alternatives.values():
            (out / alt["artifact"]).unlink(missing_ok=True)
    for entry in entries.values():  # a shared segment carries its source's model, under its own names
        if entry.get("same_as"):
            source = entries[entry["same_as"]]
            entry.pop("alternatives", None)
            rename = {t["name"]: u["name"] for k in ("inputs", "outputs") for t, u in zip(source[k], entry[k])}
            entry.update({k: [{**t, "name": rename.get(t["name"], t["name"])} for t in source[k]]
                          for k in ("inputs", "outputs")}, ranges=source["ranges"],
                         accuracy_vs_float={rename[o]: a for o, a in source["accuracy_vs_float"].items()})


def _relabel(ranges: dict, chosen: str) -> None:
    """A segment's ranges record as candidate `chosen` made it: each tensor's method and range, the
    counts, and how many ranges are narrower than min-max."""
    from ...backends.tflite import narrowing

    per_tensor = ranges.get("per_tensor", [])
    for t in per_tensor:
        t["method"] = t["least"] if chosen == "per tensor" else chosen
        t["range"] = t["ranges"][t["method"]]
    ranges.update(narrowing.kept({k: tuple(t["range"]) for k, t in enumerate(per_tensor)},
                                 {k: tuple(t["seen"]) for k, t in enumerate(per_tensor)}),
                  methods=narrowing.counts(t["method"] for t in per_tensor))
