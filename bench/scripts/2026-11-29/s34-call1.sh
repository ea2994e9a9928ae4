#!/usr/bin/env bash
# Session 34, call 1 (H200): the GPU tests of this session's change (gqa_prep against the separate
# launches; every family's GPU and hybrid fidelity, which now runs it), then #40's prep
# (scripts/device-fp4.sh SECTIONS=prep: llama.cpp build, glm-4.5-air and gpt-oss-120b at 4 layers,
# GGUFs, Krasis caches).
B=device-bundle
export KRASIS_FIXTURES_NEXT=$PWD/$B/next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
t0=$(date +%s)
for spec in "kernels gqa_prep" "kernels rope" "families_oracle gpu_and_hybrid" "gptoss_oracle gpu" "fp4_oracle gpu"; do
    set -- $spec
    echo "== test $1 $2 [+$(( $(date +%s) - t0 ))s]"
    timeout 150 $B/tests/$1 --test-threads 1 --nocapture "$2" 2>&1 | grep -E "^test |SKIPPED|panicked|test result|mean cos|rel " | head -60
done
echo "== prep [+$(( $(date +%s) - t0 ))s]"
SECTIONS=prep bash scripts/device-fp4.sh 2>&1 | tail -25
