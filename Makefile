# kvlab: `make demo` sets up and runs the main job; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvlab-installed

.PHONY: setup demo test lint bench clean figures strip

setup: $(STAMP)

# torch is installed first and pinned, so no other package can pull a (multi-GB) CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvlab demo --out results/demo

# every notebook in full mode on a fresh kernel: results/figures/<notebook>/<figure>.{png,pdf,parquet,json}
figures: $(STAMP)
	$(BIN)/kvlab figures

# clear the notebooks' outputs and volatile metadata before committing (the tests check it)
strip: $(STAMP)
	$(BIN)/kvlab figures --strip

lint: $(STAMP)
	$(BIN)/ruff check kvlab tests benchmarks

test: $(STAMP) lint
	$(BIN)/python -m pytest -n 2 --durations=15

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_replay.py

clean:
	rm -rf $(VENV) results/demo .pytest_cache
