"""Graph-level optimizations of the import stage: rewrites that keep the model's function.

Needs: a valid ONNX model, opset 13..21, static graph-input shapes, shapes inferred (value_info).
Guarantees: a valid ONNX model (checker passes, IR version <= 10) with the same graph inputs and
outputs (names, shapes, element types) computing the same function: integer and layout rewrites
exactly, float rewrites within rtol 1e-5 (each family's docstring gives its bound), with shapes
inferred again.

The rule families run in this order, each rule over the whole model (subgraphs included), and the
sequence repeats until a round fires nothing (at most `MAX_ROUNDS`):

1. no-op elimination             (`identity`: x*1, x+0, Dropout, no-op Reshape/Transpose/Cast/Expand, Identity;
                                  `pooling`: a pool's window cut to the padded input it reads)
2. constant folding              (`constant_folding`: onnxscript's folder, constants lifted)
3. loop unrolling                (`loops`: Loop with a small constant trip count -> copies of its body)
4. BatchNormalization folding    (`batchnorm`: into Conv, ConvTranspose, Gemm; inference mode only)
5. Conv/Gemm bias and activation (`conv_bias_activation`: per-channel Mul/Add into Conv, MatMul+Add
                                  -> Gemm, Min/Max -> Clip, Relu/Clip chains, HardSigmoid/HardSwish)
6. elementwise chains            (`elementwise`: constants of Mul/Div and Add/Sub chains combined)
7. transposes                    (`transpose`: pairs merged, transposes sunk through elementwise ops and
                                  through reshapes that only drop unit axes)
8. reshape chains                (`reshape`: Reshape/Flatten/Squeeze/Unsqueeze chains -> one Reshape)
9. redundancy                    (`redundancy`: initializer dedup, CSE, dead code)

A rule that raises (a bug, or a graph no rule foresaw) does not stop the build: the round is undone
from its snapshot, the rule is switched off, the round runs again, and the record's "rule_errors"
says which rule and why. If the result fails the ONNX checker the input model is returned unchanged.
"""

from __future__ import annotations

import logging

import onnx
import onnx_ir as ir

from . import (batchnorm, constant_folding, conv_bias_activation, elementwise, identity, loops, pooling, redundancy, reshape,
               transpose)
from ..ir import model as irm
from ..ir.model import op_counts
from .rule import MAX_ROUNDS, Rule, fixed_point  # noqa: F401 (MAX_ROUNDS: part of this package's API)


RULES: tuple[Rule, ...] = (
    *identity.RULES,
    *pooling.RULES,
    *constant_folding.RULES,
    *loops.RULES,
    *batchnorm.RULES,
    *conv_bias_activation.RULES,
    *elementwise.RULES,
    *transpose.RULES,
    *reshape.RULES,
    *redundancy.RULES,
)

log = logging.getLogger(__name__)


def optimize(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
    """Returns the optimized model and a record:
    {"rules": {rule_name: times_fired, ...}   # every rule that ran, 0 included, in the order they run
     "nodes_before": {op_type: count}, "nodes_after": {op_type: count},  # subgraphs included, sorted by op type
     "rounds": int}                            # fixed-point iterations, the last (quiet) one included
    plus "rule_errors": {rule_name: message} where a rule raised and was switched off.
    """
    graph, run = fixed_point(ir.serde.deserialize_model(model), RULES, isolate_errors=True)
    counts, errors, rounds = run.counts, run.errors, run.rounds

    result = ir.serde.serialize_model(graph)
    counts["remove-dead-nodes"] += _drop_unused_initializers(result)
    result.ir_version = min(result.ir_version or irm.IR_VERSION, irm.IR_VERSION)
    result = _infer_shapes(result)
    try:
        irm.check(result)
    except Exception as e:  # noqa: BLE001
        errors["checker"] = f"the optimized model is invalid, the input is kept: {str(e).splitlines()[0][:200]}"
        log.warning("passes: %s", errors["checker"])
        result, counts = model, {name: 0 for name in counts}
    record = {"rules": counts, "nodes_before": op_counts(model), "nodes_after": op_counts(result), "rounds": rounds}
    if errors:
        record["rule_errors"] = errors
    return result, record


def _drop_unused_initializers(model: onnx.ModelProto) -> int:
    """Initializers no node reads, subgraphs included. onnx_ir still counts a use by the nodes of an If
    branch that constant folding dropped, so its dead-code pass keeps what only that branch read."""
    used = ({i for n in _all_nodes(model.graph) for i in n.input} | {o.name for o in model.graph.output}
            | {i.name for i in model.graph.input})  # an input with a default keeps the signature
    dead = [t for t in model.graph.initializer if t.name not in used]
    for t in dead:
        model.graph.initializer.remove(t)
    return len(dead)


def _infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Shapes for the values the rules created; the kept value_info must agree with inference, else
    (a stale annotation) it is dropped and inferred afresh."""
    try:
        return irm.infer_shapes(model)
    except Exception:  # noqa: BLE001
        del model.graph.value_info[:]
        try:
            return irm.infer_shapes(model, strict=False)
        except Exception:  # noqa: BLE001 - the checker below decides whether the model is usable
            return model


def _all_nodes(graph: onnx.GraphProto):
    """Every node, those in If/Loop/Scan bodies included: an inlined branch is not new work."""
    return (node for g in irm.graphs(graph) for node in g.node)
