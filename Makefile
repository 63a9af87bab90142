# One entry point for a fresh machine: `make demo` (main job), `make test` (the suite CI runs) and
# `make test-fast` (no process-spawning or slow tests).
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
# kernels, autograd functions, collectives, megatron-core's modules, the flash operators' schemas)
# plus the exactness selftest,
# and Megatron's own train_step with HSP (dense option sets, MoE) on the oldest megatron-core.
OLDEST_TORCH_TESTS := tests/runtime/test_torch_compat.py tests/runtime/test_attention_units.py \
	tests/runtime/test_attention_ulysses.py tests/runtime/test_attention_ring.py \
	tests/runtime/test_attention_gpt.py tests/runtime/test_loss_normalisation.py \
	tests/runtime/test_ring_layout.py tests/runtime/test_dispatch_packing.py \
	tests/runtime/test_ring_memory.py tests/runtime/test_host_syncs.py \
	tests/runtime/test_ring_fused.py tests/runtime/test_flash_block_schema.py \
	tests/testing/test_selftest.py::test_selftest_matches_single_device \
	tests/testing/test_megatron_loop.py::test_megatron_train_step_with_hsp_matches_the_stock_path \
	tests/testing/test_megatron_loop.py::test_dropless_moe_at_ep_1_and_2_matches_the_stock_path
# megatron-dcp's plans against the oldest megatron-core's own BalancedCPScheduler (0.18.0).
OLDEST_TORCH_TESTS += tests/evaluation/test_megatron_dcp_matches_scheduler.py
# The fast tier: no test that starts a process or is marked slow (tests/conftest.py keeps the
# `spawns` marker honest); README.md gives both tiers' durations.
FAST_TESTS := -m "not spawns and not slow"
EXACTNESS_RUN := $(PY) -m megatron_hsp.testing.exactness_coverage run -- -q -n 2 --dist loadgroup \
	--durations=15

# Transformer Engine's Python sources, read (never imported or built) by
# tests/runtime/test_te_sources.py:
# the oldest and newest TE the runtime supports (runtime/backends.py TE_SUPPORTED) and the
# releases either side of its THD a2a+p2p gate. The pure-Python transformer-engine wheel holds
# them (about 1 MB each, no CUDA needed); .ci/run fetches them before `make test`.
TE_VERSIONS ?= 2.14.0 2.18.0 2.19.0 2.20.2
TE_SOURCES ?= .te-sources

.PHONY: setup demo test exactness-coverage test-fast test-oldest-torch lint format bench clean te-sources

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

# The suite in two passes, each test once: everything but the exactness checks, then the
# exactness checks (named in tests/exactness/coverage.toml) under coverage.py in every process
# they start, and the check that they execute every branch of the numerics not in that file's
# allowlist (docs/exactness.md, "Branch coverage of the numerics"). Both passes run; either fails it.
test: setup lint
	status=0; \
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15 -m "not exactness" || status=1; \
	$(EXACTNESS_RUN) || status=1; \
	exit $$status

# The exactness checks alone, under coverage; report in .exactness-coverage/coverage.txt.
exactness-coverage: setup
	$(EXACTNESS_RUN)

# The same suite less the process-spawning and slow tests: a few minutes on two cores.
test-fast: setup lint
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15 $(FAST_TESTS)

# The runtime tests again on the oldest supported torch (CI runs it after `make test`).
test-oldest-torch: $(OLD_STAMP)
	$(OLD_PY) -c "import torch, importlib.metadata as m; print('oldest supported torch:', torch.__version__, 'megatron-core:', m.version('megatron-core'))"
	$(OLD_PY) -m pytest -q -n 2 --dist loadgroup $(OLDEST_TORCH_TESTS)

te-sources: $(TE_SOURCES)/.fetched

$(TE_SOURCES)/.fetched: Makefile | setup
	rm -rf $(TE_SOURCES) && mkdir -p $(TE_SOURCES)/wheels
	for v in $(TE_VERSIONS); do \
	  $(PY) -m pip download -q --no-deps --only-binary :all: -d $(TE_SOURCES)/wheels \
	    "transformer-engine==$$v" && \
	  $(PY) -m zipfile -e $(TE_SOURCES)/wheels/transformer_engine-$$v-py3-none-any.whl \
	    $(TE_SOURCES)/$$v || exit 1; \
	done
	touch $@

bench: setup
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(OLD_VENV) $(TE_SOURCES) .exactness-coverage build *.egg-info .pytest_cache .ruff_cache
