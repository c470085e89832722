"""The whole-model choice of `--calib-method auto` (stages/compress/auto.py) where LiteRT's kernels refused one
segment's candidate: that segment keeps its own choice under it, the others take it."""

from __future__ import annotations

from edgesdk.stages.compress import auto


def _entry(out, seg: str, labels: list[str]) -> dict:
    (out / f"{seg}.tflite").write_bytes(f"{seg} own".encode())
    alternatives = {}
    for label in labels:
        (out / f"{seg}.{label}.tflite").write_bytes(f"{seg} {label}".encode())
        alternatives[label] = {"artifact": f"{seg}.{label}.tflite", "inputs": [{"name": "x", "label": label}],
                               "outputs": [{"name": "y", "label": label}], "accuracy_vs_float": {"y": label}}
    return {"artifact": f"{seg}.tflite", "inputs": [{"name": "x"}], "outputs": [{"name": "y"}],
            "accuracy_vs_float": {"y": "own"}, "ranges": {"auto": {"chosen": "per tensor"}},
            "alternatives": alternatives}


def test_a_segment_whose_kernels_refused_the_chosen_candidate_keeps_its_own(tmp_path):
    entries = {"s0": _entry(tmp_path, "s0", ["minmax", "mse"]), "s1": _entry(tmp_path, "s1", ["mse"])}
    candidate = {seg: auto._candidate(e, "minmax", entries) for seg, e in entries.items()}
    assert candidate["s0"]["artifact"] == "s0.minmax.tflite" and candidate["s1"]["artifact"] == "s1.tflite"
    auto._apply(entries, "minmax", tmp_path)
    assert (tmp_path / "s0.tflite").read_bytes() == b"s0 minmax" and entries["s0"]["accuracy_vs_float"] == {"y": "minmax"}
    assert (tmp_path / "s1.tflite").read_bytes() == b"s1 own" and entries["s1"]["accuracy_vs_float"] == {"y": "own"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s0.tflite", "s1.tflite"]  # the candidates' files gone
    assert all("alternatives" not in e and e["ranges"]["auto"]["whole_model"] == "minmax" for e in entries.values())
