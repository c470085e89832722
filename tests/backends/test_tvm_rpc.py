"""Tuning measured on remote boards over TVM RPC: a tracker on loopback, and an aarch64 board
emulated by an RPC server in the arm64 root file system under qemu-user. The
candidates are cross-built here and measured there; a board that drops out mid-run stops the
search with a report, and the next run resumes it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgesdk.backends import qemu
from edgesdk.backends import tvm as tvm_backend
from edgesdk.errors import UserError
from tests.backends.test_qemu import rootfs  # noqa: F401 -- the session fixture
from tests.backends.test_tvm import AARCH64, elf_machine, single_task_graph

pytestmark = pytest.mark.slow  # MetaSchedule searches measured on an emulated board under qemu

HERE = Path(__file__).resolve().parent
SDK = HERE.parents[1] / "sdk"
EXTRA = "opt/edgesdk-site/tvm/lib/libtvm_runtime_extra.so"
KEY = "a72-qemu"
EM_AARCH64 = 183


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the process and what it forked (the tracker's worker)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _servers(port: int, key: str) -> int:
    return tvm_backend.runner._servers(tvm_backend.Boards("127.0.0.1", port, key))


class Board:
    """The emulated board: edgesdk's board server (`runtime/board.py`, TVM's RPC server with functions
    that run and time candidate bundles) in the guest, registered with the tracker under KEY. TVM's
    own `python -m tvm.exec.rpc_server` cannot run under qemu-user: it starts its listener in a fresh
    `sys.executable`, an aarch64 binary the host kernel cannot exec; ours listens in its own process."""

    def __init__(self, rootfs: Path, tracker_port: int, log: Path) -> None:
        self.rootfs, self.tracker_port, self.log = rootfs, tracker_port, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        args = ["-B", "-m", "runtime.board", "--tracker", f"127.0.0.1:{self.tracker_port}", "--key", KEY,
                "--host", "127.0.0.1", "--port", str(port := _free_port()), "--port-end", str(port + 1),
                "--load-library", str(self.rootfs / EXTRA)]
        with open(self.log, "a") as out:  # from a bundle's runtime: the package's own runtime/ here
            self.proc = qemu.start_python(self.rootfs, args, cwd=self.log.parent, stdout=out, stderr=out,
                                          env={"TVM_NUM_THREADS": "1", "PYTHONPATH": str(SDK / "edgesdk")})
        deadline = time.monotonic() + 120
        while _servers(self.tracker_port, KEY) == 0:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the emulated board did not register with the tracker"
            time.sleep(0.5)

    def kill(self) -> None:
        if self.proc is not None:
            _stop(self.proc)
            self.proc = None


@pytest.fixture(scope="module")
def tracker(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("rpc") / "tracker.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1",
                                 "--port", str(port), "--port-end", str(port + 1)],
                                stdout=out, stderr=out, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
    yield port
    _stop(proc)


@pytest.fixture(scope="module")
def started_board(rootfs, tracker, tmp_path_factory):  # noqa: F811
    b = Board(rootfs, tracker, tmp_path_factory.mktemp("board") / "board.log")
    yield b
    b.kill()


@pytest.fixture
def board(started_board):
    """The module's emulated board, started again where a test unplugged it: under qemu its Python takes
    seconds to start."""
    if started_board.proc is None or started_board.proc.poll() is not None:
        started_board.start()
    return started_board


def test_candidates_are_measured_on_the_emulated_board(board, tracker, tmp_path):
    """4 aarch64 candidates built here, measured on the board; the records compile into a tuned
    aarch64 library."""
    db = tmp_path / "db"
    boards = tvm_backend.Boards("127.0.0.1", tracker, KEY)
    summary = tvm_backend.tune_onnx(single_task_graph(AARCH64), AARCH64, db, trials=5, batch=4, boards=boards,
                                    num_cores=1)
    assert summary["measured_on"] == f"1 board(s) {KEY}@127.0.0.1:{tracker}"
    assert summary["failures"] == {"build": 0, "run": 0, "messages": []}, summary["failures"]
    assert summary["stopped"] == "budget" and summary["trials"] == 5
    (task,) = summary["per_task"]
    assert task["untuned_ms"] > 0 and 0 < task["best_ms"] <= task["untuned_ms"]
    records = [json.loads(line) for line in (db / "database_tuning_record.json").read_text().splitlines()]
    assert len(records) == 5 and all(max(r[1][1]) < 1e9 for r in records)
    assert json.loads((db / "target.json").read_text())["mtriple"] == "aarch64-linux-gnu"
    built = tvm_backend.compile_onnx(single_task_graph(AARCH64), AARCH64, tmp_path / "tuned.so", tuning_db=db)
    assert (built.tasks, built.tuned) == (1, 1)
    assert elf_machine(tmp_path / "tuned.so")[2] == EM_AARCH64
    # what the tune stage's policy reads where it cannot time aarch64 code: the search on the board tuned it
    assert tvm_backend.tuning.untuned_reason([single_task_graph(AARCH64)], AARCH64, db) is None


def test_a_board_that_drops_out_stops_the_search_and_the_next_run_resumes(board, tracker, tmp_path):
    db = tmp_path / "db"
    boards = tvm_backend.Boards("127.0.0.1", tracker, KEY)
    batches = []

    def unplug_after_first_batch(p):
        batches.append(p)
        if len(batches) == 1:
            board.kill()

    # the baseline and one batch measured, two batches lost: the fewest that end a search on lost boards
    first = tvm_backend.tune_onnx(single_task_graph(AARCH64), AARCH64, db, trials=7, batch=2, boards=boards,
                                  num_cores=1, progress=unplug_after_first_batch)
    assert first["stopped"] == "boards-lost", first
    assert "all failed to run on the boards" in first["stop_message"]
    assert first["failures"]["run"] >= 4 and "no board is registered" in first["failures"]["messages"][-1]
    lines = (db / "database_tuning_record.json").read_text().splitlines()
    valid = [r for r in (json.loads(line) for line in lines) if max(r[1][1]) < 1e9]
    assert len(valid) == 1 + 2  # the baseline and the batch measured before the board went
    assert not (db / "searched.json").exists()  # not finished

    board.start()  # plugged in again: the search resumes with what is left of the budget
    second = tvm_backend.tune_onnx(single_task_graph(AARCH64), AARCH64, db, trials=7, batch=2, boards=boards,
                                   num_cores=1)
    assert second["stopped"] == "budget" and second["failures"]["run"] == 0, second
    valid_after = [r for r in (json.loads(line) for line in
                               (db / "database_tuning_record.json").read_text().splitlines()) if max(r[1][1]) < 1e9]
    assert len(valid_after) == 7


def test_a_key_without_boards_is_a_user_error(tracker, tmp_path):
    boards = tvm_backend.Boards("127.0.0.1", tracker, "no-such-board")
    t0 = time.monotonic()
    with pytest.raises(UserError) as err:
        tvm_backend.tune_onnx(single_task_graph(AARCH64), AARCH64, tmp_path / "db", trials=8, boards=boards)
    assert err.value.code == "tune.rpc-no-board" and "'no-such-board'" in err.value.message
    assert time.monotonic() - t0 < 30  # TVM's own request would wait forever


def test_a_build_for_the_arm_board_tunes_on_it(board, tracker, tmp_path):
    """`edgesdk build --target arm_2tpu --trials 8 --rpc-tracker ... --rpc-key ...` with a model the
    Edge TPU refuses (a sine): its aarch64 CPU segment is tuned on the emulated board and ships tuned."""
    from edgesdk.runtime import Manifest
    from tests.test_cli import edgesdk

    _sine_model(tmp_path / "sine.onnx")
    proc = edgesdk("build", str(tmp_path / "sine.onnx"), "--target", "arm_2tpu", "--no-rewrites", "-o", str(tmp_path / "out"),
                   "--trials", "8", "--tuning-db", str(tmp_path / "db"), "--cpu-backends", "planned",
                   "--rpc-tracker", f"127.0.0.1:{tracker}", "--rpc-key", KEY)  # TVM's cut, however fast
    assert proc.returncode == 0, proc.stderr
    assert f"measured on {KEY} boards via 127.0.0.1:{tracker}" in proc.stderr
    m = Manifest.load(tmp_path / "out" / "bundle")
    (seg,) = [s for s in m.segments if s.backend == "tvm"]
    # the baseline and what the search found in an elementwise function's small schedule space
    assert m.tuning["segments"][seg.id]["tuned"] >= 1 and m.tuning["database_records"] >= 2
    assert elf_machine(tmp_path / "out" / "bundle" / seg.artifact)[2] == EM_AARCH64


def _sine_model(path: Path) -> None:
    """x * sin(x): the Edge TPU refuses the sine, so an arm_2tpu plan built with `--no-rewrites` keeps
    it on the CPU (legalize would approximate x * sin(x) for the TPU, where its two convolutions win)."""
    import onnx
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Sin", ["x"], ["s"]), helper.make_node("Mul", ["s", "x"], ["y"])], "sine",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 64])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, str(path))


def test_cpu_candidates_are_checked_and_timed_on_the_board(board, tracker, tmp_path):
    """`edgesdk build --target arm_2tpu --rpc-tracker ... --rpc-key ...` (no search: --trials 0): the
    CPU span's candidates are built here, run and timed on the emulated board, checked against
    onnxruntime (onnxruntime's too: the device image has it, as an aarch64 bundle with a segment on it
    needs); the fastest measured is chosen and recorded with the board's CPU."""
    import json as json_

    from edgesdk.runtime import Manifest
    from tests.test_cli import edgesdk

    _sine_model(tmp_path / "sine.onnx")
    proc = edgesdk("build", str(tmp_path / "sine.onnx"), "--target", "arm_2tpu", "--no-rewrites", "-o", str(tmp_path / "out"),
                   "--tuning-db", str(tmp_path / "db"), "--rpc-tracker", f"127.0.0.1:{tracker}", "--rpc-key", KEY)
    assert proc.returncode == 0, proc.stderr
    assert "tune: CPU candidates are timed on" in proc.stderr and f"boards '{KEY}'" in proc.stderr
    record = json_.loads((tmp_path / "out" / ".build" / "4-tune" / "tune.json").read_text())["cpu_selection"]
    assert "aarch64" in record["measured_on"] and f"via 127.0.0.1:{tracker}" in record["measured_on"]
    (span,) = record["spans"]
    cands = span["candidates"]
    timed = {name: c["ms"] for name, c in cands.items() if "ms" in c}
    assert {"planned", "onnxruntime"} <= set(timed) and all(ms > 0 for ms in timed.values()), cands
    assert span["chosen"] == min(timed, key=timed.get)
    m = Manifest.load(tmp_path / "out" / "bundle")
    assert m.tuning["cpu_selection"]["measured_on"] == record["measured_on"]
    # a rebuild replays the board's measurements from the timing cache: the same choice, the same bundle
    again = edgesdk("build", str(tmp_path / "sine.onnx"), "--target", "arm_2tpu", "--no-rewrites", "-o", str(tmp_path / "again"),
                    "--tuning-db", str(tmp_path / "db"), "--rpc-tracker", f"127.0.0.1:{tracker}", "--rpc-key", KEY)
    assert again.returncode == 0, again.stderr
    assert "replayed from the timing cache" in again.stderr
    assert (tmp_path / "again" / "bundle.tar.gz").read_bytes() == (tmp_path / "out" / "bundle.tar.gz").read_bytes()


def test_a_stock_rpc_server_cannot_time_candidates(tracker, tmp_path):
    """A board running TVM's own rpc_server (no edgesdk functions) cannot time a bundle: asked directly,
    a user error saying what to start; in a build, a warning, and the CPU backends chosen by policy."""
    import json as json_

    from edgesdk.scheduling import boards as on_boards
    from tests.test_cli import edgesdk

    port = _free_port()
    with open(tmp_path / "server.log", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_server", "--tracker", f"127.0.0.1:{tracker}",
                                 "--key", "stock", "--host", "127.0.0.1", "--port", str(port),
                                 "--port-end", str(port + 1)], stdout=out, stderr=out, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while _servers(tracker, "stock") == 0:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.3)
        with pytest.raises(UserError) as err:
            on_boards.describe(tvm_backend.Boards("127.0.0.1", tracker, "stock"))
        assert err.value.code == "tune.board-server" and "runtime.board" in err.value.hint
        _sine_model(tmp_path / "sine.onnx")
        built = edgesdk("build", str(tmp_path / "sine.onnx"), "--target", "arm_2tpu", "--no-rewrites", "-o", str(tmp_path / "out"),
                        "--tuning-db", str(tmp_path / "db"), "--rpc-tracker", f"127.0.0.1:{tracker}", "--rpc-key", "stock")
        assert built.returncode == 0, built.stderr
        assert "do not run edgesdk's board server" in built.stderr and "chosen by policy instead" in built.stderr
        record = json_.loads((tmp_path / "out" / ".build" / "4-tune" / "tune.json").read_text())["cpu_selection"]
        assert record["measured_on"] is None and "chosen by policy" in record["note"]
    finally:
        _stop(proc)


# --- the board server's exposure: its address, and the paths a session may touch ----------------------
# (edgesdk's board server on this host, not under qemu: what is checked is the server's own Python)

HOST_KEY = "confined"


@pytest.fixture
def host_board(tracker, tmp_path):
    """The board server started as a board's operator starts it (no --host), registered under HOST_KEY; its
    sessions' work directories under `sessions/` (TMPDIR), and a file of the operator's outside them."""
    from types import SimpleNamespace

    sessions = tmp_path / "sessions"
    sessions.mkdir()
    (tmp_path / "keep.txt").write_text("the operator's")
    port = _free_port()
    log = tmp_path / "board.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-B", "-m", "runtime.board", "--tracker", f"127.0.0.1:{tracker}",
                                 "--key", HOST_KEY, "--port", str(port), "--port-end", str(port + 1)],
                                stdout=out, stderr=out, cwd=tmp_path, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(SDK / "edgesdk"), "TMPDIR": str(sessions)})
    try:
        deadline = time.monotonic() + 60
        while _servers(tracker, HOST_KEY) == 0:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        yield SimpleNamespace(port=port, log=log, sessions=sessions, root=tmp_path)
    finally:
        _stop(proc)


def _listening_addresses(port: int) -> set[str]:
    """The local addresses of this host's IPv4 and IPv6 sockets listening on `port` (/proc/net/tcp*)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


@contextlib.contextmanager
def _session(tracker_port: int):
    from tvm import rpc

    client = rpc.connect_tracker("127.0.0.1", tracker_port)
    try:
        sess = client.request(HOST_KEY, priority=1, session_timeout=60, max_retry=1)
        try:
            yield sess
        finally:
            sess._sess = None  # ends the session (as scheduling/boards.py does)
    finally:
        client.close()


def test_the_board_server_listens_on_loopback_by_default(host_board):
    assert _listening_addresses(host_board.port) == {"0100007F"}  # 127.0.0.1, and nothing else
    log = host_board.log.read_text()
    assert f"listening on 127.0.0.1:{host_board.port}" in log and "warning" not in log


def test_a_wider_address_is_given_on_purpose_and_warned_of(monkeypatch, capsys):
    """`--host 0.0.0.0` is honoured, with a warning that anyone who reaches the port runs code on the board
    (the server itself is not started here: nothing listens on every address during the tests)."""
    from types import SimpleNamespace

    from tvm.rpc import server

    from edgesdk.runtime import board

    started: list[str] = []
    monkeypatch.setattr(server, "_server_env", server._server_env)  # main wraps it: put back after the test
    monkeypatch.setattr(server, "_popen_start_rpc_server", lambda host, port, *a, **k: started.append(host) or port)
    monkeypatch.setattr(server.PopenRPCServerState, "current", SimpleNamespace(thread=SimpleNamespace(join=lambda: None)),
                        raising=False)
    assert board.main(["--tracker", "127.0.0.1:9190", "--key", "k"]) == 0
    assert started == ["127.0.0.1"] and "warning" not in capsys.readouterr().err
    assert board.main(["--tracker", "127.0.0.1:9190", "--key", "k", "--host", "0.0.0.0"]) == 0
    assert started[-1] == "0.0.0.0"
    assert ("warning: listening on 0.0.0.0: anyone who reaches this port can upload and run native code on this "
            "board (TVM's RPC has no authentication)") in capsys.readouterr().err


def test_a_session_cannot_write_read_remove_or_load_outside_its_work_directory(host_board, tracker):
    """TVM's upload, download, remove and load_module, and edgesdk.board.measure, with absolute paths
    and '..': each refused, nothing written or removed outside the session's work directory; inside it,
    upload and download still work."""
    import numpy as np

    outside = host_board.root / "keep.txt"
    with _session(tracker) as sess:
        for bad in (str(host_board.root / "planted.txt"), "../planted.txt", "../../planted.txt"):
            with pytest.raises(Exception, match="is refused"):
                sess.upload(bytearray(b"planted"), bad)
        for call in (lambda: sess.download(str(outside)), lambda: sess.download("../../keep.txt"),
                     lambda: sess.remove(str(outside)), lambda: sess.remove("../../keep.txt"),
                     lambda: sess.load_module(str(outside)), lambda: sess.load_module("../../keep.txt")):
            with pytest.raises(Exception, match="is refused"):
                call()
        measure = sess.get_function("edgesdk.board.measure")
        buf = io.BytesIO()
        np.savez(buf, **{"0/x": np.zeros((1, 4), np.float32)})
        sess.upload(bytearray(buf.getvalue()), "feeds.npz")
        for candidate, feeds in ((str(outside), "feeds.npz"), ("../candidate.tar", "feeds.npz"),
                                 ("candidate.tar", str(host_board.root / "feeds.npz"))):
            with pytest.raises(Exception, match="is refused"):
                measure(candidate, feeds, 0, 0)
        sess.upload(bytearray(b"inside"), "inside.bin")  # the work directory itself still serves
        assert bytes(sess.download("inside.bin")) == b"inside"
    assert not list(host_board.root.rglob("planted.txt")) and outside.read_text() == "the operator's"


def test_measure_refuses_a_candidate_archive_that_reaches_outside(tmp_path):
    """The members `measure` unpacks, and a link inside the work directory that leads out of it."""
    import tarfile

    from edgesdk.runtime import board

    work = tmp_path / "work"
    work.mkdir()
    (work / "out").symlink_to(tmp_path)
    for name in ("/etc/x", "../x", "a/../../x"):
        with pytest.raises(ValueError, match="is refused"):
            board.inside(work, name)
    with pytest.raises(ValueError, match="leads out of the session's work directory through a link"):
        board.inside(work, "out/x")
    assert board.inside(work, "segments/s0.so") == str(work.resolve() / "segments" / "s0.so")
    for member in ("../escaped", "/abs", "a/../../escaped"):
        with tarfile.open(work / "candidate.tar", "w") as tar:
            info = tarfile.TarInfo(member)
            tar.addfile(info, io.BytesIO(b""))
        board._WORK[:] = [work]
        try:
            with pytest.raises(ValueError, match="is refused"):
                board.measure("candidate.tar", "feeds.npz", 0, 0)
        finally:
            board._WORK.clear()
    assert not (tmp_path / "escaped").exists() and not Path("/abs").exists()
