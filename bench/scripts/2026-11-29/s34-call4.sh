#!/usr/bin/env bash
# Session 34, call 4 (H200): gqa_prep with a block per (token, head): its GPU tests, #40's prep again
# (a fresh machine), ncu per kernel against the build before the session, then the hybrid decode
# alternated with it and llama.cpp (glm-4.5-air, gpt-oss-120b at 4 layers).
B=device-bundle
export KRASIS_FIXTURES_NEXT=$PWD/$B/next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
t0=$(date +%s)
for spec in "kernels gqa_prep" "families_oracle gpu_and_hybrid" "gptoss_oracle gpu"; do
    set -- $spec
    echo "== test $1 $2 [+$(( $(date +%s) - t0 ))s]"
    timeout 150 $B/tests/$1 --test-threads 1 --nocapture "$2" 2>&1 | grep -E "^test |SKIPPED|panicked|test result|mean cos|rel " | head -40
done
echo "== prep [+$(( $(date +%s) - t0 ))s]"
SECTIONS=prep bash scripts/device-fp4.sh 2>&1 | tail -4
echo "== ncu [+$(( $(date +%s) - t0 ))s]"
bash $B/ncu2.sh 2>&1
echo "== bench [+$(( $(date +%s) - t0 ))s]"
bash $B/s34-call2.sh 2>&1
