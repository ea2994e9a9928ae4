#!/usr/bin/env bash
# Session 37, calls 6-7 (H200): the new default (auto = 4a CPU experts) against llama.cpp on the same weights:
# v2-lite at LAYERS layers (default 27; call 6 ran LAYERS=8, which llama-quantize refused: llama.cpp reads a
# deepseek2 file without q_lora_rank only at 26 or 27 layers), hybrid decode of 64 tokens after 512, the CPU
# experts alone (--cache-strategy none, as llama.cpp's -ot exps=CPU), Krasis auto (4a) and --cpu-expert-bits 4
# (INT4 g128) beside llama-bench -ngl 99 -ot exps=CPU -t $(nproc) on its Q4_K_M (llama.cpp's converter to BF16,
# then llama-quantize), three rounds alternated. Every step skips when its output exists, so a second call on
# the still-warm machine resumes; each call stops itself before ~585 s.
set -uo pipefail
LAYERS="${LAYERS:-27}"
B=device-bundle; K=$B/bin/krasis; L=$B/peer/llama.cpp; LB=/tmp/lb; M=/tmp/v2l-$LAYERS; G=$M-q4km.gguf
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }; left() { echo $(( 585 - $(date +%s) + t0 )); }
T "machine $(date -u +%FT%TZ): $(nvidia-smi --query-gpu=name --format=csv,noheader); $(nproc) cores; disk $(df -BG --output=avail /tmp | tail -1)"
if [ ! -x $LB/bin/llama-bench ] || [ ! -x $LB/bin/llama-quantize ]; then
    T "build llama.cpp (CUDA) in the background"
    cmake -S $L -B $LB -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF > /tmp/cmake.log 2>&1 || tail -5 /tmp/cmake.log
    (timeout "$(left)" ninja -C $LB -j 14 llama-bench llama-quantize > /tmp/ninja.log 2>&1) & BUILD=$!
fi
[ -f $M/config.json ] || { T "synth v2-lite at $LAYERS layers"; $K synth --preset v2-lite --layers $LAYERS --out $M 2>&1 | tail -1; }
GB=/dev/shm/v2l-$LAYERS-bf16.gguf
if [ ! -f $G ] && [ ! -f $M.bf16.done ]; then
    T "convert to a BF16 GGUF in the background (llama.cpp's converter)"
    (timeout "$(left)" python3 $B/peer/convert.py $L $M $GB bf16 > /tmp/convert.log 2>&1 && touch $M.bf16.done) & CONVERT=$!
fi
for bits in auto 4; do [ -f $M/.krasis_cache/done-$bits ] || { T "Krasis cache at $bits"
    timeout "$(left)" $K convert --model $M --cpu-expert-bits $bits 2>&1 | grep -E "routed experts|expert cache" | cut -c1-160 && touch $M/.krasis_cache/done-$bits; }; done
[ -n "${CONVERT:-}" ] && { wait $CONVERT; T "converter: $(tail -1 /tmp/convert.log | cut -c1-160)"; }
[ -n "${BUILD:-}" ] && { wait $BUILD; T "llama.cpp build: $(tail -1 /tmp/ninja.log | cut -c1-120)"; }
if [ -f $M.bf16.done ] && [ ! -f $G ] && [ -x $LB/bin/llama-quantize ]; then
    T "quantize Q4_K_M"
    timeout "$(left)" $LB/bin/llama-quantize $GB $G.part Q4_K_M "$(nproc)" > /tmp/quantize.log 2>&1 && mv $G.part $G && rm -f $GB || tail -3 /tmp/quantize.log
fi
KH="bench --model $M --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 64"
fig() { grep -E "decode 64|per token:|in-run probe|device:|tg64|error" | grep -v compiled | cut -c1-240; }
for r in 1 2 3; do
    [ -f $M.round-$r.done ] && continue
    [ "$(left)" -gt 75 ] || { T "stopping: $(left) s left"; break; }
    T "r$r Krasis auto (4a)"; timeout 60 $K $KH 2>&1 | fig
    T "r$r Krasis --cpu-expert-bits 4"; timeout 60 $K $KH --cpu-expert-bits 4 2>&1 | fig
    [ -f $G ] && { T "r$r llama.cpp Q4_K_M -ot exps=CPU"; timeout 60 $LB/bin/llama-bench -m $G -ngl 99 -ot "exps=CPU" -t "$(nproc)" -p 0 -n 64 -r 3 -o md 2>&1 | fig; }
    touch $M.round-$r.done
done
T done
