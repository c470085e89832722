"""The edgesdk runtime: what ships inside a bundle and runs it on the device.

Depends on numpy and, per segment backend, the TVM runtime, LiteRT (or tflite-runtime) or
onnxruntime; `cryptography` for signatures; nothing from the build side. Inside a bundle this package
is `runtime`, so `python -B -m runtime selftest` works from the bundle directory.

The names below are imported when first used, so that `python -m runtime verify`, `install`, `status`
and `rollback` do not load numpy and the executor they never need.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"BundleModel": ".executor", "InputError": ".inputs", "Manifest": ".manifest",
            "ManifestError": ".manifest"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
