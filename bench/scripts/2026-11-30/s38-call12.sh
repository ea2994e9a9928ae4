#!/usr/bin/env bash
# Session 38, call 12 (H200): the review of GpuLinear's exact-input path (one staging helper, one
# GEMM choice) and the reflowed kernel comments: the suites that run them.
B=device-bundle
export KRASIS_FIXTURES=$PWD/$B/fixtures KRASIS_FIXTURES_NEXT=$PWD/$B/next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for t in $(ls $B/tests); do
  T "$t"; timeout 300 $B/tests/$t --test-threads 1 --nocapture 2>&1 | grep -E "^test .*(FAILED|ignored)|panicked|test result|GPU precision f32|BF16-rounded" | head -30
done
T done
