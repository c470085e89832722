"""Install a bundle on the device into A/B slots, roll back to the previous one, say which is active.

  python -B -m runtime install BUNDLE.tar.gz --root ROOT [--trust DIR|PUB] [--allow-downgrade]
                                             [--max-bytes N] [--selftest-timeout S]
  python -B -m runtime rollback --root ROOT [--trust DIR|PUB]
  python -B -m runtime status --root ROOT [--json]

ROOT holds

  trust/*.pub        the public keys the device trusts, provisioned at the factory: the key always
                     comes from the device, never from the bundle (trust.py)
  slots/a, slots/b   bundle directories: the active one, and the free one
  state.json         which slot is active and which was active before it, with what in each, and the
                     floor: the newest bundle_version the root ever installed, below which a bundle is
                     refused without --allow-downgrade, whatever a rollback made active since:
                     {"active": "a"|"b"|null, "previous": ..., "floor": int|null, "slots": {name:
                     {"bundle_version", "model", "key_id", "manifest_sha256", "installed_at"}}}
                     (a state.json without "floor", from an older installer, has the newest version
                     its slots hold as its floor)
  install.lock       held (flock) by the one install or rollback that may run

None of these may be a link: install, rollback and status refuse a root that holds one before they
move, remove or write anything (`_check_layout`), so nothing they do reaches outside ROOT.

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
import errno
import fcntl
import hashlib
import json
import math
import os
import platform
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

from .files import read_bundle_file
from .manifest import MAX_MANIFEST_BYTES, Manifest, ManifestError
from .process import run_bounded
from .trust import TrustError, Verified, check_signature, check_version, load_trust, verify_bundle
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
MAX_SELFTEST_TIMEOUT = 86_400.0  # a day: a self-test that needs longer is not one a device can wait for
MAX_STATE_BYTES = 64 << 10  # state.json holds two slot records, a few hundred bytes
MAX_VERSION = 2**63 - 1  # manifest.bundle_version's range
# every entry install, rollback or status reads, writes or removes in ROOT, a directory before what is in
# it, what it is, and whether it must be a directory (the files are judged where they are opened); none may
# be a link
_LAYOUT = ((TRUST, "directory of keys", False), ("slots", "directory", True), ("slots/a", "slot", True),
           ("slots/b", "slot", True), (STATE, "state file", False), (f"{STATE}.tmp", "leftover", False),
           (LOCK, "lock file", False), (STAGING, "leftover", False), (TRASH, "leftover", False))
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
    """ROOT/state.json, checked, with its floor (derived from the slots for a state.json that has none);
    the empty state when nothing was ever installed. state.json is read only as a regular file of at most
    MAX_STATE_BYTES: a link, a FIFO or a device there is refused, never followed or waited on."""
    path = Path(root) / STATE
    try:
        text = read_bundle_file(path, MAX_STATE_BYTES)
    except FileNotFoundError:
        return {"active": None, "previous": None, "floor": None, "slots": {}}
    except ValueError as e:
        raise InstallError(f"{path}: {e}", _DAMAGED) from None
    except OSError as e:
        raise InstallError(f"{path}: cannot be read ({e.strerror or e})", _DAMAGED) from None
    try:
        state = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InstallError(f"{path}: not valid JSON ({str(e)[:200]})", _DAMAGED) from None
    problem = _state_problem(state)
    if problem:
        raise InstallError(f"{path}: {problem}", _DAMAGED)
    versions = [r["bundle_version"] for r in state["slots"].values()] + [state.get("floor")]
    floor = max((v for v in versions if v is not None), default=None)
    return {"active": state.get("active"), "previous": state.get("previous"), "floor": floor,
            "slots": state["slots"]}


def _state_problem(state) -> str | None:
    """What makes `state` not a state.json this installer wrote; None when nothing does. Keys it does not
    know are kept out of the way, not refused: a rollback may make an older installer read a newer one's."""
    if not isinstance(state, dict) or not isinstance(state.get("slots"), dict):
        return "not a state object (no 'slots')"
    for name, record in state["slots"].items():
        if name not in SLOTS:
            return f"slots holds {name[:40]!r}, not one of {', '.join(SLOTS)}"
        if not isinstance(record, dict):
            return f"slots.{name} is not an object"
        if not _is_version(record.get("bundle_version")):
            return f"slots.{name}.bundle_version is {_shown(record.get('bundle_version'))}, not an integer from 0 to {MAX_VERSION}"
        for field in ("model", "key_id", "manifest_sha256", "installed_at"):
            if field in record and not isinstance(record[field], str):
                return f"slots.{name}.{field} is {_shown(record[field])}, not a string"
    for role in ("active", "previous"):
        name = state.get(role)
        if name is not None and name not in SLOTS:
            return f"{role} is {_shown(name)}, not one of {', '.join(SLOTS)} or null"
        if name is not None and name not in state["slots"]:
            return f"{role} is slot {name}, but slots.{name} is missing"
    if state.get("floor") is not None and not _is_version(state["floor"]):
        return f"floor is {_shown(state['floor'])}, not an integer from 0 to {MAX_VERSION} or null"
    active, previous = state.get("active"), state.get("previous")
    if previous is not None and (active is None or previous == active):
        return f"previous is {previous!r} while active is {active!r}"
    return None


def _is_version(value) -> bool:
    return type(value) is int and 0 <= value <= MAX_VERSION  # not a bool, which JSON's true would be


def _shown(value) -> str:
    return json.dumps(value)[:60]


def installed_version(root: Path) -> int | None:
    """The active slot's bundle_version; None when nothing is installed in ROOT."""
    state = read_state(root)
    return state["slots"][state["active"]]["bundle_version"] if state["active"] else None


def version_floor(root: Path) -> int | None:
    """The newest bundle_version ROOT ever installed: a bundle below it is refused without
    --allow-downgrade, even after a rollback made an older one active; None when nothing was installed."""
    return read_state(root)["floor"]


def floor_phrase(state: dict) -> str | None:
    """What the floor is, for a refusal, when it is not the active bundle's version (check_version)."""
    active = state["slots"][state["active"]]["bundle_version"] if state["active"] else None
    if state["floor"] is None or state["floor"] == active:
        return None
    return f"{state['floor']}, the newest version this device has installed"


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
    with _locked(root, "install"):
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
        _precheck(archive, keys, root, state, allow_downgrade, unchanged)
        _step("forget-previous")
        if state["previous"] == free or free in state["slots"]:
            state = {"active": active, "previous": None, "floor": state["floor"],
                     "slots": {k: v for k, v in state["slots"].items() if k != free}}
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
            verified = _verified(bundle, keys, str(archive), installed_version=state["floor"],
                                 allow_downgrade=allow_downgrade, floor=floor_phrase(state))
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
                  "key_id": verified.key.key_id, "manifest_sha256": _manifest_sha256(slot),
                  "installed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        slots = {k: v for k, v in state["slots"].items() if k == active}
        # the floor never drops: an allowed downgrade leaves it where the newest install put it
        floor = max(v for v in (state["floor"], manifest.bundle_version) if v is not None)
        new = {"active": free, "previous": active, "floor": floor, "slots": {**slots, free: record}}
        _step("write-state")
        _write_state_tmp(root, new)
        _step("switch")
        _commit_state(root)
    return new, verified


def _precheck(archive: Path, keys, root: Path, state: dict, allow_downgrade: bool, unchanged: str) -> None:
    """What the archive's signed manifest alone can refuse: a signature by no device key, a version below
    the root's floor, another architecture. The files are checked once unpacked (`verify`)."""
    try:
        text, signature = signed_manifest(archive)
    except UnpackError as e:
        hint = _UNPACK_HINTS.get(e.code, _UNPACK_HINTS[None]).format(root=root)
        raise InstallError(f"{archive}: {e.problem}", f"{hint}; {unchanged}") from None
    try:
        check_signature(text, signature, keys)
        manifest = Manifest.from_json(text)
        check_version(manifest, state["floor"], allow_downgrade, floor_phrase(state))
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
    the import path; None when it passed. -B and PYTHONDONTWRITEBYTECODE: nothing is written into it.
    It runs in a session (and process group) of its own, which is killed whole however the self-test
    ends (passed, failed, timed out, or the installer interrupted), so no process it started outlives it."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", CRASH_ENV)}
    env.update(PYTHONPATH=str(slot), PYTHONDONTWRITEBYTECODE="1")
    try:
        done = run_bounded([sys.executable, "-B", "-m", "runtime", "selftest", "--json"], timeout=timeout,
                           capture_output=True, cwd=slot, env=env, stdin=subprocess.DEVNULL, text=True,
                           errors="replace")
    except subprocess.TimeoutExpired:
        return f"it did not finish in {timeout:g} s (--selftest-timeout)"
    stdout, stderr, code = done.stdout, done.stderr, done.returncode
    last = (stderr.strip().splitlines() or ["no output"])[-1].removeprefix("error: ")[:300]
    try:
        report = json.loads(stdout.strip().splitlines()[-1])
        passed = report["passed"]
    except (ValueError, IndexError, KeyError, TypeError):
        return f"it crashed (exit {code}): {last}"
    if passed and code == 0:
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
    return "; ".join(reasons[:5]) or f"it exited {code} ({last})"


@contextlib.contextmanager
def _locked(root: Path, command: str):
    """ROOT/install.lock held for the block; a second installer is refused at once. flock is released
    by the kernel when the holder dies, so a crashed install never leaves the device locked. The root's
    layout is checked first (no link, nothing of the wrong kind), so that nothing is created, moved or
    removed outside it."""
    _check_layout(root)
    path = root / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise InstallError(f"--root {root}: not writable ({e.strerror}), and {command} writes there "
                               f"({LOCK}, {STATE}, slots/)",
                               "remount it read-write, or run as the user who owns it; nothing changed",
                               exit_code=2) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InstallError(f"{path}: not a regular file", _DAMAGED)
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
    with _locked(root, "rollback"):
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
        if _manifest_sha256(slot) != state["slots"][previous].get("manifest_sha256"):
            raise InstallError(f"slot {previous}: {slot / 'manifest.json'} is not the manifest installed there "
                               f"(its sha256 differs from {STATE}'s slots.{previous}.manifest_sha256)",
                               "install the bundle wanted instead; nothing changed")
        new = {"active": previous, "previous": active, "floor": state["floor"], "slots": state["slots"]}
        _save_state(root, new)  # the floor stays: a rollback never makes an older bundle installable
    return new


# --- the commands ---------------------------------------------------------------------------------


def add_commands(sub) -> None:
    """install, rollback and status, on the runtime's argparse subcommands."""
    i = sub.add_parser("install", help="unpack, verify and self-test a bundle in the free slot, then make it active")
    i.add_argument("archive", help="the bundle's .tar.gz")
    i.add_argument("--root", required=True, help="the install root (trust/, slots/, state.json)")
    i.add_argument("--trust", help="a directory of public keys (*.pub) or one key file (default: ROOT/trust)")
    i.add_argument("--allow-downgrade", action="store_true",
                   help="install a bundle older than the newest one this root ever installed")
    i.add_argument("--max-bytes", type=_positive_int, help="the most the archive may unpack to "
                   "(default: EDGESDK_MAX_BUNDLE_BYTES, or 16 GiB)")
    i.add_argument("--selftest-timeout", type=_positive_seconds, default=SELFTEST_TIMEOUT,
                   help=f"seconds the self-test may take (default {SELFTEST_TIMEOUT:g}, at most "
                        f"{MAX_SELFTEST_TIMEOUT:g}); on the timeout it is killed with every process it started")
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
        value = math.nan
    if not 0 < value <= MAX_SELFTEST_TIMEOUT:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0 and at most "
                                         f"{MAX_SELFTEST_TIMEOUT:g}")
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
        except OSError as e:  # the root's disk, not the bundle: full, failing, changed under the command
            where = f"{e.filename}: " if e.filename else ""
            print(f"error: {where}{e.strerror or e}", file=sys.stderr)
            print(f"hint: {args.command} stopped there; only the last step of an install or a rollback changes "
                  f"which slot is active: `status --root {args.root}` says which is", file=sys.stderr)
            return 1
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
        raise InstallError(f"{archive}: " + ("not a regular file" if archive.exists() else "no such file"),
                           "give the bundle's .tar.gz")
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
    _check_layout(root)
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
    if floor_phrase(state):
        print(f"floor: bundle version {state['floor']}, the newest installed here: an older bundle is refused "
              "without --allow-downgrade")
    return 0


def _describe(record: dict, full: bool = False) -> str:
    text = f"model {record.get('model') or '?'}, bundle version {record['bundle_version']}"
    if full:
        text += f", signed by key {record.get('key_id')}, installed {record.get('installed_at')}"
    return text


# --- files ----------------------------------------------------------------------------------------


def _remove(path: Path) -> None:
    """`path` gone, whatever it is; a link is removed, never followed."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _check_layout(root: Path) -> None:
    """Refuse a root where an entry of `_LAYOUT` is a link, or a file where a directory must be: the
    commands would otherwise create, move, remove or write files where it leads, outside ROOT. lstat
    only: nothing is followed."""
    for rel, noun, directory in _LAYOUT:
        path = root / rel
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        except OSError as e:
            raise InstallError(f"{path}: cannot be examined ({e.strerror})", _DAMAGED) from None
        if stat.S_ISLNK(mode):
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            raise InstallError(f"{path}: is a link (to {target}); every entry of an install root is inside it, "
                               "and install, rollback and status follow no link there",
                               f"put the {noun} itself at {path}, or remove the link; nothing changed")
        if directory and not stat.S_ISDIR(mode):
            raise InstallError(f"{path}: not a directory", _DAMAGED)


def _manifest_sha256(slot: Path) -> str:
    """sha256 of the slot's manifest.json, read as a regular file of a bounded size."""
    try:
        return hashlib.sha256(read_bundle_file(slot / "manifest.json", MAX_MANIFEST_BYTES)).hexdigest()
    except ValueError as e:
        raise InstallError(f"{slot / 'manifest.json'}: {e}", _DAMAGED) from None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

