"""backends/tvm/rewrites.py: integer powers as products in CUDA segments, so that NVRTC's fast math
(`powf` as exp2(y log2 x), NaN for negative x) never sees them. What it fixed was seen on an H200
(PP-OCRv4 rec: all-NaN); here, with no GPU, the tests check the rewrite's numbers against
onnxruntime and that the CUDA library TVM writes no longer calls `powf`."""

from __future__ import annotations

import re
import types

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from edgesdk.backends.tvm.rewrites import integer_powers_as_products
from edgesdk.backends.tvm.segment import compile_segment
from tests.passes.harness import model, ops

CUDA = {"kind": "cuda", "arch": "sm_86", "host": {"kind": "llvm", "mtriple": "x86_64-linux-gnu"}}


def layer_norm_as_ops() -> onnx.ModelProto:
    """Layer normalization as paddle2onnx writes it (PP-OCRv4 rec's SVTR neck), plus powers 3, 4 and
    0.5 and a Pow that is itself a graph output."""
    return model(
        [helper.make_node("ReduceMean", ["x"], ["mean"], axes=[-1], keepdims=1),
         helper.make_node("Sub", ["x", "mean"], ["centred"]),
         helper.make_node("Pow", ["centred", "two"], ["squared"]),
         helper.make_node("ReduceMean", ["squared"], ["variance"], axes=[-1], keepdims=1),
         helper.make_node("Add", ["variance", "eps"], ["v_eps"]),
         helper.make_node("Sqrt", ["v_eps"], ["std"]),
         helper.make_node("Div", ["centred", "std"], ["normed"]),
         helper.make_node("Pow", ["normed", "three"], ["cubed"]),
         helper.make_node("Pow", ["normed", "four"], ["fourth"]),
         helper.make_node("Abs", ["normed"], ["magnitude"]),
         helper.make_node("Pow", ["magnitude", "half"], ["root"]),
         helper.make_node("Sum", ["cubed", "fourth", "root"], ["y"])],
        {"x": (1, 40, 120)}, ["y", "squared"],
        {"two": np.float32(2.0), "three": np.float32(3.0),
         "four": np.float32(4.0), "half": np.float32(0.5), "eps": np.float32(1e-5)},
    )


def run(m: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def test_integer_powers_become_products_with_the_same_outputs():
    original = layer_norm_as_ops()
    rewritten, count = integer_powers_as_products(original)
    assert count == 3
    onnx.checker.check_model(rewritten, full_check=True)
    assert ops(rewritten)["Pow"] == 1  # the square root stays
    assert ops(rewritten)["Mul"] == ops(original).get("Mul", 0) + 1 + 2 + 2
    assert [o.name for o in rewritten.graph.output] == ["y", "squared"]
    x = np.random.default_rng(0).standard_normal((1, 40, 120)).astype(np.float32) * 3 - 1
    for got, want in zip(run(rewritten, x), run(original, x)):
        # products are correctly rounded, as pow is for these exponents: a few ulp of the output's scale
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_nothing_to_rewrite_returns_the_model_itself():
    plain = model([helper.make_node("Pow", ["x", "e"], ["y"])], {"x": (2, 3)}, ["y"], {"e": np.float32(2.5)})
    assert integer_powers_as_products(plain) == (plain, 0)


def test_cuda_segment_library_has_no_powf(tmp_path):
    """The TVM backend's CUDA segments go through the rewrite: the kernels TVM writes multiply.
    The same graph compiled for the GPU without it calls powf, so the check can fail."""
    logged = []
    job = types.SimpleNamespace(
        segment=types.SimpleNamespace(id="s0", nodes=["n"] * 12), model=layer_norm_as_ops(),
        device=types.SimpleNamespace(codegen=CUDA), segments_dir=tmp_path, tuning_db=tmp_path / "db",
        compressed=None, twin_dir=tmp_path / "twin", log=logged.append)
    compile_segment(job)
    assert powf_exponents(tmp_path / "s0.so") == {0.5}
    assert any("3 integer Pow as products" in line for line in logged), logged
    twin = (tmp_path / "twin" / "s0.so").read_bytes()  # the host twin, for golden data, is left as it was
    assert twin.count(b'extern "C" __global__') == 0

    from edgesdk.backends.tvm import compile_onnx

    compile_onnx(layer_norm_as_ops(), CUDA, tmp_path / "unrewritten.so")
    assert powf_exponents(tmp_path / "unrewritten.so") == {0.5, 2.0, 3.0, 4.0}


def powf_exponents(library) -> set[float]:
    """The constant exponents of the powf calls in a library's CUDA source (TVM writes hex floats)."""
    calls = re.findall(rb"powf\([^;]*?, (0x[0-9a-f.]+p[+-][0-9]+)f", library.read_bytes())
    return {float.fromhex(c.decode()) for c in calls}
