#!/usr/bin/env bash
# Session 43, call 8 (H200): after the review's refactor of krasis-gpu's forward_group (one shape check for the
# BF16 and INT8 group launches; the INT8 group's row stride read once): krasis-gpu `linear` (the group tests, bit for
# bit against one forward per matrix), `gpu_oracle` (INT8 linears) and `hybrid_oracle`. GPU and fixtures required.
B=$PWD/device-bundle
export KRASIS_FIXTURES=$B/fixtures KRASIS_FIXTURES_NEXT=$B/fixtures-next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
export KRASIS_REQUIRE_GPU=1 KRASIS_REQUIRE_FIXTURES=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for t in linear gpu_oracle hybrid_oracle; do
  T "test $t"
  timeout 200 $B/tests/$t --test-threads=1 --nocapture > $OUT/test-$t.log 2>&1; rc=$?
  grep -E "test result|panicked|FAILED|SKIP" $OUT/test-$t.log | tail -4
  T "test $t rc=$rc"
done
