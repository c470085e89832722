"""Bundling: a plan and its compiled segments made into a bundle (DESIGN §5), below the package stage.

    bundle.py   package: compile each segment by its backend, finish it by its device kind's compiler
                (edgetpu_compiler), the manifest, runtime, requirements and plan as shipped
    golden.py   the golden self-test and the accuracy, from the bundle's own plan on the build host
    evaluation.py  --eval: the bundle against the fp32 model on held-out samples, by the task's measure
    archive.py  reproducible bytes: the file table, fixed-date .npz files, the tarball
    sbom.py     the CycloneDX SBOM of what the runtime needs on the device (sbom.cdx.json)
    signing.py  keys, the bundle's version and signature (manifest.sig), release files' signatures
"""

from .archive import write_tarball
from .bundle import Sources, package

__all__ = ["Sources", "package", "write_tarball"]
