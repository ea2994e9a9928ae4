#!/usr/bin/env bash
# Runs ON the GPU box from the repository root, over device-bundle/ (bin/krasis; peer/llama.cpp: the pruned
# llama.cpp source that ../shared/tools/peer-llama/prepare.sh writes, with llama-server added by
# scripts/peer-llama-server.sh, which the pruned tree lacks; peer/convert.py from ../shared/tools/peer-llama):
# issue #41's serving figures on `krasis synth --preset v2-lite`, the client being scripts/serve-load.py
# (Python standard library only).
#   prep     build llama.cpp (CUDA) with llama-server in the background, synthesize v2-lite (/tmp/serve-v2-lite), convert it
#            to GGUF Q8_0 (llama.cpp's converter) in the background, then Q4_K_M, then Krasis' INT4 expert cache
#   krasis   `krasis serve --device hybrid` (INT4 CPU experts, none pinned in VRAM: the routed experts all run on
#            the CPU, as llama-server's `-ot exps=CPU`; CACHE_STRATEGY overrides it; 32 batch slots): aggregate decode tok/s at 1, 8
#            and 32 streams; 32 streaming clients of which 4 send 8K-token prompts while 28 decode (every stream's
#            finish and usage checked, the decoders' inter-token latency p50/p99 while the long prompts run);
#            a 10-turn conversation on an 8K-token history (TTFT per turn, /metrics' prefix hits and reused
#            tokens, the greedy reply with its prefix reused equal to the cold one)
#   llama    the same on llama-server -ngl 99 -ot exps=CPU over the Q4_K_M file: decode at 1, 8, 32 streams
#            (-np N each), the 32-client load (-np 32), the conversation (-np 1: its slot keeps the prompt)
#   stall    (not in the default) the session-27 stall at 32 streams: Krasis' files only (synth + INT4 cache, no
#            llama.cpp), then level 32 of the scaling mode, short, once per VARIANTS entry (name:ENV=VALUE; the
#            server's stall watch logs what a stalled step waits for); a stall skips the krasis section
# SECTIONS picks them (default: all). Each call stops itself before ~585 s; every step skips when its output
# exists (a figures file under $OUT/serve/, a build, a model), so a second call on a still-warm machine resumes.
# Log: $OUT/serve.log; figures: $OUT/serve/*.json.
# The bundle, made here:  bash ../shared/tools/peer-llama/prepare.sh device-bundle/peer/llama.cpp &&
#   bash scripts/peer-llama-server.sh device-bundle/peer/llama.cpp &&
#   cp ../shared/tools/peer-llama/convert.py device-bundle/peer/ && cp target/release/krasis device-bundle/bin/
# Disk: v2-lite 31 GB + Q8_0 17 GB + Q4_K_M 10 GB + Krasis' INT4 CPU cache ~8 GB do not fit 64 GB at once: the
# Q8_0 file goes once Q4_K_M is written, and the Krasis cache is built after that.
# Tried here (no GPU, 2 cores) at small scale: PRESET=tiny DEVICE=cpu STREAMS=8 LONG=1024 IDS=258:500, with
# llama-server built on the CPU from the tree peer-llama-server.sh makes (every mode ran; figures meaningless).
set -uo pipefail
B=device-bundle
OUTD="${OUT:-/tmp}"
LOG="$OUTD/serve.log"
R="$OUTD/serve"
mkdir -p "$R"
exec > >(tee -a "$LOG") 2>&1
K=$B/bin/krasis
L=$B/peer/llama.cpp
LB=/tmp/lb
# For a small trial elsewhere (say PRESET=tiny DEVICE=cpu LONG=1024 STREAMS=8 on a laptop); the defaults are #41's.
PRESET="${PRESET:-v2-lite}"; DEVICE="${DEVICE:-hybrid}"
STREAMS="${STREAMS:-32}"; LONG="${LONG:-8192}"; DECODE="${DECODE:-512}"
M=/tmp/serve-$PRESET
G=/tmp/serve-$PRESET-q4km.gguf
IDS="${IDS:-258:32000}" # prompt token ids: the synthetic tokenizer's merges and filler words
SECTIONS="${SECTIONS:-prep krasis llama}"
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }; left() { echo $(( ${BUDGET:-585} - $(date +%s) + t0 )); }
T "machine $(date -u +%FT%TZ): $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null); $(nproc) cores; disk $(df -h /tmp | tail -1 | awk '{print $4}') free"
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
LOAD="python3 scripts/serve-load.py --ids $IDS"

# Waits (up to $2 s) until the server at port $1 answers /health with 200; 1 if it does not or if the
# process $3 (when given) has exited.
wait_health() {
    local end=$(( $(date +%s) + $2 ))
    while [ "$(date +%s)" -lt $end ]; do
        [ -n "${3:-}" ] && ! kill -0 "$3" 2>/dev/null && return 1 # the server exited
        [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$1/health")" = 200 ] && return 0
        sleep 1
    done
    return 1
}
# Stops the server whose PID is $1 (one we started), waiting for it to go.
stop() { kill "$1" 2>/dev/null; for _ in $(seq 50); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.2; done; kill -9 "$1" 2>/dev/null; }
# Runs serve-load.py MODE... against port $1 into $R/$2.json unless that file exists (resumable).
measure() {
    local port=$1 name=$2; shift 2
    [ -f "$R/$name.json" ] && { T "$name: done before ($(python3 -c "import json;print(json.load(open('$R/$name.json'))['problems'][:3] or 'ok')"))"; return 0; }
    [ "$(left)" -lt 40 ] && { T "no time left for $name"; return 1; }
    T "$name"
    timeout "$(left)" $LOAD --url "http://127.0.0.1:$port" --deadline $(( $(left) - 15 )) --json "$R/$name.json.tmp" "$@" \
        && mv "$R/$name.json.tmp" "$R/$name.json" || { [ -f "$R/$name.json.tmp" ] && mv "$R/$name.json.tmp" "$R/$name.json"; }
}

if has prep; then
    # llama.cpp's side needs llama-server's source (scripts/peer-llama-server.sh adds it to the pruned tree).
    PEER=0; { [ -x $LB/bin/llama-server ] || [ -d $L/tools/server ]; } && PEER=1
    if [ ! -x $LB/bin/llama-server ]; then
        if [ ! -d $L/tools/server ]; then
            T "no $L/tools/server: the bundle's llama.cpp is pruned without it; run scripts/peer-llama-server.sh on it first"
        else
            T "build llama.cpp (CUDA) with llama-server in the background"
            cmake -S $L -B $LB -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native \
                -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
                -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > /tmp/cmake.log 2>&1 \
                || tail -5 /tmp/cmake.log
            (ninja -C $LB -j 12 llama-server llama-quantize llama-bench > /tmp/ninja.log 2>&1) & BUILD=$!
        fi
    fi
    [ -f $M/config.json ] || { T "synth $PRESET"; timeout "$(left)" $K synth --preset "$PRESET" --out $M 2>&1 | tail -1; }
    if [ $PEER = 1 ] && [ ! -f /tmp/serve-$PRESET-q8.done ] && [ ! -f $G ]; then
        T "convert to Q8_0 in the background (llama.cpp's converter)"
        (timeout "$(left)" python3 $B/peer/convert.py $L $M /tmp/serve-$PRESET-q8.gguf q8_0 > /tmp/convert.log 2>&1 \
            && touch /tmp/serve-$PRESET-q8.done) & CONVERT=$!
    fi
    [ -n "${CONVERT:-}" ] && { wait $CONVERT; T "converter: $(tail -1 /tmp/convert.log | cut -c1-120)"; }
    [ -n "${BUILD:-}" ] && { wait $BUILD; T "llama.cpp build: $(tail -1 /tmp/ninja.log)"; }
    if [ -f /tmp/serve-$PRESET-q8.done ] && [ ! -f $G ] && [ -x $LB/bin/llama-quantize ]; then
        T "quantize Q4_K_M"
        timeout "$(left)" $LB/bin/llama-quantize --allow-requantize /tmp/serve-$PRESET-q8.gguf $G.tmp Q4_K_M "$(nproc)" > /tmp/quantize.log 2>&1 \
            && mv $G.tmp $G && rm -f /tmp/serve-$PRESET-q8.gguf || tail -3 /tmp/quantize.log
    fi
    # Disk (64 GB): v2-lite 31 GB + Q8_0 17 GB + Q4_K_M 10 GB, so Krasis' INT4 CPU expert cache (~8 GB; hybrid
    # prefill streams the experts from it, no GPU expert cache) is built once the Q8_0 file is gone.
    if [ ! -f $M/.krasis_cache/done ] && { [ $PEER = 0 ] || [ ! -f /tmp/serve-$PRESET-q8.gguf ]; }; then
        T "Krasis cache: INT4 CPU experts"; mkdir -p $M/.krasis_cache
        timeout "$(left)" $K convert --model $M --cpu-expert-bits 4 2>&1 | tail -2 && touch $M/.krasis_cache/done
    fi
fi

if has stall; then
    [ -f $M/config.json ] || { T "synth $PRESET"; timeout "$(left)" $K synth --preset "$PRESET" --out $M 2>&1 | tail -1; }
    if [ ! -f $M/.krasis_cache/done ]; then
        T "Krasis cache: INT4 CPU experts"; mkdir -p $M/.krasis_cache
        timeout "$(left)" $K convert --model $M --cpu-expert-bits 4 2>&1 | tail -2 && touch $M/.krasis_cache/done
    fi
    for v in ${VARIANTS:-default: nostream:KRASIS_GPU_STREAM_MIN_TOKENS=1000000 allstream:KRASIS_GPU_STREAM_SPLIT=1}; do
        name=${v%%:*}; envs=${v#*:}
        [ "$(left)" -lt 100 ] && { T "no time left for stall-$name"; break; }
        T "stall-$name: krasis serve --device $DEVICE ${envs:-(defaults)}"
        env $envs $K serve --model $M --device "$DEVICE" --cpu-expert-bits 4 --cache-strategy none --max-batch "$STREAMS" \
            --kv-tokens 4096 --port 8101 --served-model-name "$PRESET" > /tmp/stall-$name.log 2>&1 & KS=$!
        if wait_health 8101 60 $KS; then
            timeout 100 $LOAD --url http://127.0.0.1:8101 --deadline 70 --timeout 60 --json "$R/stall-$name.json" \
                scaling --levels "$STREAMS,$STREAMS" --prompt-tokens 128 --decode-tokens 48 2>&1 | tail -4
            if grep -qs 'no \[DONE\]\|TimeoutError' "$R/stall-$name.json"; then
                STALLED=1
                T "stall-$name: stalled; the stall watch says:"; sleep 5
                grep -E "the scheduler (has been|is no longer)|the engine meanwhile" /tmp/stall-$name.log | tail -4 | cut -c1-2000
                curl -s -m 5 http://127.0.0.1:8101/metrics | grep -E "^krasis_(active|queue|generated|time_to_first_token_seconds_count|inter_token_latency_seconds_count)" > "$R/stall-$name-metrics.txt"
                cat "$R/stall-$name-metrics.txt"
            else
                T "stall-$name: every stream finished"
            fi
        else
            T "krasis serve did not come up"; tail -5 /tmp/stall-$name.log
        fi
        stop $KS; cp /tmp/stall-$name.log "$R/stall-$name-serve.log"
    done
fi

if has krasis && [ -f $M/.krasis_cache/done ] && [ -z "${STALLED:-}" ]; then
    todo=0; for f in krasis-scaling krasis-load krasis-prefix; do [ -f "$R/$f.json" ] || todo=1; done
    if [ $todo = 1 ] && [ "$(left)" -gt 120 ]; then
        T "krasis serve --device $DEVICE (INT4 CPU experts, $STREAMS batch slots)"
        $K serve --model $M --device "$DEVICE" --cpu-expert-bits 4 --cache-strategy "${CACHE_STRATEGY:-none}" --max-batch "$STREAMS" --kv-tokens $((LONG * 2)) --port 8101 \
            --served-model-name "$PRESET" > /tmp/krasis-serve.log 2>&1 & KS=$!
        if wait_health 8101 "$(( $(left) - 60 ))" $KS; then
            grep -E "device|placement|loaded|serving|prefix" /tmp/krasis-serve.log | head -8
            measure 8101 krasis-scaling scaling --levels "1,8,$STREAMS" --prompt-tokens 128 --decode-tokens 256
            measure 8101 krasis-load load --streams "$STREAMS" --long 4 --long-tokens "$LONG" --short-tokens 128 --decode-tokens "$DECODE"
            measure 8101 krasis-prefix prefix --turns 10 --history-tokens "$LONG" --turn-tokens 64 --reply-tokens 32
            grep -E "prefix cache|reused" /tmp/krasis-serve.log | tail -12
            curl -s http://127.0.0.1:8101/metrics | grep -E "^krasis_(prefix|time_to_first|inter_token|queue)" | head -20
        else
            T "krasis serve did not come up"; tail -20 /tmp/krasis-serve.log
        fi
        # A stalled server says what it waits for (the scheduler's stall watch).
        grep -E "the scheduler (has been|is no longer)|the engine meanwhile" /tmp/krasis-serve.log | tail -4 | cut -c1-2000
        stop $KS; cp /tmp/krasis-serve.log "$R/krasis-serve.log"
    fi
fi

if has llama && [ -f $G ] && [ -x $LB/bin/llama-server ]; then
    # llama-server: one start per slot count (-np is fixed at start); each slot gets -c / -np tokens.
    llama() {
        local np=$1 ctx=$2 name=$3; shift 3
        [ -f "$R/$name.json" ] && { measure 0 "$name"; return 0; }
        [ "$(left)" -lt 90 ] && { T "no time left for $name"; return 0; }
        T "llama-server -np $np -c $((np * ctx)) -ngl 99 -ot exps=CPU -t $(nproc)"
        $LB/bin/llama-server -m $G -ngl 99 -ot "exps=CPU" -t "$(nproc)" -np "$np" -c $((np * ctx)) --port 8102 \
            --metrics > "/tmp/$name-server.log" 2>&1 & LS=$!
        if wait_health 8102 120 $LS; then measure 8102 "$name" "$@"; else T "llama-server did not come up"; tail -20 "/tmp/$name-server.log"; fi
        stop $LS; cp "/tmp/$name-server.log" "$R/$name-server.log"
    }
    for n in 1 8 "$STREAMS"; do llama "$n" 1024 "llama-scaling-$n" scaling --levels "$n" --prompt-tokens 128 --decode-tokens 256; done
    llama "$STREAMS" $((LONG + 1024)) llama-load load --streams "$STREAMS" --long 4 --long-tokens "$LONG" --short-tokens 128 --decode-tokens "$DECODE"
    llama 1 $((LONG + 2048)) llama-prefix prefix --turns 10 --history-tokens "$LONG" --turn-tokens 64 --reply-tokens 32
fi

T "figures so far:"
python3 - "$R" <<'EOF'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    v = json.load(open(f)); n = os.path.basename(f)[:-5]
    p = v.get("problems") or []
    if "levels" in v:
        for r in v["levels"]:
            print(f"  {n}: {r['streams']} streams: {r['aggregate_decode_tok_s'] and round(r['aggregate_decode_tok_s'], 1)} tok/s aggregate decode")
    elif "itl_during_long" in v:
        d, b = v["itl_during_long"], v["itl_before"]
        f1 = lambda x: x and round(x * 1000, 1)
        print(f"  {n}: {v['ok_streams']}/{v['streams']} streams correct; ITL before p50 {f1(b['p50'])} p99 {f1(b['p99'])} ms; "
              f"while the long prompts run: p50 {f1(d['p50'])} p99 {f1(d['p99'])} ms (p99/p50 {v['p99_over_p50_during'] and round(v['p99_over_p50_during'], 2)})")
    elif "turns" in v:
        print(f"  {n}: TTFT per turn (ms) {[t['ttft_s'] and round(t['ttft_s'] * 1000) for t in v['turns']]}; "
              f"prefilled per turn {[t['prefilled_tokens'] for t in v['turns']]}; turn10/turn2 {v['last_over_turn2_ttft'] and round(v['last_over_turn2_ttft'], 2)}; "
              f"greedy equal with reuse: {v['greedy_equal_with_reuse']}")
    if p:
        print(f"    problems ({len(p)}): {p[:3]}")
EOF
T done
