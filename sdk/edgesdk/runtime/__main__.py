"""The bundle's runtime on the device, without the SDK. Run it with -B from a bundle directory (or with
the bundle on PYTHONPATH): compiled files written into a bundle are files its manifest does not list,
and verification refuses a bundle that holds any.

  python -B -m runtime selftest [--json]          the golden self-test of this bundle
  python -B -m runtime run IN.npz OUT.npz [--allow-nonfinite]
                                                  run this bundle on IN's arrays, writing OUT.npz (that name)
  python -B -m runtime bench [BUNDLE] [--runs N] [--callers 1,2,4] [--depth 1,3] [--json]
                                                  latency percentiles, concurrent callers, the stream, segments

A bundle never checks itself: verify and install check ANOTHER bundle, and are run by a runtime the
device already trusts (the active slot's, or one its image installs), from outside the bundle checked:

  cd / && PYTHONPATH=ROOT/slots/<active> python3 -B -m runtime verify BUNDLE --root ROOT [--allow-downgrade]
                                                  signature, files and version of BUNDLE (or --public-key
                                                  PUB | --trust DIR instead of ROOT's trust/)
  cd / && PYTHONPATH=ROOT/slots/<active> python3 -B -m runtime install BUNDLE.tar.gz --root ROOT
                                                  unpack, verify, self-test in the free slot, then switch
  python -B -m runtime rollback --root ROOT       make the previous slot active again
  python -B -m runtime status --root ROOT [--json]  which slot is active, with what

The key always comes from the device: --public-key, --trust, or ROOT/trust/ (docs/trust.md, "Who verifies
a bundle on a device").

Exit codes: 0 ok, 1 a failed self-test, a damaged or untrusted bundle or an input the model refuses,
2 a wrong invocation (a runtime asked to verify its own bundle too) or an unusable key.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # the bundle this runtime ships in
MAX_INPUT_BYTES = 4 << 30  # `run IN`: a model's inputs, with room; past this it is not an input file


def _why(e: BaseException) -> str:
    return (e.strerror if isinstance(e, OSError) and e.strerror else str(e)) or type(e).__name__


def _verify(args: argparse.Namespace) -> int:
    bundle = Path(args.bundle)
    if _same_directory(bundle, HERE):
        # A tampered bundle's runtime would pass its own files: only code trusted beforehand may judge it.
        print(f"error: {bundle} is the bundle this runtime was loaded from: a bundle cannot vouch for itself "
              "(its own, unchecked code would check it)", file=sys.stderr)
        print(f"hint: verify it with the runtime the device already trusts, from outside the bundle: cd / && "
              f"PYTHONPATH=ROOT/slots/<active> python3 -B -m runtime verify {bundle.resolve()} --root ROOT "
              "(or `edgesdk verify BUNDLE --public-key PUB` on a host)", file=sys.stderr)
        return 2
    from .trust import load_trust, verify_bundle

    keys_from = args.public_key or args.trust or (Path(args.root) / "trust" if args.root else None)
    if keys_from is None:
        print("error: no key to verify with: give --public-key PUB, --trust DIR or --root ROOT (its trust/)",
              file=sys.stderr)
        return 2
    installed = floor = phrase = None
    if args.root:
        from .install import InstallError, floor_phrase, read_state

        try:
            state = read_state(Path(args.root))
        except InstallError as e:
            print(f"error: {e}", file=sys.stderr)
            print(f"hint: {e.hint}", file=sys.stderr)
            return e.exit_code
        # the root's floor, the newest version it ever installed, not the active one: a rollback lowers
        # what runs, never what a new bundle must reach
        floor, phrase = state["floor"], floor_phrase(state)
        installed = state["slots"][state["active"]]["bundle_version"] if state["active"] else None
    result = verify_bundle(bundle, load_trust(Path(keys_from)), installed_version=floor,
                           allow_downgrade=args.allow_downgrade, floor=phrase)
    m = result.manifest
    for note in result.notes:
        print(f"note: {note}")
    shown = "" if installed is None else f" (installed: {installed}" + (f"; floor: {floor}" if phrase else "") + ")"
    print(f"verified: {bundle}: signed by key {result.key.key_id} ({result.key.path.name}), {len(m.files)} files "
          f"match, bundle version {m.bundle_version}{shown}")
    return 0


def _same_directory(a: Path, b: Path) -> bool:
    try:
        return a.is_dir() and b.is_dir() and a.samefile(b)
    except OSError:
        return False


def _bench(args: argparse.Namespace) -> int:
    from .bench import main  # numpy and the executor, loaded only for the commands that run the model

    return main(args)


def _counts(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers joined by ',' (e.g. 1,2,4)")
    return values


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -B -m runtime", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("selftest", help="the golden self-test of this bundle")
    s.add_argument("bundle", nargs="?")
    s.add_argument("--json", action="store_true")
    r = sub.add_parser("run", help="run this bundle on IN.npz's arrays, writing OUT.npz")
    r.add_argument("inputs")
    r.add_argument("outputs")
    r.add_argument("--allow-nonfinite", action="store_true", help="run inputs that hold NaN or inf")
    v = sub.add_parser("verify", help="check another bundle's signature, files and version against the device's keys")
    v.add_argument("bundle", help="a bundle directory, never the one this runtime was loaded from: run the "
                   "device's trusted runtime (the active slot's) from outside the bundle")
    keys = v.add_mutually_exclusive_group()
    keys.add_argument("--public-key", help="an ed25519 public key file (NAME.pub)")
    keys.add_argument("--trust", help="a directory of public keys (*.pub): any of them may sign")
    v.add_argument("--root", help="an install root: its trust/ keys, and as the floor the newest version it ever "
                   "installed")
    v.add_argument("--allow-downgrade", action="store_true", help="accept a bundle older than the installed one")
    v.set_defaults(handler=_verify)
    b = sub.add_parser("bench", help="latency percentiles, concurrent callers, the pipelined stream, each segment")
    b.add_argument("bundle", nargs="?", help="a bundle directory (default: the one this runtime ships in)")
    b.add_argument("--runs", type=_positive, default=100, help="timed run() calls (default 100)")
    b.add_argument("--warmup", type=int, default=10, help="untimed calls first (default 10)")
    b.add_argument("--callers", type=_counts, default=[1, 2, 4], help="concurrent callers to try (default 1,2,4)")
    b.add_argument("--depth", type=_counts, help="stream depths to try (default 1 and the devices + 1)")
    b.add_argument("--frames", type=_positive, help="frames per stream (default from --runs)")
    b.add_argument("--json", action="store_true", help="one JSON object on stdout")
    b.add_argument("--quiet", action="store_true", help="no progress on stderr")
    b.set_defaults(handler=_bench)
    try:
        from .install import add_commands
    except ImportError:  # a runtime without the installer (never in a bundle: the module ships with it)
        pass
    else:
        add_commands(sub)
    return p


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    args = _parser().parse_args(argv)  # a wrong invocation exits 2 with argparse's message
    from .trust import KeyFileError, TrustError

    try:
        if args.command == "selftest":
            from .selftest import main

            return main(([args.bundle] if args.bundle else []) + (["--json"] if args.json else []))
        if args.command == "run":
            import zipfile

            from .files import open_regular
            from .output_file import refusal, write_whole

            out = Path(args.outputs)
            if why := refusal(out, (".npz",)):  # checked before the model runs
                print(f"error: {out}: {why}", file=sys.stderr)
                return 2
            import numpy as np

            from .executor import BundleModel

            model = BundleModel(HERE)
            try:  # IN may be a FIFO or a damaged archive: refused without waiting, named
                with open_regular(args.inputs, MAX_INPUT_BYTES) as f, np.load(f) as feeds:
                    feeds = dict(feeds)
            except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
                print(f"error: {args.inputs}: {_why(e)}", file=sys.stderr)
                return 1
            outputs = model.run(feeds, allow_nonfinite=args.allow_nonfinite)
            write_whole(out, lambda f: np.savez(f, **outputs))
            return 0
        return args.handler(args)
    except KeyFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrustError as e:
        print(f"error: not trusted: {e}", file=sys.stderr)
        for note in e.notes[1:20]:
            print(f"  {note}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:  # a malformed manifest, a missing file, an input the model refuses
        print(f"error: {e}", file=sys.stderr)
        return 1


sys.exit(_main(sys.argv[1:]))
