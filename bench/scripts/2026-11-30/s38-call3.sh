#!/usr/bin/env bash
# Session 38, call 3 (H200): the precise mode after the GEMV fix (x at m <= 8 no longer rounded),
# and the regression suites the GQA flash refactor touches (gpu, hybrid, families, deltanet, gpt-oss).
B=device-bundle
export KRASIS_FIXTURES=$PWD/$B/fixtures KRASIS_FIXTURES_NEXT=$PWD/$B/next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
T "linear (all)"; timeout 300 $B/tests/linear --test-threads 1 --nocapture 2>&1 | grep -E "^test |panicked|test result|BF16-rounded|exact .*got" | grep -v " ok$" | head -20
T "int4ct_oracle"; timeout 300 $B/tests/int4ct_oracle --test-threads 1 --nocapture 2>&1 | grep -E "panicked|test result|f32|every step" -A1 | head -30
T "fp4_oracle"; timeout 400 $B/tests/fp4_oracle --test-threads 1 --nocapture 2>&1 | grep -E "panicked|test result|f32|every step" -A1 | head -30
for t in gpu_oracle hybrid_oracle families_oracle deltanet_oracle gptoss_oracle; do
  T "$t"; timeout 500 $B/tests/$t --test-threads 1 2>&1 | grep -E "^test |panicked|test result" | grep -v " ok$" | head -20
done
T done
