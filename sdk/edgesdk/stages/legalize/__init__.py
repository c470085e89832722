"""legalize: make the graph fit the target's accelerators, then say which devices can run every node.

Needs: the imported model (static shapes); calibration data (`--calib`), or the synthetic samples
the compress stage also uses.
Guarantees: `model.onnx` whose every node carries `edgesdk.capable` (device kinds, most preferred
first, and the CPU backend: `cpu/tvm` or `cpu/onnxruntime`); `legalize.json` with every refusal
(device, reason code, sentence), every rewrite and every approximation. A node that no device can
run fails the build, all such nodes listed in one error.

Steps (`legalization.legalize`), each only where an accelerator of the target refuses something (the support tables decide,
`legalization.support`):
1. exact rewrites (`legalization.exact`) of the op types an accelerator refuses: zero error, or the
   float rounding each rule states;
2. ReLU-sum approximations (`legalization.relu_sum`) of the unary functions an accelerator lacks,
   each whole unary region from its input (`legalization.regions`), fitted on the range the
   calibration data shows, within `legalize.max_abs_error` of the target (or `--max-abs-error`), or
   within `--max-error-lsb K` int8 steps of the approximated output (its range / 255).
   A function that cannot meet the bound stays as it was (exact, on the CPU), with a warning naming
   its nodes; with `--no-cpu-fallback` it fails the build;
3. the graph optimizations of the import stage (`edgesdk.passes`), on the rewritten graph.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path


from ...ir import model as irm
from ...ir.digest import tree_sha256
from ...legalization.legalize import legalize

OPTIONS = ("max_abs_error", "max_error_lsb", "allow_cpu_fallback", "legalize_rewrites", "calib", "calib_samples", "calib_preprocess",
           "input_ranges", "seed")
READS = ("import",)  # the earlier stages whose outputs it reads (its cache key covers them)


def cache_inputs(options, target) -> dict:
    return {"calib_sha256": tree_sha256(Path(options.calib)) if options.calib else None}


def run(artifact: Path, ctx) -> dict:
    model = irm.read(artifact / "model.onnx")
    io = json.loads((artifact / "import.json").read_text())
    result = legalize(model, ctx.target, ctx.options, io["inputs"], log=ctx.log, warn=ctx.warn)
    model, counts = result.pop("model"), result.pop("preferred_device")
    del result["support"]

    irm.save(model, ctx.out / "model.onnx")
    if "exact_model" in result:   # before the approximations: the schedule may keep some regions exact
        irm.save(result.pop("exact_model"), ctx.out / "exact.onnx")
    (ctx.out / "legalize.json").write_text(json.dumps(result, indent=2, default=float) + "\n")
    by_reason = collections.Counter((r["device"], r["op"], r["code"]) for r in result["refusals"])
    for (dev, op, code), n in sorted(by_reason.items()):
        ctx.log(f"legalize: {n} x {op} cannot run on {dev} ({code})")
    return {"preferred_device": counts, "refusals": len(result["refusals"]),
            "refused_ops": {f"{d}:{op}": n for (d, op, _), n in sorted(by_reason.items())},
            "before": result["before"], "after": result["after"], "rewrites": result["rewrites"],
            "approximations": result["approximations"], "fallbacks": result["fallbacks"],
            "max_abs_error": result["max_abs_error"], "end_to_end": result["end_to_end"],
            "optimized": result["optimized"], "output_shares": result.get("output_shares")}
