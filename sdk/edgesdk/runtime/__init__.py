"""The edgesdk runtime: what ships inside a bundle and runs it on the device.

Depends on numpy and, per segment backend, the TVM runtime, LiteRT (or tflite-runtime) or
onnxruntime; nothing from the build side. Inside a bundle this package is `runtime`, so
`python -m runtime selftest` works from the bundle directory.
"""

from .executor import BundleModel
from .manifest import Manifest

__all__ = ["BundleModel", "Manifest"]
