# `make demo` and `make test` set everything up from nothing; `make setup` is what they share.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: setup demo test bench bench-quality clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
	touch $@

demo: setup
	$(BIN)/archipelago run configs/demo.yaml --report reports/demo.json

test: setup
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python bench/inner_loop.py

# About 90 minutes on 2 idle cores; resumes arm by arm (bench/results/quality/).
bench-quality: setup
	$(BIN)/python -m bench.quality

clean:
	rm -rf $(VENV) .archipelago reports *.egg-info
