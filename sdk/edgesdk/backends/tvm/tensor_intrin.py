"""The import of `tvm.s_tir.tensor_intrin` that MetaSchedule needs, made fast."""

from __future__ import annotations

from collections.abc import Callable


def _tensor_intrin_importer() -> Callable[[], None]:
    """A function that imports `tvm.s_tir.tensor_intrin` in ~3 s instead of 15-50 s (once per process).

    MetaSchedule needs the module (TuneContext and every build worker import it). It
    parses ~250 TVMScript functions, and each parse calls `inspect.stack()`, which looks
    up the module of every frame on the stack. Frames of code with no file (the import
    machinery's `<frozen importlib._bootstrap>`, `<frozen runpy>`, TVMScript's own `<ast>`,
    `python -c`'s `<string>`) find none, and `inspect` caches only what it finds: it scans
    all of `sys.modules` again for each such frame, frames x modules per function, worse the
    more a process has imported. For the time of the import, the lookup of such a name is
    made once and remembered; no module is ever found under a name in angle brackets, so
    the answers are the same. The function is built here, nested, so that cloudpickle
    ships it to MetaSchedule's worker processes by value.
    """

    def import_tensor_intrin() -> None:
        # imported inside: cloudpickle ships this function by value to worker processes
        import importlib
        import inspect
        import sys

        if "tvm.s_tir.tensor_intrin" in sys.modules:
            return
        scan = inspect.getmodule
        found: dict[str, object] = {}

        def getmodule(obj, _filename=None):
            if not (inspect.isframe(obj) and _filename and _filename.startswith("<") and _filename.endswith(">")):
                return scan(obj, _filename)
            if _filename not in found:
                found[_filename] = scan(obj, _filename)
            return found[_filename]

        inspect.getmodule = getmodule
        try:
            importlib.import_module("tvm.s_tir.tensor_intrin")
        finally:
            inspect.getmodule = scan

    return import_tensor_intrin
