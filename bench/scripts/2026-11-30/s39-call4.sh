#!/usr/bin/env bash
# Session 39, call 4 (H200): the final code's GPU suites: krasis-gpu linear / moe / moe_options /
# moe_quant, and gpu_oracle, hybrid_oracle, families_oracle, gpu_batch, gpu_precise, fp4_oracle,
# gptoss_oracle, int4ct_oracle, prefix_reuse (the invariant resume on MLA and on GQA with sinks,
# windows, qk-norm).
B=device-bundle
export KRASIS_FIXTURES=$PWD/$B/fixtures KRASIS_FIXTURES_NEXT=$PWD/$B/next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for t in $(ls $B/tests); do
  T "$t"; timeout 400 $B/tests/$t --test-threads 1 --nocapture 2>&1 | grep -E "^test .*(FAILED|ignored)|panicked|test result|invariant" | head -40
done
T done
