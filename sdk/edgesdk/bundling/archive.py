"""A bundle's bytes made reproducible: the file table of the manifest, zip-free `.npz` goldens and the
tarball, each with fixed times and owners so the same inputs give the same bytes."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
import zipfile
from pathlib import Path

import numpy as np

from ..ir.digest import file_sha256
from ..runtime.files import write_whole


def savez(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """`np.savez`, with every zip entry dated 1980-01-01 (np.savez writes the current time)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asarray(arrays[name], order="C"), allow_pickle=False)  # 0-d stays 0-d
            z.writestr(zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)), buf.getvalue())


def file_table(bundle: Path) -> dict[str, dict]:
    """Every file of the bundle but the manifest: its sha256 and size."""
    return {p.relative_to(bundle).as_posix(): {"sha256": file_sha256(p), "size": p.stat().st_size}
            for p in sorted(bundle.rglob("*")) if p.is_file() and p.name != "manifest.json"}


# A model's weights (`segments/*.data` of onnxruntime, `segments/*.weights` of TVM) are float bytes gzip shrinks by some 7 %, at 30 MB/s: past this size
# they go into the tarball stored (gzip level 0, a member of its own), which takes seconds, not minutes.
STORED_FROM = 64 << 20


def write_tarball(bundle: Path, dest: Path) -> None:
    """Same files, same bytes: sorted members, mtime SOURCE_DATE_EPOCH (or 0), root ownership. One gzip
    stream of several members (as `gzip` reads and writes them): weights files past STORED_FROM stored."""
    mtime = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    # through a temporary made with O_EXCL under a fresh name: a link planted there is never written through
    write_whole(dest, lambda raw: _write_members(bundle, raw, mtime))


def _write_members(bundle: Path, raw, mtime: int) -> None:
    with _Members(raw, mtime) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for p in [bundle, *sorted(bundle.rglob("*"))]:
                rel = "bundle" if p == bundle else f"bundle/{p.relative_to(bundle).as_posix()}"
                info = tarfile.TarInfo(rel)
                info.mtime, info.uid, info.gid, info.uname, info.gname = mtime, 0, 0, "", ""
                if p.is_dir():
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(info)
                else:
                    info.size, info.mode = p.stat().st_size, 0o644
                    weights = p.suffix in (".data", ".weights") and info.size >= STORED_FROM
                    with open(p, "rb") as f:
                        gz.level(0 if weights else 9)
                        tar.addfile(info, f)
                        gz.level(9)


class _Members:
    """A writable gzip stream whose compression level can change between writes: each change ends one
    gzip member and starts the next (RFC 1952 allows any number; `gzip.open` and `tar xzf` read them
    as one stream)."""

    def __init__(self, raw, mtime: int):
        self._raw, self._mtime, self._level = raw, mtime, 9
        self._gz = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=mtime, compresslevel=9)

    def level(self, level: int) -> None:
        if level != self._level:
            self._gz.close()  # ends the member; `raw` stays open
            self._level = level
            self._gz = gzip.GzipFile(filename="", mode="wb", fileobj=self._raw, mtime=self._mtime, compresslevel=level)

    def write(self, data) -> int:
        return self._gz.write(data)

    def tell(self) -> int:
        return self._gz.tell()

    def close(self) -> None:
        self._gz.close()

    def __enter__(self) -> "_Members":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
