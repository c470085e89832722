#!/usr/bin/env bash
# On the GPU host: every bundle of one part (benchmarks/gpu/zoo_pack.py) self-tested as `edgesdk verify` runs it,
# `python3 -B -m runtime selftest --json` in the bundle (its CUDA kernels compiled by NVRTC for this GPU when the
# library loads), JOBS at once; one JSON line per bundle in RESULTS/selftest-PART.jsonl and a line each on stdout.
#   bash benchmarks/gpu/zoo_selftest.sh PART.tar RESULTS [JOBS]
set -uo pipefail
part=$(realpath "$1"); results=$(realpath -m "$2"); jobs=${3:-4}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$results"; cd "$work" && tar xf "$part" && tar xJf site.tar.xz || exit 1
gpu=$(nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader | head -1)
echo "gpu: $gpu; python: $(python3 -c 'import sys, numpy, onnxruntime; print(sys.version.split()[0], "numpy", numpy.__version__, "onnxruntime", onnxruntime.__version__)')"
export GPU="$gpu" SITE="$work/site" TVM_USE_RUNTIME_LIB=1 PYTHONDONTWRITEBYTECODE=1

one() {  # MODEL.tar.gz -> a JSON line
  local name=${1%.tar.gz}; mkdir -p "$name" && tar xzf "$1" -C "$name" || return
  local t0=$SECONDS rc=0
  # a runtime this host lacks (OpenVINO, LiteRT: not carried) is said, not counted as a failure
  local lacks; lacks=$(PYTHONPATH="$SITE" python3 -c '
import importlib.util, json, sys
need = {"onnxruntime": "onnxruntime", "openvino": "openvino", "tflite": "ai_edge_litert", "tvm": "tvm"}
backends = {s["backend"] for s in json.load(open(sys.argv[1]))["segments"]}
print(" ".join(sorted(need[b] for b in backends if importlib.util.find_spec(need.get(b, b)) is None)))' \
    "$name/bundle/manifest.json")
  if [ -n "$lacks" ]; then
    echo "{}" >"$name/selftest.json"; echo "not run: this host lacks $lacks" >"$name/selftest.err"; rc=125
  else
    (cd "$name/bundle" && PYTHONPATH="$SITE:$PWD" timeout 600 python3 -B -m runtime selftest --json \
       >../selftest.json 2>../selftest.err)
    rc=$?
  fi
  python3 - "$name" "$rc" "$((SECONDS - t0))" "$(sha256sum "$1" | cut -d' ' -f1)" <<'EOF'
import json, os, sys
name, rc, seconds, sha = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
line = {"model": name, "bundle_sha256": sha, "gpu": os.environ["GPU"], "rc": rc, "seconds": seconds}
said = open(f"{name}/selftest.err", errors="replace").read()
if rc == 125:
    line.update(passed=None, not_run=said.strip())
    print(json.dumps(line))
    sys.exit()
try:
    report = json.load(open(f"{name}/selftest.json"))
    line.update(passed=report["passed"], load_seconds=report.get("load_seconds"), notes=report.get("notes", []),
                outputs={o["output"]: o["passed"] for o in report["outputs"]},
                segments={s["segment"]: s["passed"] for s in report["segments"]}, stream=report["stream"]["passed"])
except (OSError, ValueError, KeyError):
    line.update(passed=False, error=" ".join(said.split()[-60:]))
print(json.dumps(line))
EOF
}
export -f one
ls *.tar.gz | xargs -P "$jobs" -I{} bash -c 'one {}' | tee "$results/selftest-$(basename "$part" .tar).jsonl" |
  python3 -c 'import json, sys
for l in sys.stdin:
    r = json.loads(l); state = {True: "passed", False: "FAILED", None: "not run"}[r["passed"]]
    print(r["model"], state, r["seconds"], "s", (r.get("error") or r.get("not_run") or "")[:300], flush=True)'
