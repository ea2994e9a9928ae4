#!/usr/bin/env bash
# Session 38, call 8 (H200): main's final code (the centred-norm change reverted): every krasis-gpu
# test file, and the model suites the session's changes reach.
B=device-bundle
export KRASIS_FIXTURES=$PWD/$B/fixtures KRASIS_FIXTURES_NEXT=$PWD/$B/next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for t in $(ls $B/tests); do
  T "$t"; timeout 300 $B/tests/$t --test-threads 1 2>&1 | grep -E "^test |panicked|test result" | grep -v " ok$" | head -12
done
T done
