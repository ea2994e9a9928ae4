#!/usr/bin/env bash
# Quick check on the GPU box: task-size sweep of the expert runner (GEMV and decode).
set -uo pipefail
B=device-bundle; K=$B/bin/krasis
LOG="${OUT:-/tmp}/device-quick.log"; exec > >(tee -a "$LOG") 2>&1
W=/tmp/krasis-work
[ -f $W/v2l/config.json ] || $K synth --preset v2-lite --out $W/v2l --force 2>&1 | tail -1
for t in 1 2 4; do
  echo "== KRASIS_TASKS_PER_WORKER=$t"
  KRASIS_TASKS_PER_WORKER=$t KRASIS_ISA=avx512 $K bench --expert-gemv --gemv-bytes $((3 << 30)) --membw-bytes $((4 << 30)) 2>&1 | grep -E "bandwidth|avx512"
  KRASIS_TASKS_PER_WORKER=$t $K bench --model $W/v2l --cpu-expert-bits 4 --cpu-dense-bits 8 --decode-tokens 32 --membw-bytes $((4 << 30)) 2>&1 | tail -2
done
