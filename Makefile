# Set-up is part of every target: a fresh clone needs only `make demo`, `make test` or `make docs`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
# The full MLflow server, for the tests that log to a real `mlflow server`: heavy (pandas, scikit-learn,
# ...), so it lives in its own environment, without torch, at the version of the client in $(VENV).
MLFLOW_SERVER_VENV := .venv-mlflow-server
MLFLOW_SERVER := $(MLFLOW_SERVER_VENV)/.installed
# The lowest release of every optional extra (constraints-floor.txt), beside the newest in .venv.
FLOOR_VENV := .venv-floor
FLOOR_INSTALLED := $(FLOOR_VENV)/.installed
# The guide's site builder (the docs extra) goes into $(VENV) beside the dev extras, under a stamp of its
# own: `make test` neither needs nor installs it.
DOCS_INSTALLED := $(VENV)/.docs-installed
# The tests that reach into the extras' packages: transformers' plans, masks and rotary inputs, the
# trackers, tokenized and streamed data, torchao's float8 conversion.
FLOOR_TESTS := tests/parity/test_hf_matches_single.py tests/unit/test_hf_models.py \
	tests/parity/test_tp_families_match_single.py tests/parity/test_context_parallel_matches_single.py \
	tests/pipeline/test_pipeline_bad_input.py::test_a_transformers_model_that_cannot_be_staged_is_refused_before_training_naming_why \
	tests/tools/test_plan.py::test_fsdp_units_counted_for_traffic_include_a_transformers_models_outer_units_without_a_pipeline \
	tests/unit/test_trackers.py tests/unit/test_lm_data.py tests/unit/test_stream_data.py \
	tests/unit/test_chat_data.py tests/parity/test_lora.py tests/unit/test_float8.py tests/unit/test_hf_experts.py

# Test files run on this many pytest-xdist workers, each file whole on one worker (its module-scoped
# launches, e.g. tests/harness.LayoutRuns, run once): one per core of this 2-core machine, and one more
# that first runs the files that mostly wait (tests/scheduling.py). More workers than that only queue.
TEST_WORKERS ?= 3

.PHONY: demo test test-fast test-floor docs

$(INSTALLED): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	# constraints.txt pins torch==2.13.0 so pip never pulls a newer multi-GB CUDA build.
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev,trl]'
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
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# The inner loop: the suite without its longest files (marked slow in tests/conftest.py), over half its time.
# `make test` runs everything; CI runs `make test`.
test-fast: $(INSTALLED)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not slow"

$(FLOOR_INSTALLED): pyproject.toml constraints-floor.txt
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/pip install --quiet -c constraints-floor.txt -e '.[dev]'
	touch $@

# On the same workers as `make test`: its four parity files ran one after another for 4 minutes.
test-floor: $(FLOOR_INSTALLED)
	$(FLOOR_VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(FLOOR_TESTS)

$(DOCS_INSTALLED): $(INSTALLED)
	$(BIN)/pip install --quiet -c constraints.txt -e '.[docs]'
	touch $@

# The guide (README.md's links, docs/, mkdocs.yml's nav) as a site in site/; strict: a broken link fails.
docs: $(DOCS_INSTALLED)
	$(BIN)/mkdocs build --strict
