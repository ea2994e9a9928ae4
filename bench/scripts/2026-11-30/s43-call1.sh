#!/usr/bin/env bash
# Session 43, calls 1 and 2 (H200): #40's prep at more layers than before (glm-4.5-air 8, gpt-oss-120b 6 in
# /dev/shm; each step skips what a warm machine already has), then s43-bench.sh's alternated rounds until
# ${BENCH_UNTIL:-540} s in.
start=$(date +%s)
GLM_LAYERS=8 OSS_LAYERS=6 OW=/dev/shm SECTIONS=prep bash scripts/device-fp4.sh > $OUT/prep.log 2>&1
tail -4 $OUT/prep.log; free -g | head -2; df -h /tmp /dev/shm | tail -2
DEADLINE=$(( start + ${BENCH_UNTIL:-540} )) bash bench/scripts/2026-11-30/s43-bench.sh 2>&1 | tee $OUT/bench.log
