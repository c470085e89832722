"""The edgesdk runtime: what ships inside a bundle and runs it on the device.

Depends on numpy and, per segment backend, the TVM runtime, LiteRT (or tflite-runtime) or
onnxruntime; nothing from the build side. Inside a bundle this package is `runtime`, so
`python -B -m runtime selftest` works from the bundle directory.
"""

from .executor import BundleModel
from .inputs import InputError
from .manifest import Manifest, ManifestError

__all__ = ["BundleModel", "InputError", "Manifest", "ManifestError"]
