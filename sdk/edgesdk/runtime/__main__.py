"""`python -B -m runtime selftest [--json]` / `python -B -m runtime run IN.npz OUT.npz`, from the bundle directory.

Run it with -B (or PYTHONDONTWRITEBYTECODE=1): compiled files written into the bundle are files its
manifest does not list, and `edgesdk verify` refuses a bundle that holds any.

Exit codes: 0 ok, 1 a failed self-test, a damaged bundle or an input the model refuses, 2 a wrong
invocation.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        if argv[0] == "selftest":
            from .selftest import main

            return main(argv[1:])
        if argv[0] == "run" and len(argv) == 3:
            from .executor import BundleModel

            model = BundleModel(Path(__file__).resolve().parents[1])
            with np.load(argv[1]) as feeds:
                outputs = model.run(dict(feeds))
            np.savez(argv[2], **outputs)
            return 0
    except (ValueError, OSError) as e:  # a malformed manifest, a missing file, an input the model refuses
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(__doc__, file=sys.stderr)
    return 2


sys.exit(_main(sys.argv[1:]))
