"""Test machinery (CPU gloo harness, hand-written plans, the exactness selftest and its mutation
suite). Kept out of ``megatron_hsp.runtime`` so the runtime layer stays what production imports:
nothing in ``runtime`` may import this package or ``megatron_hsp.megatron``."""
