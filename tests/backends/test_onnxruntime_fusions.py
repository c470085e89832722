"""backends/onnxruntime/fusions.py: tf2onnx's Keras exact GELU as onnxruntime's Gelu, in the onnxruntime
backend's segments; and what the import stage and the backend make of a Keras transformer encoder."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from edgesdk.backends.onnxruntime.fusions import fuse
from tests import model_zoo
from tests.backends.test_onnxruntime_nchwc import compiled_whole, imported, reorders
from tests.passes.harness import model, ops

# the fused kernel evaluates the same function in another order (1 + erf(z) for 1 - erf(-z)): a few
# ulp of the values involved, against each output's scale
TOLERANCE = 1e-5


def run(m: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # our rewrite alone
    session = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def assert_agrees(got: np.ndarray, want: np.ndarray) -> None:
    assert np.abs(got - want).max() <= TOLERANCE * np.abs(want).max()


def keras_gelu(rsqrt2: float = 0.70710677) -> onnx.ModelProto:
    """0.5 * x * (1 - Erf(Neg(x) * 1/sqrt 2)): tf2onnx's Keras exact GELU (0.5 x erfc(-x / sqrt 2))."""
    nodes = [helper.make_node("Mul", ["half", "x"], ["h"]), helper.make_node("Neg", ["x"], ["n"]),
             helper.make_node("Mul", ["n", "k"], ["z"]), helper.make_node("Erf", ["z"], ["e"]),
             helper.make_node("Sub", ["one", "e"], ["t"]), helper.make_node("Mul", ["h", "t"], ["y"])]
    return model(nodes, {"x": [1, 5, 8]}, ["y"], {"half": np.float32(0.5), "one": np.float32(1.0),
                                                  "k": np.float32(rsqrt2)})


def test_keras_gelu_becomes_onnxruntimes_gelu():
    m = keras_gelu()
    out, fused = fuse(m)
    assert fused == {"Gelu": 1}
    assert [(n.op_type, n.domain) for n in out.graph.node] == [("Gelu", "com.microsoft")]
    assert {o.domain: o.version for o in out.opset_import}.get("com.microsoft") == 1
    x = np.random.default_rng(2).normal(0, 3, (1, 5, 8)).astype(np.float32)
    assert_agrees(run(out, x), run(m, x))


def test_a_gelu_with_another_constant_is_left_alone():
    """x * 0.7 is not x / sqrt 2: that would be another function."""
    out, fused = fuse(keras_gelu(0.7))
    assert fused == {} and ops(out)["Erf"] == 1


def test_a_keras_encoder_compiles_fused_for_onnxruntime(tmp_path):
    """A Keras transformer encoder layer (random weights) through the import stage and the onnxruntime
    backend: the attention's transpose pairs around unit-axis reshapes became one transpose each at
    import, the GELU is onnxruntime's Gelu in the artifact, onnxruntime's own optimizer has no Erf left,
    and the outputs agree with the unfused graph's."""
    m, record = imported(model_zoo.keras_encoder())
    assert record["rules"]["transpose-through-unit-reshape"] == 2  # the key's and the value's pairs
    shipped, lines = compiled_whole(m, tmp_path)
    assert ops(shipped)["Gelu"] == 1 and "Erf" not in ops(shipped), ops(shipped)
    assert any("Gelu x1" in line for line in lines), lines
    assert "Erf" not in reorders(shipped) and "Erf" in reorders(m)  # onnxruntime alone does not fuse it
    x = np.random.default_rng(3).normal(0, 1, (1, 16, 32)).astype(np.float32)
    assert_agrees(run(shipped, x), run(m, x))
