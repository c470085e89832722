"""edgesdk: compile a trained model for an industrial edge device and package it as a bundle.

    import edgesdk

    build = edgesdk.build("model.onnx", "arm_2tpu", "out/", calib="calib/")   # or an nn.Module, a Keras model
    with edgesdk.Bundle.open(build.bundle.path) as bundle:
        outputs = bundle.run({"x": image})

The same as the command line (`edgesdk build model.onnx --target arm_2tpu -o out/ --calib calib/`): the same
options, errors and bundles. `docs/python-api.md` shows a CI release script and a notebook session.

Importing this package imports nothing heavy: each name below is loaded when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it; the module itself where the name is a module
_WHERE = {
    "build": "edgesdk.api", "check": "edgesdk.api", "Build": "edgesdk.api", "Bundle": "edgesdk.api",
    "sign": "edgesdk.api", "generate_keys": "edgesdk.api",
    "BuildOptions": "edgesdk.options",
    "EdgeSDKError": "edgesdk.errors", "UserError": "edgesdk.errors", "UsageError": "edgesdk.errors",
    "targets": "edgesdk.targets",
}

__all__ = ["Build", "BuildOptions", "Bundle", "EdgeSDKError", "UsageError", "UserError", "__version__", "build",
           "check", "generate_keys", "sign", "targets"]

if TYPE_CHECKING:
    from . import targets
    from .api import Build, Bundle, build, check, generate_keys, sign
    from .errors import EdgeSDKError, UsageError, UserError
    from .options import BuildOptions


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'edgesdk' has no attribute {name!r}")
    module = importlib.import_module(where)
    value = module if where.endswith("." + name) else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
