"""The step pipeline, shared by every way of training (Megatron's ``pretrain()`` hooks, the demo).

lengths -> plan -> this rank's documents, once per step, outside any Megatron code:

* ``sampler``: seeded global batches of whole documents (lengths only);
* ``planner_service``: the planner in a background process, step t+1 solved while step t trains;
* ``pipeline``: sampler -> plan -> agreement (checked once) -> this rank's documents;
* ``documents``: document lengths from a Megatron ``.idx``, and the tokens one rank trains;
* ``observe``: one record per step, predicted against measured;
* ``corpus``: the demo's embedded corpus.

The planner's knobs are one type, ``megatron_hsp.planner.search.settings.PlannerSettings``.
"""
