# Two commands: `make demo` and `make test`. Both build .venv from nothing on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check
STAMP  := $(VENV)/.installed
DEMO   := out/demo
PYTEST_ARGS ?=

.PHONY: demo test venv clean

venv: $(STAMP)

# Install order from shared/research/environment.md: CPU torch first (the box's local wheel),
# then the project, then Dynamo's dependencies and Dynamo itself with --no-deps (its
# `aisimulate` dependency is a stub that downloads from an unreachable index), then NIXL
# (the meta package wants both CUDA builds, so it too goes in with --no-deps).
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[kernels,convert,serve,dev]'
	$(PIP) install -q ai-dynamo-runtime==1.6.1 'aiohttp<4.0,>=3.14.3' 'certifi>=2026.10.19' \
	    'kubernetes<33.0.0,>=32.0.1' 'msgspec>=0.19.0' 'prometheus-client<1.0,>=0.23.1' \
	    'pyzmq>=26.0.0' 'redis<9.0.0,>=6.2.0' 'tqdm>=4.0.0' 'transformers>=4.56.0' \
	    'typing-extensions>=4.10.0' 'zstandard<1.0,>=0.23.0' uvloop
	$(PIP) install -q --no-deps ai-dynamo==1.6.1
	$(PIP) install -q nixl-cu12==1.3.2
	$(PIP) install -q --no-deps nixl==1.3.2
	touch $@

# Two pytest runs: the plain suite (Triton kernel tests deselected), then the kernel tests
# (marker `kernel`) on the CPU in Triton's interpreter, which must be switched on before Triton
# is imported, hence its own process. Either failing fails `make test`.
test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m kernel tests/plugins tests/test_autotune_kernels.py $(PYTEST_ARGS)

# The trained tiny Beam end to end: its facts; ModelOpt FP8 and NVFP4 checkpoints with an FP8
# KV cache, the NVFP4 one verified against it; BF16, FP8 and NVFP4 engines and transformers'
# model answering a coding request one after another (their Python must parse); then the
# NVFP4 engine served by the disaggregated Dynamo graph (frontend + prefill + decode on
# 127.0.0.1, KV over NIXL): the coding request and a get_weather tool call (its arguments
# validated against the tool's JSON schema) through the OpenAI API, then Ctrl-C.
# One torch thread per process: the tiny model's ops are too small to share two cores out.
demo: export OMP_NUM_THREADS = 1
demo: $(STAMP)
	rm -rf $(DEMO)
	$(BIN)/beam-trt init-tiny $(DEMO)/tiny --trained
	$(BIN)/beam-trt info $(DEMO)/tiny --context 4096
	$(BIN)/beam-trt convert $(DEMO)/tiny $(DEMO)/tiny-fp8 --quant fp8 --kv-cache fp8
	$(BIN)/beam-trt convert $(DEMO)/tiny $(DEMO)/tiny-nvfp4 --quant nvfp4 --kv-cache fp8
	$(BIN)/beam-trt verify $(DEMO)/tiny-nvfp4 --against $(DEMO)/tiny
	$(BIN)/beam-trt build $(DEMO)/tiny $(DEMO)/tiny-engine --max-seq-len 512 --block-size 16
	$(BIN)/beam-trt build $(DEMO)/tiny-fp8 $(DEMO)/tiny-fp8-engine --max-seq-len 512 --block-size 16
	$(BIN)/beam-trt build $(DEMO)/tiny-nvfp4 $(DEMO)/tiny-nvfp4-engine --max-seq-len 512 --block-size 16
	$(BIN)/python -m dynamo_graphs.demo_answers --checkpoint $(DEMO)/tiny bf16=$(DEMO)/tiny-engine \
	    fp8=$(DEMO)/tiny-fp8-engine nvfp4=$(DEMO)/tiny-nvfp4-engine
	$(BIN)/python -m dynamo_graphs.demo_chat dynamo_graphs/disagg.yaml

clean:
	rm -rf $(VENV) out
