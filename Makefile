# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed

.PHONY: demo test

$(INSTALLED): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	# constraints.txt pins torch==2.13.0 so pip never pulls a newer multi-GB CUDA build.
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

demo: $(INSTALLED)
	rm -rf runs/quickstart
	$(BIN)/paratrain train examples/quickstart.yaml --nproc-per-node 2

test: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest
