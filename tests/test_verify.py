"""Hostile bundles: what `verify`, `run` and `inspect` refuse, with which exit code, and that nothing
of a refused bundle ran and nothing was left behind.

Each attack is built here from the real PP-OCR classifier bundle (`x86_ppocr`): a failing self-test,
a planted compiled module, a junk signature, paths and links leading out of the bundle (to a native
library whose load would write a marker file), hostile archives and malformed manifests. An attacker
who can edit the bundle can also edit its manifest, so most attacks re-stamp the manifest's hashes
after planting: the checks below must hold even for an unsigned bundle verified without a key
(signatures: tests/test_signing_e2e.py).
"""

from __future__ import annotations

import copy
import gzip
import importlib.util
import io
import json
import os
import py_compile
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from edgesdk.cli import main as cli_main
from edgesdk.errors import UserError
from edgesdk.ir.digest import file_sha256
from edgesdk.runtime import BundleModel
from edgesdk.runtime.manifest import ManifestError
from edgesdk.bundling import write_tarball
from edgesdk.verify import verify
from tests.test_cli import assert_user_facing, edgesdk
from tests.processes import ends


@pytest.fixture()
def bundle(x86_ppocr, tmp_path) -> Path:
    copy_ = tmp_path / "bundle"
    shutil.copytree(x86_ppocr.bundle, copy_)
    return copy_


@pytest.fixture()
def feeds(bundle, tmp_path) -> Path:
    (x,) = json.loads((bundle / "manifest.json").read_text())["inputs"]
    path = tmp_path / "x.npy"
    np.save(path, np.zeros(x["shape"], np.float32))
    return path


@pytest.fixture()
def marker_library(tmp_path) -> tuple[Path, Path]:
    """A native library that writes a marker file when it is loaded: if the marker exists, it ran."""
    marker = tmp_path / "marker-library-loaded"
    src = tmp_path / "evil.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void ran(void) {\n'
                   f'  FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("ran", f); fclose(f); }}\n}}\n')
    lib = tmp_path / "evil.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib, marker


def manifest_of(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def write_manifest(bundle: Path, m: dict, *, restamp: bool = True) -> None:
    """Write `m`; with `restamp`, every file now in the bundle gets its hash listed, as an attacker
    editing both would do."""
    if restamp:
        m["files"] = {p.relative_to(bundle).as_posix(): {"sha256": file_sha256(p), "size": p.stat().st_size}
                      for p in sorted(bundle.rglob("*")) if p.is_file() and p.name != "manifest.json"}
    (bundle / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")


def tarball(bundle: Path, dest: Path, extra: dict[str, bytes] | None = None) -> Path:
    """The bundle's archive as `edgesdk build` writes it, with `extra` members (name -> bytes) added."""
    write_tarball(bundle, dest)
    if extra:
        raw = gzip.decompress(dest.read_bytes())
        buf = io.BytesIO()
        with tarfile.open(fileobj=io.BytesIO(raw)) as src, \
                tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as out:
            for m in src.getmembers():
                out.addfile(m, src.extractfile(m) if m.isfile() else None)
            for name, data in extra.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                out.addfile(info, io.BytesIO(data))
        dest.write_bytes(gzip.compress(buf.getvalue(), mtime=0))
    return dest


# --- finding 1: exit codes ------------------------------------------------------------------------


def test_failed_selftest_exits_1(bundle):
    golden = dict(np.load(bundle / "golden" / "outputs.npz"))
    np.savez(bundle / "golden" / "outputs.npz", **{k: v + 1.0 for k, v in golden.items()})
    write_manifest(bundle, manifest_of(bundle))
    proc = edgesdk("verify", str(bundle))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "self-test: failed" in proc.stdout
    assert_user_facing(proc, 1, "the self-test failed natively on x86_64")  # the verdict on stderr too
    proc = edgesdk("verify", str(bundle), "--json")
    assert proc.returncode == 1 and json.loads(proc.stdout)["selftest"] == "failed"


def _hanging(bundle: Path, module: str, pid_file: Path) -> None:
    """runtime/MODULE.py replaced by code that starts a child, records the child's pid and hangs; the
    hashes re-stamped, so the bundle passes every check before its code runs."""
    (bundle / "runtime" / f"{module}.py").write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(600)\n\n"
        "def main(args):\n    time.sleep(600)\n")
    write_manifest(bundle, manifest_of(bundle))


@pytest.mark.parametrize("command, module, flag, what", [("verify", "selftest", "--selftest-timeout", "self-test"),
                                                          ("bench", "bench", "--timeout", "bench")])
def test_a_hanging_selftest_or_bench_is_stopped_with_its_children(bundle, tmp_path, command, module, flag, what):
    pid_file = tmp_path / "child.pid"
    _hanging(bundle, module, pid_file)
    proc = edgesdk(command, str(bundle), flag, "3")
    assert_user_facing(proc, 1, f"error: {bundle}: the {what} (natively) did not finish in 3 s; it was stopped with "
                       "every process it started", f"give it longer with {flag} SECONDS")
    child = int(pid_file.read_text())
    assert ends(child)


@pytest.mark.parametrize("value", ["0", "nan", "1e300"])
def test_a_timeout_outside_its_range_is_refused(bundle, value):
    for command, flag in (("verify", "--selftest-timeout"), ("bench", "--timeout")):
        assert_user_facing(edgesdk(command, str(bundle), flag, value), 2,
                           f"error: {flag} {float(value):g}: not a number of seconds above 0 and at most 604800")


# --- finding 2: the hash check cannot be bypassed -------------------------------------------------


def _planted_pyc(bundle: Path, marker: Path) -> Path:
    """runtime/selftest.py's compiled twin that writes `marker`, stamped with the real source's size and
    mtime, where Python looks for it first."""
    real = bundle / "runtime" / "selftest.py"
    evil = f"open({str(marker)!r}, 'w').write('ran')\n"
    src = real.parent.parent.parent / "evil_selftest.py"
    src.write_text(evil + "#" * (real.stat().st_size - len(evil) - 1) + "\n")
    os.utime(src, ns=(real.stat().st_atime_ns, real.stat().st_mtime_ns))
    cfile = Path(importlib.util.cache_from_source(str(real)))
    py_compile.compile(str(src), cfile=str(cfile), invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
    return cfile


def test_planted_compiled_module_is_refused_and_never_runs(bundle, tmp_path):
    marker = tmp_path / "planted-pyc-ran"
    control = tmp_path / "control"
    shutil.copytree(bundle, control)
    _planted_pyc(control, marker)
    # the attack is real: Python runs the planted module in place of the checked source
    env = {**os.environ, "PYTHONPATH": str(control)}
    subprocess.run([sys.executable, "-m", "runtime", "selftest"], cwd=control, env=env, capture_output=True,
                   timeout=300)
    assert marker.exists()
    marker.unlink()

    cfile = _planted_pyc(bundle, marker)
    rel = cfile.relative_to(bundle).as_posix()
    proc = edgesdk("verify", str(bundle))
    assert_user_facing(proc, 1, f"{rel}: not listed in the manifest")
    assert not marker.exists()
    # in an archive it is refused before anything is unpacked
    planted = cfile.read_bytes()
    shutil.rmtree(cfile.parent)
    archive = tarball(bundle, tmp_path / "b.tar.gz", {f"bundle/{rel}": planted})
    proc = edgesdk("verify", str(archive))
    assert_user_facing(proc, 1, "is not listed in the manifest")
    assert not marker.exists()


def test_selftest_writes_no_bytecode_into_the_bundle(bundle):
    report = verify(bundle)
    assert report.selftest == "passed"
    assert not list(bundle.rglob("__pycache__"))
    assert verify(bundle, run_selftest=False).hashes_ok  # so it verifies again


def test_junk_signature_is_refused_by_a_key_and_never_passes_for_checked(bundle, tmp_path):
    from edgesdk.bundling import signing

    (bundle / "manifest.sig").write_bytes(b"\x00junk signature")
    proc = edgesdk("verify", str(bundle), "--no-selftest")
    assert proc.returncode == 0 and "NOT checked" in proc.stdout  # no key given: said, never claimed verified
    _, public, _ = signing.generate_keys(tmp_path / "keys")
    proc = edgesdk("verify", str(bundle), "--public-key", str(public))
    assert_user_facing(proc, 1, "manifest.sig", "not an ed25519 signature")


# --- finding 3: every path stays inside the bundle ------------------------------------------------


def _escape(bundle: Path, how: str, library: Path) -> None:
    m = manifest_of(bundle)
    seg = next(s for s in m["segments"] if s["backend"] == "tvm")
    if how == "absolute-artifact":
        seg["artifact"] = str(library)
        write_manifest(bundle, m)
        m["files"][str(library)] = {"sha256": file_sha256(library), "size": library.stat().st_size}
        write_manifest(bundle, m, restamp=False)
    elif how == "dotdot-artifact":
        seg["artifact"] = "../" * 12 + str(library).lstrip("/")
        write_manifest(bundle, m)
    elif how == "absolute-file-key":
        m["files"]["/etc/hostname"] = {"sha256": file_sha256(Path("/etc/hostname")),
                                       "size": Path("/etc/hostname").stat().st_size}
        write_manifest(bundle, m, restamp=False)
    elif how == "link-artifact":  # the artifact's name is fine; the file is a link to the library
        (bundle / seg["artifact"]).unlink()
        (bundle / seg["artifact"]).symlink_to(library)
        write_manifest(bundle, m, restamp=False)
        m["files"][seg["artifact"]] = {"sha256": file_sha256(library), "size": library.stat().st_size}
        write_manifest(bundle, m, restamp=False)


@pytest.mark.parametrize("how", ["absolute-artifact", "dotdot-artifact", "absolute-file-key", "link-artifact"])
def test_paths_outside_the_bundle_are_refused_before_anything_loads(bundle, feeds, marker_library, how):
    library, marker = marker_library
    _escape(bundle, how, library)
    for args in (("verify", str(bundle)), ("run", str(bundle), "--input", str(feeds))):
        proc = edgesdk(*args)
        assert_user_facing(proc, 1)
        assert not marker.exists(), f"{args[0]} loaded a library outside the bundle"
    if how != "absolute-file-key":  # the runtime on the device refuses it too, before loading anything
        with pytest.raises(ManifestError):
            BundleModel(bundle, log=lambda s: None)
        assert not marker.exists()


# --- finding 7: archives --------------------------------------------------------------------------


def test_archives_leave_nothing_in_the_temporary_directory(x86_ppocr, bundle, feeds, tmp_path):
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    archive = x86_ppocr.out / "bundle.tar.gz"
    truncated = tmp_path / "cut.tar.gz"
    truncated.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    env = {"TMPDIR": str(tmp)}
    runs = [("verify", str(archive)), ("inspect", str(archive)), ("run", str(archive), "--input", str(feeds)),
            ("verify", str(truncated))]
    for args in runs:
        proc = subprocess.run([sys.executable, "-m", "edgesdk.cli", *args], capture_output=True, text=True,
                              env={**os.environ, **env}, timeout=600)
        assert proc.returncode in (0, 1), proc.stderr
        assert not list(tmp.iterdir()), f"{args[0]} left {list(tmp.iterdir())}"


def test_unlisted_bomb_member_is_refused_before_writing(bundle, tmp_path, monkeypatch):
    """1 GiB of zeros in a few MB of archive, under a name the manifest does not list."""
    class Zeros(io.RawIOBase):
        def readable(self):
            return True

        def readinto(self, b):
            b[:] = bytes(len(b))
            return len(b)

    archive = tmp_path / "bomb.tar.gz"
    plain = tarball(bundle, tmp_path / "plain.tar.gz")
    info = tarfile.TarInfo("bundle/segments/zeros.bin")
    info.size = 1 << 30
    with tarfile.open(plain) as src, tarfile.open(archive, "w:gz", compresslevel=1) as out:
        for m in src.getmembers():
            out.addfile(m, src.extractfile(m) if m.isfile() else None)
        out.addfile(info, io.BufferedReader(Zeros(), 1 << 20))
    assert archive.stat().st_size < 8 << 20
    monkeypatch.setattr(tarfile.TarFile, "extractall", lambda *a, **k: pytest.fail("the archive was unpacked"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "t"))
    (tmp_path / "t").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    with pytest.raises(UserError, match="zeros.bin' is not listed in the manifest"):
        verify(archive)
    assert not list((tmp_path / "t").iterdir())


def _gz(raw: bytes, path: Path) -> Path:
    path.write_bytes(gzip.compress(raw, mtime=0))
    return path


@pytest.mark.parametrize("case", ["declares-100-GiB", "truncated-tar-gz", "truncated-tar", "300-character-name",
                                  "size-differs", "not-an-archive"])
def test_hostile_archives_are_user_errors(x86_ppocr, bundle, tmp_path, case):
    archive = x86_ppocr.out / "bundle.tar.gz"
    raw = gzip.decompress(archive.read_bytes())
    if case == "declares-100-GiB":
        info = tarfile.TarInfo("bundle/segments/huge.bin")
        info.size = 100 << 30
        path, needle = _gz(info.tobuf(tarfile.GNU_FORMAT) + bytes(4096), tmp_path / "a.tar.gz"), "past"
    elif case == "truncated-tar-gz":
        path, needle = tmp_path / "a.tar.gz", "not a complete bundle archive"
        path.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    elif case == "truncated-tar":
        path, needle = tmp_path / "a.tar", "not a complete bundle archive"
        path.write_bytes(raw[: len(raw) // 2 + 100])
    elif case == "300-character-name":
        path, needle = tarball(bundle, tmp_path / "a.tar.gz", {"bundle/" + "a" * 300: b"x"}), "307 characters"
    elif case == "size-differs":
        seg = next(bundle.glob("segments/*.so"))
        seg.write_bytes(seg.read_bytes() + b"\0")
        path, needle = tarball(bundle, tmp_path / "a.tar.gz"), "the manifest lists"
    else:
        path, needle = tmp_path / "a.tar.gz", "not a bundle archive"
        path.write_bytes(b"\x1f\x8b" + os.urandom(2000))
    for cmd in ("verify", "inspect"):
        proc = edgesdk(cmd, str(path))
        assert_user_facing(proc, 1, needle)


# --- finding 8: manifests -------------------------------------------------------------------------


def _mutations(m: dict):
    """Every field up to three levels down: removed, or replaced by a value of the wrong type."""
    def walk(node, path):
        if len(path) > 3:
            return
        items = node.items() if isinstance(node, dict) else enumerate(node[:2]) if isinstance(node, list) else ()
        for k, v in items:
            yield path + (k,)
            yield from walk(v, path + (k,))

    # every field removed and given a string; the other wrong values in turn across the fields (each
    # value reaches every kind of field over a manifest of hundreds): the fuzz suite mutates further
    others = (-1, None, [], {}, 1e308, 2**70)
    for k, path in enumerate(walk(m, ())):
        for value in ("<delete>", "x", others[k % len(others)], others[(k + 3) % len(others)]):
            yield path, value


def _apply(m: dict, path: tuple, value) -> dict:
    m = copy.deepcopy(m)
    node = m
    for k in path[:-1]:
        node = node[k]
    if value == "<delete>":
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return m


def test_malformed_manifests_are_user_errors(bundle, feeds, capsys):
    """inspect and run on ~800 mutated manifests: exit 0 (a harmless change), or 1 (or 2 where the
    mutated manifest no longer takes the given input) with `error:` and `hint:`; never an internal error."""
    original = manifest_of(bundle)
    counts = {0: 0, 1: 0, 2: 0}
    for path, value in _mutations(original):
        write_manifest(bundle, _apply(original, path, value), restamp=False)
        for args in (["inspect", str(bundle)], ["run", str(bundle), "--input", str(feeds)]):
            code = cli_main(args)
            err = capsys.readouterr().err
            assert code in (0, 1, 2), f"{args[0]} with {'.'.join(map(str, path))} = {value!r}: exit {code}\n{err}"
            assert code == 0 or ("error: " in err and "hint: " in err), err
            counts[code] += 1
    assert counts[1] > 1000  # most mutations break the manifest; a few (an optional number) do not


@pytest.mark.parametrize("field, value, needle", [
    ("schema_version", 999, "schema_version is 999"),
    ("min_runtime_version", "99.0.0", "needs runtime 99.0.0 or newer"),
])
def test_unknown_schema_or_newer_runtime_is_refused(bundle, feeds, field, value, needle):
    m = manifest_of(bundle)
    m[field] = value
    write_manifest(bundle, m, restamp=False)
    for args in (("inspect", str(bundle)), ("verify", str(bundle)), ("run", str(bundle), "--input", str(feeds))):
        assert_user_facing(edgesdk(*args), 1, needle)
