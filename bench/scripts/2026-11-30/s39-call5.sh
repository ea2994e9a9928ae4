#!/usr/bin/env bash
# Session 39, call 5 (H200): prefix_reuse after the review's shared `try_open` helper.
B=device-bundle
export KRASIS_FIXTURES=$PWD/$B/fixtures KRASIS_FIXTURES_NEXT=$PWD/$B/next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
timeout 400 $B/tests/prefix_reuse --test-threads 1 --nocapture 2>&1 | grep -E "^test .*(FAILED|ignored)|panicked|test result|resumed at"
