# `make demo` and `make test` set everything up from nothing; `make setup` is what they share.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: setup bytecode demo test bench quality ui browser clean

setup: $(VENV)/.installed

# uv installs the same pins as pip in under a minute rather than minutes. It does not read pip's
# configuration, so the folders pip finds local builds in (the CPU build of torch, on machines that keep
# one) are passed on; and it compiles bytecode only when asked, which matters where PYTHONDONTWRITEBYTECODE
# is set: every process would compile each module it imports again. (`=`: pip is asked only when installing.)
FIND_LINKS = $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check uv
	$(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python $(addprefix --find-links=,$(FIND_LINKS)) \
		-e ".[test,kubernetes,tensorboard,mlflow,wandb]"
	touch $@

# The project's own modules, compiled once for every learner and flow-run process (see setup).
bytecode: setup
	$(BIN)/python -m compileall -q flows tasks training eval infra

demo: setup bytecode
	$(BIN)/archipelago run configs/demo.yaml --report reports/demo.json

# Two workers, a test file each at a time (module fixtures stay whole): most tests wait on servers and
# learner processes, so two of them share 2 cores in about half the time one takes alone. Files start in
# the order tests/conftest.py gives them (longest first, by tests/file_seconds.json), not xdist's (most tests first).
test: setup browser bytecode
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder

# The browser test renders the Prefect UI in Debian's headless Chromium; install it when missing.
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium)

# A local Prefect server, a process work pool and worker per island, and the deployments; Ctrl-C stops all.
ui: setup
	$(BIN)/archipelago serve configs/demo.yaml --port $(or $(PORT),4200)

# The learners' tokens per second against standard training's (benchmarks/results/learner_throughput.json).
bench: setup
	$(BIN)/python -m benchmarks.learner_throughput

# The quality experiment: about 3 hours on 2 idle cores; resumes arm by arm (experiments/quality/results/quality/).
quality: setup
	$(BIN)/python -m experiments.quality

clean:
	rm -rf $(VENV) .archipelago reports *.egg-info
