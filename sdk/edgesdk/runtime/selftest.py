"""The golden self-test: run the bundle on its stored input and compare with the stored output.

Tolerances (DESIGN §5): an output produced by an int8 segment may differ by one quantization step
(1 LSB = its scale); a float output by 1e-4 relative to the largest magnitude of the expected
output. The golden output was produced at build time by this same plan on the build host.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import numpy as np

from .executor import BundleModel

FLOAT_RTOL = 1e-4


def selftest(bundle: Path) -> dict:
    bundle = Path(bundle)
    model = BundleModel(bundle, log=lambda s: print(s, file=sys.stderr))
    inputs = dict(np.load(bundle / "golden" / "inputs.npz"))
    expected = dict(np.load(bundle / "golden" / "outputs.npz"))
    got = model.run(inputs)
    results, ok = [], True
    for spec in model.manifest.outputs:
        exp = expected[spec.name].astype(np.float64)
        out = np.asarray(got[spec.name], dtype=np.float64)
        err = float(np.max(np.abs(out - exp))) if exp.size else 0.0
        if spec.quant is not None:
            tol, rule = spec.quant.scale * 1.0001, "1 LSB"
        else:
            tol, rule = FLOAT_RTOL * max(float(np.max(np.abs(exp))), 1e-12), "1e-4 relative"
        passed = out.shape == exp.shape and err <= tol
        ok &= passed
        results.append({"output": spec.name, "max_abs_error": err, "tolerance": tol, "rule": rule, "passed": passed})
    return {"passed": ok, "arch": platform.machine(), "outputs": results, "notes": model.notes,
            "load_seconds": round(model.load_seconds, 3)}


def main(argv: list[str]) -> int:
    bundle = Path(argv[0]) if argv and not argv[0].startswith("-") else Path(__file__).resolve().parents[1]
    report = selftest(bundle)
    if "--json" in argv:
        print(json.dumps(report))
    else:
        for r in report["outputs"]:
            print(f"{'ok' if r['passed'] else 'FAIL'}  {r['output']}: max abs error {r['max_abs_error']:.3g} "
                  f"(tolerance {r['tolerance']:.3g}, {r['rule']})")
        print(f"self-test {'passed' if report['passed'] else 'FAILED'} on {report['arch']}")
    return 0 if report["passed"] else 1
