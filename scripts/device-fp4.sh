#!/usr/bin/env bash
# Runs ON the GPU box from the repository root, over device-bundle/ (bin/krasis; peer/llama.cpp, the pruned
# llama.cpp source as ../shared/tools/peer-llama/README.md prepares it) and scripts/gguf-convert.py (llama.cpp's
# converter with the flags it needs here; it travels with the working tree): #40's speed checks on GLM-4.5-Air's
# and gpt-oss-120b's shapes, cut to $GLM_LAYERS (default 4: one dense layer, three MoE; at least 2) and
# $OSS_LAYERS (default 4) layers, the same synthetic weights for both engines.
#   prep   build llama.cpp (CUDA: llama-bench, llama-quantize) in the background; `krasis synth --preset
#          glm-4.5-air` into /tmp/glm and `--preset gpt-oss-120b` into /tmp/oss (its experts MXFP4, fused as
#          OpenAI publishes them); llama.cpp's converter, both in the background: glm to a BF16 GGUF
#          (`--gpt2-vocab`: the synthetic vocabulary has none of GLM's special tokens), gpt-oss with
#          `--outtype bf16` (the converter copies the MXFP4 experts as they are, file type MXFP4_MOE, and
#          writes the other tensors BF16); `llama-quantize` glm's Q4_K_M; Krasis' caches (`krasis convert`:
#          glm's CPU experts INT4, gpt-oss's at `auto`, MXFP4 kept as stored)
#   bench  ROUNDS alternated rounds (default 3) of, per model, Krasis' hybrid decode after 512 tokens
#          (`--cache-strategy none`: the CPU experts alone; glm at `--cpu-expert-bits 4`, gpt-oss at `auto`:
#          its native MXFP4) and llama.cpp's `llama-bench -ngl 99 -ot exps=CPU -t $(nproc) -p 0 -n 64 -r 3`
#          (glm's Q4_K_M, gpt-oss's MXFP4 GGUF); then llama.cpp's decode at 512 tokens of depth (`-d 512`,
#          Krasis' context) and the CPU engine's decode (`--device cpu`, probes before and after each run)
# The bars: hybrid decode ≥ 2 × llama.cpp's on each model; the MXFP4 experts stream at ≥ 85 % of the in-run
# bandwidth probe inside decode, as INT4 does: the hybrid bench's `host read bandwidth (in-run probe)` line
# (taken before the load; its five repetitions and their median listed) and `per token: CPU experts … ms (… MB, … GB/s = N% of the probe,
# M% of its median repetition)`; the CPU bench's
# `bytes/token: experts … GB/s (N% of membw)` and its probes around each decode run.
# Disk (the box has 64 GiB): glm is 3.3 GB + 4.7 GB per MoE layer of safetensors, as much BF16 GGUF until its
# Q4_K_M (a third of it) is made, 1.15 GB of INT4 cache per MoE layer; gpt-oss is 2.3 GB + 1.75 GB per layer,
# three times (safetensors, GGUF, cache). The defaults peak at ~59 GB with the BF16 GGUF on the disk; it goes
# to /dev/shm when that has room (then GLM_LAYERS=5 fits too), and Krasis' caches are built early then, else
# after the BF16 GGUF is gone. SECTIONS picks them (default: prep bench). Every step skips when its output
# exists, so a second call on a still-warm machine resumes. Log: $OUT/fp4.log (the figures), $OUT/fp4-raw.log
# (every line of every bench); `gpu`: gpt-oss all on the GPU, MXFP4 kept (the FP4 tiles) against INT4. B (the bundle), PY, LB (llama.cpp's build), W (the working folder), OW (gpt-oss's folder, default W: eight layers of both
# models need OW=/dev/shm, glm alone filling ~55 GB of the disk) and
# GLM_SYNTH / OSS_SYNTH (the synth arguments) can be set for a dry run elsewhere.
set -uo pipefail
B="${B:-device-bundle}"
LOG="${OUT:-/tmp}/fp4.log"
RAW="${OUT:-/tmp}/fp4-raw.log"
exec > >(tee -a "$LOG") 2>&1
K=$B/bin/krasis
L=$B/peer/llama.cpp
CONV=scripts/gguf-convert.py
PY="${PY:-python3}"
LB="${LB:-/tmp/lb}"
W="${W:-/tmp}"
GLM=$W/glm
OW="${OW:-$W}"   # gpt-oss's folder: /dev/shm when the disk cannot hold both models
OSS=$OW/oss
GQ=$W/glm-q4km.gguf
OG=$OW/oss-mxfp4.gguf
GLM_LAYERS="${GLM_LAYERS:-4}"
OSS_LAYERS="${OSS_LAYERS:-4}"
GLM_SYNTH="${GLM_SYNTH:---preset glm-4.5-air --layers $GLM_LAYERS}"
OSS_SYNTH="${OSS_SYNTH:---preset gpt-oss-120b --layers $OSS_LAYERS}"
SECTIONS="${SECTIONS:-prep bench}"
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }; left() { echo $(( 585 - $(date +%s) + t0 )); }
free_gb() { df -BG --output=avail "$1" 2>/dev/null | tail -1 | tr -dc 0-9; }
mkdir -p "$W"
T "machine $(date -u +%FT%TZ): $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null); $(nproc) cores; disk $(free_gb $W)G free, /dev/shm $(free_gb /dev/shm)G; GLM_LAYERS=$GLM_LAYERS OSS_LAYERS=$OSS_LAYERS"
export KRASIS_NVRTC_CACHE=$W/krasis-nvrtc
# The lines of a Krasis or llama.cpp run that hold its figures (every line goes to $RAW).
figures() {
    tee -a "$RAW" | grep -E "prefill|decode|tok/s|probe|membw|bandwidth|per token|bytes/token|routed experts|device:|placement:|error|warning|^\|" |
        grep -v "compiled kernel" | head -40
}
caches() {
    mkdir -p $GLM/.krasis_cache $OSS/.krasis_cache
    [ -f $GLM/.krasis_cache/done ] || [ ! -f $GLM/config.json ] || { T "Krasis cache: glm's CPU experts INT4"
        timeout "$(left)" $K convert --model $GLM --cpu-expert-bits 4 2>&1 | tail -2 && touch $GLM/.krasis_cache/done; }
    [ -f $OSS/.krasis_cache/done ] || [ ! -f $OSS/config.json ] || { T "Krasis cache: gpt-oss's CPU experts at auto (MXFP4 as stored)"
        timeout "$(left)" $K convert --model $OSS 2>&1 | grep -E "routed experts|expert cache" | cut -c1-200 && touch $OSS/.krasis_cache/done; }
}
if has prep; then
    # Everything slow starts first and runs in the background.
    if [ ! -x $LB/bin/llama-bench ] || [ ! -x $LB/bin/llama-quantize ]; then
        T "build llama.cpp (CUDA) in the background"
        cmake -S $L -B $LB -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF \
            -DLLAMA_OPENSSL=OFF > $W/cmake.log 2>&1 || { tail -5 $W/cmake.log; }
        (timeout "$(left)" ninja -C $LB -j 14 llama-bench llama-quantize > $W/ninja.log 2>&1) & BUILD=$!
    fi
    [ -f $GLM/config.json ] || { T "synth glm: $GLM_SYNTH"; timeout "$(left)" $K synth $GLM_SYNTH --out $GLM 2>&1 | tail -1; }
    # glm's BF16 GGUF lives until Q4_K_M is made from it: in /dev/shm when that has room for it and
    # 8 GB besides, else on the disk.
    GB=$W/glm-bf16.gguf
    shm=$(free_gb /dev/shm)
    [ "${shm:-0}" -ge $(( $(du -BG -s $GLM 2>/dev/null | cut -f1 | tr -dc 0-9) + 8 )) ] && GB=/dev/shm/glm-bf16.gguf
    if [ ! -f $GQ ] && [ ! -f $W/glm-bf16.done ] && [ -f $GLM/config.json ]; then
        T "convert glm to a BF16 GGUF in the background ($GB; llama.cpp's converter, --gpt2-vocab)"
        (timeout "$(left)" $PY $CONV $L $GLM $GB bf16 --gpt2-vocab > $W/convert-glm.log 2>&1 \
            && echo "$GB" > $W/glm-bf16.done) & CONVERT_GLM=$!
    fi
    [ -f $OSS/config.json ] || { T "synth gpt-oss: $OSS_SYNTH"; timeout "$(left)" $K synth $OSS_SYNTH --out $OSS 2>&1 | tail -1; }
    if [ ! -f $W/oss.done ] && [ -f $OSS/config.json ]; then
        T "convert gpt-oss to its MXFP4 GGUF in the background (llama.cpp's converter, --outtype bf16)"
        (timeout "$(left)" $PY $CONV $L $OSS $OG bf16 > $W/convert-oss.log 2>&1 && touch $W/oss.done) & CONVERT_OSS=$!
    fi
    [[ $GB == /dev/shm/* ]] && caches
    [ -n "${CONVERT_OSS:-}" ] && { wait $CONVERT_OSS; T "gpt-oss converter: $(tail -1 $W/convert-oss.log | cut -c1-120)"
        grep -E "Repacked blk.0|file type" $W/convert-oss.log | cut -c1-160; }
    [ -n "${CONVERT_GLM:-}" ] && { wait $CONVERT_GLM; T "glm converter: $(tail -1 $W/convert-glm.log | cut -c1-120)"; }
    [ -n "${BUILD:-}" ] && { wait $BUILD; T "llama.cpp build: $(tail -1 $W/ninja.log)"; }
    if [ -f $W/glm-bf16.done ] && [ ! -f $GQ ] && [ -x $LB/bin/llama-quantize ]; then
        GB=$(cat $W/glm-bf16.done)
        T "quantize glm Q4_K_M"
        timeout "$(left)" $LB/bin/llama-quantize "$GB" $GQ.part Q4_K_M "$(nproc)" > $W/quantize.log 2>&1 \
            && mv $GQ.part $GQ && rm -f "$GB" || tail -3 $W/quantize.log
    fi
    caches
    T "prep: $(ls -d $GQ $OG $GLM/.krasis_cache/done $OSS/.krasis_cache/done 2>/dev/null | tr '\n' ' '); disk $(free_gb $W)G free"
fi
if has bench; then
    KH="bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 64"
    # INT8_GPU=1: each round also runs Krasis with the GPU's linears in INT8 (llama.cpp's Q4_K_M
    # file holds them in 4–6-bit types; gpt-oss's GGUF keeps them BF16, as Krasis' default).
    Q8="--attention-quant int8 --shared-expert-quant int8 --dense-mlp-quant int8 --lm-head-quant int8"
    llama_tg() { timeout 120 $LB/bin/llama-bench -m "$1" -ngl 99 -ot "exps=CPU" -t "$(nproc)" -p 0 -n 64 -r 3 "${@:2}" -o md 2>&1 | figures; }
    # Alternated: each model's Krasis run beside llama.cpp's, ROUNDS rounds, so the machine's drift
    # touches both alike.
    for round in $(seq "${ROUNDS:-3}"); do
        [ "$(left)" -gt 60 ] || break
        T "round $round: Krasis glm hybrid decode after 512 tokens (INT4 experts, the CPU experts alone)"
        timeout 150 $K $KH --model $GLM --cpu-expert-bits 4 2>&1 | figures
        [ -n "${INT8_GPU:-}" ] && { T "round $round: the same with the GPU's linears INT8 ($Q8)"
            timeout 150 $K $KH --model $GLM --cpu-expert-bits 4 $Q8 2>&1 | figures; }
        [ -f $GQ ] && { T "round $round: llama.cpp glm Q4_K_M, -ot exps=CPU decode"; llama_tg $GQ; }
        T "round $round: Krasis gpt-oss hybrid decode after 512 tokens (MXFP4 experts as stored, the CPU experts alone)"
        timeout 150 $K $KH --model $OSS 2>&1 | figures
        [ -n "${INT8_GPU:-}" ] && { T "round $round: the same with the GPU's linears INT8 ($Q8)"
            timeout 150 $K $KH --model $OSS $Q8 2>&1 | figures; }
        [ -f $OG ] && { T "round $round: llama.cpp gpt-oss MXFP4, -ot exps=CPU decode"; llama_tg $OG; }
    done
    [ "$(left)" -gt 60 ] && [ -f $GQ ] && { T "llama.cpp glm decode at 512 tokens of depth"; llama_tg $GQ -d 512; }
    [ "$(left)" -gt 60 ] && [ -f $OG ] && { T "llama.cpp gpt-oss decode at 512 tokens of depth"; llama_tg $OG -d 512; }
    KC="bench --device cpu --prompt-tokens 512 --decode-tokens 64 --decode-reps 3"
    [ "$(left)" -gt 90 ] && { T "Krasis CPU engine, gpt-oss (MXFP4 experts as stored): decode after 512 tokens, probes around each run"
        timeout 150 $K $KC --model $OSS 2>&1 | figures; }
    [ "$(left)" -gt 90 ] && { T "Krasis CPU engine, glm (INT4 experts): the same"
        timeout 150 $K $KC --model $GLM --cpu-expert-bits 4 2>&1 | figures; }
fi
if has gpu; then
    # The whole model on the GPU: gpt-oss's MXFP4 experts kept as stored (`auto`, the FP4 tiles)
    # against INT4 requantised, prefill of 2K and decode.
    for w in auto 4; do
        [ "$(left)" -gt 60 ] || break
        T "Krasis gpt-oss all on the GPU, --gpu-expert-bits $w: prefill of 2048 tokens (3 reps), decode"
        timeout 150 $K bench --model $OSS --device gpu --gpu-expert-bits $w --prompt-tokens 2048 --prefill-reps 3 \
            --decode-tokens 64 2>&1 | grep -v "compiled kernel" | figures
    done
fi
T done
