"""The committed benchmarks/RESULTS.md is what benchmarks/report.py renders from the committed results files (so
the two never drift), and every results file says where its figures come from: host, commit and command."""

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.append(str(BENCHMARKS))

import report  # noqa: E402  (after the path above)
from questions import QUESTIONS  # noqa: E402

RESULTS = sorted((BENCHMARKS / "results").glob("*.json"))


def test_results_md_is_the_rendered_results():
    assert (BENCHMARKS / "RESULTS.md").read_text() == report.render(), (
        "benchmarks/RESULTS.md differs from what benchmarks/report.py renders: run `make results`")


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.stem)
def test_results_file_names_host_commit_and_command(path):
    r = json.loads(path.read_text())
    assert r["question"] == path.stem
    assert r["question"] in QUESTIONS, "a results file of no question in benchmarks/questions.py"
    assert r["host"]["cpu"].strip()
    assert len(r["commit"]) >= 7 and all(c in "0123456789abcdef" for c in r["commit"])
    assert r["command"].strip()
    assert r["date"]
    columns = r["table"]["columns"]
    assert columns and r["table"]["rows"]
    assert all(len(row) == len(columns) for row in r["table"]["rows"])


def test_every_question_has_its_script_and_results():
    for name, q in QUESTIONS.items():
        assert (BENCHMARKS / q.script).exists(), f"{name}: no benchmarks/{q.script}"
        assert (BENCHMARKS / "results" / f"{name}.json").exists(), f"{name}: no results file"
