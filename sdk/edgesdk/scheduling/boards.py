"""A CPU span's candidates run and timed on a board over TVM RPC, where the build host cannot run the
target's CPU code (an aarch64 target built on an x86-64 host) and `--rpc-tracker`/`--rpc-key` name
boards.

Each board runs `python -B -m runtime.board --tracker HOST:PORT --key KEY` from a bundle directory
(`runtime/board.py`): TVM's RPC server, with functions that run and time an uploaded candidate. A
candidate bundle written here (manifest and segments, no runtime) is packed as a tar and sent to a
board in a session of its own; the board runs it on the samples (the build host checks the outputs
against onnxruntime, or gates an int8 candidate, as for a candidate timed here) and times it. TVM
serves each session in a process forked for it: each measurement loads its candidate alone.
"""

from __future__ import annotations

import contextlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np

from .. import backends
from ..errors import UserError
from ..timing import RUNS, WARMUP

SESSION_TIMEOUT_S = 900  # an emulated board loads TensorFlow Lite in tens of seconds
HINT = ("start `python -B -m runtime.board --tracker HOST:PORT --key KEY` from a bundle directory on each "
        "board (it serves TVM's RPC too)")


@contextlib.contextmanager
def _session(boards: backends.Boards):
    """A session on a free board, ended on leaving: a board serves one session at a time, and one kept
    alive (by a traceback that holds it) would make the next request wait for that board."""
    from tvm import rpc

    from ..backends.tvm import check_boards

    check_boards(boards)  # fails at once where TVM's request would wait forever for a board
    tracker = rpc.connect_tracker(boards.host, boards.port)
    try:
        sess = tracker.request(boards.key, priority=1, session_timeout=SESSION_TIMEOUT_S, max_retry=1)
        try:
            yield sess
        finally:
            sess._sess = None  # TVM's RPCSession has no close: releasing its module ends the session
    finally:
        tracker.close()


def describe(boards: backends.Boards) -> dict:
    """What the board says of itself (CPU, cores, architecture, runtime version). A board whose server
    cannot time bundles (TVM's stock rpc_server) is a user error with how to start ours."""
    with _session(boards) as sess:
        try:
            func = sess.get_function("edgesdk.board.describe")
        except Exception as e:  # noqa: BLE001 -- TVM raises a plain error for a function the server lacks
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
        else:
            return json.loads(func())
    raise UserError("tune.board-server", f"the boards under the key {boards.key!r} do not run edgesdk's board server, "
                    f"so they cannot time CPU candidates ({why})", hint=HINT)


def name(board: dict, boards: backends.Boards) -> str:
    """The board's CPU as the timing cache keys it (the tracker's address left out: it may move)."""
    return f"{board['cpu']} ({board['machine']}, {board['cores']} cores; boards {boards.key!r})"


def _pack(bundle: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted(bundle.rglob("*")):
            if path.is_file() and (path.name == "manifest.json" or path.relative_to(bundle).parts[0] == "segments"):
                tar.add(path, arcname=str(path.relative_to(bundle)), recursive=False)
    return buf.getvalue()


def _npz(samples: list[dict]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **{f"{i}/{k}": np.asarray(v) for i, sample in enumerate(samples) for k, v in sample.items()})
    return buf.getvalue()


def _measure(boards: backends.Boards, bundle: Path, samples: list[dict], warmup: int, runs: int
             ) -> tuple[list[float], list[dict]]:
    """One session: the candidate in `bundle` run on each sample, then sample 0 `warmup` + `runs` times:
    milliseconds per timed inference, and each sample's outputs."""
    failed = None
    with _session(boards) as sess:
        try:
            sess.upload(bytearray(_pack(bundle)), "candidate.tar")
            sess.upload(bytearray(_npz(samples)), "feeds.npz")
            answer = json.loads(sess.get_function("edgesdk.board.measure")("candidate.tar", "feeds.npz", warmup, runs))
            got = dict(np.load(io.BytesIO(bytes(sess.download(answer["outputs"])))))
        except Exception as e:  # noqa: BLE001 -- the board's error comes back as TVM's RPCError with its traceback
            lines = [line for line in str(e).splitlines() if line.strip()]
            failed = lines[-1] if lines else type(e).__name__
    if failed is not None:  # raised with the session ended, and no traceback holding it
        raise RuntimeError(f"on the board: {failed}")
    outputs: list[dict] = [{} for _ in samples]
    for key, value in got.items():
        i, tensor = key.split("/", 1)
        outputs[int(i)][tensor] = value
    return answer["laps_ms"], outputs


class OnBoard:
    """A candidate bundle written here, run on a board: `run` as the executor's `BundleModel.run`
    (`run_all` for several samples in one session), for the tune stage's checks."""

    def __init__(self, boards: backends.Boards, bundle: Path, manifest) -> None:
        self.boards, self.bundle = boards, bundle
        self.inputs, self.outputs = manifest.inputs, manifest.outputs

    def run_all(self, samples: list[dict]) -> list[dict]:
        return _measure(self.boards, self.bundle, samples, 0, 0)[1]

    def run(self, feeds: dict) -> dict:
        return self.run_all([feeds])[0]

    def close(self) -> None:
        pass


def measure(boards: backends.Boards, bundle: Path, feeds: Path, *, warmup: int, runs: int) -> list[float]:
    """One measurement on a board, as `timing.FreshProcess` on this host: milliseconds per inference
    of `runs` inferences after `warmup`, on the inputs in `feeds` (.npz)."""
    return _measure(boards, bundle, [dict(np.load(feeds))], warmup, runs)[0]


class BoardRunner:
    """The timing runner (`timing.Runner`) of the boards under a tracker's key: each `open`'s runs and
    each measurement a session of its own on a free board."""

    local = False

    def __init__(self, boards: backends.Boards) -> None:
        self.boards = boards

    def open(self, bundle: Path) -> OnBoard:
        from ..runtime.manifest import Manifest

        return OnBoard(self.boards, bundle, Manifest.load(bundle))

    def measure(self, bundle: Path, feeds: Path, *, warmup: int = WARMUP, runs: int = RUNS) -> list[float]:
        return measure(self.boards, bundle, feeds, warmup=warmup, runs=runs)
