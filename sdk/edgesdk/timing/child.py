"""The process a bundle is run or timed in alone (`runner.FreshProcess`): loads it with the runtime's
executor and nothing else of the build, so no other runtime's threads spin on the cores, as on a device.

    python -m edgesdk.timing.child measure BUNDLE FEEDS.npz WARMUP RUNS   -> stdout: JSON milliseconds per run
    python -m edgesdk.timing.child run BUNDLE FEEDS.npz OUTPUTS.npz       -> each sample's outputs

`run`'s files key each tensor "i|name", `i` the sample's index.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from edgesdk.runtime import BundleModel
from edgesdk.timing.clock import laps


def measure(bundle: str, feeds_file: str, warmup: int, runs: int) -> list[float]:
    """Milliseconds of each of `runs` inferences after `warmup`, on the inputs in `feeds_file`."""
    model = BundleModel(bundle, log=lambda s: None)
    feeds = dict(np.load(feeds_file))
    feeds = {t.name: feeds[t.name] for t in model.inputs}
    return laps(lambda: model.run(feeds), warmup, runs)


def run(bundle: str, feeds_file: str, outputs_file: str) -> None:
    model = BundleModel(bundle, log=lambda s: None)
    feeds: dict[int, dict] = {}
    with np.load(feeds_file) as given:
        for key in given.files:
            i, name = key.split("|", 1)
            feeds.setdefault(int(i), {})[name] = given[key]
    np.savez(outputs_file, **{f"{i}|{name}": value for i in sorted(feeds) for name, value in model.run(feeds[i]).items()})


def main(argv: list[str]) -> None:
    if argv[0] == "measure":
        print(json.dumps(measure(argv[1], argv[2], int(argv[3]), int(argv[4]))))
    elif argv[0] == "run":
        run(argv[1], argv[2], argv[3])
    else:
        raise SystemExit(f"usage: python -m edgesdk.timing.child measure|run ...; not {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
