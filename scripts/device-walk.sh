#!/usr/bin/env bash
# Runs ON the GPU box from the repository root, over device-bundle/ (unpacked from
# device-bundle.tar.xz by the command that calls it): #36's checks.
#   tests    the GPU oracle suites on this build (gpu_oracle, hybrid_oracle, gpu_batch, and
#            hybrid_gguf over the bundle's gguf/ twins when it has them; families_oracle and
#            int4ct_oracle over its fixtures-next/ when it has them)
#   setup    synthesize v2-lite in /tmp/v2l and build its INT4 CPU/GPU and INT8 dense caches
#   defaults the defaults, no precision flags: hybrid prefill at 8K (24 GiB), 10K (6 GiB) and 32K
#            (8 GiB); `generate` at 24 GiB (whole model on the GPU); hybrid decode with the
#            default pins against `--cache-strategy none` at PIN_BUDGET, alternating
#   pins     hybrid decode after 512 tokens at PIN_BUDGET with the default pins against
#            `--cache-strategy none`, alternating REPS times, spread evenly and then ranked by a
#            heatmap recorded with `generate --heatmap-out` beside the caches; one profiled run each
#   abcpu    the CPU-only figures of `ab` alone, each binary on a cache directory of its own (the
#            two builds fingerprint the model differently, so a shared directory is rebuilt at
#            every alternation); one unmeasured run each builds the caches first
#   ab       this build against bin/krasis-before, alternating, REPS times: GPU INT4 prefill at
#            2K and 8K and decode, hybrid decode after 512 tokens, CPU-only prefill and decode at 512
# SECTIONS picks them (default: all, in that order). Log: $OUT/walk.log.
set -uo pipefail
B=device-bundle
LOG="${OUT:-/tmp}/walk.log"
exec > >(tee -a "$LOG") 2>&1
export KRASIS_FIXTURES="$PWD/$B/fixtures" KRASIS_REQUIRE_FIXTURES=1 KRASIS_REQUIRE_GPU=1
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
K=$B/bin/krasis
KB=$B/bin/krasis-before
M=/tmp/v2l
SECTIONS="${SECTIONS:-tests setup defaults pins ab}"
REPS="${REPS:-3}"
PIN_BUDGET="${PIN_BUDGET:-10GiB}"
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
T "machine $(date -u +%FT%TZ): $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null); $(nproc) cores"
# The lines of a bench that carry its figures.
figures() { grep -E "prefill|decode|tok/s|device:|placement:|VRAM plan|KV cache|pinned|chunks|hot_cached|profile|hand-off|error|warning" | grep -v "^\s*$" | head -60; }
# A command with a time limit: everything to $OUT/full.log, its figures to the log.
run() { local limit=$1; shift; timeout "$limit" "$@" 2>&1 | tee -a "${OUT:-/tmp}/full.log" | figures; }
if has tests; then
    # GGUF twins of the fixtures, when the bundle has them (scripts/make-gguf-fixtures.sh).
    [ -d $B/gguf ] && export KRASIS_GGUF_FIXTURES="$PWD/$B/gguf"
    # The fixtures-next families (Mixtral, Kimi's compressed-tensors INT4), when the bundle has them.
    [ -d $B/fixtures-next ] && export KRASIS_FIXTURES_NEXT="$PWD/$B/fixtures-next" KRASIS_REQUIRE_FIXTURES_NEXT=1
    for t in $B/tests/gpu_oracle-* $B/tests/hybrid_oracle-* $B/tests/gpu_batch-* $B/tests/hybrid_gguf-* \
        $B/tests/families_oracle-* $B/tests/int4ct_oracle-*; do
        [ -x "$t" ] || continue
        T "-- $t"
        timeout 500 "$t" --test-threads=1 2>&1 | grep -E "test result|FAILED|panicked|SKIPPED|failures:|^    [a-z_0-9]+$" | head -40
    done
fi
if has setup; then
    [ -f $M/config.json ] || { T "synth v2-lite"; timeout 500 $K synth --preset v2-lite --out $M --force 2>&1 | tail -1; }
    T "convert: INT4 CPU and GPU experts, INT8 dense"
    timeout 500 $K convert --model $M --cpu-expert-bits 4 --gpu-expert-bits 4 --cpu-dense-bits 8 2>&1 | tail -4
fi
if has defaults; then
    T "hybrid, 8192-token prompt, 24 GiB (defaults)"
    run 300 $K bench --model $M --device hybrid --prompt-tokens 8192 --vram-budget 24GiB
    T "hybrid, 10240-token prompt, 6 GiB (defaults)"
    run 300 $K bench --model $M --device hybrid --prompt-tokens 10240 --vram-budget 6GiB
    T "hybrid, 32768-token prompt, 8 GiB (defaults)"
    run 400 $K bench --model $M --device hybrid --prompt-tokens 32768 --vram-budget 8GiB
    T "generate, 24 GiB (defaults)"
    timeout 300 $K generate --model $M --vram-budget 24GiB --prompt "The experts live in VRAM" --max-new-tokens 16 2>&1 | tail -12
    for i in 1 2; do
        T "hybrid decode after 512 tokens at $PIN_BUDGET, default pins ($i)"
        run 300 $K bench --model $M --device hybrid --vram-budget $PIN_BUDGET --prompt-tokens 512 --decode-tokens 64
        T "the same with --cache-strategy none ($i)"
        run 300 $K bench --model $M --device hybrid --vram-budget $PIN_BUDGET --cache-strategy none --prompt-tokens 512 --decode-tokens 64
    done
fi
if has pins; then
    H=$M/.krasis_cache/heatmap.json
    rm -f $H
    for heat in even heatmap; do
        if [ $heat = heatmap ]; then
            ids=$(python3 -c "import random; random.seed(7); print(','.join(str(random.randrange(100, 100000)) for _ in range(512)))")
            T "record a heatmap beside the caches"
            timeout 300 $K generate --model $M --vram-budget $PIN_BUDGET --prompt-ids "$ids" --max-new-tokens 64 --ignore-eos --heatmap-out $H 2>&1 | tail -2
        fi
        for i in $(seq 1 "$REPS"); do
            T "pins ($heat) $i: default pins at $PIN_BUDGET"
            run 300 $K bench --model $M --device hybrid --vram-budget $PIN_BUDGET --prompt-tokens 512 --decode-tokens 64
            T "pins ($heat) $i: --cache-strategy none"
            run 300 $K bench --model $M --device hybrid --vram-budget $PIN_BUDGET --cache-strategy none --prompt-tokens 512 --decode-tokens 64
        done
    done
    T "profiled: default pins (heatmap), then none"
    KRASIS_GPU_PROFILE=1 run 300 $K bench --model $M --device hybrid --vram-budget $PIN_BUDGET --prompt-tokens 512 --decode-tokens 64
    KRASIS_GPU_PROFILE=1 run 300 $K bench --model $M --device hybrid --vram-budget $PIN_BUDGET --cache-strategy none --prompt-tokens 512 --decode-tokens 64
    rm -f $H
fi
if has abcpu; then
    cpu_bench() { run 300 $1 bench --model $M --device cpu --cpu-expert-bits 4 --cpu-dense-bits 8 --cache-dir $2 --prompt-tokens 512 --decode-tokens 32; }
    T "building each binary's caches"
    cpu_bench $KB /tmp/cache-before >/dev/null; cpu_bench $K /tmp/cache-after >/dev/null
    for i in $(seq 1 "$REPS"); do
        T "== krasis-before rep $i: CPU-only prefill and decode at 512"; cpu_bench $KB /tmp/cache-before
        T "== krasis rep $i: CPU-only prefill and decode at 512"; cpu_bench $K /tmp/cache-after
    done
fi
if has ab; then
    for i in $(seq 1 "$REPS"); do
        for bin in $KB $K; do
            T "== $(basename $bin) rep $i"
            T "GPU INT4 2K prefill + decode"
            run 200 $bin bench --model $M --device gpu --gpu-expert-bits 4 --kv-tokens 12288 --prompt-tokens 2048 --decode-tokens 64
            T "GPU INT4 8K prefill"
            run 200 $bin bench --model $M --device gpu --gpu-expert-bits 4 --kv-tokens 12288 --prompt-tokens 8192 --decode-tokens 4
            T "hybrid decode after 512 tokens, CPU experts only"
            extra=""; [ $bin = $K ] && extra="--gpu-expert-bits bf16 --cache-strategy none"
            run 200 $bin bench --model $M --device hybrid --cpu-expert-bits 4 $extra --prompt-tokens 512 --decode-tokens 64
            T "CPU-only prefill and decode at 512"
            run 300 $bin bench --model $M --device cpu --cpu-expert-bits 4 --cpu-dense-bits 8 --prompt-tokens 512 --decode-tokens 32
        done
    done
fi
T done
