"""Provenance and SBOM: the manifest says what a bundle was built from, by digest, and
`sbom.cdx.json` lists what the device installs to run it, a CycloneDX 1.6 document listed (so signed) in
the manifest's file table. The bundles are the session's PP-OCR classifier builds (conftest.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator

from edgesdk.bundling.bundle import calibration_provenance, samples_sha256
from edgesdk.bundling.sbom import RUNTIME_NAME, SBOM_FILE, pins, sbom_json, write_sbom
from edgesdk.cli import main as cli_main
from edgesdk.config import load_target
from edgesdk.ir.calibration import load_calibration
from edgesdk.ir.digest import file_sha256, tree_sha256
from edgesdk.pipeline import stage_dir
from edgesdk.report.text import inspect_bundle, provenance_summary
from edgesdk.runtime import Manifest
from edgesdk.runtime.manifest import RUNTIME_VERSION
from tests.model_zoo import ROOT, ppocr_cls

SIGNATURE_DISTS = ("cryptography", "cffi", "pycparser")


def _sbom(bundle: Path) -> dict:
    return json.loads((bundle / SBOM_FILE).read_text())


def test_sbom_is_valid_cyclonedx_1_6(x86_ppocr):
    text = (x86_ppocr.bundle / SBOM_FILE).read_text()
    errors = JsonStrictValidator(SchemaVersion.V1_6).validate_str(text, all_errors=True)
    assert errors is None, [str(e) for e in errors]
    doc = json.loads(text)
    assert doc["specVersion"] == "1.6" and doc["serialNumber"].startswith("urn:uuid:")
    model = doc["metadata"]["component"]
    assert model["type"] == "machine-learning-model"
    assert model["hashes"] == [{"alg": "SHA-256", "content": file_sha256(ppocr_cls())}]
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    assert doc["metadata"]["timestamp"] == datetime.fromtimestamp(epoch, tz=timezone.utc).isoformat()


def test_sbom_lists_exactly_the_pinned_requirements_and_the_runtime(x86_ppocr):
    bundle = x86_ppocr.bundle
    pinned = pins((bundle / "requirements.txt").read_text())
    assert list(pinned)[:4] == ["numpy", *SIGNATURE_DISTS]  # the runtime's own, before the backends'
    assert {"apache-tvm", "apache-tvm-ffi"} <= pinned.keys()
    doc = _sbom(bundle)
    listed = {c["name"]: c["version"] for c in doc["components"]}
    assert listed == {**pinned, RUNTIME_NAME: RUNTIME_VERSION}
    for c in doc["components"]:
        if c["name"] != RUNTIME_NAME:
            assert c["purl"] == c["bom-ref"] == f"pkg:pypi/{c['name']}@{c['version']}"
    licenses = {c["name"]: c.get("licenses") for c in doc["components"]}
    assert licenses["cryptography"] == [{"acknowledgement": "declared", "expression": "Apache-2.0 OR BSD-3-Clause"}]
    (root,) = [d for d in doc["dependencies"] if d["ref"] == "bundle"]
    assert sorted(root["dependsOn"]) == sorted(c["bom-ref"] for c in doc["components"])


def test_sbom_is_signed_with_the_manifest(x86_ppocr):
    m = Manifest.load(x86_ppocr.bundle)
    assert m.files[SBOM_FILE]["sha256"] == file_sha256(x86_ppocr.bundle / SBOM_FILE)
    assert m.provenance["sbom"] == SBOM_FILE


def test_provenance_names_what_the_bundle_was_built_from(x86_ppocr):
    m = Manifest.load(x86_ppocr.bundle)
    p = m.provenance
    assert p["model_sha256"] == file_sha256(ppocr_cls())
    assert p["target_sha256"] == load_target("x86")[0].digest()
    assert p["tuning_database_sha256"] == tree_sha256(stage_dir(x86_ppocr.out, "tune") / "tuning_db")
    # no --calib: the samples synthesized from the seed, which another seed would change
    imported = json.loads((stage_dir(x86_ppocr.out, "import") / "import.json").read_text())
    assert p["calibration"] == {"source": "synthesized", "seed": 0, "samples": 16, "distribution": "uniform(-1, 1)"}
    same = load_calibration(SimpleNamespace(calib=None, calib_samples=16, seed=0), imported["inputs"])[0]
    other = load_calibration(SimpleNamespace(calib=None, calib_samples=16, seed=1), imported["inputs"])[0]
    assert p["calibration_sha256"] == samples_sha256(same) != samples_sha256(other)
    assert p["sdk_version"] == m.sdk_version and p["toolchain"] == m.toolchain
    assert p["python"] == platform.python_version()
    assert p["source_date_epoch"] == int(os.environ.get("SOURCE_DATE_EPOCH", "0"))


def test_provenance_of_a_calibration_directory(arm_ppocr, text_calib, tmp_path):
    p = Manifest.load(arm_ppocr.bundle).provenance
    assert p["calibration_sha256"] == tree_sha256(text_calib)
    assert p["calibration"] == {"source": "directory", "samples": 16}
    # another directory, one sample changed: another digest
    other = tmp_path / "calib"
    other.mkdir()
    for f in sorted(text_calib.iterdir()):
        (other / f.name).write_bytes(f.read_bytes())
    sample = np.zeros((1, 3, 4, 4), np.float32)
    np.save(other / "extra.npy", sample)
    info = {"synthetic": False, "source": str(other)}
    assert calibration_provenance([{"x": sample}], info)["calibration_sha256"] != p["calibration_sha256"]


def test_device_image_installs_every_pin_of_an_arm_bundle(arm_ppocr):
    """The emulated arm64 image (packaging/requirements-aarch64.txt) holds what an aarch64 bundle pins."""
    device = pins((ROOT / "packaging" / "requirements-aarch64.txt").read_text())
    bundle = pins((arm_ppocr.bundle / "requirements.txt").read_text())
    assert set(SIGNATURE_DISTS) <= bundle.keys()
    assert {name: v for name, v in bundle.items() if device.get(name) != v} == {}


def test_sbom_is_deterministic_and_follows_the_pins(x86_ppocr, tmp_path, monkeypatch):
    m = Manifest.load(x86_ppocr.bundle)
    requirements = (x86_ppocr.bundle / "requirements.txt").read_text()
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    assert write_sbom(a, m, requirements).read_bytes() == write_sbom(b, m, requirements).read_bytes() \
        == (x86_ppocr.bundle / SBOM_FILE).read_bytes()
    # another numpy: another component, another serial number; no license claimed for a version not installed
    older = requirements.replace(f"numpy=={pins(requirements)['numpy']}", "numpy==1.0.0")
    doc, before = json.loads(sbom_json(m, older)), _sbom(x86_ppocr.bundle)
    (numpy,) = [c for c in doc["components"] if c["name"] == "numpy"]
    assert numpy["version"] == "1.0.0" and numpy["purl"] == "pkg:pypi/numpy@1.0.0" and "licenses" not in numpy
    assert doc["serialNumber"] != before["serialNumber"]
    # the only time in it is SOURCE_DATE_EPOCH
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    assert json.loads(sbom_json(m, requirements))["metadata"]["timestamp"] == "2023-11-14T22:13:20+00:00"


def test_inspect_shows_provenance_and_signing(x86_ppocr, capsys):
    assert cli_main(["inspect", str(x86_ppocr.bundle)]) == 0
    out = capsys.readouterr().out
    p = Manifest.load(x86_ppocr.bundle).provenance
    (line,) = [line for line in out.splitlines() if line.startswith("provenance  ")]
    assert line == (f"provenance  model {p['model_sha256'][:12]}, target {p['target_sha256'][:12]}, "
                    f"tuning db {p['tuning_database_sha256'][:12]}, calibration {p['calibration_sha256'][:12]} "
                    "(synthesized, seed 0)")
    assert f"            edgesdk {p['sdk_version']}; SBOM {SBOM_FILE}\n" in out
    assert "signing     unsigned\n" in out
    signed = dataclasses.replace(Manifest.load(x86_ppocr.bundle), bundle_version=7,
                                 signing={"algorithm": "ed25519", "key_id": "0123456789abcdef"})
    assert "signing     bundle version 7; signed by key 0123456789abcdef (ed25519)" in \
        inspect_bundle(signed, x86_ppocr.bundle)


def test_inspect_shows_a_hostile_provenance_as_it_is():
    """The schema leaves `provenance` open: values of any type are shown, never raised on."""
    lines = provenance_summary({"model_sha256": 5, "calibration": [], "sdk_version": None, "sbom": {}})
    assert lines[0] == "provenance  model ?, target ?, tuning db ?, calibration ?"
    assert lines[1:] == ["            edgesdk ?; SBOM ?", "signing     unsigned"]
