"""Target files from Python: what `edgesdk targets list`, `show`, `validate` and `schema` read.

    import edgesdk
    target = edgesdk.targets.load("arm_2tpu")      # a shipped target's name, or a YAML file
    [d.kind for d in target.devices]
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["load", "path_of", "schema", "shipped"]


def load(target: str | os.PathLike) -> Any:
    """The target (`config.Target`, validated) from a file or a shipped target's name; UsageError naming the
    file and line of each problem."""
    from .config import load_target

    return load_target(os.fspath(target))[0]


def path_of(target: str | os.PathLike) -> Path:
    """The file a target name or path resolves to."""
    from .config import load_target

    return Path(load_target(os.fspath(target))[1])


def shipped() -> dict[str, Path]:
    """The shipped targets, by name."""
    from .config import builtin_targets

    return dict(builtin_targets())


def schema() -> dict:
    """The JSON Schema of target files."""
    from .config import target_schema

    return target_schema()
