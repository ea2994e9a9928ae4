#!/usr/bin/env bash
# Session 38, call 2 (H200): the precise mode's failures of call 1, with their messages.
B=device-bundle
export KRASIS_FIXTURES_NEXT=$PWD/$B/next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
T "linear exact"; timeout 300 $B/tests/linear --test-threads 1 --nocapture exact 2>&1 | grep -v "^GPU" | tail -12
T "int4ct_oracle gpu"; timeout 300 $B/tests/int4ct_oracle --test-threads 1 --nocapture gpu_and_hybrid 2>&1 | grep -E "panicked|test result|rel " -A1 | head -30
T "fp4_oracle gpu"; timeout 400 $B/tests/fp4_oracle --test-threads 1 --nocapture gpu_and_hybrid 2>&1 | grep -E "panicked|test result|rel " -A1 | head -30
T done
