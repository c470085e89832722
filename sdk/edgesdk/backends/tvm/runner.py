"""The runner of tuning candidates: this host (which must be able to run the target's code), or
boards registered with a TVM RPC tracker (`Boards`), one candidate per board at a time."""

from __future__ import annotations

import platform
import socket
from collections.abc import Callable
from typing import Any

from ...errors import UserError
from ..registry import Boards
from . import popen_worker
from .targets import _ARCHES, missing_host_features, target_arch


def _evaluator(ms) -> Any:
    # TVM's defaults: 3 runs per repeat, repeats of at least 100 ms, caches not flushed
    return ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=100, enable_cpu_cache_flush=False)


def _runner(ms, boards: Boards | None) -> Any:
    popen_worker.use()  # TVM's runner workers without torch
    if boards is None:
        return ms.runner.LocalRunner(timeout_sec=30, evaluator_config=_evaluator(ms))
    from tvm.support.popen_pool import PopenPoolExecutor

    workers = max(1, _servers(boards))  # a fleet measures in parallel, one candidate per board
    runner = ms.runner.RPCRunner(
        rpc_config=ms.runner.RPCConfig(
            tracker_host=boards.host, tracker_port=boards.port, tracker_key=boards.key,
            session_priority=1, session_timeout_sec=int(boards.session_timeout_s),
        ),
        evaluator_config=_evaluator(ms),
        max_workers=workers,
        f_create_session=_session_factory(),
    )
    # TVM's runner waits for a candidate without end; a board that hangs costs one timeout
    runner.pool = PopenPoolExecutor(max_workers=workers, timeout=2 * boards.session_timeout_s)
    return runner


def _session_factory() -> Callable[[Any], Any]:
    """The RPC runner's session opener, which fails at once where TVM's would wait forever.

    TVM's asks the tracker for a server of the key and blocks until one is free; when the
    boards are gone (killed, unplugged, powered off), that is never, and the search hangs.
    This one first asks the tracker whether any server of the key is registered, and fails
    the candidate if none is. Built nested, so that cloudpickle ships it to the runner's
    worker processes by value.
    """

    def create_session(rpc_config):
        # imported inside: cloudpickle ships this function by value to worker processes
        import socket

        from tvm import rpc

        host, port, key = rpc_config.tracker_host, rpc_config.tracker_port, rpc_config.tracker_key
        socket.create_connection((host, port), timeout=5).close()
        tracker = rpc.connect_tracker(host, port)
        tracker._sock.settimeout(rpc_config.session_timeout_sec)
        summary = tracker.summary()
        if not any(s.get("key") == "server:" + key for s in summary.get("server_info", [])):
            tracker.close()
            raise RuntimeError(f"no board is registered with the tracker {host}:{port} under the key {key!r}")
        return tracker.request(key, priority=rpc_config.session_priority,
                               session_timeout=rpc_config.session_timeout_sec, max_retry=1)

    return create_session


def check_boards(boards: Boards, timeout_s: float = 5.0) -> int:
    """The number of servers registered under the key. A tracker that does not answer, or a
    key no board registered, is a user error."""
    try:
        with socket.create_connection((boards.host, boards.port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise UserError(
            "tune.rpc-tracker",
            f"the RPC tracker at {boards.host}:{boards.port} does not answer ({exc.strerror or exc})",
            hint="start it with `python -m tvm.exec.rpc_tracker --host 127.0.0.1 --port PORT` (boards reach it "
                 "through an SSH tunnel: docs/tuning.md), or check --rpc-tracker",
        ) from exc
    servers = _servers(boards, timeout_s)
    if servers == 0:
        raise UserError(
            "tune.rpc-no-board",
            f"no board is registered with the tracker {boards.host}:{boards.port} under the key {boards.key!r}",
            hint="start `python -m tvm.exec.rpc_server --tracker HOST:PORT --key KEY` on each board, "
                 "or check --rpc-key",
        )
    return servers


def _servers(boards: Boards, timeout_s: float = 5.0) -> int:
    """Servers registered under the key (free or busy), from the tracker's summary."""
    from tvm import rpc

    try:
        tracker = rpc.connect_tracker(boards.host, boards.port)
        tracker._sock.settimeout(timeout_s)  # a peer that is not a tracker never answers
        try:
            summary = tracker.summary()
        finally:
            tracker.close()
    except Exception as exc:  # noqa: BLE001 -- an answer that is not a tracker's
        raise UserError(
            "tune.rpc-tracker",
            f"{boards.host}:{boards.port} answers, but not as a TVM RPC tracker ({exc})",
            hint="point --rpc-tracker at `python -m tvm.exec.rpc_tracker`",
        ) from exc
    return sum(1 for s in summary.get("server_info", []) if s.get("key") == "server:" + boards.key)


def _measured_on(target: dict, tvm_target: Any, boards: Boards | None) -> str:
    """Where tuning measures candidates, checked: `boards` with a free server, or this host if it runs the code."""
    if boards is not None:
        servers = check_boards(boards)
        return f"{servers} board(s) {boards}"
    _check_measurable(target, tvm_target)
    return "this host"


def _check_measurable(target: dict, tvm_target: Any) -> None:
    """Tuning measures candidates on this machine: it must be able to run them."""
    import tvm

    if tvm_target.kind.name == "cuda" and not tvm.cuda(0).exist:
        raise UserError(
            "tvm.tune-needs-gpu",
            "tuning a cuda segment measures kernels on a GPU, and this machine has none",
            hint="tune on the GPU host, or measure on it over RPC (--rpc-tracker), or build with --trials 0",
        )
    host = _ARCHES.get(platform.machine().lower())
    if tvm_target.kind.name == "llvm" and target_arch(target) != host:
        raise UserError(
            "tvm.tune-foreign-cpu",
            f"tuning for {target_arch(target)} measures kernels on that cpu, and this host is {host}",
            hint="measure on the boards over RPC (--rpc-tracker HOST:PORT --rpc-key KEY), or build with --trials 0",
        )
    missing = missing_host_features(target) if tvm_target.kind.name == "llvm" else []
    if missing:
        raise UserError(
            "tvm.tune-foreign-cpu",
            f"tuning measures kernels on this host, and code for cpu {target.get('mcpu', 'generic')} uses "
            f"{', '.join(missing)}, which this host's cpu lacks (it would die with SIGILL)",
            hint="tune on a host with that cpu or on one over RPC (--rpc-tracker), set mcpu to native, "
                 "or build with --trials 0",
        )
