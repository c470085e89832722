"""bench_zoo's GPU self-tests, run on a GPU host (benchmarks/gpu/zoo_selftest.sh), go into the zoo's rtx3090 rows
only for the very bundle each row built (by its archive's sha256); the table marks them apart."""

from __future__ import annotations

import json
import sys

import pytest

from tests.model_zoo import ROOT

sys.path[:0] = [str(ROOT / "benchmarks")]
import _results  # noqa: E402  (after the path above)
import bench_zoo  # noqa: E402


def _row(model: str, sha: str) -> dict:
    return {"model": model, "family": "wheel", "target": "rtx3090", "outcome": "ok", "verified": True, "build_s": 1.0,
            "bundle_sha256": sha}


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(_results, "RESULTS", tmp_path)
    bench_zoo._write([_row("ppocr-cls", "aa"), _row("silero-vad", "bb"), _row("yolov8n", "cc"), _row("blazeface", "dd")],
                     {}, 1, "test")
    return tmp_path


def test_a_gpu_self_test_goes_into_the_row_of_the_bundle_it_ran(results, capsys):
    lines = [{"model": "ppocr-cls", "bundle_sha256": "aa", "gpu": "NVIDIA H200, 9.0, 580", "rc": 0, "seconds": 9,
              "passed": True, "outputs": {"y": True}},
             {"model": "yolov8n", "bundle_sha256": "cc", "gpu": "NVIDIA H200, 9.0, 580", "rc": 1, "seconds": 4,
              "passed": False, "error": "RuntimeError: CUDA_ERROR_INVALID_PTX"},
             {"model": "silero-vad", "bundle_sha256": "another build", "gpu": "NVIDIA H200, 9.0, 580", "rc": 0,
              "seconds": 2, "passed": True},
             {"model": "blazeface", "bundle_sha256": "dd", "gpu": "NVIDIA H200, 9.0, 580", "rc": 125, "seconds": 0,
              "passed": None, "not_run": "not run: this host lacks openvino"}]
    (results / "gpu.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert bench_zoo._gpu_selftests([results / "gpu.jsonl"]) == 1  # one result was for another build
    assert "silero-vad" in capsys.readouterr().err
    written = json.loads((results / "zoo.json").read_text())
    rows = {r["model"]: r for r in written["data"]["rows"]}
    assert rows["ppocr-cls"]["gpu_selftest"]["passed"] is True and rows["ppocr-cls"]["outcome"] == "ok"
    assert rows["yolov8n"]["verified"] is False and rows["yolov8n"]["outcome"] == "verify failed"
    assert "CUDA_ERROR_INVALID_PTX" in rows["yolov8n"]["verify_error"]
    assert "gpu_selftest" not in rows["silero-vad"] and rows["silero-vad"]["verified"] is True
    # not run for want of a runtime on the GPU host: said, and the row's verdict stands
    assert rows["blazeface"]["gpu_selftest"]["not_run"] and rows["blazeface"]["outcome"] == "ok"
    column = written["table"]["columns"].index("rtx3090")
    cells = {r[1]: r[column] for r in written["table"]["rows"]}
    assert cells["ppocr-cls"].startswith("✔ GPU") and cells["yolov8n"].startswith("✘ verify failed")
    assert cells["silero-vad"].startswith("✔ ") and not cells["silero-vad"].startswith("✔ GPU")
    assert any(n.startswith("rtx3090 self-test on a GPU (NVIDIA H200, 9.0, 580;") and "2 of 4 bundles run there" in n
               and "1 passed; failed: yolov8n; not run there: blazeface (not run: this host lacks openvino)" in n
               for n in written["notes"]), written["notes"]
    assert cells["blazeface"].startswith("✔ ") and not cells["blazeface"].startswith("✔ GPU")
