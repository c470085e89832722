"""package: compile every segment with its backend and write the bundle.

Needs: the plan with its CPU backends and the tuning database copy (tune), the int8 segments (compress).
Guarantees: `bundle/` as DESIGN §5 lays it out — manifest.json with the sha256 and size of every
other file, plan.json, segments/, runtime/, golden/, requirements.txt — and a reproducible
`bundle.tar.gz` (sorted members, fixed mtime/uid/gid). It decides nothing new.

The golden output is produced by running the bundle's own plan on the build host: the very same
TFLite files, and for CPU/GPU segments built for another machine (aarch64, CUDA) an x86-64 twin
compiled from the same segment and tuning records. The twin never ships.

A bundle with int8 anywhere is held to the target's accuracy gate against the fp32 model on the
held-out calibration samples (bundling/gate.py, docs/accuracy.md): below it nothing is published,
unless `--accept-accuracy-loss`, which the manifest then records. `accuracy.html` reports it.

The stage reads the earlier stages' directories and their warnings; `packaging.package` does the rest.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...bundling import Sources, package
from ...ir.digest import tree_sha256

# the golden inputs, the held-out samples of the accuracy gate and the provenance's calibration digest come
# from the calibration samples; below the gate, --accept-accuracy-loss decides whether a bundle is published
OPTIONS = ("calib", "calib_samples", "calib_preprocess", "seed", "accept_accuracy_loss")
READS = ("import", "legalize", "schedule", "tune", "compress")  # the earlier stages whose outputs it reads (its cache key covers them)


def cache_inputs(options, target) -> dict:
    """The calibration directory's content: the same path with other samples is another bundle."""
    return {"calib_sha256": tree_sha256(Path(options.calib)) if options.calib else None}


def run(artifact: Path, ctx) -> dict:
    earlier = [w for stage in READS if (rec := ctx.artifact(stage) / "record.json").exists()
               for w in json.loads(rec.read_text()).get("warnings", [])]
    # the plan as the tune stage left it: every CPU span on the backend measured fastest
    sources = Sources(imported=ctx.artifact("import"), scheduled=ctx.artifact("tune"),
                      tuned=ctx.artifact("tune"), compressed=ctx.artifact("compress"),
                      legalized=ctx.artifact("legalize"))
    return package(sources, ctx.target, ctx.options, ctx.out, log=ctx.log, warn=ctx.warn,
                   warnings=lambda: earlier + ctx.warnings)
