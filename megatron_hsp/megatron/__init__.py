"""Thin Megatron-LM integration: flags, layer spec, data, launcher and the listed patches."""
