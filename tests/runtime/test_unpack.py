"""Archives `runtime/unpack.py` refuses from their headers alone, before any manifest is read (the
fuzzer's findings, tests/fuzz): each is an `UnpackError` with a code, never another exception, and
nothing is written. The archives are built here, in memory, a member or two each."""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

import pytest

from edgesdk.runtime.unpack import UnpackError, signed_manifest, unpack


def _archive(path: Path, members: list[tarfile.TarInfo], fmt: int = tarfile.GNU_FORMAT) -> Path:
    """A .tar.gz of `members`, each holding one byte; names may hold bytes that are not UTF-8 (as
    surrogate escapes, the way tarfile reads them back)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, encoding="utf-8", errors="surrogateescape") as tar:
        for info in members:
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    path.write_bytes(gzip.compress(buf.getvalue(), mtime=0))
    return path


def _sparse_map(text: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo("bundle/manifest.json")
    info.pax_headers = {"GNU.sparse.map": text, "GNU.sparse.size": "1"}
    return info


@pytest.mark.parametrize("name", ["bundle/\udcff\udcfe", "bundle/segments/s0\udce9.so"])
def test_a_member_name_that_is_not_utf8_is_refused(tmp_path, name):
    archive = _archive(tmp_path / "a.tar.gz", [tarfile.TarInfo(name)])
    (tmp_path / "dest").mkdir()
    with pytest.raises(UnpackError, match=r"refuses member 'bundle/.*\\x.*' \(a name that is not UTF-8\)") as e:
        unpack(archive, tmp_path / "dest", 1 << 30)
    assert e.value.code == "bundle.unsafe-member" and not list((tmp_path / "dest").iterdir())


@pytest.mark.parametrize("first", [True, False])
def test_a_header_tarfile_cannot_parse_is_a_bad_archive(tmp_path, first):
    """tarfile raises ValueError, not TarError, for a GNU sparse map of non-numbers: in `tarfile.open`
    when the member comes first, while the members are read otherwise."""
    members = [_sparse_map("0,1,x")] if first else [tarfile.TarInfo("bundle/plan.json"), _sparse_map("0,1,x")]
    archive = _archive(tmp_path / "a.tar.gz", members, fmt=tarfile.PAX_FORMAT)
    (tmp_path / "dest").mkdir()
    with pytest.raises(UnpackError, match=r"not a (complete )?bundle archive \(.*invalid literal for int") as e:
        unpack(archive, tmp_path / "dest", 1 << 30)
    assert e.value.code == "bundle.bad-archive"
    with pytest.raises(UnpackError, match=r"not a bundle archive \(ValueError: invalid literal for int") as e:
        signed_manifest(archive)  # the installer's first read of the archive
    assert e.value.code == "bundle.bad-archive"
