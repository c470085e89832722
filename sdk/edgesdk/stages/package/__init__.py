"""package: compile every segment with its backend and write the bundle.

Needs: the plan with its CPU backends and the tuning database copy (tune), the int8 segments (compress).
Guarantees: `bundle/` as docs/bundle.md lays it out — manifest.json with the sha256 and size of every
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
from ...bundling.evaluation import task_of
from ...compression.tasks import files, parse_options
from ...ir.digest import file_sha256, tree_sha256

# the golden inputs, the held-out samples of the accuracy gate and the provenance's calibration digest come
# from the calibration samples; below the gate, --accept-accuracy-loss decides whether a bundle is published;
# the task figures (the manifest's accuracy.task) come from the --eval samples
OPTIONS = ("calib", "calib_samples", "calib_preprocess", "input_ranges", "seed", "accept_accuracy_loss", "eval_data",
           "task", "decoder", "task_options", "output_activations")
READS = ("import", "legalize", "schedule", "tune", "compress")  # the earlier stages whose outputs it reads (its cache key covers them)


def cache_inputs(options, target) -> dict:
    """The calibration directory's content: the same path with other samples is another bundle; so are
    other --eval samples or labels, and another dictionary or anchors file named by --task-options."""
    out = {"calib_sha256": tree_sha256(Path(options.calib)) if options.calib else None}
    if options.eval_data:
        named = files(parse_options(task_of(options), options.decoder, options.task_options))
        out.update(eval_sha256=tree_sha256(Path(options.eval_data)) if Path(options.eval_data).is_dir() else None,
                   task_files=[file_sha256(p) if p.is_file() else None for p in named])
    return out


def run(artifact: Path, ctx) -> dict:
    earlier = [w for stage in READS if (rec := ctx.artifact(stage) / "record.json").exists()
               for w in json.loads(rec.read_text()).get("warnings", [])]
    # the plan as the tune stage left it: every CPU span on the backend measured fastest
    sources = Sources(imported=ctx.artifact("import"), scheduled=ctx.artifact("tune"),
                      tuned=ctx.artifact("tune"), compressed=ctx.artifact("compress"),
                      legalized=ctx.artifact("legalize"))
    return package(sources, ctx.target, ctx.options, ctx.out, log=ctx.log, warn=ctx.warn,
                   warnings=lambda: earlier + ctx.warnings)
