#!/usr/bin/env bash
# Session 39, call 8 (H200): after the final review (one helper for the padded block's bytes, a
# redundant fixed-rows condition gone in forward_group): linear and prefix_reuse.
B=device-bundle
export KRASIS_FIXTURES=$PWD/$B/fixtures KRASIS_FIXTURES_NEXT=$PWD/$B/next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
for t in linear prefix_reuse; do
  echo "== $t"; timeout 300 $B/tests/$t --test-threads 1 --nocapture 2>&1 | grep -E "^test .*(FAILED|ignored)|panicked|test result|invariant:" | head -30
done
