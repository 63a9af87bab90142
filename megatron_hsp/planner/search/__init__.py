"""The search: from a batch of lengths, a cost model and a cluster to a validated ``Plan``.

``solver.solve`` is the entry point; ``settings`` holds the knobs every entry point passes
(``PlannerSettings``) and the solver's own ``SolverConfig``. ``instance`` tabulates the batch
under the cost model; ``chunking`` splits it into micro-batches; ``greedy`` schedules and places
groups; ``improve`` is the local search, ``milp`` the per-micro-batch MILP (``highs`` wraps
HiGHS); ``bounds`` is the lower bound the solver stops on and reports. It reads the core types
and the cost model (``planner/cost``), never the evaluation package above it.
"""
