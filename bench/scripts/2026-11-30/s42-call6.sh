#!/usr/bin/env bash
# Session 42, call 6 (H200): after the review's refactor of the GEMV launches (one launch plan for the BF16 and INT8
# families, a shared test helper): krasis-gpu linear and kernels, gpu_oracle (its INT8 linears among them).
B=$PWD/device-bundle
export KRASIS_FIXTURES=$B/fixtures KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
for t in linear kernels gpu_oracle; do
  echo "=== $t"; timeout 150 $B/tests/$t --test-threads=1 --nocapture 2>&1 | grep -E "^test |test result|panicked|int8 glm|int8 lm_head" | grep -v "GB/s.*cublas"
done
