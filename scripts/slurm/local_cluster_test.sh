#!/bin/bash
# Prove scripts/slurm/hsp_pretrain.sbatch on a real (single-node) Slurm cluster on this machine:
# installs slurm-wlm + munge from Debian packages if missing, starts munged, slurmctld and slurmd
# with a private config under a scratch directory (nothing in /etc is changed), submits the
# sbatch script running `megatron-hsp demo` on CPU ranks (gloo), waits, checks, and stops
# everything it started.
#
#   sudo scripts/slurm/local_cluster_test.sh [--nproc 4] [--steps 4]
#
# Needs root (apt, daemons running as root) and Debian/Ubuntu. Not run by `make test`: CI has
# neither root nor network for apt (docs/integration.md).
set -euo pipefail

NPROC=4
STEPS=4
while [[ $# -gt 0 ]]; do
    case $1 in
        --nproc) NPROC=$2; shift 2 ;;
        --steps) STEPS=$2; shift 2 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${HSP_PYTHON:-$REPO/.venv/bin/python}
[[ -x $PYTHON ]] || PYTHON=$(command -v python3)
if [[ $(id -u) -ne 0 ]]; then echo "run as root (apt-get and slurmd need it)" >&2; exit 2; fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge
fi

WORK=$(mktemp -d /tmp/hsp-slurm.XXXXXX)
chmod 755 "$WORK"
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    sleep 1
    for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
    echo "logs kept in $WORK"
}
trap cleanup EXIT

# munge with its own key and socket.
mkdir -p "$WORK/munge"
dd if=/dev/urandom of="$WORK/munge/munge.key" bs=1024 count=1 status=none
chmod 700 "$WORK/munge"; chmod 400 "$WORK/munge/munge.key"
munged --force --key-file "$WORK/munge/munge.key" --socket "$WORK/munge/munge.sock" \
    --pid-file "$WORK/munge/munged.pid" --log-file "$WORK/munge/munged.log" \
    --seed-file "$WORK/munge/seed"
sleep 1
PIDS+=("$(cat "$WORK/munge/munged.pid")")

HOST=$(hostname -s)
CPUS=$(nproc)
MEM=$(awk '/MemTotal/ {print int($2/1024) - 1024}' /proc/meminfo)
mkdir -p "$WORK/ctld" "$WORK/slurmd"
cat > "$WORK/slurm.conf" <<CONF
ClusterName=hsp-local
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$WORK/munge/munge.sock
CredType=cred/munge
SlurmctldPort=$((6817 + RANDOM % 500))
SlurmdPort=$((7400 + RANDOM % 500))
StateSaveLocation=$WORK/ctld
SlurmdSpoolDir=$WORK/slurmd
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
SlurmctldLogFile=$WORK/slurmctld.log
SlurmdLogFile=$WORK/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=30 State=UP
CONF
export SLURM_CONF=$WORK/slurm.conf
slurmctld -f "$SLURM_CONF"
sleep 2
PIDS+=("$(cat "$WORK/slurmctld.pid")")
slurmd -f "$SLURM_CONF"
sleep 2
PIDS+=("$(cat "$WORK/slurmd.pid")")
for _ in $(seq 30); do
    sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed)' && break
    sleep 1
done
sinfo

OUT=$WORK/job.out
cd "$REPO"
HSP_PYTHON=$PYTHON HSP_NPROC_PER_NODE=$NPROC HSP_LOG_DIR=$WORK/logs \
    PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} \
    sbatch --wait --nodes 1 --cpus-per-task "$CPUS" --output "$OUT" \
    scripts/slurm/hsp_pretrain.sbatch demo --steps "$STEPS" --json "$WORK/demo.json"
cat "$OUT" "$WORK"/logs/node-*.out
"$PYTHON" - "$WORK/demo.json" "$STEPS" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
steps = d["steps"]
assert len(steps) == int(sys.argv[2]), f"expected {sys.argv[2]} steps, got {len(steps)}"
assert all(s["loss"] > 0 for s in steps)
print(f"slurm local test OK: {len(steps)} steps, final loss {steps[-1]['loss']:.4f}")
PY
