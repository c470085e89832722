"""`python -m runtime selftest [--json]` / `python -m runtime run IN.npz OUT.npz`, from the bundle directory."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv[0] == "selftest":
        from .selftest import main

        return main(argv[1:])
    if argv[0] == "run" and len(argv) == 3:
        from .executor import BundleModel

        model = BundleModel(Path(__file__).resolve().parents[1])
        outputs = model.run(dict(np.load(argv[1])))
        np.savez(argv[2], **outputs)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


sys.exit(_main(sys.argv[1:]))
