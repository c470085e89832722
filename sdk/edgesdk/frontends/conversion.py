"""Converting the TensorFlow formats, in a child process (`converter_child`).

TensorFlow and the TFLite flatbuffer reader are native code that can crash (SIGSEGV, SIGABRT
from a failed CHECK) on a malformed file. The child is started with its own process group, its
output goes to a log file in `work` (never the user's terminal), and it reports back through a
JSON file: `{"ok": true, ...}` or the error to raise. A child killed by a signal, one that exits
without a result, and one that outlives `TIMEOUT_S` each become a user error naming the file.

The parent watches the child while it runs: its resident memory (the peak goes into the import
record), a progress line every PROGRESS_EVERY_S with the elapsed time and that memory, and the
machine's available memory. TensorFlow and tf2onnx hold many copies of a model's weights; where the
machine's available memory falls under `memory_floor()`, the child is stopped and the build fails
naming what it held, instead of the kernel's out-of-memory killer choosing a process to kill.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import onnx

from ..errors import UsageError, UserError
from ..ir import model as irm
from ..ir.memory import available_bytes, resident_bytes, shown, tensorflow_env
from . import onnx_file
from .formats import DESCRIPTIONS
from .standard_ops import OpSite

# tf2onnx's opset: 17 is the newest whose ReduceMean takes `axes` as an attribute (read by every backend).
OPSET = 17
TIMEOUT_S = 900
POLL_S = 0.25
PROGRESS_EVERY_S = 10.0
# Available memory (MiB) under which the converter is stopped; EDGESDK_MEMORY_FLOOR_MB overrides it
MEMORY_FLOOR_MB = 256
CONVERTER_NAMES = {"savedmodel": "SavedModel", "keras": "Keras", "h5": "Keras .h5", "tflite": "TFLite",
                   "pt2": "PyTorch"}


def convert(path: Path, fmt: str, work: Path, *, batch: int, input_shapes: dict[str, tuple[int, ...]],
            log: Callable[[str], None] | None = None) -> tuple[onnx.ModelProto, dict]:
    """The converted model, and info as `frontends.load` gives it plus `converter_peak_rss` (bytes).
    `log` gets a progress line every PROGRESS_EVERY_S while the converter runs."""
    work.mkdir(parents=True, exist_ok=True)
    files = {k: work / f"{fmt}-{k}" for k in ("request.json", "result.json", "converted.onnx", "child.log")}
    for f in [*files.values(), work / f"{fmt}-converted.onnx.data"]:  # the data: the converted weights
        f.unlink(missing_ok=True)
    request = {"format": fmt, "source": str(Path(path).resolve()), "onnx": str(files["converted.onnx"]),
               "result": str(files["result.json"]), "batch": batch, "opset": OPSET,
               "input_shapes": {k: list(v) for k, v in input_shapes.items()}}
    files["request.json"].write_text(json.dumps(request))

    returncode, peak = _run_child(child_command(files["request.json"]), files["child.log"], path, fmt, log)
    result = _read_result(files["result.json"])
    if returncode < 0 or result is None:
        raise _crashed(path, fmt, returncode, files["child.log"])
    if not result["ok"]:
        error = UsageError if result.get("kind") == "usage" else UserError
        raise error(result["code"], f"{path}: {result['message']}", result.get("hint", ""), notes=result.get("notes"))

    try:
        model = irm.materialize(irm.read(files["converted.onnx"]))  # (read in: `work` goes when import ends)
    except Exception as e:
        raise UserError("import.convert-failed", f"{path}: the converter wrote no readable ONNX ({type(e).__name__})",
                        "this is a bug in edgesdk's conversion: report it with the model") from None
    onnx_file.reject_nonstandard(model, path, _UNSUPPORTED_HINT[fmt], lambda s: _describe(s, fmt, result))
    irm.check_model(model, path)
    return model, {"format": fmt, "converter": result["converter"], "opset": onnx_file.default_opset(model, path),
                   "notes": result.get("notes", []), "converter_peak_rss": peak}


def child_command(request: Path) -> list[str]:
    return [sys.executable, "-m", "edgesdk.frontends.converter_child", str(request)]


def _run_child(command: list[str], log: Path, path: Path, fmt: str,
               progress: Callable[[str], None] | None = None) -> tuple[int, int]:
    """Run the converter to its end: its return code and peak resident memory (bytes)."""
    floor = memory_floor()
    env = dict(os.environ)
    tensorflow_env(env)
    env["PYTHONHASHSEED"] = "0"  # str hashes, like node hashes (tf2onnx_patches._number_nodes), fixed: same file, same bytes
    sdk = str(Path(__file__).resolve().parents[2])  # the child imports edgesdk from where we run
    env["PYTHONPATH"] = os.pathsep.join([sdk] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    with open(log, "wb") as out:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 env=env, start_new_session=True)
        try:
            return _watch(child, path, fmt, progress, floor)
        except BaseException:  # too long, too big, Ctrl-C: do not leave the converter running
            os.killpg(child.pid, signal.SIGKILL)  # the child leads its own group: its helpers go too
            child.wait()
            raise


def _watch(child: subprocess.Popen, path: Path, fmt: str, progress: Callable[[str], None] | None,
           floor: int) -> tuple[int, int]:
    """Wait for the child, sampling its memory every POLL_S; raise where it takes too long or the
    machine runs low on memory (the caller kills it)."""
    start = time.monotonic()
    report_at = start + PROGRESS_EVERY_S
    peak = 0
    while True:
        try:
            return child.wait(timeout=POLL_S), peak
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        rss = resident_bytes(child.pid)
        peak = max(peak, rss)
        if now - start > TIMEOUT_S:
            raise UserError("import.convert-timeout", f"{path}: converting {DESCRIPTIONS[fmt]} took longer than {TIMEOUT_S} s",
                            "the model may be very large or the file damaged; convert it to ONNX yourself with tf2onnx "
                            "and pass the .onnx file")
        available = available_bytes()
        if available is not None and available < floor:
            raise UserError(
                "import.out-of-memory",
                f"{path}: converting {DESCRIPTIONS[fmt]} was stopped before this machine ran out of memory: the "
                f"converter held {shown(peak)} after {now - start:.0f} s, and {shown(available)} were left",
                "TensorFlow's converter holds several copies of the weights; build on a machine with more memory, or "
                "convert the model to ONNX there (python -m tf2onnx.convert) and pass the .onnx file, whose import "
                "needs far less", notes=[f"the model file: {shown(_size(path))}",
                                         f"stopped below {shown(floor)} available (EDGESDK_MEMORY_FLOOR_MB)"])
        if progress is not None and now >= report_at:
            progress(f"import: converting {DESCRIPTIONS[fmt]}: {now - start:.0f} s, the converter holds {shown(rss)}")
            report_at = now + PROGRESS_EVERY_S


def memory_floor() -> int:
    """Bytes of available memory under which a converter is stopped (EDGESDK_MEMORY_FLOOR_MB, else MEMORY_FLOOR_MB)."""
    given = os.environ.get("EDGESDK_MEMORY_FLOOR_MB")
    try:
        mb = float(given) if given else MEMORY_FLOOR_MB
    except ValueError:
        raise UsageError("build.bad-env", f"EDGESDK_MEMORY_FLOOR_MB={given!r} is not a number of MiB",
                         f"unset it (default {MEMORY_FLOOR_MB}) or give a number such as 512") from None
    return int(mb * 2**20)


def _size(path: Path) -> int:
    path = Path(path)
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _read_result(file: Path) -> dict | None:
    try:
        result = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) and "ok" in result else None


def _crashed(path: Path, fmt: str, returncode: int, log: Path) -> UserError:
    if returncode < 0:
        try:
            how = f"was killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"was killed by signal {-returncode}"
    else:
        how = f"exited with status {returncode} without a result"
    hint = f"check that the file is {DESCRIPTIONS[fmt]} that TensorFlow itself loads; it may be damaged"
    if returncode == -signal.SIGKILL:
        hint += " (SIGKILL often means the converter ran out of memory)"
    return UserError("import.converter-crashed", f"{path}: the {CONVERTER_NAMES[fmt]} converter {how} while reading the file", hint,
                     notes=_crash_site(log))


def _crash_site(log: Path) -> list[str]:
    """Where the child died, from the native fatal message (glog's `F... Check failed`) and the
    innermost Python frame that faulthandler (enabled in the child) writes on a fatal signal."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
    except OSError:
        return []
    notes = [f"converter log: {line[:200]}" for line in lines if re.match(r"F\d{4} |.*Check failed", line)][-2:]
    for i, line in enumerate(lines):
        if line.startswith("Fatal Python error"):
            frame = next((f for f in lines[i + 1:] if f.startswith("File ")), None)
            m = re.match(r'File "(.+)", line (\d+) in (\S+)', frame or "")
            if m:
                where = "/".join(Path(m[1]).parts[-3:])
                notes.append(f"the converter crashed in {m[3]} ({where}:{m[2]})")
            break
    return notes


_UNSUPPORTED_HINT = {
    "tflite": "edgesdk converts TFLite builtin ops; rebuild the model without custom ops, or export the source "
              "model as a SavedModel",
    "savedmodel": "replace these ops by ones tf2onnx converts (see tf2onnx's support_status.md), or export the model to "
                  "ONNX yourself",
}
_UNSUPPORTED_HINT["keras"] = _UNSUPPORTED_HINT["h5"] = _UNSUPPORTED_HINT["savedmodel"]
_UNSUPPORTED_HINT["pt2"] = ("replace these ops in the model by ones torch.onnx translates to standard ONNX, or export "
                            "the model to ONNX yourself")


def _describe(site: OpSite, fmt: str, result: dict) -> str:
    """A note for a node the converter left as it was: which source op it is and where."""
    if site.domain:  # a custom domain in the converter's output
        return site.note()
    where = f" {site.where}" if site.where else ""
    failed = result.get("failed", {}).get(site.node)
    why = f" ({failed})" if failed else ""
    if fmt == "tflite" and site.op_type.startswith("TFL_"):
        op = site.op_type.removeprefix("TFL_")
        if op in result.get("custom_codes", []):
            return f"TFLite custom op '{op}' at tensor '{site.node}'{where}{why}"
        return f"TFLite op {op} at tensor '{site.node}'{where} has no ONNX conversion in tf2onnx{why}"
    node = re.sub(r"^((Stateful)?PartitionedCall/)+", "", site.node)  # the scopes of our signature wrapper
    return f"TensorFlow op {site.op_type} at node '{node}'{where} has no ONNX conversion in tf2onnx{why}"
