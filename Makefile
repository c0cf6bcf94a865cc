# Quickstart: `make check` (set up .venv, run the conformance report), `make test` (the suite).
# `make docs` builds the site (mkdocs, strict) into site/.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: check test explore triton-oldest lint format docs bench clean

# The pinned CPU build of PyTorch goes in first, from PyTorch's CPU index, as the README's
# install does: a bare `torch` requirement would otherwise pull a CUDA build of several GB.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0 --index-url $(TORCH_INDEX)
	$(BIN)/pip install --quiet -e '.[test,dev,plot,hf,docs]'
	touch $(STAMP)

# `attngrad build`: the fused strategy's C++ kernels, compiled once per torch version and CPU
# into $ATTNGRAD_CACHE_DIR (else ~/.cache/attngrad); a no-op once built.
# TRITON_INTERPRET=1: the triton strategy's kernels run on CPU in Triton's interpreter
check: $(STAMP)
	$(BIN)/attngrad build
	TRITON_INTERPRET=1 $(BIN)/attngrad check

# --dist worksteal: a worker that runs out of tests takes the other's pending ones, so the
# two end together although a few triton tests take a minute or more
test: $(STAMP)
	$(BIN)/attngrad build
	$(BIN)/python -m pytest -n 2 --dist worksteal

# `make explore`: the property tests on fresh random examples, where `make test` draws the same
# ones on every run (tests/conftest.py's profiles); SEED=N replays a run.  A failure prints the
# seed that draws it, and Hypothesis the falsifying example and its @reproduce_failure blob.
explore: $(STAMP)
	$(BIN)/attngrad build
	@seed=$${SEED:-$$($(BIN)/python -c 'import random; print(random.getrandbits(32))')}; \
	echo "property tests on fresh examples: --hypothesis-seed=$$seed"; \
	$(BIN)/python -m pytest -n 2 -p no:cacheprovider tests/verify/test_property.py \
		--hypothesis-profile=explore --hypothesis-seed=$$seed \
	|| { echo "a property failed on --hypothesis-seed=$$seed: make explore SEED=$$seed replays it"; \
	     exit 1; }

# The oldest Triton attngrad supports: the `gpu` extra's lower bound, the Triton of PyTorch 2.11's
# CUDA builds.  It goes into a folder of its own, put ahead of .venv's newest Triton on
# PYTHONPATH, with numpy < 2.4 (Triton 3.6's interpreter converts one-element arrays with int(),
# which numpy 2.4 refuses).  Under it: the triton strategy's interpreter tests, its edge inputs
# and properties (tests/verify -k triton), and the compile report's tests, which run `attngrad
# kernels --target sm_90|sm_80 --quick` against 3.6's own tile table.
TRITON_OLDEST := 3.6.0
OLDEST := .triton-$(TRITON_OLDEST)
TRITON_TESTS := tests/strategies/test_triton.py tests/tools/test_kernel_report.py

$(OLDEST)/.installed: $(STAMP)
	rm -rf $(OLDEST)
	$(BIN)/pip install --quiet --no-deps --target $(OLDEST) triton==$(TRITON_OLDEST) 'numpy<2.4'
	touch $@

triton-oldest: $(OLDEST)/.installed
	PYTHONPATH=$(OLDEST) $(BIN)/python -c 'import triton; print("Triton", triton.__version__)'
	PYTHONPATH=$(OLDEST) $(BIN)/python -m pytest -n 2 $(TRITON_TESTS)
	PYTHONPATH=$(OLDEST) $(BIN)/python -m pytest -n 2 tests/verify -k triton

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix src tests benchmarks examples
	$(BIN)/ruff format src tests benchmarks examples

# --strict: a broken link, a missing page or a docstring mkdocstrings cannot read fails the build
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(BIN)/python benchmarks/benchmark_cpu.py

clean:
	rm -rf $(VENV) .triton-* build site src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
