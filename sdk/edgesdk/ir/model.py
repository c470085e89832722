"""Loading, checking and saving ONNX models; segment extraction; device annotations."""

from __future__ import annotations

import collections
import hashlib
import os
import re
from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper as ext_data, helper, numpy_helper

from ..errors import UserError

# onnxruntime 1.31 reads IR version <= 13; we write 10, which every backend takes.
IR_VERSION = 10
DEVICE_KEY = "edgesdk.device"
CAPABLE_KEY = "edgesdk.capable"


# Initializers of this many bytes or more are weights: the copies of a model made for onnx.checker, shape
# inference and onnxruntime leave them out (`weightless`), and `save` writes them beside a model past
# protobuf's 2 GB limit. onnx's Python API serializes the whole model for each of those calls: a copy of
# every weight each time, and no call at all past 2 GB. Shapes are computed from small tensors only.
WEIGHT_BYTES = 1 << 16
# a model whose initializers pass this size keeps its weights in a `.data` file beside it (`save`), where
# the next stage maps them (`read`): ResNet50 (98 MB) and larger never hold them in memory between stages
EXTERNAL_FROM = 64 << 20
# where a `weightless` stub says its data is: nowhere on disk (onnxruntime gets the array itself)
IN_MEMORY = "edgesdk:weight-held-in-memory"

# Mapped weights. A model read from a file with external data (`read`, `load`) keeps its main graph's
# weights there: each initializer stays an external tensor whose location is the file's absolute path.
# Nothing copies them into memory: `array` maps a weight's bytes, `save` copies them file to file (or
# links the file where the model's weights are the whole of it), onnxruntime and onnx_ir read them
# in place. A stage that does not change the weights never holds them. `inline` and `materialize`
# read them into the message where a library wants the bytes themselves (TVM's importer).


def infer_shapes(model: onnx.ModelProto, *, strict: bool = True) -> onnx.ModelProto:
    """ONNX shape inference with data propagation (shapes computed from constant shape tensors);
    `strict` raises where a declared shape contradicts the inferred one or an op cannot be inferred.

    Inference runs on `weightless(model)`; the shapes it finds (value_info and outputs, nested graphs
    included) are written into `model`, which is returned: its weights are never copied."""
    inferred = onnx.shape_inference.infer_shapes(weightless(model)[0], strict_mode=strict, data_prop=True)
    for mine, theirs in zip(graphs(model.graph), graphs(inferred.graph)):
        for field in ("value_info", "output"):
            mine.ClearField(field)
            getattr(mine, field).extend(getattr(theirs, field))
    return model


def is_weight(tensor: onnx.TensorProto) -> bool:
    """A mapped weight, or an initializer of `WEIGHT_BYTES` or more held in the message."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return is_mapped(tensor)
    return _held_bytes(tensor) >= WEIGHT_BYTES


def _held_bytes(tensor: onnx.TensorProto) -> int:
    """What a tensor's data takes in its message: its elements times their size, from its shape and type
    (upb's `ByteSize` encodes the whole message to count it, 1.8 s for a GiB, and reading `raw_data` copies
    it); a string's, or one of no known type, its message's size. A tensor whose data is not its shape's is
    refused by onnx's checker whichever way it is counted."""
    if tensor.data_type not in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        try:
            item = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
        except (KeyError, TypeError, ValueError):
            return tensor.ByteSize()
        return int(np.prod(tensor.dims, dtype=np.int64)) * item
    return tensor.ByteSize()


def is_mapped(tensor: onnx.TensorProto) -> bool:
    """Whether `tensor`'s data is still in the file it was read from (`read`, `load`): its location is absolute."""
    return tensor.data_location == onnx.TensorProto.EXTERNAL and os.path.isabs(_external(tensor).get("location", ""))


def _external(tensor: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def array(tensor: onnx.TensorProto) -> np.ndarray:
    """`numpy_helper.to_array`, where a mapped weight is a read-only view of its file (`np.memmap`), not a copy."""
    if not is_mapped(tensor):
        return numpy_helper.to_array(tensor)
    if tensor.data_type not in _ARRAY_TYPES:  # bfloat16, 4-bit, float8: onnx's own conversion
        return numpy_helper.to_array(inline(tensor))
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).newbyteorder("<")
    shape = tuple(tensor.dims)
    if not all(shape):
        return np.zeros(shape, dtype)
    info = _external(tensor)
    return np.asarray(np.memmap(info["location"], dtype=dtype, mode="r", offset=int(info.get("offset", 0)), shape=shape))


def inline(tensor: onnx.TensorProto) -> onnx.TensorProto:
    """`tensor` itself, or for a mapped weight a copy that holds its bytes (as a tensor saved inline reads)."""
    if not is_mapped(tensor):
        return tensor
    out = onnx.TensorProto()
    out.CopyFrom(tensor)
    del out.external_data[:]
    out.ClearField("data_location")
    out.raw_data = _mapped_bytes(tensor)
    return out


def materialize(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every mapped weight of `model` read into it (in place), for a library that wants the bytes in the
    message; returns `model`."""
    for t in model.graph.initializer:
        if is_mapped(t):
            t.CopyFrom(inline(t))
    return model


def _mapped_bytes(tensor: onnx.TensorProto) -> bytes:
    info = _external(tensor)
    with open(info["location"], "rb") as f:
        f.seek(int(info.get("offset", 0)))
        return f.read(int(info["length"]))


def _data_bytes(tensor: onnx.TensorProto) -> int:
    """What a tensor's data takes: a mapped weight's length in its file, else its message's size."""
    return int(_external(tensor)["length"]) if is_mapped(tensor) else _held_bytes(tensor)


def weightless(model: onnx.ModelProto, *, stubs: bool = False) -> tuple[onnx.ModelProto, list[onnx.TensorProto]]:
    """A copy of `model` without its main graph's weights (`is_weight`), and those weights (the model's
    own messages, not copies). Each becomes a graph input of its type and shape, which onnx.checker and
    shape inference read as they read the initializer; with `stubs`, an initializer whose data is
    external at `IN_MEMORY`, for onnxruntime's `add_external_initializers`."""
    shell = onnx.ModelProto()
    copy_fields(model, shell, skip="graph")
    copy_fields(model.graph, shell.graph, skip="initializer")
    weights = []
    for t in model.graph.initializer:  # in their order: a stub where a weight was
        if not is_weight(t):
            shell.graph.initializer.append(t)
            continue
        weights.append(t)
        if stubs:
            stub = shell.graph.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims,
                                               data_location=onnx.TensorProto.EXTERNAL)
            stub.external_data.add(key="location", value=IN_MEMORY)
    if not stubs:
        declared = {i.name for i in shell.graph.input}
        shell.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, t.dims)
                                 for t in weights if t.name not in declared)
    return shell, weights


def onnxruntime_session(model: onnx.ModelProto, opts=None, *, outputs: list[onnx.ValueInfoProto] | None = None):
    """An onnxruntime CPU session of `model` of any size: its weights are handed over as arrays
    (`add_external_initializers`), not serialized into the bytes the session parses. The session
    holds the arrays for its lifetime. `outputs` replaces the graph's outputs. Every session logs errors only."""
    import onnxruntime as ort

    opts = opts if opts is not None else ort.SessionOptions()
    # errors only: its shape-merge warnings about tensors of a cut-out region ("Error merging shape info ...
    # Falling back to lenient merge") reached the user's terminal, and nothing was wrong
    opts.log_severity_level = 3
    shell, weights = weightless(model, stubs=True)
    if outputs is not None:
        shell.graph.ClearField("output")
        shell.graph.output.extend(outputs)
    stubs = {t.name: t for t in shell.graph.initializer}
    for t in [t for t in weights if t.data_type not in _ARRAY_TYPES]:  # bfloat16, 4-bit, float8: serialized after all
        stubs[t.name].CopyFrom(inline(t))
    weights = [t for t in weights if t.data_type in _ARRAY_TYPES]
    arrays = [array(t) for t in weights]  # a mapped weight: a view of its file, which onnxruntime reads in place
    if weights:
        opts.add_external_initializers([t.name for t in weights], [ort.OrtValue.ortvalue_from_numpy(a) for a in arrays])
    from ..runtime.backends.ort_runner import WRONG_FUSIONS

    session = ort.InferenceSession(shell.SerializeToString(), opts, providers=["CPUExecutionProvider"],
                                   disabled_optimizers=WRONG_FUSIONS)
    session.edgesdk_weights = arrays  # onnxruntime reads them in place
    return session


# the element types onnxruntime takes as numpy arrays (`OrtValue.ortvalue_from_numpy`)
_ARRAY_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BOOL,
                          onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16, onnx.TensorProto.UINT16,
                          onnx.TensorProto.INT32, onnx.TensorProto.UINT32, onnx.TensorProto.INT64, onnx.TensorProto.UINT64})


def copy_fields(source, dest, skip: str) -> None:
    """Every field `source` has set but `skip`, into `dest` (a message of the same type)."""
    for field, value in source.ListFields():
        if field.name == skip:
            continue
        if field.is_repeated:
            getattr(dest, field.name).extend(value)
        elif field.type == field.TYPE_MESSAGE:
            getattr(dest, field.name).CopyFrom(value)
        else:
            setattr(dest, field.name, value)


def check(model: onnx.ModelProto) -> None:
    """`onnx.checker.check_model` of any size: the model without its weights, then each weight alone."""
    shell, weights = weightless(model)
    onnx.checker.check_model(shell)
    for t in weights:
        if is_mapped(t):  # its bytes were checked to be there when it was read (`read`, `load`)
            _check_mapped(t)
        else:
            onnx.checker.check_tensor(t)


def _check_mapped(t: onnx.TensorProto) -> None:
    if t.data_type not in _ARRAY_TYPES:
        onnx.checker.check_tensor(inline(t))
        return
    need = _held_bytes(t)
    if int(_external(t)["length"]) != need:
        raise onnx.checker.ValidationError(f"tensor '{t.name}': its external data holds {_external(t)['length']} "
                                           f"bytes, its type and shape need {need}")


def _check_raw_size(t: onnx.TensorProto) -> None:
    if t.data_location == onnx.TensorProto.EXTERNAL or t.data_type not in _ARRAY_TYPES or not t.HasField("raw_data"):
        return  # a mapped weight's length is checked as it is read (`_check_mapped`)
    need = _held_bytes(t)
    if len(t.raw_data) != need:
        raise onnx.checker.ValidationError(f"tensor '{t.name}': its raw data holds {len(t.raw_data)} bytes, its type "
                                           f"and shape need {need}")


def load(path: Path, *, check: bool = True) -> onnx.ModelProto:
    """Read an ONNX file (with its external data), or fail with a user error that says why.

    `check=False` leaves `onnx.checker` to the caller (`check_model`), which first wants to report every
    non-standard op at once rather than the checker's first complaint."""
    path = Path(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and friends: the file is not a model
        raise UserError(
            "import.bad-file",
            f"{path} is not a readable ONNX model ({type(e).__name__}: {str(e)[:120] or 'parse failed'})",
            "the file may be truncated or in another format; re-export it with torch.onnx.export or tf2onnx",
        ) from None
    _load_external_data(model, path)
    if not model.graph.node:
        raise UserError("import.empty-graph", f"{path}: the model has no nodes",
                        "the file parsed but holds no graph; it may be truncated or not an ONNX model")
    if check:
        check_model(model, path)
    return model


def read(path: Path) -> onnx.ModelProto:
    """A model a stage of this build wrote (`save`): its weights in a `.data` file stay there, mapped."""
    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    base = Path(os.path.abspath(path.parent))
    for t in model.graph.initializer:
        if ext_data.uses_external_data(t):
            info = ext_data.ExternalDataInfo(t)
            _BUILD_FILES.add(_set_mapped(t, base / info.location, info))
    tensors = [t for t in external_tensors(model) if not is_mapped(t)]  # in attributes and subgraphs: read in
    if tensors:
        _read_external_data(tensors, path.parent)
    return model


# the `.data` files `read` mapped: this build wrote them and never writes them again, so that `save` may
# link one (a user's file is copied: a link would follow the user's later edits)
_BUILD_FILES: set[str] = set()


def _set_mapped(t: onnx.TensorProto, file: Path, info) -> str:
    """Make `t` a mapped weight of `file` (absolute); returns the file's path."""
    where = os.path.abspath(file)
    offset = info.offset or 0
    length = info.length if info.length is not None else max(os.path.getsize(where) - offset, 0)
    del t.external_data[:]
    for key, value in (("location", where), ("offset", str(offset)), ("length", str(length))):
        t.external_data.add(key=key, value=value)
    return where


def external_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    """Every tensor of `model` (initializers, attributes, subgraphs) whose data is external."""
    return [t for t in ext_data._get_all_tensors(model) if ext_data.uses_external_data(t)]


def check_model(model: onnx.ModelProto, path: Path) -> None:
    """`onnx.checker` (full check: ops known at the model's opsets, types, topological order), and each
    initializer's raw data exactly what its shape and type need (the checker refuses too little only)."""
    try:
        check(model)
        for t in model.graph.initializer:
            _check_raw_size(t)
    except Exception as e:
        # the checker's message runs over several lines (the node it is about on the second): one line
        said = " ".join(part.strip() for part in str(e).split("\n") if part.strip()) or type(e).__name__
        raise UserError("import.invalid-model", f"{path}: not a valid ONNX model: {_clipped(said, 300)}",
                        "the file may be truncated or damaged; re-export it") from None


def _clipped(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _load_external_data(model: onnx.ModelProto, path: Path) -> None:
    """Check every external-data reference before reading it, so that a missing or short `.data`
    file is named (with each tensor that needs it) instead of surfacing as onnx's first complaint."""
    base = Path(os.path.abspath(path.parent))  # as onnx resolves locations: beside the file as named
    tensors = external_tensors(model)
    if not tensors:
        return
    problems = []
    for t in tensors:
        try:
            info = ext_data.ExternalDataInfo(t)
        except Exception:  # offset/length that are not numbers
            problems.append(f"tensor '{t.name}': its external data reference is malformed")
            continue
        file = Path(os.path.normpath(base / info.location)) if info.location else None
        if file is None or not file.is_relative_to(base):
            problems.append(f"tensor '{t.name}': external data location '{info.location}' is outside {base}")
            continue
        try:
            size = file.stat().st_size if file.is_file() else None
        except OSError as e:  # a location the file system cannot even look up (a name too long)
            problems.append(f"tensor '{t.name}': external data location '{info.location[:80]}' cannot be read "
                            f"({e.strerror or e})")
            continue
        if size is None:
            problems.append(f"tensor '{t.name}': {file} is missing")
        else:
            offset, need = info.offset or 0, info.length or 0
            if offset + need > size:
                problems.append(f"tensor '{t.name}': {file.name} holds {size} bytes, the tensor needs "
                                f"bytes {offset}..{offset + need}")
    if problems:
        raise UserError("import.external-data", f"{path}: {len(problems)} tensor(s) stored as external data cannot be read",
                        "keep the .data file(s) beside the .onnx file, as they were saved", notes=problems)
    try:
        for t in model.graph.initializer:  # weights: onnx's own checks (no symlink, no hard link, no escape), then mapped
            if ext_data.uses_external_data(t):
                info = ext_data.ExternalDataInfo(t)
                os.close(ext_data._open_external_data_fd(str(base), info.location, t.name, True))
                _set_mapped(t, base / info.location, info)
        for t in [t for t in tensors if not is_mapped(t)]:  # in attributes and subgraphs: read in
            ext_data.load_external_data_for_tensor(t, str(base))
            t.ClearField("data_location")  # as a tensor saved inline reads
    except Exception as e:
        # onnx says "Data of TensorProto ( tensor name: w) should be stored in PATH, but it has multiple hard
        # links, ...": the reason comes last, where a clipped message would lose it
        said = re.sub(r"^Data of TensorProto \( tensor name: (.*?)\) should be stored in (.*?), but ", r"tensor '\1': \2: ",
                      str(e).strip())
        raise UserError("import.external-data", f"{path}: external data could not be read ({_clipped(said, 240)})",
                        "keep the .data file(s) beside the .onnx file, as they were saved, as plain files (onnx "
                        "refuses a symbolic link, a hard link and a file outside the model's folder)") from None


def _read_external_data(tensors: list[onnx.TensorProto], base: Path) -> None:
    """Each tensor's bytes from its location into the tensor, for the files this build wrote (`read`).
    onnx's own loader, which reads a user's model (`load`), refuses a file with several hard links:
    that is how the stage cache shares a weights file a stage did not change."""
    files: dict[str, object] = {}
    try:
        for t in tensors:
            info = ext_data.ExternalDataInfo(t)
            if info.location not in files:
                files[info.location] = open(base / info.location, "rb")
            f = files[info.location]
            f.seek(info.offset or 0)
            t.raw_data = f.read(info.length) if info.length else f.read()
            del t.external_data[:]
            t.ClearField("data_location")  # as a tensor saved inline reads: the same bytes, the same digest
    finally:
        for f in files.values():
            f.close()


def save(model: onnx.ModelProto, path: Path, *, link: bool = True) -> None:
    """Write atomically (temporary files, then rename). A model past `EXTERNAL_FROM` bytes keeps its
    weights in `<name>.data` beside it (ONNX external data, each weight at an
    offset aligned to 4 KiB so that a reader can map it), written one weight at a time: never a second
    copy of them all. A mapped weight is copied file to file; where the weights are the whole of a
    `.data` file this build wrote, that file is linked instead (`_BUILD_FILES`), unless `link` is false:
    for a file that onnx's own loader reads, which refuses a file with several links."""
    model.ir_version = min(model.ir_version or IR_VERSION, IR_VERSION)
    path = Path(path)
    tmp = Path(f"{path}.tmp{os.getpid()}")
    data = path.with_name(path.name + ".data")
    if not _keeps_external(model):
        tmp.write_bytes(_inlined(model).SerializeToString())
        tmp.replace(path)
        data.unlink(missing_ok=True)
        return
    shell, weights = weightless(model, stubs=True)
    stubs = {t.name: t for t in shell.graph.initializer if t.name in {w.name for w in weights}}
    tmp_data = Path(f"{data}.tmp{os.getpid()}")
    try:
        linked = _whole_file(weights) if link else None
        if linked is not None and _linked(linked, tmp_data):
            places = [(t, int(_external(t)["offset"]), int(_external(t)["length"])) for t in weights]
        else:
            places = _write_weights(weights, tmp_data)
        for t, offset, length in places:
            stub = stubs[t.name]
            del stub.external_data[:]
            for key, value in (("location", data.name), ("offset", str(offset)), ("length", str(length))):
                stub.external_data.add(key=key, value=value)
        tmp.write_bytes(shell.SerializeToString())
        tmp_data.replace(data)
        tmp.replace(path)
    except BaseException:
        tmp_data.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
        raise


def _keeps_external(model: onnx.ModelProto) -> bool:
    """Whether `save` writes the weights beside the model (past `EXTERNAL_FROM`)."""
    return weight_bytes(model) > EXTERNAL_FROM


def _inlined(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` itself, or where it has mapped weights a copy with their bytes in it (a small model
    read from a file with external data is saved and hashed as one whole message)."""
    if not any(is_mapped(t) for t in model.graph.initializer):
        return model
    out = onnx.ModelProto()
    copy_fields(model, out, skip="graph")
    copy_fields(model.graph, out.graph, skip="initializer")
    out.graph.initializer.extend(inline(t) for t in model.graph.initializer)
    return out


def _whole_file(weights: list[onnx.TensorProto]) -> str | None:
    """The `.data` file this build wrote that holds `weights` and nothing else, if there is one."""
    files = {_external(t)["location"] if is_mapped(t) else None for t in weights}
    if len(files) != 1 or None in files or next(iter(files)) not in _BUILD_FILES:
        return None
    file = next(iter(files))
    held = sum(int(_external(t)["length"]) for t in weights)
    try:  # each weight aligned to 4 KiB: padding is all that may lie between them
        return file if os.path.getsize(file) <= held + 4096 * len(weights) else None
    except OSError:
        return None


def _linked(file: str, dest: Path) -> bool:
    dest.unlink(missing_ok=True)
    try:
        os.link(file, dest)
        return True
    except OSError:  # another file system, or one without hard links: the weights are copied
        return False


def _write_weights(weights: list[onnx.TensorProto], dest: Path) -> list[tuple[onnx.TensorProto, int, int]]:
    """Write each weight to `dest` at a 4 KiB-aligned offset; mapped ones file to file. Returns
    (weight, offset, length) for each."""
    places = []
    sources: dict[str, object] = {}
    try:
        with open(dest, "wb") as f:
            for t in weights:
                f.seek(-f.tell() % 4096, os.SEEK_CUR)
                offset = f.tell()
                if is_mapped(t):
                    info = _external(t)
                    src = sources.get(info["location"]) or sources.setdefault(info["location"], open(info["location"], "rb"))
                    length = int(info["length"])
                    f.flush()
                    _copy_range(src.fileno(), f.fileno(), int(info.get("offset", 0)), offset, length)
                    f.seek(offset + length)
                else:
                    raw = _raw_bytes(t)
                    length = len(raw)
                    f.write(raw)
                    del raw
                places.append((t, offset, length))
            f.truncate(f.tell())
    finally:
        for src in sources.values():
            src.close()
    return places


def _copy_range(src: int, dst: int, src_offset: int, dst_offset: int, length: int) -> None:
    """`length` bytes from `src` at `src_offset` to `dst` at `dst_offset`: in the kernel
    (`copy_file_range`) where the file system can, else through a 16 MiB buffer."""
    done = 0
    while done < length:
        at, to, want = src_offset + done, dst_offset + done, length - done
        try:
            n = os.copy_file_range(src, dst, want, at, to)
        except OSError:
            chunk = os.pread(src, min(16 << 20, want), at)
            n = os.pwrite(dst, chunk, to) if chunk else 0
        if n == 0:
            raise OSError(f"external data ends {want} bytes early")
        done += n


def feed_hash(h, model: onnx.ModelProto) -> None:
    """Feed `model`'s deterministic serialization to hashlib object `h`, a mapped weight as a tensor
    saved inline reads (wherever its file is); past `EXTERNAL_FROM` bytes of initializers (where
    protobuf may not serialize it whole), the model without its weights, then each weight."""
    if not _keeps_external(model):
        h.update(_inlined(model).SerializeToString(deterministic=True))
        return
    shell, weights = weightless(model)
    h.update(shell.SerializeToString(deterministic=True))
    for t in weights:
        h.update(inline(t).SerializeToString(deterministic=True))


def sha256(model: onnx.ModelProto) -> str:
    h = hashlib.sha256()
    feed_hash(h, model)
    return h.hexdigest()


def weight_bytes(model: onnx.ModelProto) -> int:
    """What the model's initializers take, mapped or held (a whole model's ByteSize fails past 2 GB)."""
    return sum(_data_bytes(t) for t in model.graph.initializer)


def _raw_bytes(t: onnx.TensorProto) -> bytes:
    """A weight's data as ONNX external data stores it (little-endian, as raw_data)."""
    if t.HasField("raw_data"):
        return t.raw_data
    return numpy_helper.from_array(numpy_helper.to_array(t)).raw_data


def get_meta(node: onnx.NodeProto, key: str) -> str | None:
    for p in node.metadata_props:
        if p.key == key:
            return p.value
    return None


def set_meta(node: onnx.NodeProto, key: str, value: str) -> None:
    for p in node.metadata_props:
        if p.key == key:
            p.value = value
            return
    node.metadata_props.add(key=key, value=value)


def graphs(graph: onnx.GraphProto):
    """`graph` and every graph nested in it (If branches, Loop and Scan bodies), depth first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from graphs(g)


def op_counts(model: onnx.ModelProto) -> dict[str, int]:
    """Nodes by op type, sorted by op type; those in If/Loop/Scan bodies included."""
    return dict(sorted(collections.Counter(n.op_type for g in graphs(model.graph) for n in g.node).items()))


def node_name(node: onnx.NodeProto, index: int) -> str:
    return node.name or f"{node.op_type}_{index}"


def static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Every tensor's static shape that shape inference knows (graph inputs, values, outputs, initializers)."""
    shapes: dict[str, tuple[int, ...]] = {}
    g = model.graph
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        t = vi.type.tensor_type
        if t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
            shapes[vi.name] = tuple(d.dim_value for d in t.shape.dim)
    for init in g.initializer:
        shapes[init.name] = tuple(init.dims)
    return shapes


def elem_types(model: onnx.ModelProto) -> dict[str, int]:
    g = model.graph
    out = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.input) + list(g.value_info) + list(g.output)}
    out.update({i.name: i.data_type for i in g.initializer})
    return out


def dtype_name(elem_type: int) -> str:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name


def constant_names(model: onnx.ModelProto) -> set[str]:
    return {i.name for i in model.graph.initializer}


def input_free_nodes(model: onnx.ModelProto) -> set[int]:
    """Indices of the main graph's nodes that depend on no graph input (an input with an initializer counts
    as a constant, as in `constant_names`), through their inputs or what their subgraphs read: values the
    same for every inference, which import folds up to a size (`passes.constant_folding`)."""
    g = model.graph
    consts = constant_names(model)
    dependent = {i.name for i in g.input if i.name not in consts}
    free = set()
    for index, node in enumerate(g.node):
        reads = set(node.input)
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                reads.update(name for body in graphs(sub) for n in body.node for name in n.input)
        if reads & dependent:
            dependent.update(node.output)
        else:
            free.add(index)
    return free


def constants_first(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` (in place) with the nodes that depend on no graph input (`input_free_nodes`) moved before all
    others, each part in its own order: still a topological order, and one in which such nodes, which only
    the host runs, form one run at the start instead of cutting an accelerator's run in the middle."""
    free = input_free_nodes(model)
    if free and max(free) >= len(free):  # some node that depends on an input comes before one that does not
        nodes = list(model.graph.node)
        order = [nodes[i] for i in sorted(free)] + [n for i, n in enumerate(nodes) if i not in free]
        del model.graph.node[:]
        model.graph.node.extend(order)
    return model


def param_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the main graph's initializers as arrays (counted, not converted)."""
    return sum(_held_bytes(t) for t in model.graph.initializer)


def extract_segment(model: onnx.ModelProto, node_indices: list[int], inputs: list[str], outputs: list[str]) -> onnx.ModelProto:
    """A standalone ONNX model of the given nodes: their initializers, the value infos they use."""
    g = model.graph
    nodes = [g.node[i] for i in node_indices]
    used = {t for n in nodes for t in n.input if t} | set(outputs)
    inits = [i for i in g.initializer if i.name in used and i.name not in inputs]
    vinfo = {vi.name: vi for vi in list(g.input) + list(g.value_info) + list(g.output)}
    graph = helper.make_graph(
        nodes,
        "segment",
        [vinfo[n] for n in inputs],
        [vinfo[n] for n in outputs],
        initializer=inits,
        value_info=[vinfo[n] for n in sorted(used) if n in vinfo and n not in inputs and n not in outputs],
    )
    seg = helper.make_model(graph, opset_imports=list(model.opset_import), producer_name="edgesdk")
    seg.ir_version = IR_VERSION
    return seg
