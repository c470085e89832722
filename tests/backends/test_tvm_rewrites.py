"""backends/tvm/rewrites.py: integer powers as products in CUDA segments, so that NVRTC's fast math
(`powf` as exp2(y log2 x), NaN for negative x) never sees them (seen on an H200: PP-OCRv4 rec all
NaN; here, with no GPU, the rewrite's numbers are checked against onnxruntime and the CUDA library
TVM writes no longer calls `powf`); and, on x86, convolutions whose output rows have a prime width
computed one wider row and sliced back, so the default schedule blocks their pixels in registers."""

from __future__ import annotations

import re
import types

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from edgesdk.backends.tvm.rewrites import _wider, integer_powers_as_products, narrow_rows_widened
from edgesdk.backends.tvm.segment import compile_segment
from tests.numeric import assert_close
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


def test_cuda_segment_library_has_no_powf(tmp_path, monkeypatch):
    """The TVM backend's CUDA segments go through the rewrite (in `_rewritten`, which tuning's task
    extraction shares): the kernels TVM writes multiply. The same graph compiled for the GPU without it
    calls powf, so the check can fail."""
    logged = []
    job = types.SimpleNamespace(
        segment=types.SimpleNamespace(id="s0", nodes=["n"] * 12), model=layer_norm_as_ops(),
        device=types.SimpleNamespace(codegen=CUDA), segments_dir=tmp_path, tuning_db=tmp_path / "db",
        compressed=None, twin_dir=tmp_path / "twin", log=logged.append, keep_kernel_times=False)
    compile_segment(job)
    assert powf_exponents(tmp_path / "s0.so") == {0.5}
    assert any("rewritten for TVM: integer Pow as products (NVRTC's fast math: powf is NaN below 0) x3" in line
               for line in logged), logged
    twin = (tmp_path / "twin" / "s0.so").read_bytes()  # the host twin, for golden data, is left as it was
    assert twin.count(b'extern "C" __global__') == 0

    from edgesdk.backends.tvm import compile as tvm_compile
    from edgesdk.backends.tvm import lowering

    monkeypatch.setattr(lowering, "integer_powers_as_products", lambda m: (m, 0))
    tvm_compile.compile_onnx(layer_norm_as_ops(), CUDA, tmp_path / "unrewritten.so")
    assert powf_exponents(tmp_path / "unrewritten.so") == {0.5, 2.0, 3.0, 4.0}


def powf_exponents(library) -> set[float]:
    """The constant exponents of the powf calls in a library's CUDA source (TVM writes hex floats)."""
    calls = re.findall(rb"powf\([^;]*?, (0x[0-9a-f.]+p[+-][0-9]+)f", library.read_bytes())
    return {float.fromhex(c.decode()) for c in calls}


# --- narrow rows -----------------------------------------------------------------------------------


def test_a_pad_folds_into_its_conv_without_its_weights_serialized(weights_never_handed_over):
    """On x86 a zero Pad before a Conv becomes the Conv's own padding (`_fold_pads_into_convs`); the shape
    inference the rule needs sees the model without its weights, as every shape inference of a segment does."""
    from edgesdk.backends.tvm.lowering import _fold_pads_into_convs

    rng = np.random.default_rng(3)
    original = model([helper.make_node("Pad", ["x", "pads"], ["p"]), helper.make_node("Conv", ["p", "w"], ["y"])],
                     {"x": (1, 32, 8, 8)}, ["y"],
                     {"pads": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64),
                      "w": rng.standard_normal((64, 32, 3, 3)).astype(np.float32)})  # 72 KiB: a weight
    folded = _fold_pads_into_convs(original)
    assert ops(folded) == {"Conv": 1}
    assert not weights_never_handed_over, weights_never_handed_over
    x = rng.standard_normal((1, 32, 8, 8)).astype(np.float32)
    assert_close(run(folded, x)[0], run(original, x)[0], "y")


def prime_width_convs() -> onnx.ModelProto:
    """Two convolutions with output widths 17 (a valid 3x3 on 19) and 9 (stride 2, padded), and one of
    width 8 that needs nothing; biases, a Relu between."""
    rng = np.random.default_rng(0)
    return model(
        [helper.make_node("Conv", ["x", "w1"], ["c1"], name="valid"),
         helper.make_node("Relu", ["c1"], ["r1"]),
         helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], strides=[2, 2], pads=[1, 1, 1, 1], name="strided"),
         helper.make_node("Conv", ["c2", "w3"], ["y"], kernel_shape=[2, 2], name="fine")],
        {"x": (1, 8, 19, 19)}, ["y"],
        {"w1": rng.standard_normal((16, 8, 3, 3)).astype(np.float32),
         "w2": rng.standard_normal((12, 16, 3, 3)).astype(np.float32),
         "b2": rng.standard_normal(12).astype(np.float32),
         "w3": rng.standard_normal((4, 12, 2, 2)).astype(np.float32)})


def test_prime_width_rows_are_computed_wider_and_sliced_back_exactly():
    original = prime_width_convs()
    widened, count = narrow_rows_widened(original, 8)
    assert count == 2
    onnx.checker.check_model(widened, full_check=True)
    pads = {n.name: list(next(a.ints for a in n.attribute if a.name == "pads")) for n in widened.graph.node
            if n.op_type == "Conv" and any(a.name == "pads" for a in n.attribute)}
    assert pads == {"valid": [0, 0, 0, 1], "strided": [1, 1, 1, 3]}  # 17 -> 18 columns; 9 -> 10 at stride 2
    assert ops(widened)["Slice"] == 2 and [o.name for o in widened.graph.output] == ["y"]
    x = np.random.default_rng(1).standard_normal((1, 8, 19, 19)).astype(np.float32)
    # the kept columns are the same sums of the same products: equal, not merely close
    assert np.array_equal(run(widened, x)[0], run(original, x)[0])
    assert narrow_rows_widened(widened, 8)[1] == 0  # nothing left to widen
    # a 1-D convolution (silero-vad's STFT front end, 17 wide here) is no row of pixels: left as it is
    rng = np.random.default_rng(2)
    one_d = model([helper.make_node("Conv", ["s", "k"], ["t"], pads=[0, 0])], {"s": (1, 1, 19)}, ["t"],
                  {"k": rng.standard_normal((4, 1, 3)).astype(np.float32)})
    assert narrow_rows_widened(one_d, 8) == (one_d, 0)
    assert _wider(71, 8) == 72 and _wider(73, 8) == 75 and _wider(147, 8) is None and _wider(7, 8) is None


def test_x86_library_with_widened_rows_matches_onnxruntime(tmp_path):
    """The x86 TVM library of those convolutions: the widening is applied (its Slice fused into the
    convolution's function) and the outputs agree with onnxruntime on the model as given."""
    import tvm

    from edgesdk.backends.tvm import compile_onnx
    from edgesdk.backends.tvm.lowering import _lowered
    from tests.backends.test_tvm import assert_matches_ort

    m = prime_width_convs()
    x86 = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "haswell"})
    names = [g.name_hint for g, f in _lowered(m, x86).functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert sum("strided_slice" in n and n.startswith("fused_conv2d") for n in names) == 2, names
    result = compile_onnx(m, {"kind": "llvm", "mcpu": "native"}, tmp_path / "rows.so")
    assert_matches_ort(m, tmp_path / "rows.so", result)
