"""One module per ``megatron-hsp`` subcommand, each with ``add_parser`` and ``run``.

Modules are imported only when their subcommand runs, so ``plan`` and ``bench`` never pay for
(or require) torch.
"""
