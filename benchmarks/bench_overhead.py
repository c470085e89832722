"""What a bundle's runtime adds to its backend's own call, per CPU backend: a bundle whose plan is one
segment on backend B against B's own session on the same inputs.

    .venv/bin/python benchmarks/bench_overhead.py [--runs 300] [--models mobilenet-v2,ppocr-cls]

Each model is imported once (`edgesdk build --until import`, into .cache/bench-overhead) and built as a one-segment
bundle on each CPU backend (TVM for the x86 target, onnxruntime, LiteRT fp32, OpenVINO fp32: the tune stage's
whole-span candidates, `selection.build`). In one process, 2 threads, on one held-out-like input (a photograph
or a rendered text line, as the model takes it), call by call interleaved: `BundleModel.run` (input checks,
the executor, the runner) and the backend's own call on the same runner's session (onnxruntime's
`InferenceSession.run`, OpenVINO's infer request, LiteRT's signature runner on the inputs already in its
layout, TVM's VM function on inputs made TVM tensors once, before the timing, with its outputs copied to
numpy); after 20 warm-up pairs, the median of each.
Which of the two goes first alternates from pair to pair (the second of a pair finds the caches warmer).
The overhead is their difference, in microseconds and as a share of the backend's own call. Results in
benchmarks/results/runtime-overhead.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "sdk")]
import _results  # noqa: E402  (after the path above)

CACHE = ROOT / ".cache" / "bench-overhead"
BACKENDS = ("tvm", "onnxruntime", "litert", "openvino")
GOAL = 0.03  # a one-segment bundle within 3 % of its backend's own call


def imported(name: str):
    """The model's canonical ONNX, as the import stage writes it, and an input for it."""
    import numpy as np
    import onnx
    from PIL import Image

    from tests import model_zoo

    source, shapes = {"mobilenet-v2": (model_zoo.mobilenet_v2(), []),
                      "ppocr-cls": (model_zoo.ppocr_cls(), ["--input-shape", model_zoo.PPOCR_CLS_SHAPE])}[name]
    out = CACHE / name
    path = out / ".build" / "1-import" / "model.onnx"
    if not path.exists():
        subprocess.run([sys.executable, "-m", "edgesdk", "build", str(source), "--target", "x86", "-o", str(out),
                        "--until", "import", "--quiet", *shapes], check=True)
    model = onnx.load(path)
    (x,) = model.graph.input
    shape = [d.dim_value for d in x.type.tensor_type.shape.dim]
    if name == "mobilenet-v2":  # a photograph, NHWC in [-1, 1]
        img = Image.fromarray(model_zoo.photos()[2]).resize((shape[2], shape[1]), Image.BILINEAR)
        feed = np.asarray(img, np.float32)[None] / 127.5 - 1.0
    else:  # a rendered text line, NCHW, PP-OCR's own preprocessing
        line = model_zoo.text_line_pixels(1)[0]
        img = Image.fromarray(line).resize((shape[3], shape[2]), Image.BILINEAR).convert("RGB")
        feed = (np.asarray(img, np.float32).transpose(2, 0, 1)[None] / 255.0 - 0.5) / 0.5
    return model, {x.name: np.ascontiguousarray(feed, np.float32)}


def one_segment_bundle(name: str, backend: str, model) -> Path:
    from edgesdk.config import load_target
    from edgesdk.ir import model as irm
    from edgesdk.scheduling import selection
    from edgesdk.scheduling.plan import PlanSegment

    out = CACHE / name / backend
    if not (out / "manifest.json").exists():
        g = model.graph
        inits = {i.name for i in g.initializer}
        seg = PlanSegment("s0", "cpu", backend, "segments/s0.onnx",
                          tuple(irm.node_name(n, i) for i, n in enumerate(g.node)),
                          tuple(i.name for i in g.input if i.name not in inits), tuple(o.name for o in g.output),
                          0.0, 0, 1.0)
        selection.build(selection.Candidate(backend, (seg,)), {"s0": model}, load_target("x86")[0], out,
                        CACHE / "db")
    return out


def own_call(runner, feeds: dict):
    """The backend's own call on the runner's session, its inputs already as that backend takes them."""
    kind = type(runner).__name__
    if kind == "OrtRunner":
        return lambda: runner.session.run(runner.outputs, feeds)
    if kind == "OvRunner":
        return lambda: runner._request.infer(feeds, share_inputs=True, share_outputs=False)
    if kind == "TfliteRunner":
        args = runner._args(feeds)
        return lambda: runner._shared.runner(**args)
    if kind == "TvmRunner":
        from edgesdk.runtime.backends import tvm_runner

        # the inputs made TVM tensors once, before the timing: its own call at its best
        args = [runner._tensor(feeds[spec.name], device=runner._device) for spec in runner._inputs]

        def tvm_call():
            result = runner._main(*args, *runner._weights)
            return [v.numpy() for v in (list(result) if tvm_runner._is_tuple(result) else [result])]
        return tvm_call
    raise ValueError(f"no own call known for {kind}")


def measure(bundle: Path, feeds: dict, runs: int) -> dict:
    from edgesdk.runtime import BundleModel

    model = BundleModel(bundle, log=lambda s: None)
    ((_, runner),) = model.runners
    call = own_call(runner, feeds)
    for _ in range(20):
        model.run(feeds)
        call()
    own, whole = [], []
    pair = [(lambda: model.run(feeds), whole), (call, own)]
    for k in range(runs):  # in turn, which goes first alternating: the second of a pair finds the caches warmer
        for f, laps in (pair if k % 2 else pair[::-1]):
            t0 = time.perf_counter()
            f()
            laps.append(time.perf_counter() - t0)
    o, w = statistics.median(own) * 1e3, statistics.median(whole) * 1e3
    model.close()
    return {"own_ms": round(o, 4), "bundle_ms": round(w, 4), "overhead_us": round((w - o) * 1e3, 1),
            "overhead": round((w - o) / o, 4), "runner": type(runner).__name__}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--models", default="mobilenet-v2,ppocr-cls")
    args = ap.parse_args()
    os.environ["EDGESDK_NUM_THREADS"] = os.environ["TVM_NUM_THREADS"] = "2"
    rows = []
    for name in args.models.split(","):
        model, feeds = imported(name)
        for backend in BACKENDS:
            got = measure(one_segment_bundle(name, backend, model), feeds, args.runs)
            rows.append({"model": name, "backend": backend, **got})
            print(f"{name} on {backend}: bundle {got['bundle_ms']:.3f} ms, its own call {got['own_ms']:.3f} ms: "
                  f"+{got['overhead_us']} us ({got['overhead']:+.1%})", flush=True)
    _results.write("runtime-overhead", {"runs": args.runs, "threads": 2, "goal": GOAL, "rows": rows}, table(rows))


def table(rows: list[dict]) -> str:
    out = ["| model | backend | its own call (ms) | the bundle's run (ms) | overhead (µs) | overhead | within 3 % |",
           "|---|---|---:|---:|---:|---:|---|"]
    out += [f"| {r['model']} | {r['backend']} | {r['own_ms']:.3f} | {r['bundle_ms']:.3f} | {r['overhead_us']} | "
            f"{r['overhead']:+.1%} | {'yes' if r['overhead'] <= GOAL else 'no'} |" for r in rows]
    return "\n".join(out)


if __name__ == "__main__":
    main()
