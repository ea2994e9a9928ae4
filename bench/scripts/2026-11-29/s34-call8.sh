#!/usr/bin/env bash
# Session 34, call 8 (H200 host, AMX-BF16): NVFP4 experts' CPU prefill on the BF16 tiles
# (094d000: the panels dequantise FP4) against the build before (63ed0a9: FP4 kept the INT8
# kernels), alternated; Qwen3-30B-A3B's config with ModelOpt NVFP4 experts at 8 layers, the CPU
# engine, 512-token prompt; then fp4_oracle's long prefill on the hardware tiles.
B=device-bundle; M=/tmp/q3nv
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_FIXTURES_NEXT=$PWD/$B/next
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
T "fp4_oracle long prefill (hardware tiles)"
timeout 60 $B/tests/fp4_oracle --nocapture long_prefill 2>&1 | grep -E "rel |test result|panicked"
[ -f $M/config.json ] || { T "synth"; $B/bin/krasis synth --config scripts/configs/qwen3-30b-a3b-nvfp4.json --layers 8 --out $M 2>&1 | tail -1; }
mkdir -p /dev/shm/kc
for r in 1 2; do
    for b in krasis-old krasis; do
        T "r$r $b CPU engine, NVFP4 as stored, prefill 512 + decode 32"
        timeout 100 $B/bin/$b bench --model $M --cache-dir /dev/shm/kc --device cpu --prompt-tokens 512 --decode-tokens 32 --decode-reps 1 2>&1 | grep -E "^prefill|routed experts:|error" | head -4
    done
done
T done
