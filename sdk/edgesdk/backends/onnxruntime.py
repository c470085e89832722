"""onnxruntime: the reference executor (and the CPU backend for ops TVM's importer lacks)."""

from __future__ import annotations

import numpy as np
import onnx


def session(model: onnx.ModelProto, *, threads: int = 0):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], outputs: list[str] | None = None) -> dict[str, np.ndarray]:
    """Run `model` on `feeds`; `outputs` may name any intermediate tensor with a known type."""
    return run_many(model, [feeds], outputs)[0]


def run_many(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]],
             outputs: list[str] | None = None) -> list[dict[str, np.ndarray]]:
    """`run` on each of `feeds`, with one session."""
    m = model
    if outputs is not None:
        m = onnx.ModelProto()
        m.CopyFrom(model)
        known = {o.name for o in m.graph.output}
        vinfo = {vi.name: vi for vi in list(m.graph.value_info) + list(m.graph.input)}
        del m.graph.output[:]
        for name in outputs:
            if name in vinfo:
                m.graph.output.append(vinfo[name])
            elif name in known:
                m.graph.output.append(next(o for o in model.graph.output if o.name == name))
            else:
                m.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    sess = session(m)
    names = [o.name for o in sess.get_outputs()]
    return [dict(zip(names, sess.run(names, f))) for f in feeds]


def lowering_reason(node, shapes, consts) -> str | None:
    """onnxruntime runs every standard op; another domain's it does not know."""
    return None if not node.domain or node.domain == "ai.onnx" else f"onnxruntime has no kernel for domain {node.domain}"


def compile_segment(job):
    """A plan segment for a bundle (`registry.CompileJob`): its ONNX graph as it is, which the runtime's
    onnxruntime runner executes."""
    from ..ir import model as irm
    from ..runtime.manifest import TensorSpec
    from .registry import Compiled

    artifact = f"segments/{job.segment.id}.onnx"
    irm.save(job.model, job.segments_dir.parent / artifact)
    shapes, types = irm.static_shapes(job.model), irm.elem_types(job.model)

    def spec(name: str) -> TensorSpec:
        return TensorSpec(name=name, shape=shapes[name], dtype=irm.dtype_name(types[name]))

    return Compiled(artifact, tuple(spec(n) for n in job.segment.inputs), tuple(spec(n) for n in job.segment.outputs))
