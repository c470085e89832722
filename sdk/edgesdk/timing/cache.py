"""The timing cache: what an earlier build measured of each candidate, replayed by the next, so a rebuild
makes the same choice and the same bundle bytes.

One JSON object in one file (the tune stage's `timing.json`, beside the tuning database), written whole:
by key (a hex digest the caller computes from everything a candidate's time depends on), either
{"skipped": why} or {"ms": milliseconds, "gate": {cosine, top1, samples}, "mixed": {float_ops, ops, ...}}
("gate" and "mixed" for int8 candidates only).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import UserError
from ..runtime.files import NotRegularFile, open_regular, read_bounded, write_whole

# a timing cache holds well under a kilobyte per candidate measured: 64 MiB is far past any real one
CACHE_MAX_BYTES = 64 << 20
CACHE_HINT = ("the timing cache only saves measuring again: remove the file, or point --tuning-db at another "
              "directory; the next build measures the candidates anew")


class TimingCache:
    """Measured medians by key, in one JSON file written whole (temporary file, then rename).

    It replays what an earlier build measured, never what it checked: the tune stage checks the candidate
    it chooses on every build (`scheduling.selection`). A file that is not a regular file of at most
    `CACHE_MAX_BYTES`, not JSON, or holds an entry of another shape is refused (`tune.timing-cache`)."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[str, dict] = _read_cache(path)

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def put(self, key: str, entry: dict) -> None:
        self.entries[key] = entry
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.entries, indent=1, sort_keys=True) + "\n"
        # through a fresh temporary: the database may be a shared directory where a link was planted
        write_whole(self.path, lambda f: f.write(text.encode()))


def _read_cache(path: Path) -> dict[str, dict]:
    """The cache's entries: {} where the file does not exist. Opened without blocking (a FIFO planted as
    the file would wait for a writer for ever), then refused unless a regular file of a bounded size."""
    def refused(why: str) -> UserError:
        return UserError("tune.timing-cache", f"the timing cache {path}: {why}", hint=CACHE_HINT)

    try:
        with open_regular(path, CACHE_MAX_BYTES) as f:
            raw = read_bounded(f, CACHE_MAX_BYTES)
    except FileNotFoundError:
        return {}
    except NotRegularFile as e:
        raise refused(str(e)) from None
    except OSError as e:
        raise refused(f"cannot be read ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
        data = json.loads(text)
    except UnicodeDecodeError as e:
        raise refused(f"is not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise refused(f"is not valid JSON (line {e.lineno} column {e.colno}: {e.msg})") from None
    except RecursionError:
        raise refused("is not valid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise refused(f"holds a JSON {_json_kind(data)}, not an object of entries")
    for key, entry in data.items():
        why = entry_problem(entry)
        if why is not None:
            at = text.find(json.dumps(key))
            line = f"line {text[:at].count(chr(10)) + 1}: " if at >= 0 else ""
            name = key if len(key) <= 20 else key[:16] + "..."
            raise refused(f"{line}entry {name!r}: {why}")
    return data


def _json_kind(x) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(
        type(x), "null")


def _finite(x, low: float = -math.inf, high: float = math.inf) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and low <= x <= high


def entry_problem(entry) -> str | None:
    """Why a timing cache entry is not one `TimingCache.put` writes (None where it is):
    {"skipped": why} or {"ms": milliseconds, "spread": its rounds' spread, "rounds": how many where more than
    the usual (a close lead settled), "gate": ..., "mixed": ...}."""
    if not isinstance(entry, dict):
        return f"is a JSON {_json_kind(entry)}, not an object"
    if "skipped" in entry:
        if set(entry) != {"skipped"} or not isinstance(entry["skipped"], str):
            return "a skipped candidate's entry holds its reason (text) alone"
        return None
    unknown = sorted(set(entry) - {"ms", "spread", "rounds", "gate", "mixed"})
    if unknown:
        return f"unknown key {unknown[0]!r}"
    if "ms" not in entry:
        return "no 'ms' (the measured milliseconds) and no 'skipped'"
    if not _finite(entry["ms"], 0.0) or entry["ms"] <= 0:
        return f"'ms' is {json.dumps(entry['ms'])}, not a finite positive number of milliseconds"
    if "spread" in entry and not _finite(entry["spread"], 0.0):
        return f"'spread' is {json.dumps(entry['spread'])}, not a finite share of at least 0"
    if "rounds" in entry and (not _count(entry["rounds"]) or entry["rounds"] < 1):
        return f"'rounds' is {json.dumps(entry['rounds'])}, not a count of at least 1"
    gate = entry.get("gate")
    if gate is not None:
        if not isinstance(gate, dict) or set(gate) != {"cosine", "top1", "samples"}:
            return "'gate' is not an object of cosine, top1 and samples"
        if not _finite(gate["cosine"], -1.0, 1.0):
            return f"'gate.cosine' is {json.dumps(gate['cosine'])}, not a number in [-1, 1]"
        if gate["top1"] is not None and not _finite(gate["top1"], 0.0, 1.0):
            return f"'gate.top1' is {json.dumps(gate['top1'])}, not null or a number in [0, 1]"
        if not _count(gate["samples"]):
            return f"'gate.samples' is {json.dumps(gate['samples'])}, not a count"
    mixed = entry.get("mixed")
    if mixed is not None:
        figures = ("calibration_cosine", "calibration_top1")  # what the search reached, where it searched
        if (not isinstance(mixed, dict) or set(mixed) - {"float_ops", "ops", *figures}
                or not _count(mixed.get("ops")) or not isinstance(mixed.get("float_ops"), list)
                or not all(isinstance(f, str) for f in mixed["float_ops"])
                or any(mixed.get(k) is not None and not _finite(mixed[k]) for k in figures)):
            return "'mixed' is not an object of float_ops (op names) and ops (a count)"
    return None


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
