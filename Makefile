# One entry point for a fresh machine: `make demo` (main job) and `make test` (the suite CI runs).
# Python 3.12 is required by megatron-core >= 0.17; on pyenv machines PYENV_VERSION selects it.
export PYENV_VERSION ?= 3.12.1
PY312 ?= python3.12
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The oldest torch and megatron-core of the supported range (pyproject.toml), in a venv of its own.
OLD_VENV ?= .venv-torch-oldest
OLD_PY := $(OLD_VENV)/bin/python
OLD_STAMP := $(OLD_VENV)/.installed
# The runtime tests that touch torch APIs whose shape changed across the range (attention
# kernels, autograd functions, collectives, megatron-core's modules) plus the exactness selftest,
# and Megatron's own train_step with HSP (dense option sets, MoE) on the oldest megatron-core.
OLDEST_TORCH_TESTS := tests/test_torch_compat.py tests/test_attention_units.py \
	tests/test_attention_ulysses.py tests/test_attention_ring.py tests/test_attention_gpt.py \
	tests/test_loss_normalisation.py tests/test_ring_layout.py tests/test_dispatch_packing.py \
	tests/test_ring_memory.py tests/test_host_syncs.py \
	tests/test_selftest.py::test_selftest_matches_single_device \
	tests/test_megatron_loop.py::test_megatron_train_step_with_hsp_matches_the_stock_path \
	tests/test_megatron_loop.py::test_dropless_moe_at_ep_1_and_2_matches_the_stock_path

.PHONY: setup demo test test-oldest-torch lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PY312) >/dev/null || { echo "error: $(PY312) not found; install Python 3.12 or pass PY312=/path/to/python3.12" >&2; exit 1; }
	$(PY312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[runtime,dev]' -c constraints/torch-pinned.txt
	touch $@

$(OLD_STAMP): pyproject.toml constraints/torch-oldest.txt
	@command -v $(PY312) >/dev/null || { echo "error: $(PY312) not found; install Python 3.12 or pass PY312=/path/to/python3.12" >&2; exit 1; }
	$(PY312) -m venv $(OLD_VENV)
	$(OLD_PY) -m pip install -q --upgrade pip
	$(OLD_PY) -m pip install -q -e '.[runtime,dev]' -c constraints/torch-oldest.txt
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
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15

# The runtime tests again on the oldest supported torch (CI runs it after `make test`).
test-oldest-torch: $(OLD_STAMP)
	$(OLD_PY) -c "import torch, importlib.metadata as m; print('oldest supported torch:', torch.__version__, 'megatron-core:', m.version('megatron-core'))"
	$(OLD_PY) -m pytest -q -n 2 --dist loadgroup $(OLDEST_TORCH_TESTS)

bench: setup
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(OLD_VENV) build *.egg-info .pytest_cache .ruff_cache
