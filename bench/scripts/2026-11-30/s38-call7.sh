#!/usr/bin/env bash
# Session 38, call 7 (H200): zero-centred norms formed as 1 + w in f32 on the GPU: the norm kernels'
# twins, the precise mode on every float fixture (the gated-DeltaNet ones included now), and the
# suites that run Qwen3-Next on the GPU (deltanet_oracle, prefix_reuse) and the hybrid's predictor.
B=device-bundle
export KRASIS_FIXTURES=$PWD/$B/fixtures KRASIS_FIXTURES_NEXT=$PWD/$B/next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
T "kernels"; timeout 300 $B/tests/kernels --test-threads 1 2>&1 | grep -E "^test |panicked|test result" | grep -v " ok$" | head -20
T "gpu_precise"; timeout 400 $B/tests/gpu_precise --test-threads 1 --nocapture 2>&1 | grep -E "panicked|test result|f32" -A1 | grep -v "^--" | head -60
T "deltanet_oracle"; timeout 300 $B/tests/deltanet_oracle --test-threads 1 --nocapture gpu 2>&1 | grep -E "panicked|test result|rel|cos" | head -20
for t in deltanet_oracle prefix_reuse hybrid_oracle; do
  T "$t"; timeout 400 $B/tests/$t --test-threads 1 2>&1 | grep -E "^test |panicked|test result" | grep -v " ok$" | head -20
done
T done
