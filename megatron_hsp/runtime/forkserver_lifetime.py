"""Imported (preloaded) by a multiprocessing fork server only: it dies with the process that
started it. The demo's ranks are forked from a fork server, so their parent is the server, not the
demo; without this, SIGKILL of the demo left the server and, through it, every rank running.
prctl only, no watchdog thread: the server must stay single-threaded to fork safely.
"""

from megatron_hsp.runtime.lifetime import die_with_parent

die_with_parent(watchdog=False)
