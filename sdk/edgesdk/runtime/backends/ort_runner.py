"""onnxruntime runner, for CPU segments: the ops TVM's importer lacks, or a whole CPU span where the tune
stage measured onnxruntime fastest."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

from ..manifest import ManifestError, Segment

# onnxruntime's rewrite rules that change what a model computes, switched off in every session edgesdk opens:
# Pad_Fusion folds a Pad into the MaxPool after it as the pool's own padding, which MaxPool fills with -inf,
# not with the Pad's 0, so a window whose values are all negative reads 0 as itself (ResNet50V2's stem, a
# zero Pad before its MaxPool on pre-activation values: off by 0.78 at the borders, with every optimization
# level but none). The fusion saves a copy; without it a Pad runs as its own op.
WRONG_FUSIONS = ["Pad_Fusion"]


class OrtRunner:
    def __init__(self, bundle: Path, segment: Segment, threads: int = 0, *, spinning: bool = False):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if threads:
            opts.intra_op_num_threads = threads
        # Idle intra-op threads spin by default, taking the cores from the next segment's backend: only a
        # segment alone on the CPU keeps onnxruntime's default (spinning is faster between its kernels).
        if not spinning:
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self.session = ort.InferenceSession(str(bundle / segment.artifact), opts, providers=["CPUExecutionProvider"],
                                                disabled_optimizers=WRONG_FUSIONS)
        except Exception as e:  # onnxruntime's own exception types: the artifact is not a model it loads
            said = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise ManifestError(f"segment {segment.id}: {segment.artifact} is not a model onnxruntime loads "
                                f"({said})") from None
        self.outputs = [o.name for o in segment.outputs]
        takes = sorted(i.name for i in self.session.get_inputs())
        gives = {o.name for o in self.session.get_outputs()}
        if takes != sorted(t.name for t in segment.inputs) or not gives.issuperset(self.outputs):
            raise ManifestError(f"segment {segment.id}: its model takes {takes} and gives {sorted(gives)}; the manifest "
                                f"lists {sorted(t.name for t in segment.inputs)} and {sorted(self.outputs)}")
        self.note = ""
        self._lock = threading.Lock()

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._lock:
            return dict(zip(self.outputs, self.session.run(self.outputs, feeds)))


def open_runner(bundle: Path, segment: Segment, physical_device: str | None, *, alone: bool = False) -> OrtRunner:
    """A segment's threads where its parallel step sets them, else the bundle's CPU threads (the target's
    cores, at most this host's: EDGESDK_NUM_THREADS, as LiteRT's). Left unset, onnxruntime takes one
    thread per physical core and pins them to cores: on 2-vCPU hosts that ran MobileNetV2 2.5 % slower
    than the same two threads unpinned, each alone in a process, in turn."""
    threads = segment.threads or int(os.environ.get("EDGESDK_NUM_THREADS") or 0)
    return OrtRunner(bundle, segment, threads, spinning=alone)
