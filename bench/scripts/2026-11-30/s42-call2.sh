#!/usr/bin/env bash
# Session 42, call 2 (H200): the INT8 GEMV change's kernel tests (krasis-gpu linear, with the GEMV timings; kernels),
# then #40's GPU oracle suites on this build: families_oracle, gptoss_oracle, fp4_oracle, gpu_precise, hybrid_oracle,
# gpu_oracle (every fixture of ../shared/fixtures and fixtures-next; GPU required, fixtures required).
B=$PWD/device-bundle
export KRASIS_FIXTURES=$B/fixtures KRASIS_FIXTURES_NEXT=$B/fixtures-next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
export KRASIS_REQUIRE_GPU=1 KRASIS_REQUIRE_FIXTURES=1 KRASIS_REQUIRE_FIXTURES_NEXT=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
T "machine: $(nvidia-smi --query-gpu=name --format=csv,noheader); $(nproc) cores"
for t in linear kernels families_oracle gptoss_oracle fp4_oracle gpu_precise hybrid_oracle gpu_oracle; do
  left=$(( 570 - $(date +%s) + t0 )); [ $left -gt 20 ] || { T "no time left for $t"; continue; }
  T "test $t"
  timeout $left $B/tests/$t --test-threads=1 --nocapture > $OUT/test-$t.log 2>&1; rc=$?
  grep -E "^test |test result|panicked|SKIPPED" $OUT/test-$t.log | grep -v " ok$" | tail -12
  grep -E "timings|GB/s" $OUT/test-$t.log | grep -E "glm|int8|head" | head -60
  T "test $t rc=$rc"
done
T done
