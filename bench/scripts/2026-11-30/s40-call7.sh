#!/usr/bin/env bash
# Session 40 call 7 (H200): the PCIe share on `4a` records (asymmetric INT4 g32, the default CPU experts of float
# checkpoints). (1) moe_pcie (30 cases, 4a among them) and hybrid_oracle (the PCIe test's 4a half); (2) glm-4.5-air at
# 4 layers with the default experts (`4a`), hybrid decode after 512 tokens, the CPU experts alone, alternated: the
# build before (krasis-old, 851f01e), this build with --pcie-routes 0, this build's default.
B=device-bundle; K=$B/bin/krasis; KO=$B/bin/krasis-old; W=/tmp
export KRASIS_FIXTURES=$PWD/$B/fixtures KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for t in moe_pcie hybrid_oracle; do
  T "$t"; timeout 120 $B/tests/$t --test-threads 1 --nocapture 2>&1 | grep -E "^test .*(FAILED|ignored)|panicked|test result|4a .*over PCIe|cases within"
done
KH="bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 64 --model $W/glm"
fig() { grep -E "decode 64|per token:|in-run probe|error|decode: |routed experts" | grep -v compiled | sed 's/.*; decode: /decode: /' | cut -c1-330; }
T "synth glm"; $K synth --preset glm-4.5-air --layers 4 --out $W/glm 2>&1 | tail -1
T "warm (the 4a cache)"; timeout 150 $K $KH --pcie-routes 0 2>&1 | fig
for r in 1 2 3; do
  [ $(( $(date +%s) - t0 )) -lt 230 ] || break
  T "r$r glm 4a old"; timeout 50 $KO $KH 2>&1 | fig
  T "r$r glm 4a new pcie 0"; timeout 50 $K $KH --pcie-routes 0 2>&1 | fig
  T "r$r glm 4a new default"; timeout 50 $K $KH 2>&1 | fig
done
T done
