# convgen: `make` sets up, builds the default kernel set and shows a comparison; `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CONVGEN := $(PY) -m convgen
INSTALLED := $(VENV)/.installed
BENCH_INSTALLED := $(VENV)/.bench-installed
BENCH_ARGS ?=

.PHONY: all setup build generate compare test bench sanitize tune clean

all: build generate compare

setup: $(INSTALLED)

$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet 'torch==2.13.0+cpu'
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(INSTALLED)

build: $(INSTALLED)
	$(CONVGEN) build kernels.toml

generate: $(INSTALLED)
	$(CONVGEN) generate kernels.toml -o generated/

compare: build
	$(CONVGEN) compare k3s1p1 --shape 8,64,56,56,64 --repeat 5
	$(CONVGEN) compare k7s2p3 --shape 8,3,224,224,64 --repeat 5
	$(CONVGEN) compare k3s1p1 --shape 1,32,32,32,32 --repeat 5

# Measure what algorithm="auto" may take on the benchmark networks' layers; the fastest become this
# machine's wisdom (convgen wisdom show | forget).
tune: build
	$(CONVGEN) tune

# One pytest-xdist worker per core: the tests compile their kernels up front or on first use, a module
# of every op per window, the workers side by side (a module one worker is compiling, the other waits
# for and loads).
TEST_WORKERS ?= auto
test: $(INSTALLED)
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests

# The bench extra (matplotlib, torch==2.13.0). The CPU build is pinned first: it satisfies the extra's
# torch==2.13.0, so pip never reaches for the multi-GB CUDA build, and fails plainly where it is missing.
$(BENCH_INSTALLED): $(INSTALLED) pyproject.toml
	$(PY) -m pip install --quiet 'torch==2.13.0+cpu'
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $(BENCH_INSTALLED)

# Forward, backward and transposed conv on the benchmark suite; tables and chart in bench/results/.
# Faster iterations: make bench BENCH_ARGS="--quick --layers resnet3x3 --ops forward"
bench: $(BENCH_INSTALLED)
	$(PY) bench/run.py $(BENCH_ARGS)
	$(PY) bench/overhead.py
	$(PY) bench/first_call.py
	$(PY) bench/end_to_end.py
	$(PY) bench/model_layers.py
	$(PY) bench/inference.py

# The op tests against kernels built with AddressSanitizer and UndefinedBehaviorSanitizer (own cache
# dir, sanitizer runtimes preloaded); any report fails. CI runs a subset: make sanitize SANITIZE_ARGS=--quick
SANITIZE_ARGS ?=
sanitize: $(INSTALLED)
	$(PY) tests/sanitize/run.py $(SANITIZE_ARGS)

clean:
	rm -rf $(VENV) generated build *.egg-info .pytest_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
