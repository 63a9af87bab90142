"""Baselines that run Megatron's own schedulers in-process (they import torch via megatron-core).

Kept apart so that ``evaluation``'s torch-free modules, like the planner, import without torch;
``megatron-hsp plan``/``bench`` import these only when ``--methods`` names them.
"""
