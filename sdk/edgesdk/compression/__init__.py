"""Model compression by pruning: weight masks by pattern (`prune`), and the pruned model's fidelity to
the dense one with an optional least-squares weight correction (`fidelity`).

Sits beside `edgesdk.passes`: it reads and writes ONNX models and imports nothing above `ir`/`config`.
"""

from .fidelity import compare, correct_weights, fidelity
from .prune import Layer, PruneMethod, mask, parse_method, prunable, prune_model, select_layers

__all__ = ["Layer", "PruneMethod", "compare", "correct_weights", "fidelity", "mask", "parse_method", "prunable",
           "prune_model", "select_layers"]
