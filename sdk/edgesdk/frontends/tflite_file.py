"""The converter child's reader of TFLite flatbuffers.

The flatbuffer is read first for what tf2onnx does not report (custom ops, signature names, the
inputs' shape signatures, state ops): a stateful model is refused, custom ops with a handler
(`tflite_custom`) are rewritten inside tf2onnx, and the inputs and outputs get the signature's names.
"""

from __future__ import annotations

import collections
from pathlib import Path

from ..errors import UserError
from . import tf2onnx_patches
from .tf2onnx_steps import finish, reading, tensorflow


def convert(request: dict) -> dict:
    _, tf2onnx, failures = tensorflow()
    from . import tflite_custom

    flatbuffer = reading("tflite", lambda: _read_tflite(request["source"]))
    _refuse_state(flatbuffer["state"], flatbuffer["subgraphs"])
    done: dict[str, str] = {}
    refused: dict[str, str] = {}
    rewrite = tflite_custom.rewriter(flatbuffer["custom_ops"], done, refused)
    with tf2onnx_patches.weights_stored() as stored, tf2onnx_patches.tflite_read_lean(tf2onnx.tflite_utils):
        proto = tf2onnx_patches.lean_first(tf2onnx, lambda: tf2onnx.convert.from_tflite(
            request["source"], opset=request["opset"], custom_rewriter=[rewrite] if rewrite else None)[0])
    storage = stored[-1]
    _rename_values(proto.graph, flatbuffer["signature_names"])
    notes = [f"TFLite custom op {code} ({count} node(s)) converted by edgesdk as {tflite_custom.HANDLERS[code][0]}"
             for code, count in sorted(collections.Counter(done.values()).items())]
    # A TFLite file fixes its shapes; only a -1 in shape_signature marks a batch that can change.
    notes += [f"TFLite input '{flatbuffer['signature_names'].get(name, name)}' has the static shape "
              f"{'x'.join(map(str, shape))} in the file: --batch {request['batch']} does not apply to it"
              for name, shape, signature in flatbuffer["inputs"]
              if shape and request["batch"] != shape[0] and (not signature or signature[0] != -1)]
    result = finish(proto, request, tf2onnx, {**failures.failed, **refused}, notes, storage)
    result["custom_codes"] = sorted({op.code for op in flatbuffer["custom_ops"]})
    return result


# TFLite's resource-variable ops: a model that keeps state between invocations (a tf.Variable
# assigned inside the converted function). CALL_ONCE runs the subgraph that initializes the
# variables. tf2onnx 1.17 has no conversion for any of them and fails with an IndexError.
STATE_OPS = ("VAR_HANDLE", "READ_VARIABLE", "ASSIGN_VARIABLE", "CALL_ONCE")


def _read_tflite(path: str) -> dict:
    """From the flatbuffer: every custom op (code, output tensor, options), the main subgraph's
    inputs (name, shape, shape_signature), signature names for its input and output tensors
    (what the user called them), the number of subgraphs, and per subgraph the count of each
    state op (STATE_OPS) it holds."""
    from tf2onnx.tflite.BuiltinOperator import BuiltinOperator
    from tf2onnx.tflite.Model import Model

    from .tflite_custom import CustomOp

    model = Model.GetRootAsModel(bytearray(Path(path).read_bytes()), 0)
    builtin_names = {v: k for k, v in vars(BuiltinOperator).items() if not k.startswith("_")}
    custom_codes, op_names = {}, {}
    for i in range(model.OperatorCodesLength()):
        code = model.OperatorCodes(i)
        builtin = max(code.DeprecatedBuiltinCode(), code.BuiltinCode())
        op_names[i] = builtin_names.get(builtin, str(builtin))
        if builtin == BuiltinOperator.CUSTOM:
            custom_codes[i] = (code.CustomCode() or b"").decode(errors="replace")
    custom_ops = []
    state = []
    for s in range(model.SubgraphsLength()):
        graph = model.Subgraphs(s)
        ops = collections.Counter(op_names.get(graph.Operators(k).OpcodeIndex()) for k in range(graph.OperatorsLength()))
        if any(ops[name] for name in STATE_OPS):
            state.append((s, (graph.Name() or b"").decode(errors="replace"), {n: ops[n] for n in STATE_OPS if ops[n]}))
        for k in range(graph.OperatorsLength()):
            op = graph.Operators(k)
            if op.OpcodeIndex() in custom_codes and op.OutputsLength():
                options = b"" if op.CustomOptionsIsNone() else op.CustomOptionsAsNumpy().tobytes()
                custom_ops.append(CustomOp(custom_codes[op.OpcodeIndex()],
                                           graph.Tensors(op.Outputs(0)).Name().decode(errors="replace"), options))
    main = model.Subgraphs(0)
    inputs = []
    for j in range(main.InputsLength()):
        t = main.Tensors(main.Inputs(j))
        inputs.append((t.Name().decode(errors="replace"), [int(d) for d in t.ShapeAsNumpy()] if t.ShapeLength() else [],
                       [int(d) for d in t.ShapeSignatureAsNumpy()] if t.ShapeSignatureLength() else []))
    return {"custom_ops": custom_ops, "signature_names": _signature_names(model), "inputs": inputs,
            "subgraphs": model.SubgraphsLength(), "state": state}


def _signature_names(model) -> dict[str, str]:
    """Tensor name -> the name the model's one signature gives that input or output; none where the
    model has no signature or several."""
    names = {}
    if model.SignatureDefsLength() == 1:
        signature = model.SignatureDefs(0)
        graph = model.Subgraphs(signature.SubgraphIndex())
        for tensors, count in ((signature.Inputs, signature.InputsLength()), (signature.Outputs, signature.OutputsLength())):
            for j in range(count):
                t = tensors(j)
                names[graph.Tensors(t.TensorIndex()).Name().decode(errors="replace")] = t.Name().decode(errors="replace")
    return names


def _refuse_state(state: list[tuple[int, str, dict[str, int]]], subgraphs: int) -> None:
    """A model with resource variables is refused before tf2onnx sees it, naming the ops: the
    compiled bundle is a function of its inputs, and tf2onnx would fail with an IndexError."""
    if not state:
        return
    present = {op for _, _, ops in state for op in ops}
    raise UserError(
        "import.tflite-stateful",
        f"the TFLite model keeps state in resource variables: ops {', '.join(n for n in STATE_OPS if n in present)} "
        f"in {len(state)} of its {subgraphs} subgraph(s); edgesdk converts stateless models only",
        "export the model without state: a function that only reads its variables converts with them frozen "
        "into constants; one that assigns them must take the state as an input and return the new state as an "
        "output (as an RNN cell does with h and c)",
        notes=[f"subgraph {i} '{name}': " + ", ".join(f"{op} x{n}" for op, n in ops.items())
               for i, name, ops in state])


def _rename_values(graph, names: dict[str, str]) -> None:
    """Rename graph inputs and outputs (and every use of them) where the new names are unused."""
    taken = {v for n in graph.node for v in list(n.input) + list(n.output)} | {i.name for i in graph.initializer}
    io = {v.name for v in list(graph.input) + list(graph.output)}
    names = {old: new for old, new in names.items() if old in io and old != new}
    if not names or len(set(names.values())) != len(names) or set(names.values()) & (taken - set(names)):
        return

    def rename(g):
        for v in [*g.input, *g.output, *g.value_info]:
            v.name = names.get(v.name, v.name)
        for n in g.node:
            n.input[:] = [names.get(v, v) for v in n.input]
            n.output[:] = [names.get(v, v) for v in n.output]
            for sub in _subgraphs(n):  # subgraphs may read outer values by name
                rename(sub)

    rename(graph)


def _subgraphs(node) -> list:
    return [g for a in node.attribute for g in ([a.g] if a.HasField("g") else []) + list(a.graphs)]
