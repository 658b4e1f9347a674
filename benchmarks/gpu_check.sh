#!/usr/bin/env bash
# NCCL/CUDA check of `ncclscope train --device cuda` on the GPUs of this machine.
#
#     bash benchmarks/gpu_check.sh [OUT_DIR]
#
# Runs each parallel mode that fits the GPUs present (dp, tp, pp 1f1b, cp, ep,
# tp x pp x dp), one NCCL fault drill (skip) analysed with `ncclscope analyze`,
# and `ncclscope run -- examples/ddp.py`; prints a PASS/FAIL/SKIP table with the
# NVML samples each run recorded. A mode needing more GPUs than there are is a
# SKIP row (NCCL needs one GPU per rank). Finishes in < 8 minutes (each run has
# its own limit and the script stops starting runs after 7 minutes).
#
# Exit codes: 0 all PASS/SKIP, 1 any FAIL, 3 no CUDA device (prints one line).
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore::FutureWarning
PY=${PYTHON:-python}
OUT=${1:-$(mktemp -d /tmp/ncclscope-gpu-check-XXXXXX)}
mkdir -p "$OUT"
BUDGET_S=420

GPUS=$($PY -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
if [ "${GPUS:-0}" -lt 1 ]; then
    echo "gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing checked"
    exit 3
fi
echo "gpu_check: $GPUS GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | xargs)"
echo "gpu_check: run directories under $OUT"

ROWS=()
FAILED=0
row() {   # name status seconds nvml_samples note
    ROWS+=("$(printf '%-14s %-5s %6s %8s  %s' "$1" "$2" "$3" "$4" "$5")")
    [ "$2" = FAIL ] && FAILED=1
    echo "gpu_check: $1 $2 ($5)"
}

# facts of a run directory: "<nvml samples> <ops> <open ops> <verdict>"
facts() {
    $PY - "$1" <<'PYEOF' 2>/dev/null || echo "0 0 0 unreadable"
import sys
from ncclscope.load.trace import load
t = load(sys.argv[1])
s = t.samples
nvml = int((s["source"] == "nvml").sum()) if len(s) else 0
ops = t.ops[t.ops["kind"].isin(["collective", "p2p"])]
print(nvml, len(ops), int((ops["status"] == "inflight").sum()))
PYEOF
}

out_of_time() { [ "$SECONDS" -ge "$BUDGET_S" ]; }

mode() {   # name ranks args...
    local name=$1 need=$2; shift 2
    if [ "$need" -gt "$GPUS" ]; then row "$name" SKIP - - "needs $need GPUs"; return; fi
    if out_of_time; then row "$name" FAIL - - "not started: over the ${BUDGET_S} s budget"; return; fi
    local t0=$SECONDS dir="$OUT/$name"
    timeout 120 ncclscope train --device cuda "$@" --steps 3 --out "$dir" >"$OUT/$name.out" 2>"$OUT/$name.err"
    local rc=$? dt=$((SECONDS - t0))
    read -r nvml ops open <<<"$(facts "$dir")"
    if [ "$rc" -eq 0 ] && [ "${ops:-0}" -gt 0 ] && [ "${open:-1}" -eq 0 ] && [ "${nvml:-0}" -gt 0 ]; then
        row "$name" PASS "$dt" "$nvml" "$ops comm ops, all ended"
    else
        row "$name" FAIL "$dt" "${nvml:-0}" "exit $rc, $ops ops, $open open; $(tail -1 "$OUT/$name.err")"
    fi
}

mode dp          2 --dp 2
mode tp          2 --tp 2
mode pp-1f1b     2 --pp 2 --microbatches 2 --schedule 1f1b
mode cp          2 --cp 2
mode ep          2 --dp 2 --ep 2
mode tp-pp-dp    8 --tp 2 --pp 2 --dp 2 --microbatches 2
[ "$GPUS" -lt 8 ] && mode tp-pp      4 --tp 2 --pp 2 --microbatches 2
[ "$GPUS" -eq 1 ] && mode single-gpu 1 --dp 1

# one NCCL drill: rank 1 skips step 1's collective; the verdict must name rank 1
if [ "$GPUS" -lt 2 ]; then
    row drill-skip SKIP - - "needs 2 GPUs"
elif out_of_time; then
    row drill-skip FAIL - - "not started: over the ${BUDGET_S} s budget"
else
    t0=$SECONDS
    timeout 150 ncclscope train --device cuda --dp 2 --steps 3 --timeout-s 10 --inject skip:rank=1,step=1 \
        --out "$OUT/drill-skip" >"$OUT/drill-skip.out" 2>"$OUT/drill-skip.err"
    ncclscope analyze --json "$OUT/drill-skip" >"$OUT/drill-skip.json" 2>/dev/null
    ranks=$($PY -c 'import json,sys; r=json.load(open(sys.argv[1])); h=[f for f in r["findings"] if f["data"].get("role")=="headline"]; print(h[0]["ranks"] if h else "-", "|", r["verdict"])' "$OUT/drill-skip.json" 2>/dev/null || echo "- | unreadable")
    read -r nvml _ _ <<<"$(facts "$OUT/drill-skip")"
    case "$ranks" in
        "[1] |"*) row drill-skip PASS $((SECONDS - t0)) "$nvml" "${ranks#*| }" ;;
        *) row drill-skip FAIL $((SECONDS - t0)) "${nvml:-0}" "headline ranks ${ranks%% |*}: ${ranks#*| }" ;;
    esac
fi

# a user's own script, traced (ncclscope run; tolerate its absence with a FAIL row)
if out_of_time; then
    row run-ddp FAIL - - "not started: over the ${BUDGET_S} s budget"
elif [ ! -f examples/ddp.py ]; then
    row run-ddp FAIL - - "examples/ddp.py is missing"
else
    n=$(( GPUS >= 2 ? 2 : 1 )); t0=$SECONDS
    timeout 150 ncclscope run --nproc "$n" --out "$OUT/run-ddp" -- examples/ddp.py --steps 3 \
        >"$OUT/run-ddp.out" 2>"$OUT/run-ddp.err"
    rc=$?
    read -r nvml _ _ <<<"$(facts "$OUT/run-ddp")"
    if [ "$rc" -eq 0 ]; then row run-ddp PASS $((SECONDS - t0)) "${nvml:-0}" "$n rank(s)"
    else row run-ddp FAIL $((SECONDS - t0)) "${nvml:-0}" "exit $rc: $(tail -1 "$OUT/run-ddp.err")"; fi
fi

echo
printf '%-14s %-5s %6s %8s  %s\n' check result sec nvml note
for r in "${ROWS[@]}"; do echo "$r"; done
echo "gpu_check: $( [ $FAILED -eq 0 ] && echo ok || echo FAILED ) in $SECONDS s"
exit $FAILED
