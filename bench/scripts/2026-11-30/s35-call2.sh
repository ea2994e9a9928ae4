#!/usr/bin/env bash
# Session 35, call 2 (H200): the expert runner's timeline (--gemv-trace) per format, RUN_K 1 and 128.
B=device-bundle; K=$B/bin/krasis
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for v in 1 128 1 128; do
  T "expert-gemv trace RUN_K=$v"
  KRASIS_MOE_W2_RUN_K=$v KRASIS_ISA=avx512 $K bench --expert-gemv --gemv-isa avx512 --gemv-trace --gemv-bytes $((3 << 30)) --membw-bytes $((4 << 30)) 2>&1 | grep -vE "^\s*$"
done
T done
