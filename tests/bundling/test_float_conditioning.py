"""A float bundle on a sample where the fp32 model is itself ill-conditioned: the package stage's float check
(`bundle._judge`) holds a bundle to the float tolerance only where fp32 can be held to it, measured per
held-out sample (`golden.conditioning`), and still refuses a wrong kernel, there and elsewhere.

The model is `sin(gain * x @ w)` over 4096 products of a photograph's pixels, compiled by TVM for this host:
at gain 1e4 a different summation order moves its argument by radians' hundredths, and fp32's own output
moves as much when its inputs move by a few roundings, as a random-weight LeViT's did on one held-out sample;
the same photograph scaled by 1e-4 keeps the argument small, where `sin` is as tame as its input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk.backends import onnxruntime as ort_backend
from edgesdk.backends import tvm as tvm_backend
from edgesdk.bundling import golden
from edgesdk.bundling.bundle import _judge
from edgesdk.compression import accuracy as measures
from edgesdk.errors import UserError
from edgesdk.report.text import accuracy_lines
from edgesdk.scheduling import selection
from tests.backends.test_tvm import HOST, run_library
from tests.bundling.test_accuracy_judge import _plan
from tests.model_zoo import photos

K = 4096  # products per output: long enough that TVM's order of summation is not onnxruntime's


def _sine(gain: float, w: np.ndarray) -> onnx.ModelProto:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["v"]), helper.make_node("Mul", ["v", "gain"], ["a"]),
             helper.make_node("Sin", ["a"], ["y"])]
    graph = helper.make_graph(nodes, "sine", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.float32(gain), "gain")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


WEIGHTS = (np.random.default_rng(0).standard_normal((K, 8)) / 64).astype(np.float32)


@pytest.fixture(scope="module")
def crops() -> list[dict]:
    """Eight crops of a photograph, 64 rows each, as four rows of 4096 pixels in [0, 1]: the first four as
    they are, the last four scaled by 1e-4."""
    grey = photos()[0][..., 0].astype(np.float32) / 255
    rows = [grey[r:r + 64, 100:356].reshape(4, K) for r in range(0, 440, 110)]
    return [{"x": x} for x in rows] + [{"x": (x * 1e-4).astype(np.float32)} for x in rows]


def _judged(model: onnx.ModelProto, compiled: onnx.ModelProto, samples: list[dict], tmp: Path) -> tuple[dict, list]:
    """`compiled` built by TVM for this host, run on `samples`, judged against `model` as the package stage
    judges a float bundle."""
    result = tvm_backend.compile_onnx(compiled, HOST, tmp / "y.so")
    got = [run_library(tmp / "y.so", result, s) for s in samples]
    ref = ort_backend.run_many(model, samples, ["y"])
    record = {"samples": len(samples), "tensors": golden.compared(got, ref, ["y"]),
              "parts": measures.measure(ref, got, measures.views(model))}
    lines: list[str] = []
    out = _judge(record, _plan(("cpu", "tvm")), lines.append,
                 conditioning=lambda: golden.conditioning(model, samples, ["y"]))
    return out, lines


def test_ill_conditioned_samples_hold_a_float_bundle_to_fp32s_own_spread(crops, tmp_path):
    model = _sine(1e4, WEIGHTS)
    out, lines = _judged(model, model, crops, tmp_path)
    y = out["tensors"]["y"]
    scale = y["max_abs_error"] / y["max_rel_error"]
    # the kernel is off by more than the float tolerance: the check before this one refused it
    assert y["max_rel_error"] > selection.TOLERANCE, y
    # the photograph's four crops are ill-conditioned, the scaled ones are not, and are within the tolerance
    assert y["ill_conditioned"]["samples"] == [0, 1, 2, 3], y["ill_conditioned"]
    assert max(y["sample_errors"][4:]) <= selection.TOLERANCE * scale
    assert all(e <= golden.CONDITION_MARGIN * m for e, m in zip(y["ill_conditioned"]["bundle_error"],
                                                                y["ill_conditioned"]["fp32_moves"]))
    assert any(line.startswith("package: y: fp32 itself moves by up to ") and "sample(s) 0, 1, 2, 3 of 8" in line
               for line in lines), lines
    # the build summary and `inspect` say so
    said = accuracy_lines(out)
    assert said[0].endswith("float throughout: judged within the float tolerance, but where fp32 itself is "
                            "ill-conditioned: there within 4x how far fp32 moves by itself"), said
    assert said[-1].startswith("y: fp32 ill-conditioned on held-out sample(s) 0, 1, 2, 3 (it moves by up to "), said


def test_a_wrong_kernel_is_still_refused_on_either_kind_of_sample(crops, tmp_path):
    """A kernel computing with weights 1 % off (as a wrong tuning record would): refused where fp32 is
    well-conditioned, and where it is not but the bundle moves more than fp32 itself does."""
    wrong = (WEIGHTS * 1.01).astype(np.float32)
    with pytest.raises(UserError) as err:
        _judged(_sine(1.0, WEIGHTS), _sine(1.0, wrong), crops, tmp_path)
    assert err.value.code == "package.float-mismatch"
    # only the photograph's crops, all ill-conditioned: the argument moved by 1 %, radians, not hundredths
    with pytest.raises(UserError) as err:
        _judged(_sine(1e4, WEIGHTS), _sine(1e4, wrong), crops[:4], tmp_path)
    assert err.value.code == "package.float-mismatch"
