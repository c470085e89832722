"""The `onnxruntime-int8` backend's quantizer (backends/onnxruntime/__init__.py:quantize_segment)."""

from __future__ import annotations

import numpy as np
import pytest

from edgesdk.backends import QuantizeJob
from edgesdk.backends import onnxruntime as ort_backend
from edgesdk.scheduling.plan import PlanSegment
from tests.backends.test_tflite_mixed import cancelling_model


@pytest.mark.parametrize("method", ["minmax", "percentile", "mse", "entropy", "auto"])
def test_quantizing_writes_nothing_on_stdout(method, tmp_path, capfd):
    """`edgesdk build --json` writes its data on stdout: onnxruntime's percentile calibration printed
    its progress there ("Collecting tensor data and making histogram ..."), which broke the JSON."""
    model = cancelling_model()
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.uniform(-1, 1, (1, 4, 8, 8)).astype(np.float32)} for _ in range(4)]
    samples = [{**f, **ort_backend.run(model, f, ["z"])} for f in feeds]
    seg = PlanSegment("s0", "cpu", "onnxruntime-int8", "segments/s0.onnx", tuple(n.name for n in model.graph.node),
                      ("x",), ("z",), 0.0, 0, 1.0)
    (tmp_path / "segments").mkdir()
    record = ort_backend.quantize_segment(QuantizeJob(segment=seg, model=model, samples=samples,
                                                      out_dir=tmp_path / "segments", method=method, percentile=99.99,
                                                      log=lambda line: None))
    assert (tmp_path / record["artifact"]).is_file()
    assert capfd.readouterr().out == ""
