"""Runtime: executes a ``Plan`` with torch.distributed (groups, dispatch, attention, loss)."""
