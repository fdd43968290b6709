# The two commands a fresh machine needs (each bootstraps .venv idempotently first):
#   make run    the whole stack on the embedded default (local processes, tiny model, its own Redis)
#   make test   the test suite (unit, integration with real Redis + vLLM, e2e)
VENV ?= .venv
PY := $(VENV)/bin/python
RECIPE ?= tiny

.PHONY: setup run test test-fast bench
setup:
	@bash scripts/bootstrap.sh

run: setup
	$(PY) -m molt.cli up --recipe $(RECIPE)

test: setup
	@bash scripts/test.sh

# Unit tests only (seconds): for quick iteration.
test-fast: setup
	$(PY) -m pytest -q tests/unit

bench: setup
	$(PY) -m bench.bus
