"""The questions the benchmarks answer: each one's script, the command that regenerates its results file,
and one line of what it answers and how. RESULTS.md lists them in this order.

`make bench Q=<name>` runs `command`; a question whose command needs hardware this host lacks has `manual`
set to say where it runs, and `make bench` passes over it.
"""

from __future__ import annotations

from dataclasses import dataclass

PY = ".venv/bin/python"


@dataclass(frozen=True)
class Question:
    title: str
    script: str
    command: str
    answers: str
    how: str
    manual: str = ""


QUESTIONS: dict[str, Question] = {
    "x86-latency": Question(
        "x86 bundle latency against onnxruntime and OpenVINO",
        "bench_cpu.py", f"{PY} benchmarks/bench_cpu.py --runs 20 --rounds 6",
        "How fast is an x86 bundle (each CPU span on the backend its build measured fastest) against the "
        "faster of onnxruntime and OpenVINO fp32 on the user's model file, against OpenVINO's default "
        "precision, and against a TVM-only bundle?",
        "targets/x86.yaml as shipped, 2 threads; each runtime in turn in a fresh process, 6 rounds of 20 "
        "inferences after 5 warm-up ones, the median; every bundle checked against onnxruntime first."),
    "x86-latency-auto": Question(
        "x86 bundle latency for this host's CPU with --cpu-precision auto, against onnxruntime and OpenVINO",
        "bench_cpu.py", f"{PY} benchmarks/bench_cpu.py --runs 20 --rounds 6 --target-cpu native --cpu-precision auto "
        "--models MobileNetV2,ResNet50,EfficientNetB0,PP-OCRv4-det,PP-OCRv4-rec,transformer-encoder "
        "--out benchmarks/results/x86-latency-auto.json",
        "Built for this host's CPU with its reduced precisions admitted behind the accuracy gate (bf16, fp16, int8 "
        "where it has them), how fast is the bundle against onnxruntime fp32, OpenVINO fp32 and OpenVINO's default "
        "(bfloat16 on a CPU with AVX512_BF16 or AMX), and how far is each from fp32?",
        "as x86-latency, the target's CPU `mcpu: native`, synthetic calibration samples (uniform in [-1, 1]) for the "
        "gate; each one's largest error on the timing input against onnxruntime fp32, of the output's scale."),
    "x86-int8-latency": Question(
        "x86 int8 bundle latency against onnxruntime fp32 (min-max calibration)",
        "bench_cpu_int8.py", f"{PY} benchmarks/bench_cpu_int8.py --runs 20",
        "With `--cpu-precision int8`, how fast is the bundle against onnxruntime fp32, and how far is its "
        "output from fp32; how does onnxruntime's own int8 fare?",
        "int8 candidates (LiteRT mixed int8, onnxruntime QDQ) admitted only past the accuracy gate; accuracy "
        "on 16 new samples against onnxruntime fp32; timing as x86-latency, 3 rounds."),
    "x86-int8-latency-percentile": Question(
        "x86 int8 bundle latency against onnxruntime fp32 (percentile calibration)",
        "bench_cpu_int8.py",
        f"{PY} benchmarks/bench_cpu_int8.py --runs 20 --calib-method percentile "
        "--models PP-OCRv4-det,PP-OCRv4-rec,PP-OCR-cls",
        "The same as x86-int8-latency with percentile calibration, on the pretrained models.",
        "as x86-int8-latency; calibrated on 32 text-line images with PP-OCR's preprocessing."),
    "calibrate-x86": Question(
        "`edgesdk calibrate` per CPU backend: predicted against measured on held-out models",
        "bench_calibrate.py", f"{PY} benchmarks/bench_calibrate.py",
        "Does each CPU backend's fitted cost model predict models it was not fitted on within 25 %?",
        "`edgesdk calibrate --target x86` fitted on 4 models (whole and in 4 cuts) and judged on 3 held out, "
        "5 rounds of 20 inferences per run, the quickest round's median."),
    "build-memory": Question(
        "Build memory against model size",
        "bench_memory.py", f"{PY} benchmarks/bench_memory.py --targets x86,arm_2tpu,rtx3090 --low-memory both",
        "What is a build's peak memory against its model's weights, per target and with `--low-memory`, and "
        "does it stay within 4 x the weights above a base build?",
        "resident memory of the build's whole process tree sampled every 0.2 s; base: the same build of a "
        "one-convolution model; each row the newest measurement of that build."),
    "converter-memory": Question(
        "TensorFlow's TFLite converter alone: memory per byte of weights",
        "bench_converter_memory.py", f"{PY} benchmarks/bench_converter_memory.py",
        "How much memory does one TFLite conversion (fp32 and full int8) hold per byte of a segment's weights?",
        "a 512 MiB MatMul segment read from external data, converted in a child process sampled from outside."),
    "accuracy-arm2tpu": Question(
        "Accuracy of int8 arm_2tpu bundles on real held-out inputs",
        "bench_accuracy.py",
        f"{PY} benchmarks/bench_accuracy.py --configs synthetic,minmax,best --best-method auto --no-verify",
        "Does an int8 arm_2tpu bundle meet each model's task goal against fp32 on real held-out inputs, with "
        "synthetic, min-max and the best (`auto`) calibration?",
        "each build a fresh process; the bundle run as its build's golden path runs it (Edge TPU segments on "
        "LiteRT's CPU interpreter); fp32 is onnxruntime on the original file."),
    "schedule-arm2tpu": Question(
        "Scheduling on arm_2tpu: predicted speedup over the ARM CPU alone",
        "bench_schedule.py", f"{PY} benchmarks/bench_schedule.py",
        "How much faster does the schedule's plan predict a model on arm_2tpu than the ARM CPU alone and than "
        "Coral's own rules (default, --num_segments 2, replication)?",
        "the simulator over targets/arm_2tpu.yaml's figures fitted to Coral's published benchmark; every "
        "model built up to the schedule stage in latency and throughput mode."),
    "fit-arm2tpu": Question(
        "arm_2tpu cost figures fitted to Coral's published benchmark",
        "fit_arm_2tpu.py", f"{PY} benchmarks/fit_arm_2tpu.py",
        "How close does the cost model with the fitted Cortex-A53 and Edge TPU figures come to Coral's "
        "published latencies, on the models it was fitted on and on those held out?",
        "two parameters per device fitted by least squares on relative errors (MobileNet v1, v2, Inception "
        "v1); ResNet-50, UNet and the USB references held out."),
    "legalize": Question(
        "Legalize for the Edge TPU",
        "bench_legalize.py", f"{PY} benchmarks/bench_legalize.py",
        "How much of a model does legalize move to the Edge TPU, at what error, and what does it do to the "
        "predicted arm_2tpu latency?",
        "`edgesdk check --target arm_2tpu` analysis; predicted latency from the schedule's plan built with "
        "and without rewrites, and Coral's default on the model as imported."),
    "inter-op-parallel": Question(
        "Inter-operator parallelism on x86, measured and predicted",
        "bench_parallel.py", f"{PY} benchmarks/bench_parallel.py --runs 30",
        "Does running independent groups of operators at once make x86 bundles faster, and does the DP "
        "predict it?",
        "each model built with the DP and with --no-inter-op on a target calibrated on this host, timed in "
        "interleaved rounds (median of 30)."),
    "tune": Question(
        "Tuning with MetaSchedule",
        "bench_tune.py", f"{PY} benchmarks/bench_tune.py --trials 600 --transfer-trials 96",
        "How fast are tuned x86 bundles against untuned ones, onnxruntime and LiteRT, and how many trials "
        "does a database from other models save?",
        "targets/x86.yaml with this host's mcpu, --no-inter-op; 600 trials per model into one database; "
        "latency median of 50 on 2 threads."),
    "prune": Question(
        "Pruned models: whole bundles against the dense bundle and onnxruntime",
        "bench_prune.py",
        f"{PY} benchmarks/bench_prune.py --models ResNet-18,MobileNetV2,ResNet50 --batches 16,1 "
        "--methods 1:4,2:4 --plans 0.5,1",
        "How much faster is a pruned bundle (N:M or a per-layer plan under a latency budget) than the dense "
        "one, and how far is its output from the dense model's?",
        "x86 with this host's mcpu, --trials 0; 3 interleaved rounds of 10 runs, each runtime in a process of "
        "its own, medians; each row the newest measurement of that build."),
    "sparse-layers": Question(
        "Sparse TVM kernels, ResNet-18's convolutions layer by layer",
        "bench_sparse.py", f"{PY} benchmarks/bench_sparse.py --batches 16,1 --trials 48 --runs 15 --rounds 3",
        "How fast are the sparse kernels on each of ResNet-18's convolutions against dense TVM (untuned and "
        "tuned) and onnxruntime?",
        "ms per layer (effective GFLOP/s), interleaved, medians; each batch's table from its newest run."),
    "field-arm2tpu": Question(
        "The arm_2tpu field bundle: size, int8 accuracy, load, latency, stream",
        "bench_field.py", f"{PY} benchmarks/bench_field.py --frames 32",
        "What does an arm_2tpu bundle weigh, how accurate is its int8 and how does it load, run and stream "
        "(on this host and emulated under qemu)?",
        "host: the bundle's plan with x86-64 twins and LiteRT's CPU interpreter; emulated: `edgesdk verify` "
        "under qemu-user."),
    "import": Question(
        "Import of every format, graph optimizations",
        "bench_import.py", f"{PY} benchmarks/bench_import.py --runs 30 --threads 2",
        "Does every format import, how far is the imported graph from the original framework, and does "
        "import's optimization make onnxruntime slower or faster?",
        "onnxruntime 2 threads, median of 30 interleaved runs; errors as max |a-b| / max |b| and L2."),
    "build-stages": Question(
        "Build time per stage, peak memory and bundle size, per target",
        "bench_e2e.py", f"{PY} benchmarks/bench_e2e.py --runs 50 --threads 2",
        "How long does each stage of a MobileNetV2 build take per target, and how large is the bundle?",
        "each build in its own process with an empty tuning database (--trials 0); peak memory is the build "
        "process's maximum resident set."),
    "input-checks": Question(
        "Cost of the runtime's input checks",
        "bench_inputs.py", f"{PY} benchmarks/bench_inputs.py --runs 60",
        "What share of an inference do the runtime's input checks take?",
        "x86 bundles as shipped; `check_feeds` alone and `BundleModel.run` interleaved, median of 60."),
    "runtime-overhead": Question(
        "What a bundle's runtime adds to its backend's own call",
        "bench_overhead.py", f"{PY} benchmarks/bench_overhead.py --runs 300",
        "How much slower is a bundle whose plan is one segment on backend B than B's own session on the same "
        "inputs, per CPU backend (goal: within 3 %)?",
        "MobileNetV2 (a photograph) and the pretrained PP-OCR classifier (a rendered text line), imported once and "
        "built as a one-segment bundle on TVM, onnxruntime, LiteRT fp32 and OpenVINO fp32; `BundleModel.run` and "
        "the backend's own call on the same runner's session, interleaved call by call in one process (which goes "
        "first alternating), 2 threads, median of 300 after 20 warm-up pairs."),
    "demo-bench": Question(
        "`edgesdk bench` on the demo bundle",
        "bench_demo.py", f"{PY} benchmarks/bench_demo.py",
        "What latency, throughput per caller count and stream rate does `edgesdk bench` report for the demo "
        "model's x86 bundle, and for its arm_2tpu bundle under qemu?",
        "`edgesdk bench BUNDLE --json` on the bundles `make demo`'s recipe builds."),
    "load": Question(
        "Load and soak of the demo bundle",
        "bench_load.py", f"{PY} benchmarks/bench_load.py --parts load,stream,soak --soak-minutes 30",
        "Does the runtime give right results under concurrent callers and a long stream, and does its memory "
        "stay flat over 30 minutes?",
        "the bundle's runtime in process; callers and stream checked against single runs; RSS sampled every "
        "10 s during the soak."),
    "trust": Question(
        "Signing, verification and install time",
        "bench_trust.py", f"{PY} benchmarks/bench_trust.py",
        "What do signing, verifying and installing a bundle into an A/B slot cost, on the host and on the "
        "device's runtime?",
        "medians of 15 runs (5 under qemu-user, 3 installs) on the demo model's bundles."),
    "pytorch-in": Question(
        "PyTorch models in: export and build time, and the bundle against eager PyTorch",
        "bench_pytorch.py", f"{PY} benchmarks/bench_pytorch.py",
        "How long do a ResNet, a MobileNet and a small transformer take to export (torch.export, torch.onnx) and "
        "build for x86 and arm_2tpu from Python, and does each bundle answer as eager PyTorch does?",
        "transformers' ResNet-18, MobileNetV2 1.0 and a DeiT-Tiny-sized ViT with random weights, each (model, "
        "target) in a fresh process; x86 with the schedule's TVM cut, untuned (--cpu-backends planned); 16 held-out "
        "crops of scikit-image's photographs; arm_2tpu calibrated on 32 others, judged by its --eval with eager "
        "PyTorch's top-1 as the labels."),
    "zoo": Question(
        "The zoo: real architectures users bring, built for every target",
        "bench_zoo.py", f"{PY} benchmarks/bench_zoo.py",
        "What share of real architectures (pretrained models from wheels; transformers, keras.applications and "
        "TFLite forms with random weights) build, verify and stay accurate on each target, and how does each fail?",
        "each model made once (benchmarks/zoo_models.py) with 32 real calibration samples and 8 held-out ones; each "
        "(model, target) in a fresh process runs `edgesdk build --json` then `edgesdk verify` (qemu for aarch64); "
        "x86 against onnxruntime and OpenVINO (fp32 and its default precision), each alone in a fresh process, "
        "rounds interleaved; arm_2tpu by the build's own int8 report."),
    "fuzz": Question(
        "Fuzzing every loader",
        "fuzz.py", f"{PY} benchmarks/fuzz.py --seed 21",
        "Does any loader crash, hang or leave files behind on hostile inputs?",
        "13,000 generated inputs from one seed, each through the CLI in a worker process."),
    "gpu-rtx3090": Question(
        "rtx3090 bundles on a real GPU",
        "gpu/run.sh", "benchmarks/gpu/prepare.sh DIR; on the GPU host: tar xJf pack.tar.xz && bash run.sh",
        "Do rtx3090 bundles load, pass their self-test and how fast do they run on a real NVIDIA GPU?",
        "bundles built here, run there with TVM's runtime alone; 50 interleaved runs against onnxruntime on "
        "that host's CPU (no GPU runtime of onnxruntime there).",
        manual="needs a GPU host: prepare.sh packs the bundles here, run.sh runs them there"),
}
