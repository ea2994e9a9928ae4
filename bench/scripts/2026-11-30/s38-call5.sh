#!/usr/bin/env bash
# Session 38, call 5 (H200): after the review refactor (one x-conversion launcher, kv_write one
# template, BfGemm): the kernel suites it touches and the precise runs again.
B=device-bundle
export KRASIS_FIXTURES=$PWD/$B/fixtures KRASIS_FIXTURES_NEXT=$PWD/$B/next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for t in kv_cache attn_decode linear gpu_oracle hybrid_oracle; do
  T "$t"; timeout 300 $B/tests/$t --test-threads 1 2>&1 | grep -E "^test |panicked|test result" | grep -v " ok$" | head -20
done
T "int4ct_oracle"; timeout 300 $B/tests/int4ct_oracle --test-threads 1 --nocapture 2>&1 | grep -E "panicked|test result|f32" | head
T "fp4_oracle"; timeout 300 $B/tests/fp4_oracle --test-threads 1 --nocapture 2>&1 | grep -E "panicked|test result|f32" | head
T done
