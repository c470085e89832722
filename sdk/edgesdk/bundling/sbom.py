"""The bundle's software bill of materials: a CycloneDX 1.6 JSON document, `sbom.cdx.json` in the bundle
root, written before the manifest's file table so that the signature covers it.

It describes the bundle as a machine-learning model (the source model's name and sha256) and lists what
the device installs to run it: exactly the pinned lines of the bundle's requirements.txt, each with its
version, purl and the license its installed distribution declares, and the bundle's runtime package.
The bundle depends on all of them.

The document is a function of its inputs: its timestamp is SOURCE_DATE_EPOCH (default 0), its serial
number a uuid5 of its own content with a nil serial, its keys sorted, its lists in the library's order.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import uuid
from datetime import datetime, timezone
from pathlib import Path

from cyclonedx.contrib.license.factories import LicenseFactory
from cyclonedx.model import HashAlgorithm, HashType, Property
from cyclonedx.model.bom import Bom, BomMetaData
from cyclonedx.model.component import Component, ComponentType
from cyclonedx.model.license import DisjunctiveLicense, License, LicenseAcknowledgement
from cyclonedx.model.tool import ToolRepository
from cyclonedx.output.json import JsonV1Dot6
from packageurl import PackageURL

from .. import __version__
from ..runtime import manifest as mf

SBOM_FILE = "sbom.cdx.json"
RUNTIME_NAME = "edgesdk-runtime"
_SERIAL_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "edgesdk:sbom")
_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)\s*$")
# Trove classifiers that name exactly one SPDX license; others ("BSD License": which BSD?) are left out
_CLASSIFIER_SPDX = {
    "License :: OSI Approved :: MIT License": "MIT",
    "License :: OSI Approved :: Apache Software License": "Apache-2.0",
    "License :: OSI Approved :: ISC License (ISCL)": "ISC",
    "License :: OSI Approved :: Mozilla Public License 2.0 (MPL 2.0)": "MPL-2.0",
    "License :: OSI Approved :: Python Software Foundation License": "PSF-2.0",
}


def source_date_epoch() -> int:
    """The one time a bundle may carry (the reproducible-builds convention): SOURCE_DATE_EPOCH, else 0."""
    return int(os.environ.get("SOURCE_DATE_EPOCH", "0"))


def pins(requirements_text: str) -> dict[str, str]:
    """The `name==version` lines of a requirements.txt, in order (comments and other lines skipped)."""
    return {m[1]: m[2] for line in requirements_text.splitlines() if (m := _PIN.match(line))}


def write_sbom(bundle: Path, manifest: mf.Manifest, requirements_text: str) -> Path:
    """Write `bundle/sbom.cdx.json` for `manifest`'s model and the pins of `requirements_text`."""
    path = bundle / SBOM_FILE
    path.write_text(sbom_json(manifest, requirements_text))
    return path


def sbom_json(manifest: mf.Manifest, requirements_text: str) -> str:
    """The SBOM's text: CycloneDX 1.6 JSON, keys sorted, two-space indent, a final newline."""
    bom = _bom(manifest, requirements_text)
    bom.serial_number = uuid.uuid5(_SERIAL_NAMESPACE, _render(bom))  # the content with the nil serial
    return _render(bom)


def _bom(manifest: mf.Manifest, requirements_text: str) -> Bom:
    model = manifest.model
    bundle = Component(
        type=ComponentType.MACHINE_LEARNING_MODEL, name=model["name"], bom_ref="bundle",
        description=f"{model['name']} compiled by edgesdk {manifest.sdk_version} for {manifest.target['name']} "
                    f"({manifest.arch})",
        hashes=[HashType(alg=HashAlgorithm.SHA_256, content=model["sha256"])] if model.get("sha256") else [],
        properties=[Property(name="edgesdk:target", value=manifest.target["name"]),
                    Property(name="edgesdk:arch", value=manifest.arch)])
    runtime = Component(type=ComponentType.LIBRARY, name=RUNTIME_NAME, version=mf.RUNTIME_VERSION,
                        bom_ref=RUNTIME_NAME, licenses=_licenses("edgesdk", __version__),
                        description="the device runtime, shipped in the bundle's runtime/")
    dists = [_distribution(name, version) for name, version in pins(requirements_text).items()]
    tool = Component(type=ComponentType.APPLICATION, name="edgesdk", version=__version__,
                     bom_ref=f"tool:edgesdk@{__version__}")
    bom = Bom(serial_number=uuid.UUID(int=0), components=[runtime, *dists],
              metadata=BomMetaData(component=bundle, tools=ToolRepository(components=[tool]),
                                   timestamp=datetime.fromtimestamp(source_date_epoch(), tz=timezone.utc)))
    bom.register_dependency(bundle, [runtime, *dists])
    return bom


def _distribution(name: str, version: str) -> Component:
    purl = PackageURL(type="pypi", name=re.sub(r"[-_.]+", "-", name).lower(), version=version)
    return Component(type=ComponentType.LIBRARY, name=name, version=version, purl=purl, bom_ref=purl.to_string(),
                     licenses=_licenses(name, version))


def _licenses(dist: str, version: str) -> list[License]:
    """What the installed distribution `dist` declares, when it is this `version`: its License-Expression,
    else the SPDX ids of its license classifiers; nothing when it declares neither or another version
    is installed (an SBOM says nothing rather than guess)."""
    try:
        meta = importlib.metadata.metadata(dist)
    except importlib.metadata.PackageNotFoundError:
        return []
    if meta["Version"] != version:
        return []
    declared = LicenseAcknowledgement.DECLARED
    if meta.get("License-Expression"):
        return [LicenseFactory().make_from_string(meta["License-Expression"], license_acknowledgement=declared)]
    ids = dict.fromkeys(_CLASSIFIER_SPDX[c] for c in meta.get_all("Classifier") or () if c in _CLASSIFIER_SPDX)
    return [DisjunctiveLicense(id=i, acknowledgement=declared) for i in ids]


def _render(bom: Bom) -> str:
    doc = json.loads(JsonV1Dot6(bom).output_as_string())
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"
