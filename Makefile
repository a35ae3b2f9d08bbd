# kvrouter — developer entry points. `make run` and `make test` work on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test lint chaos clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,plot]'
	touch $(STAMP)

run: install
	$(BIN)/kvrouter up

test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info

chaos: install  ## faults under load: exits non-zero when a request is lost or hung (docs/reliability.md)
	$(BIN)/python -m loadtest.chaos $(CHAOS_ARGS)
