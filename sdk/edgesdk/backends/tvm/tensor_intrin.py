"""The import of `tvm.s_tir.tensor_intrin` that MetaSchedule needs, made fast."""

from __future__ import annotations

from collections.abc import Callable

# The submodules of tvm.s_tir.tensor_intrin whose intrinsics a target kind's schedules use: MetaSchedule's
# CPU rules tensorize with x86's (VNNI, AVX-512) and arm_cpu's (NEON, dot product) intrinsics, CUDA's with
# cuda's (and dlight imports cuda's itself). The package imports every family (rocm, hexagon, RISC-V too).
FAMILIES = {"llvm": ("x86", "arm_cpu"), "cuda": ("cuda",)}
ALL = ("cuda", "arm_cpu", "x86", "rocm", "hexagon", "riscv_cpu")  # what the package's __init__ imports


def _tensor_intrin_importer(kind: str = "llvm") -> Callable[[], None]:
    """A function that registers the tensor intrinsics of TVM target kind `kind` ("llvm", "cuda") in well
    under a second, where `import tvm.s_tir.tensor_intrin` (which TuneContext and every MetaSchedule build
    worker run) takes 15-50 s.

    Two costs, both removed. The package imports the intrinsics of every family, ~250 TVMScript functions,
    most of them CUDA's: here it is put in `sys.modules` without running its `__init__` (so that
    TuneContext's import of it does nothing), and only `kind`'s submodules are imported, as TVM's own code
    imports a submodule it needs (dlight the cuda one). And each TVMScript function's parse calls
    `inspect.stack()`, which looks up the module of every frame on the stack: frames of code with no file
    (the import machinery's `<frozen importlib._bootstrap>`, TVMScript's own `<ast>`, `python -c`'s
    `<string>`) find none, and `inspect` caches only what it finds, so it scans all of `sys.modules` again
    for each such frame, frames x modules per function, worse the more a process has imported. For the
    time of the import, the lookup of such a name is made once and remembered; no module is ever found
    under a name in angle brackets, so the answers are the same.

    The function is built here, nested, so that cloudpickle ships it (with `kind`'s submodule names) to
    MetaSchedule's worker processes by value.
    """
    wanted = FAMILIES.get(kind, ALL)

    def import_tensor_intrin() -> None:
        # imported inside: cloudpickle ships this function by value to worker processes
        import importlib
        import importlib.util
        import inspect
        import sys

        package = "tvm.s_tir.tensor_intrin"
        todo = [f"{package}.{name}" for name in wanted if f"{package}.{name}" not in sys.modules]
        if package in sys.modules and not todo:
            return
        if package not in sys.modules:  # the package without its __init__: a namespace for the submodules
            module = importlib.util.module_from_spec(importlib.util.find_spec(package))
            sys.modules[package] = module
            setattr(importlib.import_module("tvm.s_tir"), "tensor_intrin", module)
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
            for name in todo:
                importlib.import_module(name)
        finally:
            inspect.getmodule = scan

    return import_tensor_intrin
