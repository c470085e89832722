"""Per-layer pruning plans: the knapsack against brute force, budgets that cannot be met or need nothing,
sensitivities measured on a real (small) network, per-layer methods in one model, and plan files."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from edgesdk.compression import parse_method, prunable, prune_model
from edgesdk.compression.plan import (DENSE, FORMAT, RESOLUTION, Option, choose, fastest, options, parse_candidates,
                                      read_plan, sensitivity, table, write_plan)
from edgesdk.errors import UsageError, UserError

from .test_prune import conv_net, initializer


def _options(rows):
    return {f"l{i}": [Option(DENSE, d, 0.0)] + [Option(f"m{k}", t, loss) for k, (t, loss) in enumerate(opts)]
            for i, (d, opts) in enumerate(rows)}


def _brute(options, dense_ms, budget):
    best = None
    names = list(options)
    for combo in itertools.product(*(options[n] for n in names)):
        t = dense_ms - sum(max(0.0, options[n][0].ms - o.ms) for n, o in zip(names, combo))
        if t <= budget:
            loss = sum(o.loss for o in combo)
            if best is None or loss < best:
                best = loss
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.5, 5.0),
                          st.lists(st.tuples(st.floats(0.05, 6.0), st.floats(0.0, 1.0)), min_size=1, max_size=3)),
                min_size=1, max_size=5),
       st.floats(0.0, 1.0), st.floats(0.0, 3.0))
def test_choose_meets_the_budget_with_the_least_loss_brute_force_finds(rows, where, rest):
    options = _options(rows)
    dense_ms = rest + sum(d for d, _ in rows)
    saving = sum(max(0.0, d - min(t for t, _ in opts)) for d, opts in rows)
    budget = dense_ms - where * saving  # between the fastest plan and the dense one
    got = choose(options, dense_ms, budget)
    assert got.predicted_ms <= budget + 1e-9
    best = _brute(options, dense_ms, budget)
    # savings are counted in whole steps of the time to save, rounded down: at most one step per layer lost
    slack = len(rows) * (dense_ms - budget) / RESOLUTION
    relaxed = _brute(options, dense_ms, budget - slack) if slack else best
    assert best - 1e-9 <= got.loss <= (relaxed if relaxed is not None else got.loss) + 1e-9
    assert got.loss == pytest.approx(sum(next(o.loss for o in options[n] if o.method == m)
                                         for n, m in got.layers.items()))


def test_choose_keeps_everything_dense_within_the_budget():
    options = _options([(2.0, [(1.0, 0.1)]), (3.0, [(1.0, 0.2)])])
    got = choose(options, 6.0, 6.0)
    assert got.layers == {"l0": DENSE, "l1": DENSE} and got.predicted_ms == 6.0 and got.loss == 0.0


def test_choose_trades_loss_for_time():
    # l0 saves 1 ms for 0.1, l1 saves 2 ms for 0.5: a budget needing 1 ms prunes l0, 2 ms prunes l1
    options = _options([(2.0, [(1.0, 0.1)]), (3.0, [(1.0, 0.5)])])
    assert choose(options, 6.0, 5.0).layers == {"l0": "m0", "l1": DENSE}
    assert choose(options, 6.0, 4.0).layers == {"l0": DENSE, "l1": "m0"}
    assert choose(options, 6.0, 3.0).layers == {"l0": "m0", "l1": "m0"}


def test_choose_never_takes_a_slower_kernel_as_a_saving():
    # the sparse kernel is slower here: its option saves nothing, so pruning it cannot help
    options = _options([(2.0, [(3.0, 0.0)]), (3.0, [(1.0, 0.4)])])
    got = choose(options, 5.0, 3.0)
    assert got.layers["l1"] == "m0" and got.predicted_ms == pytest.approx(3.0)


def test_choose_refuses_an_unreachable_budget_with_the_fastest_prediction():
    options = _options([(2.0, [(1.0, 0.1)]), (3.0, [(1.0, 0.5)])])
    with pytest.raises(UserError) as e:
        choose(options, 6.0, 2.5)
    assert e.value.code == "prune.budget-unreachable"
    assert "3.000 ms" in e.value.message and "6.000 ms" in e.value.message and "at least 3" in e.value.hint


def test_parse_candidates_reads_a_list_and_drops_repeats():
    assert [m.text for m in parse_candidates("2:4, 1:4,2:4")] == ["2:4", "1:4"]
    with pytest.raises(UsageError) as e:
        parse_candidates("2:4,,1:4")
    assert e.value.code == "prune.bad-method"
    with pytest.raises(UsageError):
        parse_candidates("2:4,3:2")


def test_prune_model_takes_a_method_per_layer():
    model = conv_net()
    layers = {x.name: x for x in prunable(model)}
    chosen = [layers["conv2"], layers["c3"]]
    pruned, records = prune_model(model, {"conv2": parse_method("2:4"), "c3": parse_method("1:4")}, chosen)
    assert [(r["layer"], r["method"]) for r in records] == [("conv2", "2:4"), ("c3", "1:4")]
    assert np.mean(initializer(pruned, "w2") == 0) == pytest.approx(0.5)
    assert np.mean(initializer(pruned, "w3") == 0) == pytest.approx(0.75)


def test_sensitivity_is_zero_for_a_mask_that_removes_nothing_and_grows_with_sparsity():
    model = conv_net(width=8)
    layers = {x.name: x for x in prunable(model)}
    rng = np.random.default_rng(0)
    samples = [{"x": rng.standard_normal((1, 3, 12, 12)).astype(np.float32)} for _ in range(4)]
    got = sensitivity(model, [layers["conv2"], layers["c3"]], [parse_method("15:16"), parse_method("2:4"),
                                                                parse_method("1:8")], samples)
    for name in ("conv2", "c3"):
        assert got[name]["15:16"] < got[name]["2:4"] < got[name]["1:8"] <= 1.0
        assert got[name]["15:16"] >= 0.0


def test_plan_files_round_trip_and_name_the_line_of_what_is_wrong(tmp_path):
    model = conv_net()
    layers = prunable(model)
    path = tmp_path / "plan.json"
    write_plan(path, {"conv2": "2:4", "c3": DENSE}, predicted_ms=1.5)
    assert read_plan(path, layers) == {"conv2": parse_method("2:4"), "c3": None}
    assert json.loads(path.read_text())["format"] == FORMAT

    path.write_text('{"layers": {\n  "conv2": "2:4",\n  "conv9": "1:4"\n}}\n')
    with pytest.raises(UsageError) as e:
        read_plan(path, layers)
    assert e.value.code == "prune.unknown-layer" and f"{path}:3:" in e.value.message and "conv2" in e.value.hint

    path.write_text('{"layers": {\n  "conv2": "3:2"\n}}\n')
    with pytest.raises(UsageError) as e:
        read_plan(path, layers)
    assert e.value.code == "prune.bad-method" and f"{path}:2:" in e.value.message

    path.write_text('{"layers": {\n  "conv2": "2:4",\n}}\n')
    with pytest.raises(UsageError) as e:
        read_plan(path, layers)
    assert e.value.code == "prune.plan-invalid" and f"{path}:3:" in e.value.message

    for text in ('[1, 2]', '{"format": "other/9", "layers": {}}'):
        path.write_text(text)
        with pytest.raises(UsageError) as e:
            read_plan(path, layers)
        assert e.value.code == "prune.plan-invalid"
    with pytest.raises(UsageError) as e:
        read_plan(tmp_path / "missing.json", layers)
    assert e.value.code == "prune.plan-unreadable"


@pytest.mark.parametrize("data, message", [
    (b'{"layers": {\n  "conv2": "2:4\xff"\n}}\n', "plan.json:2: not UTF-8 text (byte 0xff)"),
    # 100,000 levels: the JSON parser would recurse past Python's stack (RecursionError)
    (b'{"layers": {},\n "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     "plan.json:2: nested more than 32 levels deep"),
    (None, "plan.json: not a regular file (a FIFO)"),
])
def test_a_plan_file_that_is_not_utf8_nested_without_end_or_not_a_file_is_refused(tmp_path, data, message):
    import os

    path = tmp_path / "plan.json"
    if data is None:
        os.mkfifo(path)  # opened without waiting for a writer
    else:
        path.write_bytes(data)
    with pytest.raises(UsageError) as e:
        read_plan(path, prunable(conv_net()))
    assert e.value.message == f"{tmp_path}/{message}" and e.value.hint
    assert e.value.code == ("prune.plan-unreadable" if data is None else "prune.plan-invalid")


def test_options_take_the_kernel_the_build_will_run():
    layers = {x.name: x for x in prunable(conv_net())}
    chosen = [layers["conv2"], layers["c3"], layers["fc"]]
    times = {layers["conv2"].output: {"dense_ms": 2.0, "sparse_ms": {"2:4": 2.5, "1:4": 1.0}},
             layers["c3"].output: {"dense_ms": 1.0, "sparse_ms": {"2:4": 0.8, "1:4": 0.5}}}
    loss = {"conv2": {"2:4": 0.1, "1:4": 0.3}, "c3": {"2:4": 0.2, "1:4": 0.4}}
    methods = [parse_method("2:4"), parse_method("1:4")]
    got = options(chosen, times, loss, methods)
    # a sparse kernel slower than the dense one: the build keeps the dense one, so the option saves nothing
    assert [(o.method, o.ms, o.kernel) for o in got["conv2"]] == [(DENSE, 2.0, "dense"), ("2:4", 2.0, "dense"),
                                                                  ("1:4", 1.0, "sparse")]
    assert got["fc"] == [Option(DENSE, 0.0, 0.0)]  # a Gemm: no sparse kernel, no option but dense
    forced = options(chosen, times, loss, methods, "sparse")
    assert [o.ms for o in forced["conv2"]] == [2.0, 2.5, 1.0]
    assert [o.ms for o in options(chosen, times, loss, methods, "dense")["c3"]] == [1.0, 1.0, 1.0]
    record = {"options": {k: [vars(o) for o in v] for k, v in got.items()}, "dense_ms": 5.0, "predicted_ms": 4.0,
              "budget_ms": 4.5, "fastest_ms": 3.5, "loss": 0.3}
    lines = table(record, {"conv2": "1:4", "c3": DENSE, "fc": DENSE})
    assert any("conv2" in line and "<-" not in line for line in lines)
    assert any("1:4 (sparse)" in line and line.rstrip().endswith("<-") for line in lines)
    assert lines[-1].endswith("dense 5.000 ms, predicted 4.000 ms (budget 4.5 ms, fastest 3.500 ms; the kernels' savings "
                              "alone scaled by 1.00 to the whole segments'), summed loss 0.30000")


def test_the_savings_are_scaled_to_the_fastest_plan_measured_whole():
    # alone the kernels save 1 + 2 ms; whole, the fastest plan saves 6 (layout edges gone): every saving doubles
    options = _options([(2.0, [(1.0, 0.1)]), (3.0, [(1.0, 0.5)])])
    assert fastest(options) == {"l0": "m0", "l1": "m0"}
    got = choose(options, 10.0, 8.0, fastest_ms=4.0)
    assert got.scale == pytest.approx(2.0) and got.fastest_ms == pytest.approx(4.0)
    assert got.layers == {"l0": "m0", "l1": DENSE} and got.predicted_ms == pytest.approx(8.0)
    with pytest.raises(UserError, match="predicted at 4.000 ms"):
        choose(options, 10.0, 3.9, fastest_ms=4.0)
    # measured whole, the fastest plan is slower than the dense one: nothing saves time
    assert choose(options, 10.0, 10.0, fastest_ms=11.0).layers == {"l0": DENSE, "l1": DENSE}
    with pytest.raises(UserError):
        choose(options, 10.0, 9.0, fastest_ms=11.0)


def test_the_fastest_plan_breaks_ties_by_loss_and_keeps_what_saves_nothing_dense():
    options = {"a": [Option(DENSE, 2.0, 0.0), Option("2:4", 1.0, 0.3), Option("1:4", 1.0, 0.2)],
               "b": [Option(DENSE, 2.0, 0.0), Option("2:4", 2.0, 0.1)]}
    assert fastest(options) == {"a": "1:4", "b": DENSE}
