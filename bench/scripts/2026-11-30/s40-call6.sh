#!/usr/bin/env bash
# Session 40 call 6 (H200): the final code. (1) The hybrid suites again after the default share's size model and the
# prediction's order (hybrid_oracle, families_oracle, deltanet_oracle, prefix_reuse, gpu_batch, fp4_oracle,
# gptoss_oracle, int4ct_oracle). (2) Alternated with the build before the session (krasis-old, 851f01e): glm-4.5-air at
# 4 layers and V2-Lite, hybrid decode after 512 tokens, the CPU experts alone (INT4): old; new with --pcie-routes 0;
# new default (glm 2 of 8 routes over PCIe, V2-Lite 1 of 6); glm also with the GPU linears INT8.
B=device-bundle; K=$B/bin/krasis; KO=$B/bin/krasis-old; W=/tmp
export KRASIS_FIXTURES=$PWD/$B/fixtures KRASIS_FIXTURES_NEXT=$PWD/$B/next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for t in hybrid_oracle families_oracle deltanet_oracle prefix_reuse gpu_batch fp4_oracle gptoss_oracle int4ct_oracle; do
  T "$t"; timeout 300 $B/tests/$t --test-threads 1 --nocapture 2>&1 | grep -E "^test .*(FAILED|ignored)|panicked|test result|over PCIe" | head -60
done
KH="bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 64 --cpu-expert-bits 4"
Q8="--attention-quant int8 --shared-expert-quant int8 --dense-mlp-quant int8 --lm-head-quant int8"
fig() { grep -E "decode 64|per token:|in-run probe|error|decode: " | grep -v compiled | sed 's/.*; decode: /decode: /' | cut -c1-330; }
T "synth glm"; $K synth --preset glm-4.5-air --layers 4 --out $W/glm 2>&1 | tail -1
T "synth v2-lite"; $K synth --preset v2-lite --out $W/v2 2>&1 | tail -1
T "warm (caches)"; timeout 120 $K $KH --model $W/glm --pcie-routes 0 2>&1 | fig; timeout 120 $K $KH --model $W/v2 --pcie-routes 0 2>&1 | fig
for r in 1 2 3; do
  [ $(( $(date +%s) - t0 )) -lt 470 ] || break
  T "r$r glm old"; timeout 60 $KO $KH --model $W/glm 2>&1 | fig
  T "r$r glm new pcie 0"; timeout 60 $K $KH --model $W/glm --pcie-routes 0 2>&1 | fig
  T "r$r glm new default"; timeout 60 $K $KH --model $W/glm 2>&1 | fig
  T "r$r glm new default + int8 linears"; timeout 60 $K $KH --model $W/glm $Q8 2>&1 | fig
  T "r$r v2-lite old"; timeout 60 $KO $KH --model $W/v2 2>&1 | fig
  T "r$r v2-lite new pcie 0"; timeout 60 $K $KH --model $W/v2 --pcie-routes 0 2>&1 | fig
  T "r$r v2-lite new default"; timeout 60 $K $KH --model $W/v2 2>&1 | fig
done
T done
