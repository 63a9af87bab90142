"""megatron-hsp: heterogeneity-adaptive sequence parallelism for Megatron-LM.

Layers, each importing only the ones above it in this list:
  planner/   pure numpy + PuLP: lengths -> Plan (no torch import, ever)
  runtime/   torch.distributed: Plan -> process groups, dispatch, Ulysses attention, loss
  megatron/  thin Megatron-LM integration: flags, layer spec, data, launcher, patches
"""

__version__ = "0.1.0"
