"""The reference pages that restate facts of the repository stay true to it: every relative link and every
module path they name exists, and docs/cost-figures.md gives each figure the value and unit of its target file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("docs/platform-notes.md", "docs/cost-figures.md")
# paths a page names that are made by a run, not committed (or, for parallel.json, named as a source states it)
NOT_COMMITTED = {"target.json", ".cache/bench-parallel/x86_host.yaml", "benchmarks/parallel.json"}
_PATH = re.compile(r"\.(py|sh|txt|md|yaml|json)$|/$|^Makefile$")


def _anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve(page):
    path = ROOT / page
    text = path.read_text()
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}
    broken = []
    for link in re.findall(r"\]\(([^)]+)\)", text):
        if link.startswith(("http://", "https://")):
            continue
        file, _, fragment = link.partition("#")
        if file and not (path.parent / file).exists() or not file and fragment not in anchors:
            broken.append(link)
    assert not broken, f"{page}: broken links {broken}"


@pytest.mark.parametrize("page", PAGES)
def test_named_paths_exist(page):
    named = {t.rstrip(":,") for t in re.findall(r"`([^`\s]+)`", (ROOT / page).read_text()) if _PATH.search(t)}
    missing = sorted(t for t in named - NOT_COMMITTED
                     if not (ROOT / t).exists() and not (ROOT / "sdk" / "edgesdk" / t).exists())
    assert not missing, f"{page} names paths that do not exist (under the repository or sdk/edgesdk/): {missing}"


def _stated_figures() -> list[tuple[str, str, str, float, str]]:
    """(target, device kind, figure path, value, unit) of each row of the cost-figures tables."""
    rows, target, kind = [], None, "cpu"
    for line in (ROOT / "docs" / "cost-figures.md").read_text().splitlines():
        if m := re.match(r"## targets/(\w+)\.yaml", line):
            target, kind = m.group(1), "cpu"
        elif m := re.search(r"\(`kind: (\w+)`\):$", line):
            kind = m.group(1)
        elif target and (m := re.match(r"\| `([\w.]+)`[^|]* \| ([\d.]+) (\S+) \|", line)):
            rows.append((target, kind, m.group(1), float(m.group(2)), m.group(3)))
    return rows


def test_cost_figures_match_the_target_files():
    rows = _stated_figures()
    assert {r[0] for r in rows} == {p.stem for p in (ROOT / "targets").glob("*.yaml")}
    for target, kind, figure, value, unit in rows:
        device = next(d for d in yaml.safe_load((ROOT / "targets" / f"{target}.yaml").read_text())["devices"]
                      if d["kind"] == kind)
        entry = device
        for key in figure.split("."):
            entry = entry[key]
        assert (entry["value"], entry["unit"]) == (value, unit), f"{target} {kind} {figure}"
    listed = {(target, kind, figure) for target, kind, figure, *_ in rows}
    for path in (ROOT / "targets").glob("*.yaml"):
        for device in yaml.safe_load(path.read_text())["devices"]:
            for figure in _figures(device):
                assert (path.stem, device["kind"], figure) in listed, f"docs/cost-figures.md lacks {path.name} {figure}"


def _figures(entry: dict, prefix: str = "") -> list[str]:
    """The dotted paths of every FIGURE ({value, unit, source}) inside a target file's device entry."""
    if {"value", "unit", "source"} <= entry.keys():
        return [prefix.rstrip(".")]
    return [f for k, v in entry.items() if isinstance(v, dict) for f in _figures(v, f"{prefix}{k}.")]
