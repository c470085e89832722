"""Target files and build options: schemas, YAML loading with file/line errors."""

from .target import (
    HOST,
    CpuBackendFigures,
    CpuDevice,
    EdgeTpuDevice,
    Figure,
    GpuDevice,
    Link,
    Target,
    builtin_targets,
    load_target,
    register_device_schema,
    target_schema,
    unregister_device_schema,
)

__all__ = [
    "HOST",
    "CpuBackendFigures",
    "CpuDevice",
    "EdgeTpuDevice",
    "Figure",
    "GpuDevice",
    "Link",
    "Target",
    "builtin_targets",
    "load_target",
    "register_device_schema",
    "unregister_device_schema",
    "target_schema",
]
