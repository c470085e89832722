"""`clip-pool-window`: a pooling window that reaches past its padded input cut to it (passes/pooling.py)."""

from __future__ import annotations

import pytest

from tests.passes.harness import check_does_not_fire, check_fires, model, node

X = {"x": (1, 8, 7, 7)}


@pytest.mark.parametrize("op, extra", [("AveragePool", {"count_include_pad": 1}), ("AveragePool", {}), ("MaxPool", {})])
def test_a_window_larger_than_the_input_reads_the_input(op, extra):
    """transformers' EfficientNet: AvgPool2d(2560, ceil_mode=True) on 7x7 features: one window, k = 2560, the
    mean of the 49 cells (what onnxruntime computes, before and after); TVM padded to 2560 x 2560 per channel
    and died with std::bad_alloc."""
    m = model([node(op, ["x"], ["y"], kernel_shape=[2560, 2560], strides=[2560, 2560], ceil_mode=1, **extra)], X,
              ["y"])
    out = check_fires(m, "clip-pool-window")
    pool = next(n for n in out.graph.node if n.op_type == op)
    assert list(next(a.ints for a in pool.attribute if a.name == "kernel_shape")) == [7, 7]
    assert list(next(a.ints for a in pool.attribute if a.name == "strides")) == [1, 1]


def test_declared_pads_stay_inside_the_window():
    """With pads, the window is the padded input: count_include_pad still counts the declared pad cells."""
    m = model([node("AveragePool", ["x"], ["y"], kernel_shape=[64, 64], strides=[64, 64], pads=[1, 1, 1, 1],
                    ceil_mode=1, count_include_pad=1)], X, ["y"])
    out = check_fires(m, "clip-pool-window")
    pool = next(n for n in out.graph.node if n.op_type == "AveragePool")
    assert list(next(a.ints for a in pool.attribute if a.name == "kernel_shape")) == [9, 9]


def test_windows_inside_the_input_stay():
    m = model([node("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)], X, ["y"])
    check_does_not_fire(m, "clip-pool-window", kept=("MaxPool",))
    # a whole-input window already: nothing to cut
    m = model([node("AveragePool", ["x"], ["y"], kernel_shape=[7, 7])], X, ["y"])
    check_does_not_fire(m, "clip-pool-window", kept=("AveragePool",))
