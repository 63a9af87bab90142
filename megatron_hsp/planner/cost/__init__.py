"""The cost model: what a group of ``d`` ranks costs to train a set of sequences.

``costcore`` holds the ``CostModel`` type and its formulas; ``costspec`` reads a model from a
mapping or file, ``costmodel`` resolves a name, preset or spec (``load_cost_model``);
``shape`` holds ``TransformerShape``, the one model-shape type the builders read;
``first_principles`` and ``presets_flexsp`` derive models from hardware and published numbers;
``calibration``, ``fit`` and ``refit`` fit and update the coefficients from measurements;
``parallel``, ``moe`` and ``pipeline`` price a stage under tensor, expert and pipeline
parallelism. It reads only the planner's core types (``planner/*.py``); the search
(``planner/search``) reads it.
"""
