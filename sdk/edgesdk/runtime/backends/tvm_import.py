"""TVM imported without torch.

TVM imports torch wherever torch is installed, for its DLPack interop with torch tensors: its FFI library
(`tvm_ffi`) first thing, Relax (`tvm.relax.base_py_module`) again. That is 2-3 s and a few hundred MiB in
every process that imports TVM (a build, a bundle's runtime on the build host), where edgesdk hands TVM numpy
arrays, never torch tensors. `install()` adds an import hook under which, while a module of `tvm_ffi` or `tvm`
is executed, `import torch` fails as if torch were not installed (TVM goes on without its torch interop);
where torch is imported already, nothing changes, and torch imports normally from anywhere else, before or
after. On a device without torch the hook changes nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys


def _tvm(name: str) -> bool:
    return name in ("tvm", "tvm_ffi") or name.startswith(("tvm.", "tvm_ffi."))


class _WithoutTorch(importlib.abc.Loader):
    """A TVM module's own loader, run with `torch` unimportable."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def __getattr__(self, name: str):  # the loader's resource reader and the like
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        blocked = "torch" not in sys.modules
        if blocked:
            sys.modules["torch"] = None  # `import torch` raises ImportError, which TVM catches
        try:
            self._loader.exec_module(module)
        finally:
            if blocked and "torch" in sys.modules and sys.modules["torch"] is None:
                del sys.modules["torch"]


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if not _tvm(name) or "torch" in sys.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None and not isinstance(spec.loader, _WithoutTorch):
            spec.loader = _WithoutTorch(spec.loader)
        return spec


def install() -> None:
    """The hook, once per process."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
