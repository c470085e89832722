"""The manifest's schema (runtime/manifest.py) against what reads a manifest: the fuzzer's findings
(tests/fuzz). A string that is not Unicode text is refused naming its field; and every part that
`edgesdk inspect` reads is typed, so that a manifest the schema accepts is one inspect can show (a
pruning record without its method used to pass and then fail inside inspect, exit 3)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from edgesdk.report.text import inspect_bundle
from edgesdk.runtime.manifest import Manifest, ManifestError, Segment, TensorSpec


def _full() -> dict:
    """A one-segment manifest whose informational parts hold what the build writes for an Edge TPU
    segment, a measured CPU span and a pruned model under a latency budget."""
    x, y = TensorSpec("x", (1, 4), "float32"), TensorSpec("y", (1, 4), "float32")
    segment = Segment("s0", "cpu", "tvm", "segments/s0.so", (TensorSpec("x", (1, 4), "float32", "0"),),
                      (TensorSpec("y", (1, 4), "float32", "0"),))
    m = json.loads(Manifest(1, "0.3.0", "0.1.0", {"name": "m"}, {"name": "t"}, "x86_64", {"cpu": "cpu"}, (x,), (y,),
                            (segment,), (("s0",),), {"latency_ms": 1.0}).to_json())
    m["edgetpu"] = {
        "edgetpu_compiled": True, "co_compiled": {"edgetpu:0": ["s0"]},
        "compiler": {"s0": {"on_chip_bytes": 100, "off_chip_bytes": 0, "ops_on_tpu": 3}},
        "caches": {"edgetpu:0": {"capacity_bytes": 8 << 20, "cached_bytes": 100, "streamed_bytes": 0}},
        "corrections": [{"segment": "s0", "ops": 4, "ops_on_tpu": 3, "ops_on_cpu": 1, "first_unmapped": "SOFTMAX",
                         "status": "unsupported", "first_cpu_node": "softmax", "predicted_ms_before": 1.0,
                         "predicted_ms_after": 1.5}],
        "cache_corrections": [{"segment": "s0", "streamed_share": 0.5, "predicted_ms_before": 1.0,
                               "predicted_ms_after": 2.0}]}
    m["tuning"] = {"cpu_selection": {"measured_on": "host", "precision": "int8", "gate": {
        "cosine": 0.999, "top1": 0.99, "calibration_samples": 8, "held_out_samples": 8}, "spans": [{
            "segments": ["s0"], "chosen": "tvm", "nodes": 2, "candidates": {
                "tvm": {"ms": 0.1}, "onnxruntime": {"ms": 0.2, "gate": {"cosine": 0.9999, "top1": None},
                                                    "mixed": {"float_ops": 1, "ops": 4}},
                "litert": {"skipped": "not installed"}}}]}}
    m["pruning"] = {"method": "2:4", "layers": 3, "sparsity": 0.5, "corrected": True, "sparse_kernels": 1,
                    "accelerator_layers_dense": ["conv0"],
                    "fidelity": {"samples": 16, "end_to_end": {"y": {"cosine": 0.99, "max_error_of_scale": 0.01,
                                                                      "top1_agreement": 0.9}}},
                    "accuracy": {"labels": 16, "top1": {"dense": 0.9, "pruned": 0.85, "corrected": 0.88}},
                    "plan": {"source": "auto", "budget_ms": 2.0, "dense_ms": 3.0, "predicted_ms": 1.9,
                             "measured_ms": 2.1}}
    return m


def _read(m: dict) -> Manifest:
    return Manifest.from_json(json.dumps(m))


def _at(m: dict, path: tuple, value=None, *, delete: bool = False) -> dict:
    m = copy.deepcopy(m)
    node = m
    for k in path[:-1]:
        node = node[k]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return m


def test_the_full_manifest_reads_and_inspect_shows_every_part():
    text = inspect_bundle(_read(_full()), Path("bundle"))
    for needle in ("co-compiled", "cache 100 B of 8.00 MiB", "streams 50% of its parameters", "3 of 4 ops mapped",
                   "int8 candidates", "mixed precision, 1 of 4 ops float", "litert skipped", "pruning     2:4",
                   "fidelity of y", "top-1 accuracy", "per-layer plan chosen under a 2 ms budget"):
        assert needle in text, needle


@pytest.mark.parametrize("path, where", [
    (("model", "name"), "manifest.model.name"), (("segments", 0, "artifact"), "manifest.segments[0].artifact"),
    (("warnings",), "manifest.warnings[0]"), (("files",), "manifest.files key"),
    (("provenance", "model_sha256"), "manifest.provenance.model_sha256"),
])
def test_a_string_that_is_not_unicode_text_is_refused_naming_its_field(path, where):
    """JSON's \\ud800 escape makes a lone surrogate, which no file name holds and no terminal prints: it
    used to fail in the path check (UnicodeEncodeError), or in inspect printing the provenance."""
    bad = "segments/\ud800.so"
    value = {"warnings": [bad], "files": {bad: {"sha256": "0" * 64, "size": 1}}}.get(path[0], bad)
    with pytest.raises(ManifestError, match=r"is not Unicode text \(a lone surrogate at character 9\)") as e:
        _read(_at(_full(), path, value))
    assert str(e.value).startswith(where + ": ")


@pytest.mark.parametrize("path, field", [
    (("pruning", "method"), "manifest.pruning.method: missing"),
    (("pruning", "fidelity", "end_to_end", "y", "cosine"), "manifest.pruning.fidelity.end_to_end[\"y\"].cosine: missing"),
    (("pruning", "accuracy", "top1", "pruned"), "manifest.pruning.accuracy.top1.pruned: missing"),
    (("pruning", "plan", "budget_ms"), "manifest.pruning.plan.budget_ms: missing (the plan was chosen under a budget)"),
    (("pruning", "plan", "predicted_ms"), "manifest.pruning.plan.predicted_ms: missing"),
    (("edgetpu", "caches", "edgetpu:0", "cached_bytes"), "cached_bytes: missing"),
    (("edgetpu", "corrections", 0, "first_cpu_node"), "manifest.edgetpu.corrections[0].first_cpu_node: missing"),
    (("edgetpu", "cache_corrections", 0, "streamed_share"), "cache_corrections[0].streamed_share: missing"),
    (("tuning", "cpu_selection", "spans", 0, "candidates"),
     "manifest.tuning.cpu_selection.spans[0].candidates: missing (the span was chosen by measurement)"),
])
def test_a_part_inspect_reads_is_refused_without_what_it_reads(path, field):
    with pytest.raises(ManifestError) as e:
        _read(_at(_full(), path, delete=True))
    assert field in str(e.value)


def test_every_manifest_the_schema_accepts_inspect_can_show():
    """Each value of the informational parts (pruning, edgetpu, tuning, accuracy, calibration,
    provenance) removed or replaced by one of the wrong type: refused by the schema, or shown by inspect
    as text a UTF-8 terminal prints."""
    full = _full()

    def paths(node, path):
        yield path
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            yield from paths(v, path + (k,))

    shown = 0
    for part in ("pruning", "edgetpu", "tuning", "accuracy", "calibration", "provenance", "predicted"):
        for path in paths(full.get(part, {}), (part,)):
            for how in ("delete", None, "x", "\udcff", -1, 1.5, [], {}, True):
                if how == "delete" and len(path) == 1:
                    continue
                m = _at(full, path, delete=True) if how == "delete" else _at(full, path, how)
                try:
                    manifest = _read(m)
                except ManifestError:
                    continue
                inspect_bundle(manifest, Path("bundle")).encode()  # must not raise, and print as UTF-8
                shown += 1
    assert shown > 50


_TOLERANCE = {"abs": 0.0156, "lsb": 4, "scale": 0.0039, "rule": "r", "reason": "why",
              "activation": {"op": "LOGISTIC", "input_scale": 0.88, "input": "logits"}}


@pytest.mark.parametrize("change, field", [
    (lambda t: t.pop("lsb"),
     'manifest.golden.tensors["y"].lsb: missing (the tolerance is carried through an activation)'),
    (lambda t: t.pop("reason"), 'manifest.golden.tensors["y"].reason: missing'),
    (lambda t: t.update(abs=-1), 'manifest.golden.tensors["y"].abs: expected a number of at least 0, got -1'),
    (lambda t: t.update(abs=float("nan")), 'manifest.golden.tensors["y"].abs: expected a finite number'),
    (lambda t: t["activation"].update(op="RELU"), 'manifest.golden.tensors["y"].activation.op: "RELU" is not one of'),
    (lambda t: t["activation"].update(input_scale=0), 'manifest.golden.tensors["y"].activation.input_scale: expected a '
                                                      'positive number'),
])
def test_a_golden_tolerance_the_selftest_cannot_use_is_refused_naming_its_field(change, field):
    """The self-test judges the bundle by these figures: each is typed, and one carried through an
    activation says in which steps."""
    tolerance = copy.deepcopy(_TOLERANCE)
    _read(_at(_full(), ("golden",), {"tensors": {"y": tolerance}, "outputs": {"y": _TOLERANCE}}))  # as written
    change(tolerance)
    with pytest.raises(ManifestError) as e:
        _read(_at(_full(), ("golden",), {"tensors": {"y": tolerance}}))
    assert str(e.value).startswith(field), str(e.value)
