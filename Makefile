# Two commands matter: `make run` (isolated training on the embedded default model) and
# `make test`. Both create .venv/ on first use; `make install` does only that.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test test-slow bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first: the CPU build 2.13.0, so no later requirement pulls a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: install
	$(BIN)/swarm-node train --config configs/isolated.yaml

test: install
	$(BIN)/python -m pytest -q

test-slow: install
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) build *.egg-info
