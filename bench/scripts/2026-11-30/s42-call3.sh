#!/usr/bin/env bash
# Session 42, call 3 (H200): the GEMV timings of krasis-gpu's linear test (the INT8 GEMV's rows-per-warp rule now
# gives 4 rows down to 4 warps an SM), #40's prep (device-fp4.sh), then alternated rounds of s42-bench2.sh until
# 480 s in.
start=$(date +%s)
KRASIS_REQUIRE_GPU=1 KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc timeout 60 device-bundle/tests/linear bf16_gemv_timings --nocapture \
  2>&1 | grep -E "glm|lm_head|o_proj|test result" | tee $OUT/gemv.log
SECTIONS=prep bash scripts/device-fp4.sh > $OUT/prep.log 2>&1
tail -3 $OUT/prep.log
DEADLINE=$(( start + 480 )) bash bench/scripts/2026-11-30/s42-bench2.sh 2>&1 | tee $OUT/bench.log
