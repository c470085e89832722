"""Runs a TVM segment: a shared library exported by the build's TVM backend.

The library holds a Relax VM executable whose function `main` takes the segment inputs
in `TensorSpec.key` order, then the segment's weights, and returns one tensor, or a tuple
when the segment has several outputs. The weights are a file beside the library
(`weights_path`: segments/s0.so -> segments/s0.weights, in the format `save_weights` writes),
not constants linked into it: a library holding them copied them at load (the mapped library,
then the VM's own tensors, with a serialized copy between: 4x the weights for VGG16), and an
aarch64 library cannot link past 2 GiB of them. On the CPU the runner maps the file and gives
TVM views of it (DLPack), so the weights are in memory once, in pages the kernel may drop and
read again; on a GPU each is copied to the device once.

This module needs only TVM's runtime (it works with `TVM_USE_RUNTIME_LIB=1`, which imports
in about a second and never loads the compiler) and numpy.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np

from ..manifest import ManifestError, Segment, TensorSpec
from .tvm_import import install

install()  # TVM without the torch import of its FFI library (tvm_import.py)


class TvmRunner:
    """One loaded library on one device; `run` may be called from several threads."""

    native_tensors = True  # `run` takes and, with native=True, returns TVM tensors

    def __init__(self, library: Path, segment: Segment, device_index: int):
        import tvm
        from tvm.runtime.vm import VirtualMachine

        self.note = ""
        self._segment = segment
        self._inputs = sorted(segment.inputs, key=lambda s: int(s.key))
        self._outputs = sorted(segment.outputs, key=lambda s: int(s.key))
        self._tensor = tvm.runtime.tensor
        if segment.device.startswith("gpu"):
            self._device = _cuda_device(tvm, device_index, segment)
            with _CUDA_LOAD:
                _CUDA_ARCH[0] = "sm_" + self._device.compute_version.replace(".", "")
                _register_cuda_compiler()
                library_module = load_library(library)
        else:
            self._device = tvm.cpu(0)
            library_module = load_library(library)
        self._vm = VirtualMachine(library_module, self._device)
        self._main = self._vm["main"]
        arity = self._vm._get_function_arity("main")
        if arity < len(self._inputs):
            raise ManifestError(f"segment {segment.id}: its library's main takes {arity} inputs; the manifest lists "
                                f"{len(self._inputs)}")
        self._weights = load_weights(Path(library), arity - len(self._inputs), self._device, segment.id)
        self._on_cpu = not segment.device.startswith("gpu")
        self._from_dlpack = tvm.runtime.from_dlpack
        self._empty = tvm.runtime.empty
        # per input, an aligned CPU tensor and a numpy view of it, made at its first unaligned feed (`_argument`)
        self._staging: list[tuple | None] = [None] * len(self._inputs)
        # The VM keeps per-call state (registers, its memory pool): one call at a time.
        self._lock = threading.Lock()

    def set_threads(self, threads: int) -> None:
        """Size the calling thread's TVM thread pool (TVM keeps one pool per thread; it never grows
        beyond TVM_NUM_THREADS)."""
        import tvm

        tvm.get_global_func("runtime.config_threadpool")(1, threads)

    def run(self, feeds: dict, *, native: bool = False) -> dict:
        """Outputs by ONNX name for `feeds` (ONNX names, shapes and dtypes of the segment).

        A feed may be a numpy array or a TVM tensor on this runner's device (another TVM segment's
        output, passed on without a copy). With `native`, the outputs stay TVM tensors: the executor
        hands them to the next TVM segment as they are, and copies to numpy only for other backends
        and for the model's outputs (on NASNetMobile's 38-segment bundle the two copies per boundary
        took 3.4 ms of 16)."""
        with self._lock:  # the staging buffers are the runner's: filled, used and read out under its lock
            args = [self._argument(feeds, spec, i) for i, spec in enumerate(self._inputs)]
            result = self._main(*args, *self._weights)
            values = list(result) if _is_tuple(result) else [result]
            if len(values) != len(self._outputs):
                raise ManifestError(f"segment {self._segment.id}: its library returns {len(values)} outputs; the "
                                    f"manifest lists {len(self._outputs)}")
            if native and any(self._staging):
                values = [self._owned(v) for v in values]
            if native:
                return {spec.name: value for spec, value in zip(self._outputs, values)}
            return {spec.name: value.numpy() for spec, value in zip(self._outputs, values)}

    def _argument(self, feeds: dict, spec: TensorSpec, slot: int):
        """Input `slot` as the TVM tensor `main` takes. On the CPU a numpy feed is not copied where TVM can
        take its memory as it is (C-ordered, 64-byte aligned, writeable: DLPack); any other is copied into
        the slot's own aligned tensor, made once. A new tensor per call cost MobileNetV2's 600 KB input 50 us
        (an allocation and a copy), copying into the same one 19 us, a view 0.5 us."""
        value = feeds.get(spec.name)
        if value is not None and not isinstance(value, np.ndarray) and hasattr(value, "numpy"):
            if value.device == self._device and str(value.dtype) == spec.dtype \
                    and tuple(value.shape) == tuple(spec.shape):
                return value
            value = value.numpy()  # another device, or not what this segment takes: checked below
            feeds = {**feeds, spec.name: value}
        value = _checked(feeds, spec, self._segment.id)
        if not self._on_cpu:
            return self._tensor(value, device=self._device)  # copied to the GPU
        if value.ctypes.data % ALIGNMENT == 0 and value.flags.writeable:
            try:
                return self._from_dlpack(value)
            except (BufferError, RuntimeError, TypeError, ValueError):
                pass  # a layout DLPack does not take: copied as any other
        staged = self._staging[slot]
        if staged is None:
            tensor = self._empty(value.shape, spec.dtype, self._device)
            staged = self._staging[slot] = (tensor, _view(tensor), tensor.data_ptr())
        np.copyto(staged[1], value)
        return staged[0]

    def _owned(self, value):
        """An output as a tensor of its own where it is a staging buffer (a segment that returns an input as
        it is): the next call refills that buffer while the output may still be on its way to another segment."""
        if value.data_ptr() in {staged[2] for staged in self._staging if staged is not None}:
            return self._tensor(value.numpy(), device=self._device)
        return value


def open_runner(bundle: Path, segment: Segment, physical_device: str | None, *, alone: bool = False) -> TvmRunner:
    """A runner for `segment`'s library; CUDA when the segment's device is a GPU.

    `physical_device` (e.g. `cuda:1`) selects the GPU; it is ignored on the CPU. A CUDA
    library built on a machine without a GPU carries its kernels as CUDA source, which
    TVM compiles when the library loads (`tvm_callback_cuda_compile`: NVRTC from the
    cuda-bindings package, or nvcc with `TVM_CUDA_COMPILE_MODE=nvcc`).
    """
    return TvmRunner(Path(bundle) / segment.artifact, segment, _device_index(physical_device or segment.device))


# A weights file: MAGIC, the header's length (8 bytes, little-endian), the header (JSON: each tensor's dtype,
# shape and offset, in the order `main` takes them), then the tensors, each at an offset ALIGNMENT divides
# (TVM's kernels assume 64-byte aligned buffers; the file is mapped at a page boundary).
WEIGHTS_SUFFIX = ".weights"
MAGIC = b"EDGESDK-TVM-WEIGHTS-1\n"
ALIGNMENT = 64


def _aligned(n: int) -> int:
    """`n` rounded up to ALIGNMENT."""
    return -(-n // ALIGNMENT) * ALIGNMENT


_LOADED: dict[str, tuple[int, int, int, int]] = {}  # a library's real path -> its file's identity when loaded
_LOADED_LOCK = threading.Lock()


def load_library(library: Path):
    """`tvm.runtime.load_module(library)`, the file as it is now. The dynamic loader hands back the library it
    loaded before under the same path, even where the file was replaced since (a build's accuracy remedy
    compiles a segment again to the same name, in the same process): its old code then met the new weights
    file (`holds 2 weights; the library takes 1`). A path loaded before whose file changed is loaded from a
    copy under a name of its own."""
    import shutil
    import tempfile

    import tvm

    real = os.path.realpath(library)
    st = os.stat(real)
    identity = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
    with _LOADED_LOCK:
        first = _LOADED.setdefault(real, identity)
    if first == identity:
        return tvm.runtime.load_module(str(library))
    with tempfile.TemporaryDirectory(prefix="edgesdk-library-") as tmp:
        copy = shutil.copyfile(real, Path(tmp) / Path(real).name)
        return tvm.runtime.load_module(str(copy))  # mapped by then: the copy may go


def weights_path(library: Path) -> Path:
    """The weights file of the library at `library`: beside it, the suffix WEIGHTS_SUFFIX."""
    return Path(library).with_suffix(WEIGHTS_SUFFIX)


def save_weights(path: Path, tensors: list) -> int:
    """Write `tensors` (TVM tensors on the CPU, or numpy arrays) to `path` in the weights format, each from a
    view of its memory where it offers one (DLPack), to a temporary name renamed into place. Returns the
    bytes written."""
    specs, offset = [], 0
    for t in tensors:
        shape, dtype = tuple(int(d) for d in t.shape), np.dtype(str(t.dtype))
        offset = _aligned(offset)
        specs.append({"dtype": dtype.name, "shape": list(shape), "offset": offset})
        offset += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    header = json.dumps({"tensors": specs}).encode()
    start = _aligned(len(MAGIC) + 8 + len(header))
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + len(header).to_bytes(8, "little") + header)
            for t, spec in zip(tensors, specs):
                f.seek(start + spec["offset"])
                value = _view(t)
                f.write(np.ascontiguousarray(value).data)
                del value
            f.truncate(start + offset)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return start + offset


def _view(tensor) -> np.ndarray:
    """`tensor`'s values as numpy: a view of its memory (DLPack) where it gives one, else a copy."""
    if isinstance(tensor, np.ndarray):
        return tensor
    try:
        return np.from_dlpack(tensor)
    except (TypeError, BufferError, RuntimeError, AttributeError):
        return tensor.numpy()


def load_weights(library: Path, count: int, device, segment_id: str) -> list:
    """The `count` weights `library`'s main takes after its inputs, from its weights file, as TVM tensors on
    `device`: views of the mapped file on the CPU (no copy), copies on a GPU. A missing, linked, short or
    foreign file is a ManifestError naming it."""
    import tvm

    if count == 0:
        return []
    path = weights_path(library)
    where = f"segment {segment_id}: {path.name}"
    if not path.is_file():
        raise ManifestError(f"{where}: missing; the library takes {count} weights from it (keep the .weights "
                            "file beside its library, as the build wrote it)")
    if path.is_symlink():  # the bundle's own folders may be reached through a link (an installed slot's)
        raise ManifestError(f"{where}: a link (a bundle holds none)")
    data = np.memmap(path, dtype=np.uint8, mode="c")  # private pages: DLPack exports only writable arrays
    head = bytes(data[:len(MAGIC) + 8])
    if not head.startswith(MAGIC):
        raise ManifestError(f"{where}: not a weights file (its first bytes are {head[:len(MAGIC)]!r})")
    size = int.from_bytes(head[len(MAGIC):], "little")
    try:
        specs = json.loads(bytes(data[len(MAGIC) + 8:len(MAGIC) + 8 + size]))["tensors"]
    except (ValueError, KeyError) as exc:
        raise ManifestError(f"{where}: its header cannot be read ({exc})") from exc
    if len(specs) != count:
        raise ManifestError(f"{where}: holds {len(specs)} weights; the library takes {count}")
    start = _aligned(len(MAGIC) + 8 + size)
    out = []
    for k, spec in enumerate(specs):
        try:
            dtype, shape, offset = np.dtype(spec["dtype"]), tuple(int(d) for d in spec["shape"]), int(spec["offset"])
        except (TypeError, ValueError, KeyError) as exc:
            raise ManifestError(f"{where}: weight {k} is not described as a tensor ({spec})") from exc
        begin = start + offset
        end = begin + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if offset < 0 or begin % ALIGNMENT or end > data.size:
            raise ManifestError(f"{where}: weight {k} ({spec}) lies outside the file's {data.size} bytes or unaligned")
        view = data[begin:end].view(dtype).reshape(shape)
        out.append(tvm.runtime.from_dlpack(view) if device.dlpack_device_type() == tvm.cpu(0).dlpack_device_type()
                   else tvm.runtime.tensor(view, device=device))
    return out


def _is_tuple(value) -> bool:
    return not hasattr(value, "numpy")  # a TVM array (an ffi Array of tensors) rather than one tensor


def _device_index(name: str) -> int:
    tail = name.rpartition(":")[2]
    return int(tail) if tail.isdigit() else 0


def _cuda_device(tvm, index: int, segment: Segment):
    device = tvm.cuda(index)
    if not device.exist:
        # TVM's runtime-only mode does not load its CUDA plugin at import; load it here.
        _load_cuda_plugin()
        device = tvm.cuda(index)
    if not device.exist:
        raise RuntimeError(
            f"no CUDA device: segment {segment.id} runs on {segment.device}, but TVM sees no GPU "
            f"cuda:{index} (check the NVIDIA driver, or rebuild the bundle for the CPU)"
        )
    return device


# The architecture of the GPU whose library is being loaded, read by the compile callback below;
# loads of CUDA libraries take the lock, so two GPUs of different architectures each get their own.
_CUDA_LOAD = threading.Lock()
_CUDA_ARCH = [""]


def _register_cuda_compiler() -> None:
    """Make TVM compile a library's CUDA source for the GPU it is loaded on.

    A library built without a GPU carries its kernels as CUDA source; TVM compiles them when it
    loads the library, through the global function `tvm_callback_cuda_compile`. TVM's own
    callback asks the compiler's current Target for the architecture, which TVM's runtime-only
    mode (`TVM_USE_RUNTIME_LIB=1`, what a bundle runs with) does not have: it fails with
    "module 'tvm.target._ffi_api' has no attribute 'TargetCurrent'" (seen on an H200). This one
    compiles for the device's own compute capability: NVRTC by default, the toolkit's nvcc with
    `TVM_CUDA_COMPILE_MODE=nvcc`, as TVM's does.
    """
    import tvm_ffi

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", _compile_cuda, override=True)


def _compile_cuda(code: str) -> bytes:
    import os

    arch = _CUDA_ARCH[0]
    mode = os.environ.get("TVM_CUDA_COMPILE_MODE", "nvrtc").lower()
    if mode == "nvcc":
        return _compile_with_nvcc(code, arch)
    if mode != "nvrtc":
        raise ValueError(f"TVM_CUDA_COMPILE_MODE={mode!r}: expected 'nvrtc' or 'nvcc'")
    from tvm.support.nvcc import compile_cuda

    return compile_cuda(code, target_format="cubin", arch=arch, compiler="nvrtc")


def _compile_with_nvcc(code: str, arch: str) -> bytes:
    import shutil
    import subprocess
    import tempfile

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RuntimeError("TVM_CUDA_COMPILE_MODE=nvcc, but nvcc is not on PATH (install the CUDA toolkit, "
                           "or leave the variable unset to compile with NVRTC)")
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "kernels.cu", Path(tmp) / "kernels.cubin"
        source.write_text(code)
        done = subprocess.run([nvcc, "--cubin", "-O3", f"-arch={arch}", "-o", str(binary), str(source)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc cannot compile this library's CUDA kernels for {arch}:\n{done.stderr[-2000:]}")
        return binary.read_bytes()


def _load_cuda_plugin() -> None:
    """Load libtvm_runtime_cuda beside libtvm_runtime (it registers the CUDA device API)."""
    import ctypes

    import tvm

    runtime = getattr(tvm.base, "_LOADED_LIBS", {}).get("tvm_runtime")
    if runtime is None:
        return
    plugin = Path(runtime._name).resolve().parent / "libtvm_runtime_cuda.so"
    if plugin.exists():
        try:
            ctypes.CDLL(str(plugin), mode=ctypes.RTLD_LOCAL)
        except OSError:
            pass  # no CUDA driver (libcuda.so.1): reported as "no CUDA device" by the caller


def _checked(feeds: dict[str, np.ndarray], spec: TensorSpec, segment_id: str) -> np.ndarray:
    if spec.name not in feeds:
        raise KeyError(f"segment {segment_id} needs input {spec.name!r}, got {sorted(feeds)}")
    # np.asarray, not np.ascontiguousarray, which makes a 0-d array 1-d: a scalar that another segment computed
    # (a DequantizeLinear of a scalar constant) was refused as shape (1,)
    value = np.asarray(feeds[spec.name], dtype=spec.dtype, order="C")
    if tuple(value.shape) != tuple(spec.shape):
        raise ValueError(
            f"segment {segment_id} input {spec.name!r} has shape {tuple(value.shape)}, expected {tuple(spec.shape)}"
        )
    return value
