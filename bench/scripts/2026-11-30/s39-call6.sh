#!/usr/bin/env bash
# Session 39, call 6 (H200): the invariant prefill on gated DeltaNet (the recurrence at every
# length): prefix_reuse (qwen3next-tiny resumed at its snapshot and its end, GPU and hybrid) and
# deltanet_oracle.
B=device-bundle
export KRASIS_FIXTURES=$PWD/$B/fixtures KRASIS_FIXTURES_NEXT=$PWD/$B/next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
for t in prefix_reuse deltanet_oracle; do
  echo "== $t"; timeout 400 $B/tests/$t --test-threads 1 --nocapture 2>&1 | grep -E "^test .*(FAILED|ignored)|panicked|test result|invariant" | head -30
done
