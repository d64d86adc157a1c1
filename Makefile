# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
# The full MLflow server, for the tests that log to a real `mlflow server`: heavy (pandas, scikit-learn,
# ...), so it lives in its own environment, without torch, at the version of the client in $(VENV).
MLFLOW_SERVER_VENV := .venv-mlflow-server
MLFLOW_SERVER := $(MLFLOW_SERVER_VENV)/.installed

.PHONY: demo test

$(INSTALLED): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	# constraints.txt pins torch==2.13.0 so pip never pulls a newer multi-GB CUDA build.
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

$(MLFLOW_SERVER): $(INSTALLED)
	$(PYTHON) -m venv $(MLFLOW_SERVER_VENV)
	$(MLFLOW_SERVER_VENV)/bin/pip install --quiet -c constraints.txt \
		"mlflow==$$($(BIN)/python -c 'from importlib.metadata import version; print(version("mlflow-skinny"))')"
	touch $@

demo: $(INSTALLED)
	rm -rf runs/quickstart
	$(BIN)/paratrain train examples/quickstart.yaml --nproc-per-node 2

test: $(INSTALLED) $(MLFLOW_SERVER)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest
