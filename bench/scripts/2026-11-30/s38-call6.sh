#!/usr/bin/env bash
# Session 38, call 6 (H200): the precise mode on every oracle fixture with BF16-exact weights,
# whole GPU and hybrid (gpu_precise).
B=device-bundle
export KRASIS_FIXTURES=$PWD/$B/fixtures KRASIS_FIXTURES_NEXT=$PWD/$B/next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
T "gpu_precise"; timeout 500 $B/tests/gpu_precise --test-threads 1 --nocapture 2>&1 | grep -E "^test |panicked|test result|f32|every step" -A1 | grep -v "^--" | head -80
T done
