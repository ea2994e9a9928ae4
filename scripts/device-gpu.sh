#!/usr/bin/env bash
# Runs ON the GPU box from the repository root, over device-bundle/ built by
# scripts/device-bundle.sh: the GPU test suite (every kernel against its CPU twin, KRASIS_REQUIRE_GPU=1
# so nothing skips), the HF oracle on --device gpu, the attention benches, and a whole-model GPU
# decode of a synthetic V2-Lite. Everything goes to $OUT/gpu.log.
#   run(command="bash device-bundle/device-gpu.sh", carry=["device-bundle"])
# Optional: SECTIONS="tests oracle bench model" (default: all).
set -uo pipefail
B=device-bundle
LOG="${OUT:-/tmp}/gpu.log"
exec > >(tee -a "$LOG") 2>&1
export KRASIS_FIXTURES="$PWD/$B/fixtures" KRASIS_REQUIRE_FIXTURES=1 KRASIS_REQUIRE_GPU=1
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
K=$B/bin/krasis
SECTIONS="${SECTIONS:-tests oracle bench model}"
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
echo "== machine $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>/dev/null || true
if has tests; then
    echo "== GPU kernel tests (krasis-gpu)"
    for t in $B/tests/krasis_gpu-* $B/tests/kernels-* $B/tests/linear-* $B/tests/moe-* $B/tests/router-* \
        $B/tests/sampling-* $B/tests/flash_prefill-* $B/tests/kv_cache-* $B/tests/attn_decode-*; do
        [ -x "$t" ] || continue
        echo "-- $t"
        timeout 300 "$t" --test-threads=1 --nocapture 2>&1 | grep -E "test result|FAILED|panicked|SKIPPED|^GPU:|µs|us per|TFLOP|GB/s|failures:|^    [a-z_]+$|assert" | head -60
    done
fi
if has oracle; then
    echo "== HF oracle on --device gpu"
    for t in $B/tests/gpu_oracle-*; do
        timeout 400 "$t" --test-threads=1 --nocapture 2>&1 | grep -vE "^\s*$|^running|^test .* ok$" | head -80
    done
fi
if has bench; then
    echo "== attention benches"
    timeout 300 $K bench --gpu-attention 2>&1 | tail -30
fi
if has model; then
    W=/tmp/krasis-work; mkdir -p $W
    [ -f $W/v2l/config.json ] || $K synth --preset v2-lite --out $W/v2l --force 2>&1 | tail -1
    echo "== whole-model GPU decode, v2-lite (27 layers), BF16 KV then FP8 KV"
    for kv in bf16 fp8; do
        timeout 300 $K bench --model $W/v2l --device gpu --kv-dtype $kv --decode-tokens 64 --prompt-tokens 512 2>&1 | tail -8
    done
    echo "== 10K-token prompt through the whole model (flash prefill, O(T) memory)"
    timeout 300 $K bench --model $W/v2l --device gpu --decode-tokens 16 --prompt-tokens 10240 2>&1 | tail -2
    echo "== INT8 linears (all --*-quant int8)"
    timeout 300 $K bench --model $W/v2l --device gpu --attention-quant int8 --shared-expert-quant int8 \
        --dense-mlp-quant int8 --kv-b-proj-quant int8 --lm-head-quant int8 --decode-tokens 64 --prompt-tokens 512 2>&1 | tail -2
    echo "== generate smoke (--device gpu)"
    timeout 200 $K generate --model $W/v2l --device gpu --prompt "The experts live in VRAM" --max-new-tokens 16 2>&1 | tail -5
fi
echo "== done $(date -u +%FT%TZ)"
