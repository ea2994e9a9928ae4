#!/usr/bin/env bash
# Session 38, call 4 (H200): what the precise mode costs (v2-lite at 8 layers, GPU and hybrid,
# --gpu-precision f32 against bf16, alternated), and gpt-oss MXFP4's f32 numbers.
B=device-bundle
export KRASIS_FIXTURES_NEXT=$PWD/$B/next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
N=$B/bin/krasis; W=/tmp/v2l8
T "gptoss_oracle mxfp4 (f32 lines)"; timeout 300 $B/tests/gptoss_oracle --test-threads 1 --nocapture mxfp4 2>&1 | grep -E "f32|panicked|test result" | head
T synth; $N synth --preset v2-lite --layers 8 --out $W 2>&1 | tail -1
for dev in gpu hybrid; do for r in 1 2; do for p in bf16 f32; do
  echo "== $dev $p r$r"
  timeout 200 $N bench --model $W --device $dev --gpu-precision $p --prompt-tokens 512 --decode-tokens 32 2>&1 | grep -E "prefill|decode|per token|KV cache" | cut -c1-220
done; done; done
T done
