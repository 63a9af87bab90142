#!/bin/bash
# One node's part of scripts/slurm/hsp_pretrain.sbatch (srun starts it once per node):
#
#   hsp_node.sh SIGNAL -- COMMAND...     (COMMAND: python -m torch.distributed.run ...)
#
# Runs COMMAND (torchrun) and, when SIGNAL reaches this script (srun forwards SIGUSR1/SIGUSR2 to
# its tasks), passes it to torchrun's children, the training ranks, where Megatron's
# --exit-signal-handler --exit-signal SIG<SIGNAL> saves a checkpoint at the end of the
# iteration and exits 0. Why not to torchrun: torchrun does not handle SIGUSR1 (its default
# action would kill the agent and then every rank, with no checkpoint); it is started with
# SIGNAL ignored, and the ranks install Megatron's handler themselves. SIGTERM/SIGINT (scancel,
# preemption without --signal) go to torchrun, which forwards them to the ranks (the launcher
# stops each within seconds, docs/reliability.md). Exits with COMMAND's status.
set -uo pipefail

if [[ $# -lt 3 || $2 != "--" ]]; then
    echo "usage: hsp_node.sh SIGNAL -- COMMAND..." >&2
    exit 2
fi
SIG=${1#SIG}
shift 2

trap '' "$SIG"  # inherited by COMMAND: torchrun (and anything else that does not opt in) ignores it
"$@" &
CHILD=$!

forward_checkpoint_signal() {
    echo "megatron-hsp node $(hostname -s): SIG$SIG, asking the ranks to checkpoint and exit" >&2
    pkill "-$SIG" -P "$CHILD" || true
}
forward_stop() {
    kill -TERM "$CHILD" 2>/dev/null || true
}
trap forward_checkpoint_signal "$SIG"
trap forward_stop TERM INT

# `wait` returns early (status > 128) whenever a trapped signal arrives: wait again until the
# child has really exited, then report its own status.
while true; do
    wait "$CHILD"
    status=$?
    if ! kill -0 "$CHILD" 2>/dev/null; then
        if ((status > 128)); then  # a trap ended that wait; the child's own status, if any
            wait "$CHILD" 2>/dev/null
            again=$?
            ((again != 127)) && status=$again
        fi
        break
    fi
done
exit "$status"
