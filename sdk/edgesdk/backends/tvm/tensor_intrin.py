"""The import of `tvm.s_tir.tensor_intrin` that MetaSchedule needs, made fast."""

from __future__ import annotations

from collections.abc import Callable


def _tensor_intrin_importer() -> Callable[[], None]:
    """A function that imports `tvm.s_tir.tensor_intrin` in ~4 s instead of 20-50 s.

    MetaSchedule needs the module (TuneContext and every build worker import it). It
    parses ~250 TVMScript functions, and each parse calls `inspect.stack()`, which looks
    up the module of every frame on the stack. The import machinery's frames
    (`<frozen importlib._bootstrap>`) have no file, so `inspect` never caches their module
    and scans all of `sys.modules` for each one: frames x modules per function, worse the
    more a process has imported. Recording in inspect's own cache which module those
    frames come from removes the scans. The function is built here, nested, so that
    cloudpickle ships it to MetaSchedule's worker processes by value.
    """

    def import_tensor_intrin() -> None:
        # imported inside: cloudpickle ships this function by value to worker processes
        import importlib
        import inspect
        import os

        for name in ("importlib._bootstrap", "importlib._bootstrap_external"):
            # the key inspect.getmodule computes for such a frame (relative to the cwd)
            inspect.modulesbyfile.setdefault(os.path.normcase(os.path.abspath(f"<frozen {name}>")), name)
        importlib.import_module("tvm.s_tir.tensor_intrin")

    return import_tensor_intrin
