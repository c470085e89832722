"""The device models, keyed by kind (MetaSchedule's string-keyed roles are the model).

`devices/__init__.py` registers the shipped kinds; a test registers a dummy with `registered(...)`,
which removes it again. Order never depends on registration order: the host comes first, then the
accelerators by `preference`, ties broken by kind.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from ..config import HOST
from ..errors import UsageError
from .model import DeviceModel

_MODELS: dict[str, DeviceModel] = {}


def register(m: DeviceModel) -> None:
    if m.kind in _MODELS:
        raise ValueError(f"a device model of kind '{m.kind}' is already registered")
    _MODELS[m.kind] = m


def unregister(kind: str) -> None:
    del _MODELS[kind]


@contextmanager
def registered(m: DeviceModel) -> Iterator[DeviceModel]:
    """`m` registered for the duration of a `with` block (tests: no model leaks into later tests)."""
    register(m)
    try:
        yield m
    finally:
        unregister(m.kind)


def model(kind: str) -> DeviceModel:
    try:
        return _MODELS[kind]
    except KeyError:
        raise UsageError("device.unknown-kind", f"no device model of kind '{kind}'",
                         f"known kinds: {', '.join(m.kind for m in models())}") from None


def models() -> list[DeviceModel]:
    """Every registered model: the host first, then the accelerators by preference."""
    return sorted(_MODELS.values(), key=lambda m: (m.kind != HOST, m.preference, m.kind))


def accelerators(kinds: Iterable[str] | None = None) -> list[DeviceModel]:
    """The models of the accelerator kinds among `kinds` (default: every registered one), by preference."""
    present = set(kinds) if kinds is not None else set(_MODELS)
    return [m for m in models() if m.kind != HOST and m.kind in present]
