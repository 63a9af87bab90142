"""Evaluation: the baselines hsp is compared with, the ``bench`` harness and research bounds.

Production training plans with ``planner`` alone; only an A/B run (``--hsp-plan-method``
other than hsp) plans with ``torch_side/methods.py``, the one name -> plan function over these
baselines, which its planner process imports by name (``PlannerSpec.factory``).
``baselines`` (static, batchada, FlexSP-style, dp-balanced and the ring-priced plans the
Megatron schedulers' layouts become), ``bench`` (every method on the same batches, priced by
the same cost model) and ``placement_bound`` (a placement-aware LP bound used by
``benchmarks/placement_gap.py``) are torch-free like the planner; ``torch_side`` runs
megatron-core's own dynamic-CP schedulers and imports torch.
"""
