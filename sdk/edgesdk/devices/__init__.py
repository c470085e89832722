"""Device models: op-support tables and cost formulas, as data; one module per kind, in a registry
keyed by kind (`registry.model(kind)`)."""

from . import cpu, edgetpu, gpu
from .registry import register

for _m in (cpu.MODEL, edgetpu.MODEL, gpu.MODEL):
    register(_m)
