#!/usr/bin/env bash
# Session 40 call 5 (H200): the final code's GPU suites after decode's PCIe share (on by default in every hybrid
# whose stream reads the CPU's INT4/INT8 records and whose experts are SiLU without biases): krasis-gpu moe_pcie /
# moe / moe_options, and hybrid_oracle, families_oracle, deltanet_oracle, prefix_reuse, gpu_batch, fp4_oracle,
# gptoss_oracle, int4ct_oracle; then v2-lite (top-6: 2 routes over PCIe) hybrid decode, --pcie-routes 0 against the
# default, alternated.
B=device-bundle; K=$B/bin/krasis
export KRASIS_FIXTURES=$PWD/$B/fixtures KRASIS_FIXTURES_NEXT=$PWD/$B/next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for t in moe_pcie moe moe_options hybrid_oracle families_oracle deltanet_oracle prefix_reuse gpu_batch fp4_oracle gptoss_oracle int4ct_oracle; do
  T "$t"; timeout 300 $B/tests/$t --test-threads 1 --nocapture 2>&1 | grep -E "^test .*(FAILED|ignored)|panicked|test result|over PCIe|cases within" | head -60
done
T "synth v2-lite"; $K synth --preset v2-lite --out /tmp/v2 2>&1 | tail -1
KH="bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 64 --model /tmp/v2 --cpu-expert-bits 4"
fig() { grep -E "decode 64|per token:|in-run probe|error|decode:" | grep -v compiled | cut -c1-400; }
timeout 120 $K $KH --pcie-routes 0 2>&1 | fig
for r in 1 2 3; do
  [ $(( $(date +%s) - t0 )) -lt 520 ] || break
  T "r$r v2-lite pcie 0"; timeout 60 $K $KH --pcie-routes 0 2>&1 | fig
  T "r$r v2-lite default"; timeout 60 $K $KH 2>&1 | fig
done
T done
