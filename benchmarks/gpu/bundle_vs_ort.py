"""From a bundle directory on a GPU host: load the bundle, time N runs of its golden input on the bundle
and onnxruntime (CPU) on the source model, interleaved; print medians and the outputs' difference as JSON."""
import json, os, sys, time, statistics
from pathlib import Path
import numpy as np
sys.path.insert(0, os.getcwd())
from runtime.executor import BundleModel

src, n = sys.argv[1], int(sys.argv[2])
t0 = time.perf_counter()
model = BundleModel(Path.cwd(), log=lambda s: print(s, file=sys.stderr))
load_s = time.perf_counter() - t0
feeds = dict(np.load("golden/inputs.npz"))
golden = dict(np.load("golden/outputs.npz"))
import onnxruntime as ort
so = ort.SessionOptions()
sess = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
names = [i.name for i in sess.get_inputs()]
first = model.run(feeds)
ref = sess.run(None, {k: feeds[k] for k in names})
for _ in range(5):
    model.run(feeds); sess.run(None, {k: feeds[k] for k in names})
tb, to = [], []
for _ in range(n):
    a = time.perf_counter(); model.run(feeds); tb.append(time.perf_counter() - a)
    a = time.perf_counter(); sess.run(None, {k: feeds[k] for k in names}); to.append(time.perf_counter() - a)
outs = list(first.values())
diff = [float(np.abs(o - r).max() / max(np.abs(r).max(), 1e-12)) for o, r in zip(outs, ref)]
gdiff = [float(np.abs(first[k] - golden[k]).max() / max(np.abs(golden[k]).max(), 1e-12)) for k in golden]
print(json.dumps({"load_s": load_s, "bundle_ms": statistics.median(tb) * 1e3, "ort_cpu_ms": statistics.median(to) * 1e3,
                  "ort_threads": os.cpu_count(), "rel_diff_vs_ort": diff, "rel_diff_vs_golden": gdiff, "runs": n,
                  "ort_providers": ort.get_available_providers()}))
