#!/usr/bin/env bash
# Session 38, call 1 (H200): the precise GPU mode (GpuPrecision::F32): its kernel tests, and the
# int4ct / FP4 fixtures' f32 runs at the reference path's bar.
# Pack: TESTS_JSON="/tmp/g1.json /tmp/g2.json" NEXT="dsv3-int4ct-tiny gptoss-mxfp4-tiny qwen3moe-nvfp4-tiny" bash /work/tools/pack.sh
# Run: cd device-bundle && tar -xJf b.tar.xz && cd .. && bash device-bundle/s38-call1.sh
B=device-bundle
export KRASIS_FIXTURES_NEXT=$PWD/$B/next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for t in kv_cache attn_decode; do
  T "$t"; timeout 200 $B/tests/$t --test-threads 1 2>&1 | grep -E "^test |panicked|test result" | grep -v " ok$" | head -20
done
T "flash_prefill f32"; timeout 200 $B/tests/flash_prefill --test-threads 1 --nocapture f32 2>&1 | grep -E "^test |panicked|test result|err/tol" | tail -12
T "flash_prefill (all)"; timeout 300 $B/tests/flash_prefill --test-threads 1 2>&1 | grep -E "^test |panicked|test result" | head -20
T "linear exact"; timeout 300 $B/tests/linear --test-threads 1 --nocapture exact 2>&1 | grep -E "^test |panicked|test result|BF16-rounded" | head -12
T "linear (all)"; timeout 300 $B/tests/linear --test-threads 1 2>&1 | grep -E "^test |panicked|test result" | head -30
T "int4ct_oracle"; timeout 300 $B/tests/int4ct_oracle --test-threads 1 --nocapture 2>&1 | grep -E "^test |panicked|test result|rel |f32" | head -30
T "fp4_oracle"; timeout 400 $B/tests/fp4_oracle --test-threads 1 --nocapture 2>&1 | grep -E "^test |panicked|test result|rel " | head -40
T done
