#!/usr/bin/env bash
# Session 40 call 2: decode's PCIe share. (1) the kernel against its twin; (2) hybrid_oracle, the whole file (the new
# pcie_share test, and every other hybrid test with the default share in its decode steps); (3) glm-4.5-air at 4 layers,
# hybrid decode with the CPU experts alone, alternated: --pcie-routes 0 / default (3 of 8) / 2 / 4.
B=device-bundle; K=$B/bin/krasis; W=/tmp
export KRASIS_FIXTURES=$PWD/$B/fixtures KRASIS_FIXTURES_NEXT=$PWD/$B/next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
# (moe_pcie passed in call 2)
T hybrid_oracle; $B/tests/hybrid_oracle --test-threads 1 --nocapture 2>&1 | grep -E "^test |over PCIe|panicked|result|error" | head -60
KH="bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 64 --model $W/glm --cpu-expert-bits 4"
fig() { grep -E "decode 64|per token:|in-run probe|error|decode:" | grep -v compiled; }
[ -d $W/glm ] || { T synth; $K synth --preset glm-4.5-air --layers 4 --out $W/glm 2>&1 | tail -1; }
T "warm"; timeout 120 $K $KH --pcie-routes 0 2>&1 | fig
for r in 1 2 3; do
  for p in 0 default 2 4; do
    [ $(( $(date +%s) - t0 )) -lt 500 ] || break
    a="--pcie-routes $p"; [ $p = default ] && a=""
    T "r$r pcie $p"; timeout 60 $K $KH $a 2>&1 | fig
  done
done
T done
