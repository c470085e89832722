"""Signing, verification, install and rollback times for the demo bundle.

    .venv/bin/python benchmarks/bench_trust.py [--runs 15] [--qemu-runs 5] [--install-runs 3] [--out benchmarks/results/trust.json]

The demo model (PP-OCRv4's text recognizer, 1x3x48x320) is built as `make demo` builds it, for
arm_2tpu, and for x86 (the installer runs the self-test natively, so install and rollback are timed on
an x86 bundle on this host). In one run, interleaved round by round, medians:

1. sign: `edgesdk.bundling.signing.stamp` on a copy of the arm_2tpu bundle (every file's hash checked,
   manifest.json rewritten, manifest.sig written, bundle.tar.gz written again), and the ed25519
   signature of the manifest alone;
2. verify on the build host, in process: the hash check alone (what `edgesdk verify` did before
   signatures) against signature + hash check + version (`verify.check_trust`);
3. the device's `python -B -m runtime verify` (a trusted copy of the runtime, as the device's active slot
   holds it, checking the bundle) as a process on this host, and under qemu-user in the
   arm64 root file system (the board's Python and `cryptography` wheel, emulated: a board's own time
   is not this), each beside the same interpreter doing nothing (`python -B -c pass`), so what
   verification costs is the difference;
4. `python -B -m runtime install` of the x86 bundle (unpack, verify, self-test, switch) into an empty
   root, a second install of a newer version, `rollback`, and `status`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk")]
import _results  # noqa: E402  (after the path above)

CACHE = ROOT / ".cache" / "bench-trust"
MODEL = ROOT / ".cache" / "models" / "ch_PP-OCRv4_rec_infer.onnx"


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _built(target: str) -> Path:
    out = CACHE / target
    if not (out / "bundle.tar.gz").exists():
        subprocess.run([str(ROOT / ".venv" / "bin" / "edgesdk"), "build", str(MODEL), "--input-shape", "x=1x3x48x320",
                        "--target", target, "-o", str(out), "--quiet"], check=True)
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def _run(cmd: list[str], env: dict | None = None, ok: tuple[int, ...] = (0,)) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode not in ok:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")


# run by the device's Python: the parts of verification timed inside one process, after the imports
_PARTS = """
import json, sys, time
from pathlib import Path
t0 = time.perf_counter()
from runtime import trust
from runtime.manifest import Manifest
t1 = time.perf_counter()
bundle, keys = Path(sys.argv[1]), trust.load_trust(Path(sys.argv[2]))
text, sig = trust.read_signed(bundle)
t2 = time.perf_counter()
trust.check_signature(text, sig, keys)
t3 = time.perf_counter()
manifest = Manifest.from_json(text)
t4 = time.perf_counter()
assert not trust.file_problems(bundle, manifest)
t5 = time.perf_counter()
print(json.dumps({"imports": t1 - t0, "signature": t3 - t2, "manifest": t4 - t3, "files": t5 - t4}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--qemu-runs", type=int, default=5)
    ap.add_argument("--install-runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=_results.path("trust"))
    args = ap.parse_args()

    from edgesdk.backends import qemu
    from edgesdk.bundling import signing
    from edgesdk.runtime import trust
    from edgesdk.verify import check_bundle, check_trust

    arm, x86 = _built("arm_2tpu"), _built("x86")
    work = Path(tempfile.mkdtemp(prefix="bench-trust-"))
    try:
        priv, pub, _ = signing.generate_keys(work / "keys", "bench")
        key, keys = signing.load_private_key(priv), trust.load_trust(pub)
        bundle = work / "arm" / "bundle"
        shutil.copytree(arm / "bundle", bundle)
        tar = work / "arm" / "bundle.tar.gz"
        signing.stamp(bundle, version=1, key=key, tarball=tar)
        manifest_bytes = (bundle / "manifest.json").read_bytes()
        # the device's trusted runtime (as its active slot holds it), never the bundle verifying itself
        trusted = work / "device"
        shutil.copytree(bundle / "runtime", trusted / "runtime")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env["PYTHONPATH"] = str(trusted)
        device = [sys.executable, "-B", "-m", "runtime", "verify", str(bundle), "--public-key", str(pub)]
        rootfs = qemu.find_rootfs()
        times: dict[str, list[float]] = {}

        def add(name: str, ms: float) -> None:
            times.setdefault(name, []).append(ms)

        for r in range(args.runs):  # interleaved: each round runs every variant once
            add("sign: stamp (hash check, manifest, signature, tarball)",
                _timed(lambda: signing.stamp(bundle, version=1, key=key, tarball=tar)))
            add("sign: ed25519 over the manifest alone", _timed(lambda: key.sign(manifest_bytes)))
            add("host verify: hashes only (unsigned check)", _timed(lambda: check_bundle(bundle, bundle)))
            add("host verify: signature + hashes + version", _timed(lambda: check_trust(bundle, bundle, keys,
                                                                                         installed_version=1)))
            add("device verify (process, this host)", _timed(lambda: _run(device, env)))
            add("python -B -c pass (process, this host)", _timed(lambda: _run([sys.executable, "-B", "-c", "pass"])))
            proc = subprocess.run([sys.executable, "-B", "-c", _PARTS, str(bundle), str(pub)], env=env,
                                  capture_output=True, text=True, check=True)
            for part, secs in json.loads(proc.stdout).items():
                add(f"device verify, in process, this host: {part}", secs * 1000)
            if rootfs is not None and r < args.qemu_runs:
                guest = lambda a: qemu.run_python(rootfs, a, cwd=work, env={"PYTHONPATH": str(trusted)}, timeout=600)
                t0 = time.perf_counter()
                proc = guest(["-B", "-m", "runtime", "verify", str(bundle), "--public-key", str(pub)])
                add("device verify (qemu-user aarch64, emulated)", (time.perf_counter() - t0) * 1000)
                assert proc.returncode == 0, proc.stderr
                add("python -B -c pass (qemu-user aarch64, emulated)", _timed(lambda: guest(["-B", "-c", "pass"])))
                proc = guest(["-B", "-c", _PARTS, str(bundle), str(pub)])
                assert proc.returncode == 0, proc.stderr
                for part, secs in json.loads(proc.stdout).items():
                    add(f"device verify, in process, qemu-user: {part}", secs * 1000)

        # install and rollback: the x86 bundle, versions 1 and 2
        versions = []
        for v in (1, 2):
            d = work / f"x86-v{v}"
            shutil.copytree(x86 / "bundle", d / "bundle")
            signing.stamp(d / "bundle", version=v, key=key, tarball=d / "bundle.tar.gz")
            versions.append(d)
        runtime_env = {**env, "PYTHONPATH": str(versions[0] / "bundle")}
        rt = [sys.executable, "-B", "-m", "runtime"]
        for r in range(args.install_runs):
            root = work / f"root{r}"
            (root / "trust").mkdir(parents=True)
            shutil.copy(pub, root / "trust")
            add("install: first (unpack, verify, self-test, switch)",
                _timed(lambda: _run(rt + ["install", str(versions[0] / "bundle.tar.gz"), "--root", str(root)], runtime_env)))
            add("install: a newer version beside it",
                _timed(lambda: _run(rt + ["install", str(versions[1] / "bundle.tar.gz"), "--root", str(root)], runtime_env)))
            add("rollback", _timed(lambda: _run(rt + ["rollback", "--root", str(root)], runtime_env)))
            add("status", _timed(lambda: _run(rt + ["status", "--root", str(root)], runtime_env)))
            add("python -B -c pass (process, this host) [install rounds]",
                _timed(lambda: _run([sys.executable, "-B", "-c", "pass"])))
        files = json.loads(manifest_bytes)["files"]
        result = {
            "host_cpu": _cpu(), "cores": os.cpu_count(), "python": platform.python_version(),
            "command": " ".join(["benchmarks/bench_trust.py", *sys.argv[1:]]),
            "arm_bundle": {"files": len(files), "bytes": sum(f["size"] for f in files.values()),
                           "tarball_bytes": tar.stat().st_size},
            "x86_bundle_tarball_bytes": (versions[0] / "bundle.tar.gz").stat().st_size,
            "runs": {k: len(v) for k, v in times.items()},
            "median_ms": {k: round(statistics.median(v), 2) for k, v in times.items()},
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _results.write("trust", result, table(result), out=args.out)
    print(table(result))


def table(result: dict) -> str:
    """Each step's median, beside how many runs it is the median of."""
    rows = ["| step | median ms | runs |", "|---|---:|---:|"]
    rows += [f"| {step} | {ms:g} | {result['runs'][step]} |" for step, ms in result["median_ms"].items()]
    return "\n".join(rows)


if __name__ == "__main__":
    main()
