#!/usr/bin/env bash
# Session 43, call 7 (H200): #40's GPU oracle suites on this session's build: families_oracle, gptoss_oracle,
# fp4_oracle, gpu_precise, hybrid_oracle, gpu_oracle (every fixture of ../shared/fixtures and fixtures-next; GPU
# required, so no GPU test can skip; families_oracle's GGUF twins are CPU tests CI runs with the GGUF fixtures it
# makes, and skip visibly here, where those files are not carried).
B=$PWD/device-bundle
export KRASIS_FIXTURES=$B/fixtures KRASIS_FIXTURES_NEXT=$B/fixtures-next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
export KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
T "machine: $(nvidia-smi --query-gpu=name --format=csv,noheader); $(nproc) cores"
for t in families_oracle gptoss_oracle fp4_oracle gpu_precise hybrid_oracle gpu_oracle; do
  left=$(( 400 - $(date +%s) + t0 )); [ $left -gt 20 ] || { T "no time left for $t"; continue; }
  T "test $t"
  timeout $left $B/tests/$t --test-threads=1 --nocapture > $OUT/test-$t.log 2>&1; rc=$?
  grep -E "test result|panicked|FAILED|failed" $OUT/test-$t.log | tail -6
  grep -cE "SKIP" $OUT/test-$t.log | sed 's/^/skip lines: /'
  T "test $t rc=$rc"
done
T done
