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


def savez(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """`np.savez`, with every zip entry dated 1980-01-01 (np.savez writes the current time)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arrays[name]), allow_pickle=False)
            z.writestr(zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)), buf.getvalue())


def file_table(bundle: Path) -> dict[str, dict]:
    """Every file of the bundle but the manifest: its sha256 and size."""
    return {p.relative_to(bundle).as_posix(): {"sha256": file_sha256(p), "size": p.stat().st_size}
            for p in sorted(bundle.rglob("*")) if p.is_file() and p.name != "manifest.json"}


def write_tarball(bundle: Path, dest: Path) -> None:
    """Same files, same bytes: sorted members, mtime SOURCE_DATE_EPOCH (or 0), root ownership."""
    mtime = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    tmp = dest.with_name(dest.name + ".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=mtime) as gz:
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
                    with open(p, "rb") as f:
                        tar.addfile(info, f)
    tmp.replace(dest)
