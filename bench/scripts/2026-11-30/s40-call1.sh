#!/usr/bin/env bash
# (zc.py travelled in the bundle; it is committed as bench/scripts/2026-11-30/s40-pcie-reader.py)
# Session 40 call 1: does a PCIe read of host memory (zero-copy SM reads, or the copy engine) take bandwidth from
# the CPU's expert reads? glm-4.5-air 4 layers, hybrid decode with the CPU experts alone, alone and beside a
# background PCIe reader.
B=device-bundle; K=$B/bin/krasis; W=/tmp
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
KH="bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 64 --model $W/glm --cpu-expert-bits 4"
fig() { grep -E "decode 64|per token:|in-run probe|error" | grep -v compiled; }
T "solo PCIe"; python3 bench/scripts/2026-11-30/s40-pcie-reader.py solo
[ -d $W/glm ] || { T synth; $K synth --preset glm-4.5-air --layers 4 --out $W/glm 2>&1 | tail -2; }
T "warm (cache build)"; timeout 120 $K $KH 2>&1 | fig
for r in 1 2; do
  T "r$r alone"; timeout 90 $K $KH 2>&1 | fig
  T "r$r beside zero-copy"; python3 bench/scripts/2026-11-30/s40-pcie-reader.py zc 20 & sleep 2; timeout 90 $K $KH 2>&1 | fig; wait
  T "r$r beside copy engine"; python3 bench/scripts/2026-11-30/s40-pcie-reader.py ce 20 & sleep 2; timeout 90 $K $KH 2>&1 | fig; wait
done
T done
