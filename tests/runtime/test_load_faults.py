"""Load and faults at run time, the short forms that run in `make test`
(the long forms are `benchmarks/bench_load.py`):

- 8 concurrent callers on a real model (the x86 PP-OCR classifier), each with its own inputs: every
  result equals the single-threaded one for that input, so none was delivered to another caller;
- a stream of 1,000 frames: in order, each equal to `run()` of its frame;
- a segment that raises on one caller's input: that caller gets the error, the others their results;
- an Edge TPU that stops answering mid-stream (a TEST DOUBLE of the device: the delegate's invoke
  raises from the 4th call on, as LiteRT does when libedgetpu loses the USB device): the frames go on
  on the CPU model, none lost or reordered, one warning.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from edgesdk.runtime import BundleModel
from tests.runtime.test_stream import bundle  # noqa: F401  (the four-segment onnxruntime bundle, a fixture)
from tests.test_interrupted_build import tiny_model

# 8 x 30 calls interleave the callers hundreds of times over (each call is milliseconds); the
# long forms (thousands of calls, a 30-minute soak) are bench_load.py's
CALLERS, CALLS, STREAM_FRAMES = 8, 30, 1000


def _inputs(model: BundleModel, count: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{t.name: rng.standard_normal(t.shape).astype(t.dtype) for t in model.inputs} for _ in range(count)]


@pytest.fixture(scope="module")
def loaded(x86_ppocr):
    model = BundleModel(x86_ppocr.bundle, log=lambda s: None)
    feeds = _inputs(model, 2 * CALLERS)
    expected = [model.run(f) for f in feeds]  # single-threaded, one at a time
    yield model, feeds, expected
    model.close()


def _equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in b)


def test_concurrent_callers_each_get_their_own_results(loaded):
    model, feeds, expected = loaded
    wrong: list[tuple[int, int]] = []
    done = [0] * CALLERS
    start = threading.Barrier(CALLERS)

    def caller(i: int) -> None:
        start.wait()
        for j in range(CALLS):
            k = i + CALLERS * (j % 2)  # each caller's own two inputs, alternately
            if not _equal(model.run(feeds[k]), expected[k]):
                wrong.append((i, j))
            done[i] += 1

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(CALLERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert done == [CALLS] * CALLERS and wrong == []


def test_a_long_stream_comes_out_in_order(loaded):
    model, feeds, expected = loaded
    got = 0
    for f, out in enumerate(model.stream(feeds[f % len(feeds)] for f in range(STREAM_FRAMES))):
        assert _equal(out, expected[f % len(feeds)]), f"frame {f}"
        got += 1
    assert got == STREAM_FRAMES


def test_an_error_on_one_callers_input_reaches_that_caller_only(bundle):  # noqa: F811
    model = BundleModel(bundle, log=lambda s: None)
    seg, runner = model.runners[1]
    poisoned = 3.0

    def fails_on_one_input(feeds, _run=runner.run):
        if feeds["a"][0, 0] == poisoned + 1:  # s0 adds 1
            raise RuntimeError(f"segment {seg.id} failed on this input")
        return _run(feeds)

    runner.run = fails_on_one_input
    inputs = [{"x": np.full((1, 4), float(i), np.float32)} for i in range(CALLERS)]
    results: dict[int, object] = {}

    def caller(i: int) -> None:
        try:
            results[i] = model.run(inputs[i])
        except RuntimeError as e:
            results[i] = e

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(CALLERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(results[int(poisoned)], RuntimeError)
    for i in range(CALLERS):
        if i != int(poisoned):  # y = relu((x + 1) * 2) + x
            np.testing.assert_array_equal(results[i]["y"], np.maximum((inputs[i]["x"] + 1) * 2, 0) + inputs[i]["x"])


class VanishingEdgeTpu:
    """TEST DOUBLE of an Edge TPU's delegate that is unplugged after `calls` invokes: it runs the real
    signature runner until then, and raises as LiteRT does when libedgetpu loses the device."""

    def __init__(self, runner, calls: int):
        self.runner, self.left = runner, calls

    def __call__(self, **args):
        if self.left == 0:
            raise RuntimeError("Failed to invoke: Edge TPU: USB transfer error (device gone)")
        self.left -= 1
        return self.runner(**args)

    def __getattr__(self, name):
        return getattr(self.runner, name)


@pytest.fixture(scope="module")
def litert_bundle(tmp_path_factory):
    """A one-convolution model whose segment runs on LiteRT (the TFLite runner the Edge TPU uses)."""
    from tests.conftest import _build

    d = tmp_path_factory.mktemp("litert")
    return _build(d / "out", tiny_model(d / "m.onnx", 7), "x86", tuning_db=d / "db", cpu_backends=("litert",)).bundle


def test_an_edge_tpu_that_vanishes_mid_stream_falls_back_to_the_cpu(litert_bundle, capfd):
    model = BundleModel(litert_bundle, log=lambda s: None)
    seg, runner = model.runners[0]
    assert seg.backend == "tflite"
    reference = BundleModel(litert_bundle, log=lambda s: None)
    feeds = _inputs(model, 12, seed=1)
    expected = [reference.run(f) for f in feeds]
    # as if the segment ran on an Edge TPU with its int8 model as fallback (here the same CPU model)
    runner._shared.fallback = litert_bundle / seg.artifact
    runner._shared.runner = VanishingEdgeTpu(runner._shared.runner, calls=3)
    out = list(model.stream(iter(feeds), depth=3))
    assert len(out) == len(feeds) and all(_equal(o, e) for o, e in zip(out, expected))
    err = capfd.readouterr().err
    assert err.count("runtime: warning:") == 1 and "stopped answering (Failed to invoke: Edge TPU: USB transfer" in err
    assert "runs its int8 model on the CPU from now on" in runner.note
    assert not isinstance(runner._shared.runner, VanishingEdgeTpu)  # the device is no longer called
    assert _equal(model.run(feeds[0]), expected[0]) and capfd.readouterr().err == ""  # said once
