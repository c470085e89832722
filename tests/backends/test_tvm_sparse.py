"""backends/tvm/sparse_*.py: pruned convolutions packed with fixed loop lengths (blocked ELL) and computed
by TIR kernels in CHWN (a batch) or W-vectorized (batch 1), compiled into TVM libraries where a constant
weight is mostly zeros; each checked against onnxruntime on the pruned dense model."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper

from edgesdk.backends.tvm import compile as tvm_compile
from edgesdk.backends.tvm import lowering, sparse_format, sparse_measured, sparse_schedules
from tests.numeric import assert_close


def nm_pruned(weight: np.ndarray, n: int, m: int) -> np.ndarray:
    """`weight` with the n largest of every m consecutive input channels kept (a last short group keeps
    min(n, its size))."""
    out = np.zeros_like(weight)
    for start in range(0, weight.shape[1], m):
        group = np.abs(weight[:, start:start + m])
        keep = np.argsort(-group, axis=1, kind="stable")[:, :n]
        np.put_along_axis(out[:, start:start + m], keep, np.take_along_axis(weight[:, start:start + m], keep, 1), 1)
    return out


@st.composite
def pruned_weights(draw):
    co, ci = draw(st.integers(1, 9)), draw(st.integers(1, 40))
    k = draw(st.sampled_from([1, 3, 5]))
    seed = draw(st.integers(0, 2**16))
    density = draw(st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0]))
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((co, ci, k, k)).astype(np.float32)
    w[rng.random(w.shape) >= density] = 0
    return w


@settings(max_examples=60, deadline=None)
@given(pruned_weights(), st.sampled_from([1, 4, 16, 64]))
def test_blocked_ell_decodes_to_the_pruned_weights_exactly(w, block):
    ell = sparse_format.pack(w, block)
    assert np.array_equal(sparse_format.decode(ell), w)
    assert ell.kept == np.count_nonzero(w)
    assert ell.values.shape[:2] == (w.shape[0], -(-w.shape[1] // block))
    # every padding entry reads a row of its own block
    rows_per_channel = w.shape[2] * w.shape[3]
    blocks = ell.rows // rows_per_channel // block
    assert np.array_equal(blocks, np.broadcast_to(np.arange(ell.values.shape[1])[None, :, None], blocks.shape))


def test_n_m_pruning_fills_its_lists_exactly():
    w = nm_pruned(np.random.default_rng(0).standard_normal((8, 32, 3, 3)).astype(np.float32), 2, 4)
    ell = sparse_format.pack(w, 16)
    assert ell.padding == 0.0
    assert ell.values.shape == (8, 2, 16 // 4 * 2 * 9)


def conv_model(n, ci, co, h, w, k, stride, pads, weight, dilation=1, relu=True) -> onnx.ModelProto:
    bias = np.random.default_rng(1).standard_normal(co).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c" if relu else "y"], pads=list(pads), strides=[stride] * 2,
                              dilations=[dilation] * 2)]
    forced(nodes[0])
    if relu:
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT,
                                                                            [n, ci, h, w])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def forced(node) -> None:
    """The sparse kernel forced on `node` where its weight is sparse (as --sparse-kernels sparse does):
    these tests check its numbers, whatever it measures against the dense one here."""
    node.metadata_props.add(key="edgesdk.kernel", value="sparse")


def ort_run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {model.graph.input[0].name: x})[0]


def run_library(lib, result, x: np.ndarray) -> np.ndarray:
    """The library `lib` compiled as `result` says, run on `x` with its weights (the file beside it)."""
    import tvm

    from edgesdk.runtime.backends.tvm_runner import load_weights

    vm = tvm.relax.VirtualMachine(tvm.runtime.load_module(str(lib)), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x), *load_weights(lib, result.weights, tvm.cpu(), "s0")).numpy()


def tvm_run(model: onnx.ModelProto, x: np.ndarray, tmp_path) -> tuple[np.ndarray, int]:
    """The model compiled for this host by TVM, run on `x`; and how many sparse kernels its library has."""
    import tvm

    lib = tmp_path / "segment.so"
    result = tvm_compile.compile_onnx(model, {"kind": "llvm", "mcpu": "native"}, lib)
    out = run_library(lib, result, x)
    lowered = lowering._lowered(model, tvm.target.Target({"kind": "llvm"}))
    kernels = sum(1 for gv in lowered.functions if gv.name_hint.startswith("sparse_conv2d"))
    return out, kernels


# (batch, in channels, out channels, height, width, kernel, stride, pads, N:M or sparsity, dilation):
# tails everywhere: widths 7, 14 and 56, channels not a multiple of M, stride 2, asymmetric padding
CASES = [
    (16, 16, 8, 7, 7, 3, 1, (1, 1, 1, 1), (2, 4), 1),
    (16, 6, 10, 14, 14, 3, 2, (1, 1, 1, 1), (1, 4), 1),
    (8, 13, 12, 14, 14, 1, 1, (0, 0, 0, 0), (1, 4), 1),
    (2, 24, 16, 56, 56, 3, 1, (1, 1, 1, 1), 0.9, 1),
    (1, 16, 8, 56, 56, 3, 1, (1, 1, 1, 1), (2, 4), 1),
    (1, 6, 10, 7, 7, 3, 2, (1, 1, 1, 1), (1, 4), 1),
    (1, 10, 9, 14, 14, 3, 2, (0, 1, 1, 0), 0.75, 1),
    (1, 12, 8, 14, 14, 3, 1, (2, 2, 2, 2), (2, 4), 2),
]


@pytest.mark.parametrize("case", CASES, ids=[f"n{c[0]}-c{c[1]}-w{c[4]}-k{c[5]}-s{c[6]}-{c[8]}" for c in CASES])
def test_sparse_kernel_equals_onnxruntime_on_the_pruned_dense_model(case, tmp_path):
    n, ci, co, h, w, k, stride, pads, method, dilation = case
    rng = np.random.default_rng(hash(case) % 2**32)
    weight = rng.standard_normal((co, ci, k, k)).astype(np.float32)
    if isinstance(method, tuple):
        weight = nm_pruned(weight, *method)
    else:
        weight[np.abs(weight) < np.quantile(np.abs(weight), method)] = 0
    model = conv_model(n, ci, co, h, w, k, stride, pads, weight, dilation)
    x = rng.standard_normal((n, ci, h, w)).astype(np.float32)
    got, kernels = tvm_run(model, x, tmp_path)
    assert kernels == 1
    assert_close(got, ort_run(model, x), "sparse conv")


HASWELL = {"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "haswell"}  # AVX2: 8 lanes, vmaskmov


@pytest.mark.parametrize("target", [HASWELL, {"kind": "llvm", "mcpu": "native"}], ids=["avx2", "native"])
@pytest.mark.parametrize("h, w, stride, masked", [(9, 13, 1, True), (6, 16, 1, False), (12, 17, 2, True),
                                                   (8, 32, 2, True)])
def test_batch_one_rows_that_lanes_do_not_divide_run_the_masked_row_kernel(target, h, w, stride, masked, tmp_path):
    """Batch 1: a width the register's lanes do not divide (13), or strided columns (dealt into planes), get
    `row_kernel`, with a masked tail (scheduled by hand, not a tuning task); a width they divide at stride 1
    (16) keeps `kernel`. All equal onnxruntime, on AVX2 (vmaskmov) and on this host's own vector width."""
    import tvm

    rng = np.random.default_rng(h * w)
    weight = nm_pruned(rng.standard_normal((12, 20, 3, 3)).astype(np.float32), 1, 4)
    model = conv_model(1, 20, 12, h, w, 3, stride, (1, 1, 1, 1), weight)
    x = rng.standard_normal((1, 20, h, w)).astype(np.float32)
    lib = tmp_path / "segment.so"
    got = run_library(lib, tvm_compile.compile_onnx(model, target, lib), x)
    assert_close(got, ort_run(model, x), "sparse conv")
    lowered = lowering._lowered(model, tvm.target.Target(target))
    kernels = [f for gv, f in lowered.functions_items() if gv.name_hint.startswith("sparse_conv2d")]
    assert len(kernels) == 1
    assert bool(kernels[0].attrs.get("tirx.is_scheduled", False)) == masked
    assert sparse_schedules.is_kernel(kernels[0]) != masked  # only `kernel` is a MetaSchedule task


def test_a_dense_convolution_keeps_the_dense_kernel(tmp_path):
    weight = np.random.default_rng(0).standard_normal((8, 8, 3, 3)).astype(np.float32)
    weight[:, :3] = 0  # 37.5 % zeros: below MIN_SPARSITY
    model = conv_model(2, 8, 8, 14, 14, 3, 1, (1, 1, 1, 1), weight)
    x = np.random.default_rng(1).standard_normal((2, 8, 14, 14)).astype(np.float32)
    got, kernels = tvm_run(model, x, tmp_path)
    assert kernels == 0
    assert_close(got, ort_run(model, x), "dense conv")


def residual_block(n: int, dense_middle: bool) -> onnx.ModelProto:
    """conv -> relu -> conv -> add(input) -> relu -> max pool, all sparse (or the middle one dense)."""
    rng = np.random.default_rng(3)
    w1 = nm_pruned(rng.standard_normal((16, 16, 3, 3)).astype(np.float32), 1, 4)
    w2 = rng.standard_normal((16, 16, 3, 3)).astype(np.float32)
    w2 = w2 if dense_middle else nm_pruned(w2, 2, 4)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1] * 4),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1] * 4),
             helper.make_node("Add", ["c2", "x"], ["s"]),
             helper.make_node("Relu", ["s"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["y"], kernel_shape=[2, 2], strides=[2, 2])]
    forced(nodes[0])
    forced(nodes[2])
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT,
                                                                             [n, 16, 14, 14])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def permutes(model: onnx.ModelProto) -> int:
    """The layout changes in `model` imported into Relax after SparseConvs (its transposes as kernels)."""
    import tvm
    from tvm import relax

    from edgesdk.backends.tvm.sparse_pass import SparseConvs

    mod = SparseConvs(channels_last=True, prepare=lowering._ClipAsRelaxOps())(lowering._import(model))
    found = []

    @relax.expr_functor.visitor
    class Count(relax.PyExprVisitor):
        def visit_call_(self, call):
            super().visit_call_(call)
            if call.op == tvm.ir.Op.get("relax.permute_dims") or (
                    call.op == tvm.ir.Op.get("relax.call_tir") and call.args[0].name_hint.startswith("layout_transpose")):
                found.append(call)

    Count().visit_expr(mod["main"])
    return len(found)


@pytest.mark.parametrize("dense_middle", [False, True])
def test_layout_changes_only_at_the_edges_of_sparse_runs(dense_middle, tmp_path):
    model = residual_block(16, dense_middle)
    # all sparse: into CHWN for the run (the residual input once more) and back once; a dense middle
    # convolution adds its own way out of CHWN and back
    assert permutes(model) == (2 if not dense_middle else 4) + 1
    x = np.random.default_rng(2).standard_normal((16, 16, 14, 14)).astype(np.float32)
    got, kernels = tvm_run(model, x, tmp_path)
    assert kernels == (1 if dense_middle else 2)
    assert_close(got, ort_run(model, x), "residual block")


def test_the_measured_choice_follows_the_times_it_keeps(tmp_path):
    """`Measured` times both kernels once, keeps the times, and chooses the sparse kernel only where it was
    faster; a kept time is replayed, not measured again (the tune and package stages choose alike)."""
    import json

    target = tvm_compile._resolve_target({"kind": "llvm", "mcpu": "native"})[0]
    weight = nm_pruned(np.random.default_rng(0).standard_normal((16, 16, 3, 3)).astype(np.float32), 1, 4)
    shape = sparse_format.ConvShape(4, 16, 14, 14, 16, 3, 3, (1, 1, 1, 1))
    cache = tmp_path / "times.json"
    first = sparse_measured.Measured(target, cache)(shape, weight)
    assert first["kernel"] == ("sparse" if first["sparse_ms"] < first["dense_ms"] else "dense")
    (key,) = json.loads(cache.read_text())
    for sparse_ms, dense_ms, want in ((1.0, 2.0, "sparse"), (2.0, 1.0, "dense"), (1.0, 1.0, "dense")):
        cache.write_text(json.dumps({key: {"sparse_ms": sparse_ms, "dense_ms": dense_ms}}))
        choice = sparse_measured.Measured(target, cache)(shape, weight)
        assert (choice["kernel"], choice["sparse_ms"], choice["dense_ms"]) == (want, sparse_ms, dense_ms)
    # the package stage reads the tune stage's copy and adds nothing to it
    sparse_measured.Measured(target, tmp_path / "read-only.json", keep=False)(shape, weight)
    assert not (tmp_path / "read-only.json").exists()


@pytest.mark.slow
def test_metaschedule_searches_the_sparse_kernel_and_compilation_applies_its_record(tmp_path):
    """The sparse kernel is a task of the tune stage's search (its design space `sparse_schedules.design`: the tile
    sizes sampled, measured on random offsets that the kernel clamps to its input), and the library
    compiled with the database takes its record and still equals onnxruntime."""
    import tvm

    from edgesdk.backends.tvm.database import _apply_database, _open_database
    from edgesdk.backends.tvm.tuning import tune_onnx

    target = {"kind": "llvm", "mcpu": "native", "num-cores": 2}
    weight = nm_pruned(np.random.default_rng(4).standard_normal((16, 16, 3, 3)).astype(np.float32), 1, 4)
    model = conv_model(8, 16, 16, 14, 14, 3, 1, (1, 1, 1, 1), weight)
    summary = tune_onnx(model, target, tmp_path / "db", trials=12)
    (task,) = [t for t in summary["per_task"] if t["name"].startswith("sparse_conv2d")]
    # searched, its untuned baseline measured (a record of its design space's trace, as each candidate is)
    assert task["searched"] and task["untuned_ms"] is not None and task["records"] >= 1, task
    resolved, tt = tvm_compile._resolve_target(target)
    with tt:
        mod = _apply_database(lowering._lowered(model, tt), _open_database(tmp_path / "db", resolved,
                                                                           must_exist=True))
    kernels = [f for g, f in mod.functions_items() if g.name_hint.startswith("sparse_conv2d")]
    assert kernels and all(f.attrs.get("tirx.is_scheduled", False) for f in kernels)
    result = tvm_compile.compile_onnx(model, target, tmp_path / "tuned.so", tuning_db=tmp_path / "db")
    assert result.sparse_kernels == 1 and result.tuned == result.tasks
    x = np.random.default_rng(5).standard_normal((8, 16, 14, 14)).astype(np.float32)
    assert_close(run_library(tmp_path / "tuned.so", result, x), ort_run(model, x), "tuned sparse conv")


@pytest.mark.parametrize("stride", [1, 2])
def test_a_depthwise_convolution_stays_in_the_sparse_run(stride, tmp_path):
    """MobileNetV2's inverted residual: a pruned 1x1 expansion, a dense depthwise 3x3, a pruned 1x1
    projection. With a batch the depthwise layer gets a CHWN kernel of its own, so the run has no layout
    change inside it; the whole equals onnxruntime."""
    rng = np.random.default_rng(7)
    expand = nm_pruned(rng.standard_normal((32, 16, 1, 1)).astype(np.float32), 1, 4)
    depthwise = rng.standard_normal((32, 1, 3, 3)).astype(np.float32)
    project = nm_pruned(rng.standard_normal((16, 32, 1, 1)).astype(np.float32), 1, 4)
    nodes = [helper.make_node("Conv", ["x", "we"], ["e"]),
             helper.make_node("Relu", ["e"], ["re"]),
             helper.make_node("Conv", ["re", "wd"], ["d"], group=32, pads=[1] * 4, strides=[stride] * 2),
             helper.make_node("Clip", ["d", "lo", "hi"], ["rd"]),
             helper.make_node("Conv", ["rd", "wp"], ["y"])]
    forced(nodes[0])
    forced(nodes[4])
    graph = helper.make_graph(nodes, "inverted_residual",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [8, 16, 14, 14])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(a, k) for k, a in
                               (("we", expand), ("wd", depthwise), ("wp", project),
                                ("lo", np.float32(0.0)), ("hi", np.float32(6.0)))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    assert permutes(model) == 2  # into CHWN at the input, out of it at the output
    x = rng.standard_normal((8, 16, 14, 14)).astype(np.float32)
    got, kernels = tvm_run(model, x, tmp_path)
    assert kernels == 2
    assert_close(got, ort_run(model, x), "inverted residual")


def test_a_kernel_is_made_once_per_shape_and_target():
    """The same shape under the same target is the same TIR function (TVMScript is parsed once); another target
    gets its own, tiled for its registers (AVX-512's 32 against AVX2's 16: another block of output pixels)."""
    import tvm

    from edgesdk.backends.tvm import sparse_kernels

    shape = sparse_format.ConvShape(n=16, ci=8, h=14, w=14, co=8, kh=3, kw=3, pads=(1, 1, 1, 1))
    avx512 = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})
    avx2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
    with avx512:
        first = sparse_kernels.depthwise_kernel(shape)
        assert sparse_kernels.depthwise_kernel(shape) is first
        assert sparse_kernels.kernel(shape, 2, 4) is sparse_kernels.kernel(shape, 2, 4)
        assert sparse_kernels.depthwise_kernel(sparse_format.ConvShape(16, 8, 28, 28, 8, 3, 3, (1, 1, 1, 1))) \
            is not first
    with avx2:
        other = sparse_kernels.depthwise_kernel(shape)
    assert other is not first and str(other) != str(first)
