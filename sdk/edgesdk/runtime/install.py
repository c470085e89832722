"""Install a bundle on the device into A/B slots, roll back to the previous one, say which is active.

  python -B -m runtime install BUNDLE.tar.gz --root ROOT [--trust DIR|PUB] [--allow-downgrade]
                                             [--max-bytes N] [--selftest-timeout S]
  python -B -m runtime rollback --root ROOT [--trust DIR|PUB]
  python -B -m runtime status --root ROOT [--json]

ROOT holds

  trust/*.pub        the public keys the device trusts, provisioned at the factory: the key always
                     comes from the device, never from the bundle (trust.py)
  slots/a, slots/b   bundle directories: the active one, and the free one
  state.json         which slot is active and which was active before it, with what in each:
                     {"active": "a"|"b"|null, "previous": ..., "slots": {name: {"bundle_version",
                     "model", "key_id", "manifest_sha256", "installed_at"}}}
  install.lock       held (flock) by the one install or rollback that may run

Why an install can stop at any instant (a crash, a kill, a power cut) and leave the previous bundle
active and intact: only state.json says which slot runs, and it changes by one rename of a written
and fsynced state.json.tmp (the last step, `switch`); nothing is ever written into the active slot;
before the free slot is destroyed, state.json stops naming it (`forget-previous`), so state.json never
names a slot that is half gone; and what an interrupted install leaves (staging/, trash/,
state.json.tmp) is in no slot and the next install removes it (`clean`). The price of two slots: a
new install gives up the slot `rollback` would have returned to.

Test hook: EDGESDK_INSTALL_CRASH_AT=<step> makes install SIGKILL itself when it reaches that step, a
name in STEPS (any other value is refused), so the tests can stop it before each step.

Runs on the device: standard library and the runtime's own modules.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .manifest import Manifest, ManifestError
from .trust import TrustError, Verified, check_signature, check_version, file_sha256, load_trust, verify_bundle
from .unpack import UnpackError, max_bundle_bytes, signed_manifest, unpack

# install's steps, in order; `_step(name)` marks each (and is where the test hook kills)
STEPS = (
    "lock",             # take ROOT/install.lock: one install or rollback at a time
    "load-keys",        # the device's keys, before anything is touched
    "clean",            # remove what an interrupted install left: staging/, trash/, state.json.tmp
    "precheck",         # the archive's manifest and signature: key, version, architecture, before any slot
                        # is touched, so a bundle refused for them costs the device nothing
    "forget-previous",  # state.json stops naming the free slot (previous: null), written atomically
    "remove-slot",      # the free slot renamed to trash/, then removed
    "unpack",           # the archive, checked member by member, into staging/ (the same file system)
    "verify",           # signature by a device key, every file, the version, the architecture
    "place",            # the unpacked bundle renamed to the free slot
    "selftest",         # the golden self-test, run by the new slot's own runtime in its own process
    "recheck",          # the slot's files again: the self-test wrote nothing into it
    "sync",             # fsync every file and directory of the slot
    "write-state",      # state.json.tmp written and fsynced, the new slot active, the old one previous
    "switch",           # state.json.tmp renamed over state.json (and ROOT fsynced): the new slot runs
)
SLOTS = ("a", "b")
CRASH_ENV = "EDGESDK_INSTALL_CRASH_AT"
STATE, LOCK, STAGING, TRASH, TRUST = "state.json", "install.lock", "staging", "trash", "trust"
SELFTEST_TIMEOUT = 900.0
_UNPACK_HINTS = {
    "bundle.unpack-failed": "free space in {root}",
    "bundle.too-large": "raise --max-bytes (default EDGESDK_MAX_BUNDLE_BYTES, or 16 GiB) if the bundle is this large",
    None: "this archive was not written by edgesdk, or it was damaged on the way: fetch or rebuild it",
}
_DAMAGED = f"the install root is damaged: restore {STATE} from a backup, or move it aside and install again"


class InstallError(ValueError):
    """An install, rollback or status that cannot go on; the message names the file, field or slot at
    fault, `hint` what to do, `exit_code` 1 (a refused bundle or state) or 2 (a wrong invocation)."""

    def __init__(self, message: str, hint: str = "", exit_code: int = 1):
        super().__init__(message)
        self.hint = hint
        self.exit_code = exit_code


# --- state ----------------------------------------------------------------------------------------


def read_state(root: Path) -> dict:
    """ROOT/state.json, checked; the empty state when nothing was ever installed."""
    path = Path(root) / STATE
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return {"active": None, "previous": None, "slots": {}}
    try:
        state = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InstallError(f"{path}: not valid JSON ({str(e)[:200]})", _DAMAGED) from None
    problem = _state_problem(state)
    if problem:
        raise InstallError(f"{path}: {problem}", _DAMAGED)
    return {"active": state.get("active"), "previous": state.get("previous"), "slots": state["slots"]}


def _state_problem(state) -> str | None:
    if not isinstance(state, dict) or not isinstance(state.get("slots"), dict):
        return "not a state object (no 'slots')"
    for role in ("active", "previous"):
        name = state.get(role)
        if name is not None and name not in SLOTS:
            return f"{role} is {name!r}, not one of {', '.join(SLOTS)} or null"
        record = state["slots"].get(name) if name else None
        if name is not None and not (isinstance(record, dict) and isinstance(record.get("bundle_version"), int)):
            return f"{role} is slot {name}, but slots.{name}.bundle_version is missing"
    active, previous = state.get("active"), state.get("previous")
    if previous is not None and (active is None or previous == active):
        return f"previous is {previous!r} while active is {active!r}"
    return None


def installed_version(root: Path) -> int | None:
    """The active slot's bundle_version; None when nothing is installed in ROOT."""
    state = read_state(root)
    return state["slots"][state["active"]]["bundle_version"] if state["active"] else None


def _save_state(root: Path, state: dict) -> None:
    """state.json replaced by a rename, so a reader (or a power cut) sees the old state or the new one."""
    _write_state_tmp(root, state)
    _commit_state(root)


def _write_state_tmp(root: Path, state: dict) -> None:
    data = (json.dumps(state, indent=2, sort_keys=True) + "\n").encode()
    fd = os.open(root / f"{STATE}.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _commit_state(root: Path) -> None:
    os.replace(root / f"{STATE}.tmp", root / STATE)
    _fsync(root)  # the rename itself reaches the disk


# --- install --------------------------------------------------------------------------------------


def _step(name: str) -> None:
    """Install reached step `name`; with EDGESDK_INSTALL_CRASH_AT=name the process dies here, at once."""
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def install(archive: Path, root: Path, *, trust_from: Path, allow_downgrade: bool = False,
            max_bytes: int | None = None, selftest_timeout: float = SELFTEST_TIMEOUT) -> tuple[dict, Verified]:
    """Install `archive` into ROOT's free slot and make it active (the steps in STEPS); returns the new
    state and what verified the bundle. Raises InstallError, TrustError or KeyFileError with the active
    slot unchanged (the free one may be gone)."""
    root = Path(root)
    _step("lock")
    with _locked(root):
        _step("load-keys")
        keys = load_trust(trust_from)
        _step("clean")
        for leftover in (root / STAGING, root / TRASH, root / f"{STATE}.tmp"):
            _remove(leftover)
        state = read_state(root)
        active = state["active"]
        free = SLOTS[1] if active == SLOTS[0] else SLOTS[0]
        unchanged = _unchanged(state)
        _step("precheck")
        _precheck(archive, keys, root, allow_downgrade, unchanged)
        _step("forget-previous")
        if state["previous"] == free or free in state["slots"]:
            state = {"active": active, "previous": None, "slots": {k: v for k, v in state["slots"].items() if k != free}}
            _save_state(root, state)
        _step("remove-slot")
        slot = root / "slots" / free
        if slot.exists() or slot.is_symlink():
            slot.rename(root / TRASH)  # a slot half removed is never left under slots/
            _remove(root / TRASH)
        staging = root / STAGING
        try:
            _step("unpack")
            staging.mkdir()
            try:
                bundle = unpack(archive, staging, max_bundle_bytes() if max_bytes is None else max_bytes)
            except UnpackError as e:
                hint = _UNPACK_HINTS.get(e.code, _UNPACK_HINTS[None]).format(root=root)
                raise InstallError(f"{archive}: {e.problem}", f"{hint}; {unchanged}") from None
            _step("verify")
            verified = _verified(bundle, keys, str(archive), installed_version=installed_version(root),
                                 allow_downgrade=allow_downgrade)
            arch = verified.manifest.arch
            if arch != platform.machine():
                raise InstallError(f"{archive}: manifest.arch is {arch}, but this device is {platform.machine()}",
                                   f"install the bundle built for this device's target; {unchanged}")
            _step("place")
            slot.parent.mkdir(exist_ok=True)
            bundle.rename(slot)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        _step("selftest")
        reason = _selftest(slot, selftest_timeout)
        if reason:
            raise InstallError(f"slot {free}: the self-test failed: {reason}",
                               f"the bundle does not run correctly on this device; {unchanged}")
        _step("recheck")
        _verified(slot, keys, f"slot {free} after its self-test")
        _step("sync")
        for top, _, files in os.walk(slot):
            for name in files:
                _fsync(Path(top) / name)
            _fsync(Path(top))
        _fsync(slot.parent)
        manifest = verified.manifest
        record = {"bundle_version": manifest.bundle_version, "model": str(manifest.model.get("name", "")),
                  "key_id": verified.key.key_id, "manifest_sha256": file_sha256(slot / "manifest.json"),
                  "installed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        slots = {k: v for k, v in state["slots"].items() if k == active}
        new = {"active": free, "previous": active, "slots": {**slots, free: record}}
        _step("write-state")
        _write_state_tmp(root, new)
        _step("switch")
        _commit_state(root)
    return new, verified


def _precheck(archive: Path, keys, root: Path, allow_downgrade: bool, unchanged: str) -> None:
    """What the archive's signed manifest alone can refuse: a signature by no device key, a version below
    the installed one, another architecture. The files are checked once unpacked (`verify`)."""
    try:
        text, signature = signed_manifest(archive)
    except UnpackError as e:
        hint = _UNPACK_HINTS.get(e.code, _UNPACK_HINTS[None]).format(root=root)
        raise InstallError(f"{archive}: {e.problem}", f"{hint}; {unchanged}") from None
    try:
        check_signature(text, signature, keys)
        manifest = Manifest.from_json(text)
        check_version(manifest, installed_version(root), allow_downgrade)
    except ManifestError as e:
        raise TrustError("manifest", f"{archive}: manifest.json: {e}") from None
    except TrustError as e:
        raise TrustError(e.code, f"{archive}: {e}", e.notes) from None
    if manifest.arch != platform.machine():
        raise InstallError(f"{archive}: manifest.arch is {manifest.arch}, but this device is {platform.machine()}",
                           f"install the bundle built for this device's target; {unchanged}")


def _verified(bundle: Path, keys, where: str, **kwargs) -> Verified:
    try:
        return verify_bundle(bundle, keys, **kwargs)
    except TrustError as e:
        raise TrustError(e.code, f"{where}: {e}", e.notes) from None


def _unchanged(state: dict) -> str:
    """What runs after a refused install (the slot refused was the free one)."""
    if not state["active"]:
        return "nothing is installed, as before"
    return f"slot {state['active']} ({_describe(state['slots'][state['active']])}) is still active"


def _selftest(slot: Path, timeout: float) -> str | None:
    """Why the bundle in `slot` failed its golden self-test, run by its own runtime with only the slot on
    the import path; None when it passed. -B and PYTHONDONTWRITEBYTECODE: nothing is written into it."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", CRASH_ENV)}
    env.update(PYTHONPATH=str(slot), PYTHONDONTWRITEBYTECODE="1")
    try:
        proc = subprocess.run([sys.executable, "-B", "-m", "runtime", "selftest", "--json"], cwd=slot, env=env,
                              capture_output=True, text=True, errors="replace", timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"it did not finish in {timeout:g} s (--selftest-timeout)"
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1].removeprefix("error: ")[:300]
    try:
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        passed = report["passed"]
    except (ValueError, IndexError, KeyError, TypeError):
        return f"it crashed (exit {proc.returncode}): {last}"
    if passed and proc.returncode == 0:
        return None
    try:
        checks = [(f"segment {s['segment']} output {r['output']}", r) for s in report.get("segments", [])
                  for r in s["outputs"]] + [(f"output {r['output']}", r) for r in report.get("outputs", [])]
        reasons = [f"{what}: max abs error {r['max_abs_error']:.3g}, tolerance {r['tolerance']:.3g} ({r['rule']})"
                   for what, r in checks if not r["passed"]]
        stream = report.get("stream") or {}
        if not stream.get("passed", True):
            reasons.append(f"the pipelined stream differs from run() in frames {stream.get('mismatched_frames')}")
    except (KeyError, TypeError, ValueError, AttributeError):  # a report in another form: say what is known
        reasons = []
    return "; ".join(reasons[:5]) or f"it exited {proc.returncode} ({last})"


@contextlib.contextmanager
def _locked(root: Path):
    """ROOT/install.lock held for the block; a second installer is refused at once. flock is released
    by the kernel when the holder dies, so a crashed install never leaves the device locked."""
    path = root / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            raise InstallError(f"{path}: held by another install or rollback"
                               + (f" (pid {holder})" if holder.isdigit() else ""),
                               "wait for it to finish, then try again; nothing changed") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


# --- rollback -------------------------------------------------------------------------------------


def rollback(root: Path, *, trust_from: Path) -> dict:
    """Make the previous slot active and the active one previous; returns the new state. The previous
    slot's signature and files are checked with the device's keys first; its version is not: a
    rollback is deliberate."""
    root = Path(root)
    with _locked(root):
        keys = load_trust(trust_from)
        state = read_state(root)
        previous, active = state["previous"], state["active"]
        if previous is None:
            raise InstallError(f"{root / STATE}: no previous slot to roll back to"
                               + (f" (slot {active} is active, and the other slot holds no installed bundle)"
                                  if active else " (nothing is installed)"),
                               "install the bundle wanted instead")
        slot = root / "slots" / previous
        _verified(slot, keys, f"slot {previous}")
        if file_sha256(slot / "manifest.json") != state["slots"][previous].get("manifest_sha256"):
            raise InstallError(f"slot {previous}: {slot / 'manifest.json'} is not the manifest installed there "
                               f"(its sha256 differs from {STATE}'s slots.{previous}.manifest_sha256)",
                               "install the bundle wanted instead; nothing changed")
        new = {"active": previous, "previous": active, "slots": state["slots"]}
        _save_state(root, new)
    return new


# --- the commands ---------------------------------------------------------------------------------


def add_commands(sub) -> None:
    """install, rollback and status, on the runtime's argparse subcommands."""
    i = sub.add_parser("install", help="unpack, verify and self-test a bundle in the free slot, then make it active")
    i.add_argument("archive", help="the bundle's .tar.gz")
    i.add_argument("--root", required=True, help="the install root (trust/, slots/, state.json)")
    i.add_argument("--trust", help="a directory of public keys (*.pub) or one key file (default: ROOT/trust)")
    i.add_argument("--allow-downgrade", action="store_true", help="install a bundle older than the active one")
    i.add_argument("--max-bytes", type=_positive_int, help="the most the archive may unpack to "
                   "(default: EDGESDK_MAX_BUNDLE_BYTES, or 16 GiB)")
    i.add_argument("--selftest-timeout", type=_positive_seconds, default=SELFTEST_TIMEOUT,
                   help=f"seconds the self-test may take (default {SELFTEST_TIMEOUT:g})")
    i.set_defaults(handler=_install_command)
    r = sub.add_parser("rollback", help="make the previous slot active again")
    r.add_argument("--root", required=True, help="the install root")
    r.add_argument("--trust", help="a directory of public keys (*.pub) or one key file (default: ROOT/trust)")
    r.set_defaults(handler=_rollback_command)
    s = sub.add_parser("status", help="which slot is active, with which bundle")
    s.add_argument("--root", required=True, help="the install root")
    s.add_argument("--json", action="store_true", help="the state as JSON on stdout")
    s.set_defaults(handler=_status_command)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of bytes")
    return int(text)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _reported(command):
    """The command's exit code; an InstallError printed as error and hint lines, no traceback."""
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except InstallError as e:
            print(f"error: {e}", file=sys.stderr)
            if e.hint:
                print(f"hint: {e.hint}", file=sys.stderr)
            return e.exit_code
    return run


def _root(args: argparse.Namespace) -> Path:
    root = Path(args.root)
    if not root.is_dir():
        raise InstallError(f"--root {root}: not a directory", "give the device's install root (it holds trust/)",
                           exit_code=2)
    return root


def _trust_from(args: argparse.Namespace, root: Path) -> Path:
    """--trust, else ROOT/trust, which the factory provisions: its absence is said as such."""
    if args.trust:
        return Path(args.trust)
    if not (root / TRUST).exists():
        raise InstallError(f"--root {root}: no {TRUST}/ directory, so no key to check a bundle with",
                           f"provision the vendor's public key as {root / TRUST}/NAME.pub (docs/trust.md), "
                           "or give --trust DIR|PUB", exit_code=2)
    return root / TRUST


@_reported
def _install_command(args: argparse.Namespace) -> int:
    crash_at = os.environ.get(CRASH_ENV)
    if crash_at is not None and crash_at not in STEPS:
        raise InstallError(f"{CRASH_ENV}={crash_at!r} is not a step of install", f"one of {', '.join(STEPS)}",
                           exit_code=2)
    root, archive = _root(args), Path(args.archive)
    if not archive.is_file():
        raise InstallError(f"{archive}: no such file", "give the bundle's .tar.gz")
    state, verified = install(archive, root, trust_from=_trust_from(args, root),
                              allow_downgrade=args.allow_downgrade, max_bytes=args.max_bytes,
                              selftest_timeout=args.selftest_timeout)
    for note in verified.notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"installed: slot {state['active']} is active: {_describe(state['slots'][state['active']])}"
          + (f"; slot {state['previous']} ({_describe(state['slots'][state['previous']])}) is previous: "
             "`rollback` returns to it" if state["previous"] else ""))
    return 0


@_reported
def _rollback_command(args: argparse.Namespace) -> int:
    root = _root(args)
    state = rollback(root, trust_from=_trust_from(args, root))
    print(f"rolled back: slot {state['active']} is active: {_describe(state['slots'][state['active']])}; "
          f"slot {state['previous']} ({_describe(state['slots'][state['previous']])}) is previous")
    return 0


@_reported
def _status_command(args: argparse.Namespace) -> int:
    root = _root(args)
    state = read_state(root)
    if args.json:
        print(json.dumps({"root": str(root), **state}, sort_keys=True))
        return 0
    if not state["active"]:
        print(f"nothing is installed in {root}: no slot is active")
        return 0
    for role in ("active", "previous"):
        name = state[role]
        print(f"{role}: " + (f"slot {name}: {_describe(state['slots'][name], full=True)}" if name else
                             "none (`rollback` has nothing to return to)"))
    return 0


def _describe(record: dict, full: bool = False) -> str:
    text = f"model {record.get('model') or '?'}, bundle version {record['bundle_version']}"
    if full:
        text += f", signed by key {record.get('key_id')}, installed {record.get('installed_at')}"
    return text


# --- files ----------------------------------------------------------------------------------------


def _remove(path: Path) -> None:
    """`path` gone, whatever it is; a link is removed, never followed."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

