#!/usr/bin/env bash
# Runs ON the GPU box from the repository root, over device-bundle/ (bin/krasis, tests/, fixtures/,
# fixtures-next/, peer/: the pruned llama.cpp source and a converter wrapper passing extra flags, as
# ../shared/tools/peer-llama/README.md prepares it): #39's checks on Qwen3.6-35B-A3B's shapes.
#   tests   the GPU suites of this build over the bundle's fixtures (deltanet_oracle, gpu_batch,
#           families_oracle, fp4_oracle, int4ct_oracle, krasis-gpu's delta_rule kernels)
#   prep    build llama.cpp (CUDA) and convert `qwen3.6-35b --layers $LAYERS` (synthesized in /tmp/q36)
#           to llama.cpp's BF16 GGUF in the background while the tests run, then Q4_K_M and
#           Krasis' INT4 caches
#   bench   llama.cpp on the Q4_K_M file (`-ot exps=CPU` with all cores; all layers on the GPU, 8K
#           prompt) and Krasis on the safetensors with INT4 experts: hybrid decode (the CPU experts
#           alone, `--cache-strategy none`) after 512 tokens, alternated with llama.cpp's decode
#           and, when device-bundle/bin/krasis-old exists, with that build's ($ROUNDS rounds, default 3);
#           the same with an INT8
#           LM head; hybrid decode after 32768 tokens (also the hybrid prefill of 32K at a 24 GiB
#           budget) beside one after 512; GPU INT4 prefill at 8K (profiled)
#   profile ncu (`--clock-control none`) sections of the hybrid decode's critical-path kernels in an
#           all-GPU decode step (router_publish, the DeltaNet decode step's two kernels, the grouped BF16 GEMV), each
#           report in $OUT/ncu-KERNEL.txt, its duration, throughput, grid, registers and occupancy
#           in the log; then the GPU decode's own profile (KRASIS_GPU_PROFILE=1)
# SECTIONS picks them (default: prep tests bench). Every step skips when its output exists, so a second call on
# a still-warm machine resumes. Log: $OUT/next.log.
set -uo pipefail
B=device-bundle
LOG="${OUT:-/tmp}/next.log"
exec > >(tee -a "$LOG") 2>&1
K=$B/bin/krasis
L=$B/peer/llama.cpp
LB=/tmp/lb
M=/tmp/q36
LAYERS="${LAYERS:-12}"
SECTIONS="${SECTIONS:-prep tests bench}"
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }; left() { echo $(( 585 - $(date +%s) + t0 )); }
T "machine $(date -u +%FT%TZ): $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null); $(nproc) cores; disk $(df -h /tmp | tail -1 | awk '{print $4}') free"
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
if has prep; then
    # Everything slow starts first and runs in the background while the tests use the GPU.
    if [ ! -x $LB/bin/llama-bench ]; then
        T "build llama.cpp (CUDA) in the background"
        cmake -S $L -B $LB -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF \
            -DLLAMA_OPENSSL=OFF > /tmp/cmake.log 2>&1 || { tail -5 /tmp/cmake.log; }
        (ninja -C $LB -j 15 llama-bench llama-quantize > /tmp/ninja.log 2>&1) & BUILD=$!
    fi
    [ -f $M/config.json ] || { T "synth qwen3.6-35b --layers $LAYERS"; timeout "$(left)" $K synth --preset qwen3.6-35b --layers "$LAYERS" --out $M 2>&1 | tail -1; }
    if [ ! -f /tmp/q36-bf16.done ]; then
        # BF16 out of the converter (it writes, it does not quantise: several times faster than
        # its single-threaded Q8_0), then llama-quantize's 16 threads make Q4_K_M from it.
        T "convert to BF16 GGUF in the background (llama.cpp's converter, no MTP)"
        (timeout "$(left)" python3 $B/peer/convert-next.py $L $M /tmp/q36-bf16.gguf bf16 --no-mtp > /tmp/convert.log 2>&1 \
            && touch /tmp/q36-bf16.done) & CONVERT=$!
    fi
fi
if has tests; then
    export KRASIS_FIXTURES="$PWD/$B/fixtures" KRASIS_REQUIRE_FIXTURES=1 KRASIS_REQUIRE_GPU=1
    export KRASIS_FIXTURES_NEXT="$PWD/$B/fixtures-next" KRASIS_REQUIRE_FIXTURES_NEXT=1
    for t in $B/tests/*-bin; do
        T "-- $t"
        # The whole output (every printed error and timing) beside the log; the summary lines here.
        full="${OUT:-/tmp}/tests-$(basename "$t" -bin).log"
        timeout "$(left)" "$t" --test-threads=1 --nocapture > "$full" 2>&1
        grep -E "test result|FAILED|panicked|SKIPPED|failures:|^    [a-z_0-9:]+$" "$full" | head -40
    done
fi
if has prep; then
    [ -n "${CONVERT:-}" ] && { wait $CONVERT; T "converter: $(tail -1 /tmp/convert.log | cut -c1-120)"; }
    [ -n "${BUILD:-}" ] && { wait $BUILD; T "llama.cpp build: $(tail -1 /tmp/ninja.log)"; }
    if [ -f /tmp/q36-bf16.done ] && [ ! -f /tmp/q36-q4km.gguf ] && [ -x $LB/bin/llama-quantize ]; then
        T "quantize Q4_K_M"
        timeout "$(left)" $LB/bin/llama-quantize /tmp/q36-bf16.gguf /tmp/q36-q4km.gguf Q4_K_M "$(nproc)" > /tmp/quantize.log 2>&1 \
            && rm -f /tmp/q36-bf16.gguf || tail -3 /tmp/quantize.log
    fi
    mkdir -p $M/.krasis_cache; [ -f $M/.krasis_cache/done ] || { T "Krasis caches: INT4 CPU and GPU experts"
        timeout "$(left)" $K convert --model $M --cpu-expert-bits 4 --gpu-expert-bits 4 2>&1 | tail -2 && touch $M/.krasis_cache/done; }
fi
figures() { grep -E "prefill|decode|tok/s|probe|per token|device:|placement:|DeltaNet|error|warning|^\|" | grep -v "compiled kernel" | head -40; }
if has bench; then
    G=/tmp/q36-q4km.gguf
    H="--model $M --device hybrid --cpu-expert-bits 4 --cache-strategy none --vram-budget 24GiB"
    llama_tg() { timeout 90 $LB/bin/llama-bench -m $G -ngl 99 -ot "exps=CPU" -t "$(nproc)" -p 0 -n 64 -r 3 -o md 2>&1 | figures; }
    if [ -f $G ]; then
        [ "$(left)" -gt 120 ] && { T "llama.cpp -ot exps=CPU, Q4_K_M, $(nproc) threads"
            timeout 150 $LB/bin/llama-bench -m $G -ngl 99 -ot "exps=CPU" -t "$(nproc)" -p 512 -n 64 -r 3 -o md 2>&1 | figures; }
        [ "$(left)" -gt 90 ] && { T "llama.cpp all layers on the GPU, Q4_K_M"
            timeout 120 $LB/bin/llama-bench -m $G -ngl 99 -p 8192 -n 64 -r 2 -o md 2>&1 | figures; }
    fi
    # Decode alternated: Krasis (this build, then the previous one if bundled) and llama.cpp's
    # -ot exps=CPU, ROUNDS rounds, so the machine's drift touches all alike.
    for round in $(seq "${ROUNDS:-3}"); do
        [ "$(left)" -gt 60 ] || break
        T "round $round: Krasis hybrid decode after 512 tokens (INT4 experts, the CPU experts alone)"
        timeout 100 $K bench $H --prompt-tokens 512 --decode-tokens 64 --decode-reps 3 2>&1 | figures
        [ -x $B/bin/krasis-old ] && { T "round $round: the previous build, the same"
            timeout 100 $B/bin/krasis-old bench $H --prompt-tokens 512 --decode-tokens 64 --decode-reps 3 2>&1 | figures; }
        T "round $round: the same with an INT8 LM head (--lm-head-quant int8)"
        timeout 100 $K bench $H --lm-head-quant int8 --prompt-tokens 512 --decode-tokens 64 --decode-reps 3 2>&1 | figures
        [ -f $G ] && { T "round $round: llama.cpp -ot exps=CPU decode"; llama_tg; }
    done
    [ "$(left)" -gt 60 ] && { T "Krasis GPU INT4 prefill at 8K"
        KRASIS_GPU_PROFILE=1 timeout 150 $K bench --model $M --device gpu --gpu-expert-bits 4 --prompt-tokens 8192 --decode-tokens 16 2>&1 | figures; }
    for round in 1 2; do
        [ "$(left)" -gt 60 ] || break
        T "round $round: Krasis hybrid, 32K prompt at 24 GiB, then decode at 32K context"
        timeout 150 $K bench $H --prompt-tokens 32768 --decode-tokens 64 --decode-reps 3 2>&1 | figures
        T "round $round: Krasis hybrid decode after 512 tokens (beside it)"
        timeout 100 $K bench $H --prompt-tokens 512 --decode-tokens 64 --decode-reps 3 2>&1 | figures
    done
fi
if has profile; then
    [ -f $M/config.json ] || { T "profile: synth"; timeout 120 $K synth --preset qwen3.6-35b --layers "$LAYERS" --out $M 2>&1 | tail -1; }
    mkdir -p $M/.krasis_cache; [ -f $M/.krasis_cache/done ] || { T "profile: Krasis caches"
        timeout 120 $K convert --model $M --cpu-expert-bits 4 --gpu-expert-bits 4 2>&1 | tail -1 && touch $M/.krasis_cache/done; }
    for k in router_publish delta_decode_prep_dk128 delta_decode_rule_dk128 bf16_gemv_m1_r4; do
        [ "$(left)" -gt 60 ] || break
        T "ncu: $k (launches 61-66)"
        timeout 60 ncu --clock-control none -k regex:"^$k\$" --launch-skip 60 --launch-count 6 \
            --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
            --section MemoryWorkloadAnalysis $K bench --model $M --device gpu --gpu-expert-bits 4 --prompt-tokens 64 \
            --decode-tokens 8 > "${OUT:-/tmp}/ncu-$k.txt" 2>&1
        grep -E "Duration|DRAM Throughput|Grid Size|Registers Per|Achieved Occupancy|Local Memory Spilling Requests  " \
            "${OUT:-/tmp}/ncu-$k.txt" | head -12
    done
    [ "$(left)" -gt 30 ] && { T "GPU decode, profiled"
        KRASIS_GPU_PROFILE=1 timeout 60 $K bench --model $M --device gpu --gpu-expert-bits 4 --prompt-tokens 512 --decode-tokens 64 2>&1 | figures; }
fi
T done
