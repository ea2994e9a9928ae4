#!/usr/bin/env bash
# Session 42, call 1 (H200): #40's prep (device-fp4.sh: llama.cpp built, glm-4.5-air and gpt-oss-120b synthesized at
# 4 layers, converted by llama.cpp's converter, glm's Q4_K_M, Krasis' caches), then alternated rounds of s42-bench.sh
# until 540 s into the call.
start=$(date +%s)
SECTIONS=prep bash scripts/device-fp4.sh > $OUT/prep.log 2>&1
tail -5 $OUT/prep.log
DEADLINE=$(( start + 520 )) bash bench/scripts/2026-11-30/s42-bench.sh 2>&1 | tee $OUT/bench.log
