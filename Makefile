# One entry point for a fresh machine: `make demo` (main job) and `make test` (the suite CI runs).
# Python 3.12 is required by megatron-core >= 0.17; on pyenv machines PYENV_VERSION selects it.
export PYENV_VERSION ?= 3.12.1
PY312 ?= python3.12
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PY312) >/dev/null || { echo "error: $(PY312) not found; install Python 3.12 or pass PY312=/path/to/python3.12" >&2; exit 1; }
	$(PY312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[runtime,dev]'
	touch $@

demo: setup
	$(VENV)/bin/megatron-hsp demo

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: setup lint
	$(PY) -m pytest -q -n 2 --dist loadgroup

bench: setup
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
