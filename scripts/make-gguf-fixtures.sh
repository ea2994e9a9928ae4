#!/bin/bash
# GGUF twins of the HF oracle fixtures, made with llama.cpp's own converter (convert_hf_to_gguf.py
# + gguf-py from the llama-cpp-python sdist, pruned by shared/tools/peer-llama/prepare.sh) with the
# pre-tokenizer pinned to gpt-2 (shared/tools/peer-llama/convert.py).
#
# usage: scripts/make-gguf-fixtures.sh [OUT]
#   fixtures from KRASIS_FIXTURES (default ../shared/fixtures), GGUFs to OUT (default
#   KRASIS_GGUF_FIXTURES, else .gguf-fixtures in the checkout, git-ignored):
#   OUT/<fixture>/model-{bf16,q8_0}.gguf, plus model-{q4_k_m,q4_0_mixed}.gguf when KRASIS_GGUF_Q4KM=1
#   (builds llama-quantize with cmake, CPU only: slow on 2 cores; q4_0_mixed is Q4_0 with layer 1's
#   ffn_down_exps in Q8_0), and reference-{q8_0,q4_k_m,q4_0_mixed}.safetensors:
#   transformers in float64 on each quantised GGUF's dequantised weights
#   (scripts/gguf-dequant-reference.py). From ../shared/fixtures-next (KRASIS_FIXTURES_NEXT):
#   mixtral-tiny's, qwen2moe-tiny's, minimaxm2-tiny's, glm4moe-tiny's,
#   glm4moe-qknorm-tiny's, gptoss-tiny's, gptoss-mxfp4-tiny's (its experts stay MXFP4), qwen3next-tiny's
#   and qwen35moe-tiny's BF16 and Q8_0 twins and their reference-q8_0.safetensors. qwen3moe-tiny has a
#   dense layer, which llama.cpp's qwen3moe cannot express, and dsv3-fp8-tiny is FP8: neither gets
#   a twin.
# Python: a venv in OUT/.venv with torch (CPU use only), transformers, safetensors, numpy, gguf.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
FIX=${KRASIS_FIXTURES:-$ROOT/../shared/fixtures}
OUT=${1:-${KRASIS_GGUF_FIXTURES:-$ROOT/.gguf-fixtures}}
PEER=${KRASIS_PEER_TOOLS:-$ROOT/../shared/tools/peer-llama}
FIXTURES=(dsv2-lite-tiny dsv2-grouped-tiny dsv2-k256-tiny dsv3-tiny)
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
[ -d "$FIX" ] || { echo "make-gguf-fixtures: no fixtures at $FIX (set KRASIS_FIXTURES)" >&2; exit 1; }
t0=$SECONDS

PY=${KRASIS_GGUF_PYTHON:-$OUT/.venv/bin/python}
if ! "$PY" -c "import torch, transformers, safetensors, numpy" 2>/dev/null; then
    echo "make-gguf-fixtures: creating $OUT/.venv (torch, transformers, safetensors, numpy)"
    python3 -m venv "$OUT/.venv"; PY=$OUT/.venv/bin/python
    "$PY" -m pip install -q --upgrade pip >/dev/null
    "$PY" -m pip install -q torch transformers safetensors numpy sentencepiece protobuf
fi
LCPP=$OUT/.llama.cpp
if [ ! -f "$LCPP/convert_hf_to_gguf.py" ]; then
    bash "$PEER/prepare.sh" "$LCPP"
fi
# gguf-py's own dependencies (numpy, pyyaml, tqdm) for the converter
"$PY" -c "import yaml, tqdm" 2>/dev/null || "$PY" -m pip install -q pyyaml tqdm

for f in "${FIXTURES[@]}"; do
    [ -f "$FIX/$f/config.json" ] || { echo "make-gguf-fixtures: $FIX/$f missing" >&2; exit 1; }
    mkdir -p "$OUT/$f"
    for t in bf16 q8_0; do
        dst=$OUT/$f/model-$t.gguf
        if [ ! -s "$dst" ] || [ "$dst" -ot "$FIX/$f/model.safetensors" ]; then
            "$PY" "$PEER/convert.py" "$LCPP" "$FIX/$f" "$dst.tmp" "$t" >"$OUT/$f/convert-$t.log" 2>&1 \
                || { tail -20 "$OUT/$f/convert-$t.log" >&2; exit 1; }
            mv "$dst.tmp" "$dst"
        fi
    done
done

# fixtures-next families with a GGUF arch in Krasis: their BF16 twins (tests/families_oracle.rs);
# the gated-DeltaNet fixtures also get a Q8_0 twin (tests/deltanet_gguf.rs). Those two convert with
# `--no-mtp` (they have no MTP layers) through scripts/gguf-convert.py, which also reads the
# tokenizer class the fixture declares (transformers would pick Qwen3.5's for qwen35moe-tiny,
# whose extra <|endoftext|> stops the converter; the weights and config.json are untouched).
FIXN=${KRASIS_FIXTURES_NEXT:-$(dirname "$FIX")/fixtures-next}
NEXT=(mixtral-tiny qwen2moe-tiny minimaxm2-tiny glm4moe-tiny glm4moe-qknorm-tiny gptoss-tiny gptoss-mxfp4-tiny
    qwen3next-tiny qwen35moe-tiny)
for f in "${NEXT[@]}"; do
    [ -f "$FIXN/$f/config.json" ] || { echo "make-gguf-fixtures: $FIXN/$f missing: no twin"; continue; }
    case $f in
        qwen3next-tiny | qwen35moe-tiny) types=(bf16 q8_0); conv=$ROOT/scripts/gguf-convert.py; extra=(--no-mtp) ;;
        mixtral-tiny | qwen2moe-tiny | minimaxm2-tiny) types=(bf16 q8_0); conv=$PEER/convert.py; extra=() ;;
        # GLM's converter looks up GLM's special tokens, which the synthetic vocabulary lacks.
        glm4moe-tiny | glm4moe-qknorm-tiny) types=(bf16 q8_0); conv=$ROOT/scripts/gguf-convert.py; extra=(--gpt2-vocab) ;;
        # gpt-oss: gptoss-mxfp4-tiny's experts stay MXFP4 in both twins (the converter copies the
        # hub's blocks); the Q8_0 twins' float64 references rebuild the hub's fused, transposed
        # experts (scripts/gguf-dequant-reference.py).
        gptoss-tiny | gptoss-mxfp4-tiny) types=(bf16 q8_0); conv=$ROOT/scripts/gguf-convert.py; extra=() ;;
        *) types=(bf16); conv=$PEER/convert.py; extra=() ;;
    esac
    mkdir -p "$OUT/$f"
    for t in "${types[@]}"; do
        dst=$OUT/$f/model-$t.gguf
        if [ ! -s "$dst" ] || [ "$dst" -ot "$FIXN/$f/model.safetensors" ]; then
            "$PY" "$conv" "$LCPP" "$FIXN/$f" "$dst.tmp" "$t" "${extra[@]}" >"$OUT/$f/convert-$t.log" 2>&1 \
                || { tail -20 "$OUT/$f/convert-$t.log" >&2; exit 1; }
            mv "$dst.tmp" "$dst"
        fi
    done
done

if [ "${KRASIS_GGUF_Q4KM:-0}" = 1 ]; then
    Q=$LCPP/build/bin/llama-quantize
    if [ ! -x "$Q" ]; then
        echo "make-gguf-fixtures: building llama-quantize (CPU only; log in $OUT/cmake.log)"
        { cmake -S "$LCPP" -B "$LCPP/build" -DGGML_NATIVE=OFF -DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
            -DCMAKE_BUILD_TYPE=Release >"$OUT/cmake.log" 2>&1 &&
          cmake --build "$LCPP/build" --target llama-quantize -j "$(nproc)" >>"$OUT/cmake.log" 2>&1; } \
            || { tail -20 "$OUT/cmake.log" >&2; exit 1; }
    fi
    # llama.cpp reads a deepseek2 file without q_lora_rank only at V2-Lite's 26/27 layers, so
    # llama-quantize refuses the 2- and 3-layer q_lora-less fixtures (dsv2-lite, dsv2-k256).
    # q4_0_mixed: Q4_0 (4-bit blocks of 32, which these rows allow) with layer 1's ffn_down_exps in
    # Q8_0, the per-layer mix of widths Q4_K_M gives real models (Q6_K down in some layers), which
    # the fixtures' Q4_K_M cannot show (its K-quants fall back to Q5_0 on rows of 128/192).
    for f in dsv2-grouped-tiny dsv3-tiny; do
        for t in q4_k_m q4_0_mixed; do
            dst=$OUT/$f/model-$t.gguf
            [ -s "$dst" ] && [ "$dst" -nt "$OUT/$f/model-bf16.gguf" ] && continue
            case $t in
                q4_k_m) args=(Q4_K_M) ;;
                q4_0_mixed) args=(--tensor-type 'blk\.1\.ffn_down_exps=q8_0' Q4_0) ;;
            esac
            "$Q" --allow-requantize "${args[@]:0:${#args[@]}-1}" "$OUT/$f/model-bf16.gguf" "$dst.tmp" "${args[-1]}" \
                >"$OUT/$f/quantize-$t.log" 2>&1 || { tail -20 "$OUT/$f/quantize-$t.log" >&2; exit 1; }
            mv "$dst.tmp" "$dst"
        done
    done
fi
# The oracle of each quantised GGUF: transformers in float64 on its dequantised weights.
for f in "${FIXTURES[@]}"; do
    for t in q8_0 q4_k_m q4_0_mixed; do
        src=$OUT/$f/model-$t.gguf; dst=$OUT/$f/reference-$t.safetensors
        [ -s "$src" ] || continue
        [ -s "$dst" ] && [ "$dst" -nt "$src" ] && continue
        GGUF_PY=$LCPP/gguf-py "$PY" "$ROOT/scripts/gguf-dequant-reference.py" "$FIX/$f" "$src" "$dst" \
            >"$OUT/$f/reference-$t.log" 2>&1 || { tail -20 "$OUT/$f/reference-$t.log" >&2; exit 1; }
    done
done
for f in mixtral-tiny qwen2moe-tiny minimaxm2-tiny glm4moe-tiny glm4moe-qknorm-tiny gptoss-tiny gptoss-mxfp4-tiny \
    qwen3next-tiny qwen35moe-tiny; do
    src=$OUT/$f/model-q8_0.gguf; dst=$OUT/$f/reference-q8_0.safetensors
    [ -s "$src" ] || continue
    [ -s "$dst" ] && [ "$dst" -nt "$src" ] && continue
    GGUF_PY=$LCPP/gguf-py "$PY" "$ROOT/scripts/gguf-dequant-reference.py" "$FIXN/$f" "$src" "$dst" \
        >"$OUT/$f/reference-q8_0.log" 2>&1 || { tail -20 "$OUT/$f/reference-q8_0.log" >&2; exit 1; }
done
echo "make-gguf-fixtures: ${FIXTURES[*]} ${NEXT[*]} -> $OUT ($((SECONDS - t0)) s)"
