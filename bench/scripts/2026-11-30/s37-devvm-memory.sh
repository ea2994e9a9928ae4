#!/usr/bin/env bash
# Session 37, dev VM: #38 item 6 again with the new default (auto = 4a on float experts): RSS after a CPU run
# against the memory estimate, presets at 2-4 layers, 16 / 512 / 2048-token prompts, defaults (auto experts, auto dense).
K=${K:-/work/main/target/release/krasis}
for pl in qwen3-30b-a3b:2 glm-4.5-air:2 mixtral-8x7b:2 minimax-m2:2 v2-lite:2 qwen3-next-80b:4 gpt-oss-120b:2; do
  P=${pl%:*}; L=${pl#*:}; D=/tmp/ms-$P
  [ -f $D/config.json ] || $K synth --preset $P --layers $L --out $D 2>&1 | tail -1
  V=$(python3 -c "import json;print(json.load(open('$D/config.json')).get('vocab_size') or json.load(open('$D/config.json'))['text_config']['vocab_size'])" 2>/dev/null || echo 1000)
  for n in 16 512 2048; do
    ids=$(python3 -c "print(','.join(str((i*7919)%($V-300)+5) for i in range($n)))")
    out=$($K generate --model $D --device cpu --prompt-ids $ids --max-new-tokens 2 2>&1)
    echo "$P L=$L n=$n: $(echo "$out" | grep -E "^memory:|^warning|routed experts:" | tr '\n' ' ' | cut -c1-300)"
  done
  rm -rf $D
done
