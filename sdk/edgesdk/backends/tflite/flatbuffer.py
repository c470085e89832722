"""Reading a .tflite flatbuffer: its operators per subgraph and their counts."""

from __future__ import annotations


def operators(model: bytes) -> tuple[tuple[str, ...], ...]:
    """The operators of each subgraph of a .tflite flatbuffer (the main one first), in execution
    order: builtin operators by their schema name (CONV_2D, ...), custom ops by their custom code."""
    from ai_edge_litert import schema_py_generated as schema

    names = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
    m = schema.Model.GetRootAs(model, 0)
    codes = []
    for i in range(m.OperatorCodesLength()):
        c = m.OperatorCodes(i)
        code = max(c.BuiltinCode(), c.DeprecatedBuiltinCode())
        codes.append(c.CustomCode().decode() if code == schema.BuiltinOperator.CUSTOM else names[code])
    return tuple(tuple(codes[g.Operators(i).OpcodeIndex()] for i in range(g.OperatorsLength()))
                 for g in (m.Subgraphs(s) for s in range(m.SubgraphsLength())))


def op_counts(model: bytes) -> dict[str, int]:
    """Histogram of the operators of a .tflite flatbuffer, over all its subgraphs."""
    counts: dict[str, int] = {}
    for graph in operators(model):
        for name in graph:
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))
