#!/usr/bin/env bash
# Many ranks on one GPU (issue 41; docs/gpu-validation.md, "Many ranks on one GPU").
#
# Runs on a machine with ONE CUDA device, no internet: the acceptance kit with 4 and then 8
# ranks sharing cuda:0 (gloo groups, the runtime's collectives staged through pinned host
# buffers), fp32 and bf16 against the CPU fp32 reference of stock megatron-core; one planted bug
# that the 4-rank kit must catch; and the fused ring against the tiled one on length-1 and
# shorter-than-2d documents with GQA (benchmarks/ring_cuda_check.py --part short-documents).
#
# Needs: torch with CUDA, and megatron-core, pulp, highspy, einops importable (e.g. installed
# with `pip install --no-index --no-deps --target /tmp/site` and PYTHONPATH=/tmp/site set by the
# caller). Writes at most 6 files under "$OUT" (default ./gpu-out): summary.txt (read this
# first), kit4.json, kit8.json, plant4.json, ring_short.json, logs.txt. Every run is bounded by
# `timeout`; the whole script takes about 2-4 minutes on an H200 and at most ~7.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
PY="${PYTHON:-$(command -v python || command -v python3)}"
DEVICE="${DEVICE:-cuda}"  # DEVICE=cpu: a dry run of the same steps on CPU ranks (no GPU)
SUMMARY="$OUT/summary.txt"
LOGS="$OUT/logs.txt"
START=$(date +%s)
: > "$SUMMARY"
: > "$LOGS"

say() { echo "$*" | tee -a "$SUMMARY"; }
elapsed() { echo $(( $(date +%s) - START )); }

# run NAME SECONDS JSONFILE COMMAND...: stdout to JSONFILE, stderr to the log, rc and time noted
run() {
    local name=$1 limit=$2 json=$3
    shift 3
    local t0=$(date +%s)
    echo "===== $name: $*" >> "$LOGS"
    timeout -k 15 "$limit" "$@" > "$json" 2>> "$LOGS"
    local rc=$?
    say "$name: exit $rc in $(( $(date +%s) - t0 )) s (limit $limit s$([ $rc = 124 ] && echo ', TIMED OUT'))"
}

# render JSONFILE: the kit's one-screen table from its --json document, into the summary
render() {
    "$PY" - "$1" >> "$SUMMARY" 2>> "$LOGS" <<'EOF'
import json, sys
text = open(sys.argv[1]).read()
start = text.find("{\n")
if start < 0:
    print(f"  (no JSON document in {sys.argv[1]}: see logs.txt)")
    sys.exit(0)
doc, _ = json.JSONDecoder().raw_decode(text[start:])
from megatron_hsp.testing.acceptance import render
print(render(doc))
routes = sorted({r for c in doc["cases"] for r in c["routes"]})
print(f"  routes taken: {', '.join(routes)}; host-staged collectives per rank: "
      f"{doc['kit'].get('host_staged_collectives')}")
EOF
}

say "megatron-hsp many ranks on one GPU, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$SUMMARY" 2>> "$LOGS"
"$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())" >> "$SUMMARY" 2>> "$LOGS"
"$PY" -c "import megatron.core, pulp; print('megatron-core', megatron.core.__version__, 'pulp', pulp.__version__)" >> "$SUMMARY" 2>> "$LOGS"

# 1. the fused ring on short documents (single process, bf16, flash against tiled)
run ring-short-documents 60 "$OUT/ring_short.json" \
    "$PY" benchmarks/ring_cuda_check.py --part short-documents
"$PY" - "$OUT/ring_short.json" >> "$SUMMARY" 2>> "$LOGS" <<'EOF'
import json, sys
try:
    doc = json.load(open(sys.argv[1]))
except Exception as exc:
    print(f"  (no result: {exc}; see logs.txt)")
    sys.exit(0)
for r in doc["short_documents"]:
    print(f"  {r['case']:16} {r['route']:10} local {r['local']:4} fused vs tiled: out {r['out_rel']:.2e} "
          f"dq {r['dq_rel']:.2e} dk {r['dk_rel']:.2e} dv {r['dv_rel']:.2e} finite {r['finite']}")
    for k in ("fused", "tiled"):
        errs = " ".join(f"{n} {r[f'{n}_err64_{k}']:.2e}" for n in ("out", "dq", "dk", "dv"))
        print(f"    {k} against fp64 (scaled by the reference's norm, or dout's where it is zero): {errs}")
EOF

# 2-3. the kit, 4 then 8 ranks on cuda:0, fp32 and bf16
for n in 4 8; do
    limit=$([ $n = 4 ] && echo 150 || echo 210)
    run "kit-$n-ranks" "$limit" "$OUT/kit$n.json" \
        "$PY" -m megatron_hsp.cli selftest --ranks-share-gpu --device "$DEVICE" --nproc $n --dtype fp32,bf16 --json
    render "$OUT/kit$n.json"
done

# 4. the kit can fail in this mode: a ring bug between ranks, 4 ranks, fp32 (exit 1 expected)
if [ "$(elapsed)" -lt 300 ]; then
    run "kit-4-ranks-planted-wrong-ring-merge" 90 "$OUT/plant4.json" \
        "$PY" -m megatron_hsp.cli selftest --ranks-share-gpu --device "$DEVICE" --nproc 4 --dtype fp32 \
        --plant wrong-ring-merge --json
    render "$OUT/plant4.json"
else
    say "kit-4-ranks-planted-wrong-ring-merge: skipped (already $(elapsed) s in)"
fi

say "done in $(elapsed) s"
# logs of 8 ranks can be long: keep their last 2 MB
tail -c 2000000 "$LOGS" > "$LOGS.tmp" && mv "$LOGS.tmp" "$LOGS"
