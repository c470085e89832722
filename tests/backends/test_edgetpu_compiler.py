"""Coral's edgetpu_compiler log: the parser, where the compiler cuts a segment, and the plan correction.

The compiler itself cannot be installed here; these tests feed the parser logs as the compiler prints
them, and the correction a real int8 .tflite made by `convert_int8` from a tiny ONNX model."""

from __future__ import annotations

import math
import os
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgesdk.backends import edgetpu_compiler as etc
from edgesdk.backends import tflite
from edgesdk.config import load_target
from edgesdk.devices.cost import node_bytes, node_flops, node_ms, tensor_bytes
from edgesdk.ir import model as irm
from edgesdk.scheduling import placement
from edgesdk.scheduling.graph import build_problem
from edgesdk.scheduling.correction import corrected_prediction, edgetpu_correction
from edgesdk import backends
from edgesdk.bundling.bundle import finish_segment
from edgesdk.scheduling.plan import PlanSegment
from tests.edgetpu_double import install_co_compiling_double

# Verbatim from Coral's issue tracker, google-coral/edgetpu issue #342 ("Operations not mapped to TPU",
# 2021-03-21, https://github.com/google-coral/edgetpu/issues/342): `edgetpu_compiler -s` without -a on a
# model whose TRANSPOSEs the Edge TPU cannot run. The blank lines after the header are as printed.
# Coral's engineer explains the cut in issue #461: the ops after the first one it cannot map show
# "More than one subgraph is not supported".
CORAL_ISSUE_342 = """\
Number of operations that will run on Edge TPU: 2
Number of operations that will run on CPU: 153

Operator                       Count      Status


TRANSPOSE                      70         Operation not supported
FULLY_CONNECTED                1          More than one subgraph is not supported
PAD                            1          Mapped to Edge TPU
PAD                            17         More than one subgraph is not supported
ADD                            10         More than one subgraph is not supported
MEAN                           2          More than one subgraph is not supported
CONV_2D                        35         More than one subgraph is not supported
QUANTIZE                       1          Mapped to Edge TPU
QUANTIZE                       1          Operation is otherwise supported, but not mapped due to some unspecified limitation
DEPTHWISE_CONV_2D              17         More than one subgraph is not supported
"""

OTHERWISE = "Operation is otherwise supported, but not mapped due to some unspecified limitation"
SUBGRAPH = "More than one subgraph is not supported"


def _log(table: list[tuple[str, int, str]], *, tpu: int | None = None, cpu: int | None = None,
         on_chip: str = "6.08MiB", off_chip: str = "0.00B") -> str:
    """A log in the layout compiler version 16 prints with -s."""
    lines = ["Edge TPU Compiler version 16.0.384591198", "Started a compilation timeout timer of 180 seconds.", "",
             "Model compiled successfully in 412 ms.", "", "Input model: s0.tflite",
             f"On-chip memory used for caching model parameters: {on_chip}",
             "On-chip memory remaining for caching model parameters: 1.90MiB",
             f"Off-chip memory used for streaming uncached model parameters: {off_chip}",
             "Number of Edge TPU subgraphs: 1", ""]
    if cpu:
        lines += [f"Model successfully compiled but not all operations are supported by the Edge TPU. A percentage "
                  "of the model will instead run on the CPU, which is slower. If possible, consider updating your "
                  "model to use only operations supported by the Edge TPU. For details, visit g.co/coral/model-reqs."]
    if tpu is not None:
        lines += [f"Number of operations that will run on Edge TPU: {tpu}",
                  f"Number of operations that will run on CPU: {cpu}"]
    lines += ["", "Operator                       Count      Status", ""]
    lines += [f"{op:<30} {n:<10} {status}" for op, n, status in table]
    lines += ["Compilation child process completed within timeout period.", "Compilation succeeded! "]
    return "\n".join(lines) + "\n"


# --- the parser -------------------------------------------------------------------------------


def test_parses_coral_issue_342_verbatim():
    log = etc.parse_log(CORAL_ISSUE_342)
    assert (log.ops_on_tpu, log.ops_on_cpu) == (2, 153)
    assert len(log.ops) == 10 and sum(r.count for r in log.ops) == 155
    assert log.ops[0] == etc.OpRow("TRANSPOSE", 70, "Operation not supported")
    assert log.ops[8] == etc.OpRow("QUANTIZE", 1, OTHERWISE)
    assert [r.operator for r in log.ops if r.mapped] == ["PAD", "QUANTIZE"]
    assert not log.partly_mapped and not log.others_mapped  # that excerpt starts below the compiler's note
    # a model like it: a float input quantized and padded, the first TRANSPOSE, ..., the output quantized
    ops = ["QUANTIZE", "PAD", "TRANSPOSE", "PAD", "CONV_2D", "TRANSPOSE", "QUANTIZE"]
    m = etc.mapping(ops, log)
    assert (m.on_tpu, m.first_unmapped, m.status) == (2, "TRANSPOSE", "Operation not supported")


def test_parses_a_version_16_log_with_totals_sizes_and_the_partly_mapped_line():
    text = _log([("CONV_2D", 42, etc.MAPPED), ("SOFTMAX", 1, OTHERWISE)], tpu=42, cpu=1,
                on_chip="322.25KiB", off_chip="1.70MiB")
    log = etc.parse_log(text)
    assert log.version == "16.0.384591198"
    assert (log.ops_on_tpu, log.ops_on_cpu) == (42, 1)
    assert log.on_chip_bytes == int(322.25 * 1024) and log.off_chip_bytes == int(1.70 * 2**20)
    assert log.ops == (etc.OpRow("CONV_2D", 42, etc.MAPPED), etc.OpRow("SOFTMAX", 1, OTHERWISE))
    assert log.partly_mapped


@pytest.mark.parametrize("size, expected", [("0.00B", 0), ("512B", 512), ("1.50 MiB", int(1.5 * 2**20)),
                                            ("7.98MiB", int(7.98 * 2**20)), ("2.25 KiB", 2304)])
def test_sizes_in_bytes_kib_and_mib(size, expected):
    assert etc.parse_log(f"On-chip memory used for caching model parameters: {size}\n").on_chip_bytes == expected


def test_a_log_without_a_table_keeps_its_totals():
    text = ("Edge TPU Compiler version 15.0.340273435\n"
            "Number of operations that will run on Edge TPU: 60\nNumber of operations that will run on CPU: 2\n")
    log = etc.parse_log(text)
    assert (log.version, log.ops_on_tpu, log.ops_on_cpu, log.ops) == ("15.0.340273435", 60, 2, ())
    # the cut falls after the compiler's count of ops on the TPU
    m = etc.mapping(["CONV_2D"] * 60 + ["MEAN", "FULLY_CONNECTED"], log)
    assert (m.on_tpu, m.first_unmapped) == (60, "MEAN") and "names no operator" in m.status


def test_an_empty_or_foreign_text_parses_to_nothing():
    log = etc.parse_log("edgetpu_compiler: command not found\n")
    assert (log.version, log.ops_on_tpu, log.ops_on_cpu, log.on_chip_bytes, log.ops) == ("unknown", 0, 0, 0, ())


def test_zero_ops_mapped():
    text = _log([("CONV_2D", 2, "Operation is working on an unsupported data type"), ("MEAN", 1, SUBGRAPH),
                 ("FULLY_CONNECTED", 1, SUBGRAPH)], tpu=0, cpu=4)
    log = etc.parse_log(text)
    assert (log.ops_on_tpu, log.ops_on_cpu) == (0, 4) and not any(r.mapped for r in log.ops)
    m = etc.mapping(["CONV_2D", "CONV_2D", "MEAN", "FULLY_CONNECTED"], log)
    assert (m.on_tpu, m.on_cpu, m.first_unmapped) == (0, 4, "CONV_2D")
    assert m.status == "Operation is working on an unsupported data type"


def test_whitespace_tabs_and_crlf_are_tolerated():
    text = ("Number of operations that will run on Edge TPU:  3\r\nNumber of operations that will run on CPU:\t1\r\n"
            "\r\n   Operator\tCount\t\tStatus   \r\n\r\n"
            "\tCONV_2D     3\tMapped  to  Edge TPU\r\n  MEAN 1   Operation   not supported  \r\n")
    log = etc.parse_log(text)
    assert (log.ops_on_tpu, log.ops_on_cpu) == (3, 1)
    assert log.ops == (etc.OpRow("CONV_2D", 3, "Mapped to Edge TPU"), etc.OpRow("MEAN", 1, "Operation not supported"))
    assert log.ops[0].mapped and not log.ops[1].mapped


def test_a_table_without_totals_gives_them():
    # the layout of the compiler's .log file (and of version 14's stdout): no totals, only the table
    text = ("Edge TPU Compiler version 14.1.317412892\nInput: m.tflite\nOutput: m_edgetpu.tflite\n\n"
            "Operator                       Count      Status\n\n"
            f"CONV_2D                        11         {etc.MAPPED}\n"
            f"CONV_2D                        2          {SUBGRAPH}\n"
            f"QUANTIZE                       1          {OTHERWISE}\n")
    log = etc.parse_log(text)
    assert (log.ops_on_tpu, log.ops_on_cpu) == (11, 3)


def test_an_abbreviated_table_lists_only_what_is_not_mapped():
    # version 16 may print only the unmapped rows, then this line
    text = _log([("MEAN", 1, OTHERWISE)], tpu=5, cpu=2).replace(
        "Compilation child", "... All other operators were mapped successfully. See s0_edgetpu.log.\nCompilation child")
    log = etc.parse_log(text)
    assert log.others_mapped and log.ops == (etc.OpRow("MEAN", 1, OTHERWISE),)
    m = etc.mapping(["CONV_2D", "CONV_2D", "MEAN", "CONV_2D", "CONV_2D", "MEAN", "FULLY_CONNECTED"], log)
    # the second MEAN is the one not mapped: MEAN's one unmapped op comes after its mapped one
    assert (m.on_tpu, m.first_unmapped, m.status) == (5, "MEAN", OTHERWISE)


def test_the_cause_is_preferred_over_the_consequence():
    log = etc.parse_log(_log([("ADD", 3, etc.MAPPED), ("ADD", 2, SUBGRAPH), ("ADD", 1, OTHERWISE)], tpu=3, cpu=3))
    m = etc.mapping(["ADD"] * 6, log)
    assert (m.on_tpu, m.status) == (3, OTHERWISE)


def test_a_fully_mapped_model_needs_no_correction():
    log = etc.parse_log(_log([("CONV_2D", 2, etc.MAPPED), ("MEAN", 1, etc.MAPPED)], tpu=3, cpu=0))
    m = etc.mapping(["CONV_2D", "MEAN", "CONV_2D"], log)
    assert (m.on_tpu, m.on_cpu, m.first_unmapped) == (3, 0, None) and not log.partly_mapped
    assert etc.leading_nodes(7, m) == 7
    # a table that counts fewer ops of a type than the model has, none of them unmapped: still no cut
    assert etc.mapping(["CONV_2D", "MEAN", "CONV_2D", "CONV_2D"], log).on_cpu == 0


@pytest.mark.parametrize("nodes, on_tpu, ops, expected", [
    (6, 2, 4, 3),       # 3.0 exactly
    (7, 2, 5, 3),       # 2.8 -> 3
    (125, 148, 149, 124),
    (10, 1, 100, 1),    # 0.1: at least one node for the ops the TPU does run
    (10, 99, 100, 9),   # 9.9: at least one node for the ops the CPU runs
    (10, 0, 100, 0),
    (1, 3, 4, 0),       # one node cannot be split: it goes where its tail goes
])
def test_leading_nodes_split_in_proportion(nodes, on_tpu, ops, expected):
    assert etc.leading_nodes(nodes, etc.Mapping(("OP",) * ops, on_tpu, "x" if on_tpu < ops else "")) == expected


# --- the correction on a real int8 model ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """conv1 -> relu1 -> conv2 -> relu2 -> mean -> fc as the scheduled model of one Edge TPU segment
    (every node capable of edgetpu and the CPU), and its full-int8 .tflite."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n)
             for n, s in [("w1", (8, 4, 3, 3)), ("w2", (8, 8, 3, 3)), ("fc_w", (8, 5)), ("fc_b", (5,))]]
    N = helper.make_node
    nodes = [N("Conv", ["x", "w1"], ["a"], name="conv1", pads=[1, 1, 1, 1]), N("Relu", ["a"], ["b"], name="relu1"),
             N("Conv", ["b", "w2"], ["c"], name="conv2", pads=[1, 1, 1, 1]), N("Relu", ["c"], ["d"], name="relu2"),
             N("ReduceMean", ["d"], ["e"], name="mean", axes=[2, 3], keepdims=0),
             N("Gemm", ["e", "fc_w", "fc_b"], ["y"], name="fc")]
    g = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])], inits)
    model = onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]))
    model.ir_version = 8
    path = tmp_path_factory.mktemp("etpu") / "s0.tflite"
    tflite.convert_int8(model, [{"x": rng.uniform(-1, 1, (1, 4, 8, 8)).astype(np.float32)} for _ in range(4)], path)
    for node in model.graph.node:
        irm.set_meta(node, irm.CAPABLE_KEY, "edgetpu,cpu/tvm")
    target, _ = load_target("arm_2tpu")
    problem, _ = build_problem(model, target, irm.static_shapes(model), irm.constant_names(model))
    seg = {"id": "s0", "device": "edgetpu:0", "nodes": [n.name for n in model.graph.node],
           "predicted_ms": round(placement.segment_ms(problem, 0, 6, "edgetpu:0"), 4)}
    return model, path, target, seg


def _by_hand(model: onnx.ModelProto, target, k: int) -> float:
    """nodes[:k] on the Edge TPU, nodes[k:] on the CPU, from the cost model's per-node figures and the
    target's link: the TPU part receives x and sends back what the CPU part reads (int8: a quarter of
    the float32 bytes), one link latency per tensor."""
    shapes, consts = irm.static_shapes(model), irm.constant_names(model)
    tpu = next(d for d in target.devices if d.kind == "edgetpu")
    link_latency_ms = tpu.link.latency.value * 1e-3
    ms_per_int8_byte = 1e3 / (tpu.link.bandwidth.value * 1e6)
    nodes = list(model.graph.node)
    total = 0.0
    for i, n in enumerate(nodes):
        params, acts = node_bytes(n, shapes, consts)
        kind = "edgetpu" if i < k else "cpu"
        total += node_ms(target, kind, flops=node_flops(n, shapes), param_bytes=params, act_bytes=acts)
    if k:
        crossing = ["x"] + ([nodes[k - 1].output[0]] if k < len(nodes) else ["y"])
        total += sum(link_latency_ms + tensor_bytes(shapes[t]) / 4 * ms_per_int8_byte for t in crossing)
    return total


def test_the_hand_formula_matches_the_schedule_stage_on_the_whole_segment(tiny):
    model, _, target, seg = tiny
    assert seg["predicted_ms"] == pytest.approx(_by_hand(model, target, 6), abs=1e-4)


@pytest.mark.parametrize("unmapped, on_tpu, k", [
    ("MEAN", 2, 3),             # CONV_2D CONV_2D | MEAN FULLY_CONNECTED: 6 * 2/4 = 3 nodes stay
    ("FULLY_CONNECTED", 3, 5),  # 6 * 3/4 = 4.5 -> 5: only fc runs on the CPU
])
def test_correction_of_a_partly_mapped_segment(tiny, unmapped, on_tpu, k):
    model, path, target, seg = tiny
    ops = tflite.operators(path.read_bytes())[0]
    assert ops == ("CONV_2D", "CONV_2D", "MEAN", "FULLY_CONNECTED")
    table = [(op, 1, etc.MAPPED if i < on_tpu else OTHERWISE if op == unmapped else SUBGRAPH)
             for i, op in enumerate(ops) if op != "CONV_2D"] + [("CONV_2D", 2, etc.MAPPED)]
    m = etc.mapping(ops, etc.parse_log(_log(table, tpu=on_tpu, cpu=4 - on_tpu)))
    assert (m.on_tpu, m.first_unmapped, m.status) == (on_tpu, unmapped, OTHERWISE)

    c = edgetpu_correction(seg, m, model, target)
    assert (c["nodes_on_tpu"], c["nodes_on_cpu"], c["first_cpu_node"]) == (k, 6 - k, seg["nodes"][k])
    assert (c["ops"], c["ops_on_tpu"], c["ops_on_cpu"], c["first_unmapped"]) == (4, on_tpu, 4 - on_tpu, unmapped)
    assert c["predicted_ms_before"] == seg["predicted_ms"]
    expected = _by_hand(model, target, k)
    assert c["predicted_ms_after"] == pytest.approx(expected, abs=1e-4)
    assert c["predicted_ms_after"] > c["predicted_ms_before"]  # the Cortex-A53 is slower than the TPU here

    text = etc.describe(c)
    assert text.startswith(f"s0: edgetpu_compiler mapped {on_tpu} of 4 ops to the Edge TPU")
    tail = "it runs" if on_tpu == 3 else f"it and the {3 - on_tpu} ops after it run"
    assert f"op {on_tpu + 1} ({unmapped}: {OTHERWISE}), so {tail} on the host CPU" in text
    assert f"(costed as the last {6 - k} of its 6 nodes, from {seg['nodes'][k]})" in text
    assert f"predicted {c['predicted_ms_before']:.3f} -> {c['predicted_ms_after']:.3f} ms" in text


def test_correction_when_nothing_is_mapped(tiny):
    model, path, target, seg = tiny
    ops = tflite.operators(path.read_bytes())[0]
    log = etc.parse_log(_log([("CONV_2D", 2, "Operation is working on an unsupported data type"),
                              ("MEAN", 1, SUBGRAPH), ("FULLY_CONNECTED", 1, SUBGRAPH)], tpu=0, cpu=4))
    c = edgetpu_correction(seg, etc.mapping(ops, log), model, target)
    assert (c["ops_on_tpu"], c["nodes_on_tpu"], c["first_cpu_node"]) == (0, 0, "conv1")
    # all on the CPU: no link at all
    assert c["predicted_ms_after"] == pytest.approx(_by_hand(model, target, 0), abs=1e-4)
    assert "mapped none of its 4 ops" in etc.describe(c) and "uncompiled int8 model" in etc.describe(c)


def test_the_plan_latency_moves_by_the_sum_of_the_differences():
    predicted = {"latency_ms": 2.0, "throughput_fps": 500.0, "sequential_ms": 2.5}
    corrections = [{"predicted_ms_before": 1.0, "predicted_ms_after": 1.75},
                   {"predicted_ms_before": 0.5, "predicted_ms_after": 0.25}]
    got = corrected_prediction(predicted, corrections)
    assert got == {"latency_ms": 2.5, "throughput_fps": 500.0, "sequential_ms": 3.0}
    assert math.isclose(got["sequential_ms"] - predicted["sequential_ms"], 0.5)
    assert predicted["latency_ms"] == 2.0  # not changed in place


@pytest.mark.parametrize("case", ["partly", "nothing", "all"])
def test_compile_for_edgetpu_ships_what_the_compiler_mapped(tiny, tmp_path, monkeypatch, case):
    """The package stage's step with a TEST DOUBLE named edgetpu_compiler on PATH (the real one cannot
    be installed here): it copies the model as the "compiled" one and prints a canned -s log."""
    model, path, target, seg = tiny
    bundle = tmp_path / "bundle"
    (bundle / "segments").mkdir(parents=True)
    shutil.copyfile(path, bundle / "segments" / "s0.tflite")
    onnx.save(model, str(tmp_path / "model.onnx"))
    (tmp_path / "log.txt").write_text({
        "partly": _log([("CONV_2D", 2, etc.MAPPED), ("MEAN", 1, OTHERWISE), ("FULLY_CONNECTED", 1, SUBGRAPH)],
                       tpu=2, cpu=2),
        "nothing": _log([("CONV_2D", 2, "Operation is working on an unsupported data type"), ("MEAN", 1, SUBGRAPH),
                         ("FULLY_CONNECTED", 1, SUBGRAPH)], tpu=0, cpu=4),
        "all": _log([("CONV_2D", 2, etc.MAPPED), ("MEAN", 1, etc.MAPPED), ("FULLY_CONNECTED", 1, etc.MAPPED)],
                    tpu=4, cpu=0),
    }[case])
    double = tmp_path / "bin" / "edgetpu_compiler"
    double.parent.mkdir()
    double.write_text("#!/bin/sh\n# TEST DOUBLE for Coral's edgetpu_compiler: copies the model, prints a canned log\n"
                      'out=.; while [ $# -gt 1 ]; do case "$1" in -o) out=$2; shift 2;; *) shift;; esac; done\n'
                      'cp "$1" "$out/$(basename "$1" .tflite)_edgetpu.tflite"\n'
                      f'cat "{tmp_path / "log.txt"}"\n')
    double.chmod(0o755)
    monkeypatch.setenv("PATH", f"{double.parent}{os.pathsep}{os.environ['PATH']}")
    planned = PlanSegment(seg["id"], seg["device"], "tflite", "segments/s0.onnx", tuple(seg["nodes"]), ("x",), ("y",),
                          0.0, 0, seg["predicted_ms"])

    art, record, correction, shipped = finish_segment(backends.finisher("edgetpu"), bundle, "segments/s0.tflite",
                                                      planned, tmp_path / "model.onnx", target)
    plan_seg = shipped.to_json()  # the segment as shipped: the plan itself is never changed
    assert "text" not in record and record["ops_on_tpu"] == {"partly": 2, "nothing": 0, "all": 4}[case]
    compiled = bundle / "segments" / "s0_edgetpu.tflite"
    if case == "all":
        assert (art, correction, plan_seg["predicted_ms"]) == ("segments/s0_edgetpu.tflite", None, seg["predicted_ms"])
        assert compiled.exists()
    elif case == "partly":
        assert art == "segments/s0_edgetpu.tflite" and compiled.exists()
        assert (correction["ops_on_tpu"], correction["first_unmapped"], correction["nodes_on_tpu"]) == (2, "MEAN", 3)
        assert plan_seg["predicted_ms"] == correction["predicted_ms_after"] == pytest.approx(
            _by_hand(model, target, 3), abs=1e-4)
    else:  # nothing mapped: the uncompiled int8 model ships, and the compiled one is gone from the bundle
        assert art == "segments/s0.tflite" and not compiled.exists()
        assert (correction["ops_on_tpu"], correction["first_unmapped"]) == (0, "CONV_2D")
        assert plan_seg["predicted_ms"] == pytest.approx(_by_hand(model, target, 0), abs=1e-4)


# --- co-compilation: one call per Edge TPU, its models in cache priority ---------------------------

def _block(name: str, on_chip: str, remaining: str, off_chip: str) -> str:
    """One model's block of a co-compiling call's -s log (the layout of google-coral/edgetpu #518's)."""
    return (f"Input model: {name}.tflite\nInput size: 1.00MiB\nOutput model: {name}_edgetpu.tflite\n"
            f"Output size: 1.20MiB\nOn-chip memory used for caching model parameters: {on_chip}\n"
            f"On-chip memory remaining for caching model parameters: {remaining}\n"
            f"Off-chip memory used for streaming uncached model parameters: {off_chip}\n"
            "Number of Edge TPU subgraphs: 1\nTotal number of operations: 6\n"
            f"Operation log: {name}_edgetpu.log\n\nOperator                       Count      Status\n\n"
            "CONV_2D                        2          Mapped to Edge TPU\n\n")


def test_a_co_compiling_log_is_read_per_model():
    text = ("Edge TPU Compiler version 16.0.384591198\nStarted a compilation timeout timer of 180 seconds.\n\n"
            "Models compiled successfully in 2988 ms.\n\n" + _block("cnn", "7.16MiB", "2.25KiB", "2.95MiB")
            + _block("rnn", "0.00B", "2.25KiB", "4.53MiB"))
    blocks = etc.split_log(text)
    assert len(blocks) == 2 and all(b.startswith("Edge TPU Compiler version 16") for b in blocks)
    cnn, rnn = map(etc.parse_log, blocks)
    assert (cnn.on_chip_bytes, cnn.on_chip_remaining_bytes, cnn.off_chip_bytes) == (
        int(7.16 * 2**20), int(2.25 * 2**10), int(2.95 * 2**20))
    assert (rnn.on_chip_bytes, rnn.off_chip_bytes) == (0, int(4.53 * 2**20))
    assert cnn.version == rnn.version == "16.0.384591198"
    assert etc.split_log("no blocks here") == ["no blocks here"]




def test_finish_group_co_compiles_one_tpus_models_in_one_call_in_the_order_given(tiny, tmp_path, monkeypatch):
    from edgesdk.bundling.bundle import finish_segments

    model, path, target, seg = tiny
    bundle = tmp_path / "bundle"
    (bundle / "segments").mkdir(parents=True)
    for name in ("s3", "s1", "s7"):
        shutil.copyfile(path, bundle / "segments" / f"{name}.tflite")
    onnx.save(model, str(tmp_path / "model.onnx"))
    double = install_co_compiling_double(tmp_path / "bin", monkeypatch)
    planned = [PlanSegment(sid, "edgetpu:0", "tflite", f"segments/{sid}.onnx", tuple(seg["nodes"]), ("x",), ("y",),
                           0.0, 0, seg["predicted_ms"]) for sid in ("s3", "s1", "s7")]
    done = finish_segments(backends.finisher("edgetpu"), bundle,
                           [(f"segments/{p.id}.tflite", p) for p in planned], tmp_path / "model.onnx", target)
    calls = (double.parent / "calls.txt").read_text().split("\n")
    assert [c.split() for c in calls if c] == [[str(bundle / "segments" / f"{s}.tflite") for s in ("s3", "s1", "s7")]]
    assert [d[0] for d in done] == [f"segments/{s}_edgetpu.tflite" for s in ("s3", "s1", "s7")]
    assert [(d[1]["on_chip_bytes"], d[1]["off_chip_bytes"]) for d in done] == [(2**20, 0), (0, 512 * 2**10),
                                                                                (0, 512 * 2**10)]
    assert all(d[2] is None for d in done)   # every op mapped: nothing to correct


def test_finish_groups_follow_the_plans_cache_priority():
    from edgesdk.bundling.bundle import finish_groups
    from edgesdk.scheduling.plan import Plan

    def seg(sid, device, backend="tflite"):
        return PlanSegment(sid, device, backend, f"segments/{sid}.onnx", (sid,), (), (), 0.0, 0, 1.0)

    segments = (seg("s0", "cpu", "tvm"), seg("s1", "edgetpu:0"), seg("s2", "edgetpu:1"), seg("s3", "edgetpu:0"),
                seg("s4", "edgetpu:0"))
    plan = Plan("arm_2tpu", "latency", (), (), {}, segments, (), (), {}, {}, {}, "", "", {}, {}, (),
                caches={"instances": {"edgetpu:0": {"compile_order": ["s3", "s1", "s4"]}}})
    assert finish_groups(plan) == {"edgetpu:0": ["s3", "s1", "s4"], "edgetpu:1": ["s2"]}
    assert finish_groups(Plan.from_json(plan.to_json())) == finish_groups(plan)
    without = Plan.from_json(plan.to_json().replace('"caches"', '"ignored"'))
    assert finish_groups(without) == {"edgetpu:0": ["s1", "s3", "s4"], "edgetpu:1": ["s2"]}


@pytest.mark.parametrize("script, says", [
    ("echo 'Internal compiler error. Aborting!'; exit 1", "edgetpu_compiler failed on a.tflite, b.tflite (exit 1)"),
    ('for m in "$@"; do case "$m" in *.tflite) cp "$m" "$3/$(basename "$m" .tflite)_edgetpu.tflite";; esac; done\n'
     "echo 'Input model: a.tflite'", "printed 1 model block(s) for 2 co-compiled models (a.tflite, b.tflite)"),
    ("exit 0", "edgetpu_compiler wrote no compiled model for a.tflite, b.tflite"),
])
def test_a_co_compiling_call_that_fails_says_which_models(tmp_path, monkeypatch, script, says):
    """A TEST DOUBLE compiler that fails, or prints fewer model blocks than it was given: a clear error
    naming the models, never a log credited to the wrong model."""
    from edgesdk.errors import UserError

    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "edgetpu_compiler").write_text(f"#!/bin/sh\n# TEST DOUBLE for Coral's edgetpu_compiler\n{script}\n")
    (bindir / "edgetpu_compiler").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    models = []
    for name in ("a", "b"):
        (tmp_path / f"{name}.tflite").write_bytes(b"model")
        models.append(tmp_path / f"{name}.tflite")
    with pytest.raises(UserError) as err:
        etc.compile_models(models, tmp_path)
    assert err.value.code == "package.edgetpu-compiler" and says in err.value.message
