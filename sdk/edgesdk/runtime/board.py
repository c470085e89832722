"""A board's RPC server for the build host: TVM's RPC, and candidate bundles run and timed on the board.

    python -B -m runtime.board --tracker HOST:PORT --key KEY [--host 127.0.0.1] [--port 9090]
                               [--port-end 9199] [--load-library LIB]

run from any bundle directory on the board (its `runtime/` is the device runtime; a bundle of the
edgesdk version that builds, whose manifests it reads). It registers with the TVM RPC tracker under
KEY and serves what `python -m tvm.exec.rpc_server` serves (MetaSchedule's candidates, `--trials` with
`--rpc-tracker`), and two functions the tune stage calls where it cannot time the target's CPU on
the build host (`edgesdk build --rpc-tracker HOST:PORT --rpc-key KEY`, `scheduling/boards.py`):

    edgesdk.board.describe() -> JSON: the board's CPU, cores, architecture, runtime version
    edgesdk.board.measure(candidate.tar, feeds.npz, warmup, runs) -> JSON: milliseconds per inference,
        and the name of an .npz of the candidate's outputs for each sample (to download)

A candidate is a bundle without runtime (manifest and segments) uploaded as a tar into the session's
work directory; feeds.npz holds sample i's input `name` as `i/name`; the outputs come back the same way.
The samples are run once each (the build host checks them against onnxruntime), then sample 0 `warmup`
and `runs` times. TVM serves each session in a process forked for it, so every measurement loads its
candidate alone, as on the device.

The listener runs in this process: TVM's `rpc.Server` starts it in a fresh interpreter, which would
not have these functions (and cannot start under qemu-user, where the board is emulated in CI).

TVM's RPC has no authentication, and whoever reaches the port runs code on the board (a client
uploads a library and loads it). So the server listens on 127.0.0.1 unless `--host` says otherwise
(reach it through an SSH tunnel: docs/tuning.md), and warns when it listens wider. What it can
confine, it does: every path a session writes, reads, removes or loads (TVM resolves them all
through `tvm.rpc.server.workpath` and `tvm.rpc.server.load_module`, which each session's process
replaces here, `_confine`) and the files `measure` reads and unpacks stay inside the session's work
directory: an absolute path, `..` or a link that leads out of it is refused.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import platform
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from .backends.tvm_import import install

install()  # TVM without the torch import of its FFI library (backends/tvm_import.py)

# Arm's CPU part numbers (/proc/cpuinfo's "CPU part" on aarch64, which has no model name)
ARM_PARTS = {"0xd03": "Cortex-A53", "0xd04": "Cortex-A35", "0xd05": "Cortex-A55", "0xd07": "Cortex-A57",
             "0xd08": "Cortex-A72", "0xd09": "Cortex-A73", "0xd0a": "Cortex-A75", "0xd0b": "Cortex-A76",
             "0xd0c": "Neoverse-N1", "0xd0d": "Cortex-A77", "0xd41": "Cortex-A78", "0xd44": "Cortex-X1",
             "0xd46": "Cortex-A510", "0xd47": "Cortex-A710", "0xd4b": "Cortex-A78C"}


def describe() -> str:
    from .manifest import RUNTIME_VERSION

    model = ""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    for line in cpuinfo.splitlines():
        key = line.split(":", 1)[0].strip().lower()
        if key in ("model name", "cpu part") and ":" in line:
            value = line.split(":", 1)[1].strip()
            model = value if key == "model name" else ARM_PARTS.get(value, f"Arm CPU part {value}")
            if key == "model name":
                break
    return json.dumps({"machine": platform.machine(), "cpu": model or platform.machine(),
                       "cores": os.cpu_count() or 1, "runtime_version": RUNTIME_VERSION})


def measure(candidate: str, feeds: str, warmup: int, runs: int) -> str:
    """Run the uploaded candidate on every sample of the uploaded feeds, then time sample 0."""
    from .executor import BundleModel

    work = _session_work()
    tar_path, feeds_path = inside(work, candidate), inside(work, feeds)
    where = Path(tempfile.mkdtemp(prefix="candidate-", dir=work))
    with tarfile.open(tar_path) as tar:
        for member in tar.getmembers():  # what the build host packs: plain files and folders inside
            if not (member.isfile() or member.isdir()):
                raise ValueError(f"candidate archive member {member.name!r} is not a plain file inside it")
            inside(where, member.name, what="candidate archive member")
        tar.extractall(where)
    arrays = dict(np.load(feeds_path))
    samples: dict[int, dict] = {}
    for key, value in arrays.items():
        i, name = key.split("/", 1)
        samples.setdefault(int(i), {})[name] = value
    model = BundleModel(where, log=lambda line: None)
    try:
        outputs = {}
        for i in sorted(samples):
            for name, value in model.run(samples[i]).items():
                outputs[f"{i}/{name}"] = value
        laps = []
        for k in range(int(warmup) + int(runs)):
            t0 = time.perf_counter()
            model.run(samples[0])
            if k >= int(warmup):
                laps.append((time.perf_counter() - t0) * 1e3)
    finally:
        model.close()
    np.savez(inside(work, "outputs.npz"), **outputs)
    return json.dumps({"laps_ms": laps, "outputs": "outputs.npz"})


def inside(root: Path, name: str, what: str = "path") -> str:
    """`name` as a path inside the directory `root`, links resolved: raises ValueError for an absolute
    path, a `..`, or a link that leads out of `root`."""
    if not isinstance(name, str) or "\0" in name:
        raise ValueError(f"{what} {name!r} is not a file name")
    if os.path.isabs(name) or ".." in Path(name).parts:
        raise ValueError(f"{what} {name!r} is refused: a session's paths are relative to its work directory, "
                         "without '..'")
    base = Path(root).resolve()
    full = (base / name).resolve()
    if full != base and base not in full.parents:
        raise ValueError(f"{what} {name!r} is refused: it leads out of the session's work directory through a link")
    return str(full)


_WORK: list[Path] = []  # the work directory of the session this process serves (`_confine`)


def _session_work() -> Path:
    if not _WORK:
        raise ValueError("no RPC session is being served in this process")
    return _WORK[0]


def _no_linking(name: str):
    raise ValueError(f"download_linked_module {name!r} is refused: edgesdk's board server links nothing on the board")


def _confine(server) -> None:
    """Each session's environment with its paths kept inside its work directory. TVM's session process
    (forked for each session) registers `tvm.rpc.server.workpath`, `load_module` and
    `download_linked_module` anew with `os.path.join` (an absolute path escapes): its `_server_env` is
    wrapped so that ours replace them right after. upload, download and remove resolve their paths
    through `workpath`."""
    import tvm_ffi
    from tvm.runtime.module import load_module

    stock = server._server_env

    def confined_env(load_library, work_path=None):
        temp = stock(load_library, work_path)
        work = Path(temp.temp_dir).resolve()
        _WORK[:] = [work]
        tvm_ffi.register_global_func("tvm.rpc.server.workpath", lambda name: inside(work, name), override=True)
        tvm_ffi.register_global_func("tvm.rpc.server.load_module", lambda name: load_module(inside(work, name)),
                                     override=True)
        tvm_ffi.register_global_func("tvm.rpc.server.download_linked_module", _no_linking, override=True)
        return temp

    server._server_env = confined_env


def exposure(host: str) -> str | None:
    """The warning for a listening address other hosts can reach (None for loopback)."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return None
    return (f"listening on {host}: anyone who reaches this port can upload and run native code on this board "
            "(TVM's RPC has no authentication); listen on 127.0.0.1 and reach it through an SSH tunnel "
            "(docs/tuning.md)")


def register() -> None:
    import tvm_ffi

    tvm_ffi.register_global_func("edgesdk.board.describe", describe, override=True)
    tvm_ffi.register_global_func("edgesdk.board.measure", measure, override=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.board", description=__doc__.split("\n\n")[0])
    p.add_argument("--tracker", required=True, help="the build host's TVM RPC tracker, HOST:PORT")
    p.add_argument("--key", required=True, help="the key the build names with --rpc-key")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address this server listens on (default 127.0.0.1, reached through an SSH tunnel); "
                        "another address lets anyone who reaches the port run code on this board")
    p.add_argument("--port", type=int, default=9090)
    p.add_argument("--port-end", type=int, default=9199)
    p.add_argument("--load-library", default=None, help="a library TVM's RPC server loads (as rpc_server's)")
    a = p.parse_args(argv)
    host, _, port = a.tracker.rpartition(":")
    if not host or not port.isdigit():
        p.error(f"--tracker {a.tracker!r} is not HOST:PORT")
    warning = exposure(a.host)
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    from tvm.rpc import server

    register()
    _confine(server)
    bound = server._popen_start_rpc_server(a.host, a.port, a.port_end, tracker_addr=(host, int(port)), key=a.key,
                                           load_library=a.load_library)
    print(f"edgesdk board server for key {a.key} listening on {a.host}:{bound}, tracker {a.tracker}", flush=True)
    server.PopenRPCServerState.current.thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
