#!/bin/bash
# One node's part of scripts/slurm/hsp_pretrain.sbatch (srun starts it once per node):
#
#   hsp_node.sh SIGNAL -- COMMAND...     (COMMAND: python -m torch.distributed.run ...)
#
# Runs COMMAND (torchrun) and, when SIGNAL reaches this script (srun forwards it to its tasks),
# passes it to torchrun's children, the training ranks, where Megatron's --exit-signal-handler
# (--exit-signal SIG<SIGNAL>) saves a checkpoint at the end of the iteration and exits 0.
# torchrun itself must survive SIGNAL for as long as the checkpoint takes: it is started with
# SIGNAL ignored and, for SIGTERM (Megatron's default exit signal), with SIGTERM left out of
# TORCHELASTIC_SIGNALS_TO_HANDLE. Otherwise torchrun would take SIGTERM as a stop, forward it,
# and SIGKILL the ranks 30 s later, mid-checkpoint; SIGUSR1/SIGUSR2's default action would kill
# the agent at once. The ranks install Megatron's handler themselves. SIGTERM/SIGINT that are not
# SIGNAL (scancel, preemption without --signal) go to torchrun, which forwards them to the ranks
# (the launcher stops each within seconds, docs/reliability.md). Exits with COMMAND's status.
set -uo pipefail

if [[ $# -lt 3 || $2 != "--" ]]; then
    echo "usage: hsp_node.sh SIGNAL -- COMMAND..." >&2
    exit 2
fi
SIG=${1#SIG}
shift 2

case $SIG in
TERM | USR1 | USR2) ;;
*)
    echo "hsp_node.sh: cannot hand SIG$SIG to the ranks (SIGTERM, SIGUSR1 or SIGUSR2)" >&2
    exit 2
    ;;
esac
if [[ $SIG == TERM ]]; then
    # torchrun registers handlers for the signals listed here (its default adds SIGTERM).
    export TORCHELASTIC_SIGNALS_TO_HANDLE=${TORCHELASTIC_SIGNALS_TO_HANDLE:-SIGINT,SIGHUP,SIGQUIT}
    if [[ ,$TORCHELASTIC_SIGNALS_TO_HANDLE, == *,SIGTERM,* ]]; then
        echo "hsp_node.sh: TORCHELASTIC_SIGNALS_TO_HANDLE names SIGTERM, the ranks' checkpoint" \
            "signal: torchrun would kill them 30 s after it" >&2
        exit 2
    fi
fi
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
trap forward_stop TERM INT
trap forward_checkpoint_signal "$SIG"  # after: SIGNAL may be TERM

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
echo "megatron-hsp node $(hostname -s): torchrun exited with status $status" >&2
exit "$status"
